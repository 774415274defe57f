"""The data-loading bottleneck: decoding and augmenting images on the fly vs reading preprocessed
tensors from a memory-mapped file, with DistributedSampler, num_workers, pin_memory,
persistent_workers and prefetch_factor; reports how much of each step waits for data.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/data_loading.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/data_loading.py \\
        --images 512 --epochs 3 --metrics-out runs/dp_data_loading.json
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/data_loading.py \\
        --device cuda --images 4096 --workers 8
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/data_loading.py \\
        --records --images 512 --epochs 1      # + a page-aligned record file, read cold and warm

The point FFCV made (Leclerc et al. 2023): a GPU step can take less time than decoding and
augmenting its batch, so the accelerator waits for the loader. Two fixes, measured here:

    more loader processes     num_workers > 0: decoding runs in parallel with the training step,
                              prefetch_factor batches ahead per worker; persistent_workers keeps
                              them alive between epochs; pin_memory makes the host->GPU copy
                              asynchronous (CUDA only)
    less work per sample      decode + resize once, store uint8 tensors in a memory-mapped file;
                              each step reads rows (page cache) and does only cheap augmentation

--records adds a third way to store the preprocessed images, after FFCV's idea (its .beton file
packs many samples into large pages, 8 MiB by default, and its QUASI_RANDOM order reads them page
by page) in this lesson's own, simpler variant: a record file written once, each image one
fixed-size record padded to whole 4096-byte pages, with an index (offset, bytes, label per record)
beside it, read in a quasi-random order: the blocks of --block-records consecutive records (a
block plays the part of an FFCV page) in a random order, then the records of each block in a
random order. Every epoch still mixes the whole dataset, but a batch is a few runs of consecutive
records, each read with one pread. It trains a fifth setting, and each file-backed loader reads
one epoch cold (the file's pages dropped from the page cache) and warm, --read-repeats times.

The images are synthetic and deterministic (smooth random patterns, JPEG-encoded in memory): no
download, the same bytes on every rank. figures/dp_figures.py draws the --metrics-out JSON.
"""

import ctypes
import mmap
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.io import decode_jpeg, encode_jpeg
from torchvision.transforms import v2

from dtcourse import cli, launch, report

SCRIPT = "05-advanced/c-data-parallel-techniques/data_loading.py"


# --------------------------------------------------------------------------------------------------
# Data: synthetic JPEGs ("the files on disk") and the two pipelines that read them


def synthetic_jpegs(n: int, side: int, seed: int):
    """n smooth random RGB images (side x side), JPEG-encoded; labels from the image content."""
    jpegs, labels = [], []
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        coarse = torch.rand(1, 3, 6, 6, generator=g)
        img = F.interpolate(coarse, size=side, mode="bilinear", align_corners=False)[0]
        jpegs.append(encode_jpeg((img * 255).to(torch.uint8), quality=90))
        # A learnable label: which of 10 bins the mean colour difference falls into.
        labels.append(int(((coarse[0, 0] - coarse[0, 2]).mean() + 1) * 5) % 10)
    return jpegs, labels


class OnTheFly(Dataset):
    """Every access decodes the JPEG and runs a full augmentation (the expensive path)."""

    def __init__(self, jpegs, labels, size):
        # numpy arrays, not tensors: a worker receives the dataset pickled (see worker_start).
        # Pickled tensors would move to shared memory and travel as one file descriptor each, and
        # the fork server hands a new worker at most ~250 descriptors ("too many fds").
        self.jpegs, self.labels = [j.numpy() for j in jpegs], labels
        self.augment = v2.Compose([v2.RandomResizedCrop(size, antialias=True),
                                   v2.RandomHorizontalFlip(),
                                   v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)])

    def __len__(self):
        return len(self.jpegs)

    def __getitem__(self, i):
        image = self.augment(decode_jpeg(torch.from_numpy(self.jpegs[i])))  # uint8 (3, size, size)
        return image, self.labels[i], i


def preprocess(jpegs, size) -> torch.Tensor:
    """The deterministic, expensive part done once: decode and resize. (N, 3, size, size) uint8."""
    resize = v2.Resize((size, size), antialias=True)
    return torch.stack([resize(decode_jpeg(j)) for j in jpegs])


def cache_file(cache_dir: Path, images: int, size: int, seed: int) -> Path:
    return Path(cache_dir) / f"images_{images}x3x{size}x{size}_seed{seed}.u8"


def write_memmap(path: Path, jpegs, size: int, kept: bool) -> None:
    """Rank 0 only: preprocess every image into a uint8 file, under a temporary name first.
    `kept`: under --cache-dir, where later runs find it (else a temporary directory, whose
    name changes with every run: only the file's name is printed)."""
    t0 = time.perf_counter()  # host clock: preprocessing runs on the host
    rows = np.memmap(path.with_suffix(".tmp"), dtype=np.uint8, mode="w+",
                     shape=(len(jpegs), 3, size, size))
    rows[:] = preprocess(jpegs, size).numpy()
    rows.flush()
    del rows
    path.with_suffix(".tmp").replace(path)  # an atomic rename: the complete file, or none
    where = str(path) if kept else f"{path.name} (in a temporary directory)"
    took = time.perf_counter() - t0  # host clock: as above
    print(f"preprocessed {len(jpegs)} images into {where} in {took:.2f} s "
          f"(once; every later epoch{' and run' if kept else ''} reuses it)", flush=True)


def cheap_augmentation(size: int):
    return v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(size, padding=4)])


class MemoryMapped(Dataset):
    """Rows of a uint8 file mapped into memory; only a cheap flip + padded crop per access."""

    def __init__(self, path, n, size, labels, augment: bool = True):
        self.path, self.shape, self.labels = path, (n, 3, size, size), labels
        self.rows = None  # opened lazily: each DataLoader worker maps the file itself
        self.augment = cheap_augmentation(size) if augment else nn.Identity()

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, i):
        if self.rows is None:
            self.rows = np.memmap(self.path, dtype=np.uint8, mode="r", shape=self.shape)
        image = torch.from_numpy(np.array(self.rows[i]))  # copy one row out of the page cache
        return self.augment(image), self.labels[i], i


# --------------------------------------------------------------------------------------------------
# A page-aligned record file, read in a quasi-random order

PAGE = 4096  # bytes: the unit of the OS page cache (and of a block device's reads)
INDEX = np.dtype([("offset", "<u8"), ("nbytes", "<u4"), ("label", "<i4")])


def index_path(records: Path) -> Path:
    return records.with_name(records.name + ".idx")


def write_records(records: Path, rows: np.ndarray, labels) -> None:
    """Rank 0 only, once: rows (N, 3, S, S) uint8 as N records of ceil(3*S*S / PAGE) pages each
    (zero padding at the end of a record), so that every record starts on a page boundary and no
    page holds two records; the index beside it. (This alignment is this lesson's choice: FFCV's
    writer packs samples back to back into pages of 8 MiB, ffcv/writer.py and
    ffcv/memory_allocator.py.) Temporary names first; the index is renamed last,
    so a reader that finds it finds the complete file."""
    n, payload = len(rows), rows[0].size
    record = -(-payload // PAGE) * PAGE
    index = np.zeros(n, INDEX)
    index["offset"] = np.arange(n, dtype=np.uint64) * record
    index["nbytes"], index["label"] = payload, labels
    padded = np.zeros((n, record), np.uint8)
    padded[:, :payload] = rows.reshape(n, payload)
    writes = ((records, padded.tofile), (index_path(records), lambda f: np.save(f, index)))
    for path, write in writes:
        with open(path.with_name(path.name + ".tmp"), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk, not only in the page cache: the cold reads read it
    for path in (records, index_path(records)):
        path.with_name(path.name + ".tmp").replace(path)


class RecordFile:
    """The records of one file: read(ids) returns them in the order asked, reading each run of
    consecutive records with one pread (`reads` counts them)."""

    def __init__(self, path: Path, shape: tuple):
        with open(index_path(path), "rb") as f:
            self.index = np.load(f)
        self.shape, self.fd, self.reads = shape, os.open(path, os.O_RDONLY), 0

    def __len__(self):
        return len(self.index)

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """(len(ids), *shape) uint8: record ids[i] in row i."""
        out = np.empty((len(ids), int(np.prod(self.shape))), np.uint8)
        by_id = np.argsort(ids, kind="stable")  # positions in ids, ascending record id
        runs = np.split(by_id, np.flatnonzero(np.diff(ids[by_id]) != 1) + 1)
        for run in runs:  # the positions of consecutive records ids[run[0]], ids[run[0]] + 1, ...
            first, last = self.index[ids[run[0]]], self.index[ids[run[-1]]]
            start = int(first["offset"])
            length = int(last["offset"]) + int(last["nbytes"]) - start
            span = np.frombuffer(os.pread(self.fd, length, start), np.uint8)  # one sequential read
            if len(span) != length:
                raise OSError(f"short read: {len(span)} of {length} bytes at offset {start}")
            for pos in run:
                entry = self.index[ids[pos]]
                begin = int(entry["offset"]) - start
                out[pos] = span[begin:begin + int(entry["nbytes"])]
            self.reads += 1
        return torch.from_numpy(out).view(len(ids), *self.shape)

    def close(self):
        os.close(self.fd)


def quasi_random_order(n: int, block: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order of records 0..n-1: the blocks of `block` consecutive records in a random
    order, then the records of each block in a random order. A pure function of (seed, epoch):
    every rank computes the same order. (FFCV's QUASI_RANDOM, ffcv/traversal_order/
    quasi_random.py, shuffles its pages and the samples in each, then draws each next sample from
    one of up to 2 x batch-size pages held open at a time, so that a batch mixes many pages; it
    refuses distributed=True. The contiguous per-rank split below is this lesson's choice.)"""
    rng = np.random.default_rng([seed, epoch])
    starts = rng.permutation(np.arange(0, n, block))
    return np.concatenate([start + rng.permutation(min(block, n - start)) for start in starts])


def rank_shard(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank r's contiguous 1/world of the epoch's order (the last n % world records dropped, as
    DistributedSampler(drop_last=True) drops them): whole blocks wherever n / world is a multiple
    of the block, so every rank still reads runs of consecutive records."""
    per_rank = len(order) // world
    return order[rank * per_rank:(rank + 1) * per_rank]


class QuasiRandomLoader:
    """Batches (images (B, 3, S, S) uint8, labels (B,), record ids (B,)) of rank r's shard of the
    quasi-random order, read in the training process: its own sampler (set_epoch) and batcher.
    `delivered[epoch]` keeps the record ids it handed out."""

    def __init__(self, records: RecordFile, batch_size: int, rank: int, world: int, block: int,
                 seed: int, augment: bool = True, pin: bool = False):
        self.records, self.batch_size, self.rank, self.world = records, batch_size, rank, world
        self.block, self.seed, self.pin, self.epoch, self.delivered = block, seed, pin, 0, {}
        self.labels = torch.from_numpy(records.index["label"].astype(np.int64))
        self.augment = cheap_augmentation(records.shape[-1]) if augment else None

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.records) // self.world // self.batch_size  # drop_last

    def __iter__(self):
        order = quasi_random_order(len(self.records), self.block, self.seed, self.epoch)
        shard = rank_shard(order, self.rank, self.world)
        self.delivered[self.epoch] = []
        for b in range(len(self)):
            ids = shard[b * self.batch_size:(b + 1) * self.batch_size]
            images = self.records.read(ids)
            if self.augment is not None:  # the same flip + crop as MemoryMapped, per image
                images = torch.stack([self.augment(image) for image in images])
            self.delivered[self.epoch] += ids.tolist()
            # Pinned (page-locked) memory: an asynchronous host->GPU copy, as DataLoader's
            # pin_memory gives.
            yield (images.pin_memory() if self.pin else images), self.labels[ids], \
                torch.from_numpy(ids)


# --------------------------------------------------------------------------------------------------
# Cold and warm: the page cache


def drop_page_cache(path: Path) -> None:
    """Evict the file's pages from this machine's page cache: fsync (dirty pages cannot be
    dropped), then posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), offset 0 and length 0 meaning the
    whole file. It needs no privileges and touches only this file; `echo 3 >
    /proc/sys/vm/drop_caches` (as root) drops the clean cached pages of every file on the machine.
    Neither drops a page that a process still maps (both skip mapped pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now: mincore(2) on a mapping of the file
    (mapping reads nothing; mincore only looks). True only for a file this user owns or may write:
    since Linux 5.0 mincore reports every page of any other file's mapping as resident
    (can_do_mincore in mm/mincore.c), which would read as "all cached" before a cold epoch."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    resident = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        address = view.ctypes.data
        del view  # no exported buffer may outlive the mapping
        if libc.mincore(address, size, resident.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    return int((resident & 1).sum())


def time_reads(args, d, memmap_path: Path, records_path: Path, labels) -> list[dict]:
    """Each file-backed loader reads and batches one epoch (epoch 0) of this rank's shard, without
    augmentation or training: cold, right after every rank dropped the file's pages, then warm,
    right after; --read-repeats times, each time cold then warm. Runs before any training, while
    no process maps the files. Times: mean over the ranks, then the median of the repeats (one
    read of a few megabytes on a shared machine moves by tens of percent)."""
    shape = (3, args.size, args.size)

    def records(block):
        return lambda: QuasiRandomLoader(RecordFile(records_path, shape), args.batch_size, d.rank,
                                         d.world_size, block, args.seed, augment=False,
                                         pin=d.device.type == "cuda")  # as the DataLoader's

    loaders = [  # (loader, order, file, build)
        ("memmap + DataLoader", "random (DistributedSampler)", memmap_path,
         lambda: make_loader(args, d, MemoryMapped(memmap_path, args.images, args.size, labels,
                                                   augment=False), 0)[1]),
        ("records", f"quasi-random, blocks of {args.block_records}", records_path,
         records(args.block_records)),
        ("records", "random (blocks of 1)", records_path, records(1)),
    ]
    rows = []
    for name, order, path, build in loaders:
        row = {"loader": name, "order": order, "pages": -(-os.path.getsize(path) // PAGE),
               "cold_s_runs": [], "warm_s_runs": [], "cold_cached_pages_runs": [],
               "warm_cached_pages_runs": []}
        for _ in range(args.read_repeats):
            for state in ("cold", "warm"):
                for _ in range(3 if state == "cold" else 0):
                    # a readahead still in flight from the last epoch can land after the drop:
                    # drop again until no rank sees a page of the file cached
                    drop_page_cache(path)
                    if max(report.gather(cached_pages(path))) == 0:
                        break
                dist.barrier()  # every rank has dropped (cold) or read (warm) ...
                row[f"{state}_cached_pages_runs"].append(cached_pages(path))
                dist.barrier()  # ... and looked, before anyone reads
                loader = build()
                t0 = time.perf_counter()  # host clock: reading files is the host's work
                for _ in loader:
                    pass
                seconds = time.perf_counter() - t0  # host clock: as above
                if isinstance(loader, QuasiRandomLoader):
                    row["reads_per_rank"] = report.gather(loader.records.reads)
                    loader.records.close()
                del loader  # closes the memory map: dropped pages must not stay mapped
                row[f"{state}_s_runs"].append(sum(report.gather(seconds)) / d.world_size)
        # The worst case of the repeats: every cold epoch started with no page cached (max 0),
        # every warm one with all of them (min = pages).
        row["cold_cached_pages"] = max(row["cold_cached_pages_runs"])
        row["warm_cached_pages"] = min(row["warm_cached_pages_runs"])
        row["cold_s"] = float(np.median(row["cold_s_runs"]))
        row["warm_s"] = float(np.median(row["warm_s_runs"]))
        row["cold_over_warm"] = row["cold_s"] / row["warm_s"]
        rows.append(row)
    return rows


def print_reads(rows, args) -> None:
    report.print0(f"one epoch of each rank's shard read and batched ({args.batch_size} per batch, "
                  f"no augmentation), cold (the file's pages dropped first) then warm, "
                  f"{args.read_repeats} times; ~: timings, medians of the {args.read_repeats}")
    report.print0(f"{'loader':<20} {'order':<28} {'preads':>6} {'cached pages cold/warm':>23} "
                  f"{'cold':>9} {'warm':>9} {'cold/warm':>9}")
    for r in rows:
        reads = "-" if "reads_per_rank" not in r else str(r["reads_per_rank"][0])
        cached = f"{r['cold_cached_pages']}/{r['pages']} {r['warm_cached_pages']}/{r['pages']}"
        report.print0(f"{r['loader']:<20} {r['order']:<28} {reads:>6} {cached:>23} "
                      f"{'~' + format(r['cold_s'] * 1e3, '.1f'):>6} ms "
                      f"{'~' + format(r['warm_s'] * 1e3, '.1f'):>6} ms "
                      f"{'~' + format(r['cold_over_warm'], '.1f') + 'x':>9}")
    memmap, quasi, random_ = rows
    report.print0(f"cold, records in quasi-random order: "
                  f"~{memmap['cold_s'] / quasi['cold_s']:.1f}x the speed of memmap + DataLoader, "
                  f"~{random_['cold_s'] / quasi['cold_s']:.1f}x that of records in random order")


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        # Strided convolutions keep the step short: the point is a model that is faster than its
        # input pipeline, as a GPU often is.
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(16 * 16, classes)

    def forward(self, x):  # x: (B, 3, H, W) float -> (B, classes)
        return self.head(self.features(x).flatten(1))


# --------------------------------------------------------------------------------------------------
# Training with one loader setting, timing the wait for each batch


def worker_start():
    """The loader workers start from a fork server, not by forking this rank. A rank runs other
    threads (gloo's, a finished loader's queue feeders), and fork copies only the calling one:
    whatever another thread held at that instant stays held in the child. On CPython 3.8 to
    3.11.9 that includes the interpreter's lock on its list of threads, taken whenever
    a thread starts, ends or enters Python (cpython#112275): the worker hangs inside fork, never
    delivers a batch, and its rank waits for it. The server is started by fork + exec, runs no
    other Python thread, imports torch once per rank, and forks every worker. (Python 3.12 warns
    when a process with threads forks; 3.14 made "forkserver" the default on Linux.) The preload
    list replaces the default ["__main__"]: each worker still imports this script, cheaply once
    torch is in."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchvision.transforms.v2"])
    return context


def make_loader(args, d, dataset, workers: int):
    # Each rank reads its own 1/world of a shuffled permutation, the same permutation on every
    # rank for a given (seed, epoch): shards are disjoint and together cover the dataset.
    sampler = DistributedSampler(dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    extra = dict(persistent_workers=True, prefetch_factor=args.prefetch_factor,
                 multiprocessing_context=worker_start()) if workers else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=d.device.type == "cuda", drop_last=True, **extra)
    return sampler, loader


def train_step(d, model, optimizer, images, labels) -> torch.Tensor:
    mean = torch.tensor([0.5, 0.5, 0.5], device=d.device).view(1, 3, 1, 1)
    # non_blocking: with pinned memory the copy overlaps the next operations on CUDA.
    x = images.to(d.device, non_blocking=True).float().div_(255).sub_(mean)
    loss = F.cross_entropy(model(x), labels.to(d.device, non_blocking=True))
    loss.backward()
    # Average the gradients over the ranks so that every rank trains the same model
    # (DDP would do this; communication_overlap.py shows how, faster).
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= d.world_size
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)  # measure the step, not its launch
    return loss.detach()


def train_one_setting(args, d, dataset, workers: int):
    """Train a fresh model for --epochs; returns the model, the timing row, the losses and the
    sample indices this rank read in epoch 0."""
    torch.manual_seed(args.seed)
    model = SmallCNN().to(d.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if isinstance(dataset, QuasiRandomLoader):
        sampler = loader = dataset  # its own sampler (set_epoch) and batcher, in this process
    else:
        sampler, loader = make_loader(args, d, dataset, workers)
    wait = compute = first_batch = 0.0
    epoch0, losses = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (forgetting this repeats epoch 0)
        t_ready = time.perf_counter()  # host clock: the loader's wait is the host's
        for images, labels, idx in loader:  # blocks while the next batch is not ready
            t_got = time.perf_counter()  # host clock: as above
            if epoch == 0 and not epoch0:
                first_batch = t_got - t_ready  # includes starting the worker processes
            else:
                wait += t_got - t_ready
            if epoch == 0:
                epoch0 += idx.tolist()
            losses.append(train_step(d, model, optimizer, images, labels))
            t_ready = time.perf_counter()  # host clock: train_step's .item() ends the step
            compute += t_ready - t_got
    start_method = loader.multiprocessing_context.get_start_method() if workers else None
    del loader  # shuts the persistent workers down
    # Per-rank sums, then the mean over ranks (one small all-reduce, on the run's device: NCCL
    # takes no CPU tensors).
    totals = torch.tensor([wait, compute, first_batch], dtype=torch.float64, device=d.device)
    dist.all_reduce(totals)
    wait, compute, first_batch = (totals / d.world_size).tolist()
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    row = {"num_workers": workers, "pin_memory": d.device.type == "cuda",
           "persistent_workers": bool(workers),
           "start_method": start_method,
           "prefetch_factor": args.prefetch_factor if workers else None,
           "data_wait_s": wait, "compute_s": compute, "first_batch_s": first_batch,
           "data_wait_fraction": wait / (wait + compute)}
    return model, row, (losses / d.world_size).tolist(), epoch0


# --------------------------------------------------------------------------------------------------
# The settings (four, five with --records)


def prepare_cache(args, d, jpegs, labels) -> tuple[Path, Path | None, str]:
    """Rank 0 preprocesses into the memory-mapped file (and, with --records, copies its rows into
    the record file), then everybody meets at a barrier. Returns the two files (the record file
    None without --records) and the directory (a temporary one unless --cache-dir)."""
    cache = [str(args.cache_dir) if args.cache_dir else None]
    if d.rank == 0:
        if cache[0] is None:
            # --records times cold reads, which need a file on a disk: /tmp is a tmpfs on some
            # systems (its pages are the file and cannot be dropped), so the temporary directory
            # goes under the working directory there
            cache[0] = tempfile.mkdtemp(prefix="dp_data_loading_",
                                        dir=Path.cwd() if args.records else None)
        Path(cache[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(cache, src=0)  # every rank learns the directory rank 0 chose
    path = cache_file(cache[0], args.images, args.size, args.seed)
    if d.rank == 0 and not path.exists():
        write_memmap(path, jpegs, args.size, kept=args.cache_dir is not None)
    records = path.with_suffix(".rec") if args.records else None
    if d.rank == 0 and records is not None and not index_path(records).exists():
        write_records(records, np.memmap(path, dtype=np.uint8, mode="r",
                                         shape=(args.images, 3, args.size, args.size)), labels)
        report.print0(f"wrote {args.images} records of {-(-3 * args.size ** 2 // PAGE)} pages "
                      f"({3 * args.size ** 2} bytes of image each) and their index")
    dist.barrier()
    return path, records, cache[0]


def run(args, d):
    if args.images // d.world_size < args.batch_size:
        cli.fail(f"--images {args.images} over {d.world_size} ranks leaves "
                 f"{args.images // d.world_size} per rank, less than one --batch-size "
                 f"{args.batch_size}")
    # One thread: the loader workers need the cores too, and the synthetic images come out the
    # same bytes whatever the core count (threads split the float interpolation differently).
    torch.set_num_threads(1)
    jpegs, labels = synthetic_jpegs(args.images, args.raw_size, args.seed)
    path, records_path, cache_dir = prepare_cache(args, d, jpegs, labels)
    # Before any training: no process may map the files while their pages are dropped.
    reads = time_reads(args, d, path, records_path, labels) if args.records else None
    settings = [  # (name, tag, dataset, num_workers)
        ("on-the-fly, 0 workers", "onthefly_w0", OnTheFly(jpegs, labels, args.size), 0),
        (f"on-the-fly, {args.workers} workers", f"onthefly_w{args.workers}",
         OnTheFly(jpegs, labels, args.size), args.workers),
        ("memmap, 0 workers", "memmap_w0", MemoryMapped(path, args.images, args.size, labels), 0),
        (f"memmap, {args.workers} workers", f"memmap_w{args.workers}",
         MemoryMapped(path, args.images, args.size, labels), args.workers),
    ]
    if args.records:
        records = QuasiRandomLoader(RecordFile(records_path, (3, args.size, args.size)),
                                    args.batch_size, d.rank, d.world_size, args.block_records,
                                    args.seed, pin=d.device.type == "cuda")
        settings.append(("records, quasi-random", "records", records, 0))
    report.print0(f"world {d.world_size} | {args.images} images, {args.epochs} epochs, batch "
                  f"{args.batch_size} per rank | pin_memory {d.device.type == 'cuda'} (CUDA only)"
                  f" | persistent_workers, prefetch_factor {args.prefetch_factor} when "
                  f"workers > 0")
    rows, trained, seen = [], [], None
    for name, tag, dataset, workers in settings:
        model, row, losses, indices = train_one_setting(args, d, dataset, workers)
        rows.append({"setting": name, "tag": tag, **row, "losses": losses,
                     "final_loss": losses[-1]})
        trained.append(model)
        seen = seen if seen is not None else indices
    print_table(rows)
    record_orders = None
    if args.records:
        print_reads(reads, args)
        records.records.close()
        # What the test checks: the order each rank computed, and the ids each rank was handed.
        epochs = range(args.epochs)
        record_orders = {
            "block_records": args.block_records,
            "orders_per_rank": report.gather([quasi_random_order(
                args.images, args.block_records, args.seed, e).tolist() for e in epochs]),
            "delivered_per_rank": report.gather([records.delivered[e] for e in epochs])}
    write_outputs(args, d, trained, rows, report.gather(seen),
                  str(path) if args.cache_dir else None, reads, record_orders)
    if d.rank == 0 and args.cache_dir is None:
        shutil.rmtree(cache_dir, ignore_errors=True)


def print_table(rows) -> None:
    report.print0(f"{'setting':<24} {'data wait':>9} {'compute':>8} {'wait fraction':>13} "
                  f"{'first batch':>11}   (~: depends on the machine's speed)")
    for r in rows:
        report.print0(f"{r['setting']:<24} {r['data_wait_s']:8.2f}s {r['compute_s']:7.2f}s "
                      f"{'~' + format(r['data_wait_fraction'], '.1%'):>13} "
                      f"{r['first_batch_s']:10.2f}s")


# --------------------------------------------------------------------------------------------------
# Outputs, arguments and launch


def write_outputs(args, d, trained, rows, indices_per_rank, cache_path, reads=None,
                  record_orders=None) -> None:
    """--export: one plain state dict per setting (PATH with the setting's tag before the
    suffix); --metrics-out: the rows, the sample indices each rank read in epoch 0, the kept
    cache file, and the contract's top-level fields taken from the first setting."""
    for model, row in zip(trained, rows):
        row["export"] = None if args.export is None else \
            str(report.variant_path(args.export, row["tag"], several=len(rows) > 1))
        if d.rank == 0 and args.export:
            report.save_state_dict(row["export"], model.state_dict())
    per_rank = report.gather(report.held_bytes(params=trained[0].parameters(), device=d.device))
    samples = args.epochs * (args.images // (d.world_size * args.batch_size)) * \
        d.world_size * args.batch_size
    metrics = report.metrics(
        d, script=SCRIPT, strategy="data parallel (all-reduce per parameter)",
        steps=len(rows[0]["losses"]), global_batch=d.world_size * args.batch_size,
        losses=rows[0]["losses"],
        samples_per_s=samples / (rows[0]["data_wait_s"] + rows[0]["compute_s"]),
        per_rank=per_rank, settings=rows, indices_per_rank=indices_per_rank,
        cache_file=cache_path, reads=reads, record_orders=record_orders)
    report.finish(args, metrics)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p)
    p.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--images", type=int, default=192, help="size of the synthetic dataset")
    p.add_argument("--raw-size", type=int, default=128, help="side of the stored JPEGs")
    p.add_argument("--size", type=int, default=64, help="side of the training crops")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="num_workers of the parallel settings")
    p.add_argument("--prefetch-factor", type=int, default=2, help="batches ahead per worker")
    p.add_argument("--records", action="store_true",
                   help="also write the page-aligned record file, train a fifth setting from it "
                        "in quasi-random order, and time one epoch of each file-backed loader "
                        "cold (the file's cached pages dropped) and warm")
    p.add_argument("--block-records", type=int, default=8,
                   help="--records: consecutive records per block of the quasi-random order")
    p.add_argument("--read-repeats", type=int, default=5,
                   help="--records: how many times each loader reads its epoch cold and warm "
                        "(the table shows the medians)")
    p.add_argument("--cache-dir", type=Path,
                   help="keep the preprocessed memory-mapped file (and the record file) here "
                        "(default: a temporary directory, removed at the end: under the working "
                        "directory with --records, whose cold reads need a disk); must be visible "
                        "to every rank")
    args = p.parse_args(argv)
    cli.check_positive(args, "images", "raw_size", "size", "epochs", "batch_size",
                       "prefetch_factor", "lr", "block_records", "read_repeats",
                       "timeout_s")
    if args.records and not hasattr(os, "posix_fadvise"):
        cli.fail("--records drops the file's pages with os.posix_fadvise, which this OS lacks "
                 "(Linux has it)")
    if args.workers < 1:
        cli.fail(f"--workers must be at least 1 (the parallel settings use it), got "
                 f"{args.workers}")
    if args.size > args.raw_size:
        cli.fail(f"--size {args.size} cannot exceed --raw-size {args.raw_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
