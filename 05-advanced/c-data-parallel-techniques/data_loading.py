"""The data-loading bottleneck: decoding and augmenting images on the fly vs reading preprocessed
tensors from a memory-mapped file, with DistributedSampler, num_workers, pin_memory,
persistent_workers and prefetch_factor; reports how much of each step waits for data.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/data_loading.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/data_loading.py \\
        --images 512 --epochs 3 --metrics-out runs/dp_data_loading.json
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/data_loading.py \\
        --device cuda --images 4096 --workers 8

The point FFCV made (Leclerc et al. 2023): a GPU step can take less time than decoding and
augmenting its batch, so the accelerator waits for the loader. Two fixes, measured here:

    more loader processes     num_workers > 0: decoding runs in parallel with the training step,
                              prefetch_factor batches ahead per worker; persistent_workers keeps
                              them alive between epochs; pin_memory makes the host->GPU copy
                              asynchronous (CUDA only)
    less work per sample      decode + resize once, store uint8 tensors in a memory-mapped file;
                              each step reads rows (page cache) and does only cheap augmentation

The images are synthetic and deterministic (smooth random patterns, JPEG-encoded in memory): no
download, the same bytes on every rank. figures/dp_figures.py draws the --metrics-out JSON.
"""

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
        self.jpegs, self.labels = jpegs, labels
        self.augment = v2.Compose([v2.RandomResizedCrop(size, antialias=True),
                                   v2.RandomHorizontalFlip(),
                                   v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)])

    def __len__(self):
        return len(self.jpegs)

    def __getitem__(self, i):
        image = self.augment(decode_jpeg(self.jpegs[i]))  # uint8 (3, size, size)
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
    t0 = time.perf_counter()
    rows = np.memmap(path.with_suffix(".tmp"), dtype=np.uint8, mode="w+",
                     shape=(len(jpegs), 3, size, size))
    rows[:] = preprocess(jpegs, size).numpy()
    rows.flush()
    del rows
    path.with_suffix(".tmp").replace(path)  # an atomic rename: the complete file, or none
    where = str(path) if kept else f"{path.name} (in a temporary directory)"
    print(f"preprocessed {len(jpegs)} images into {where} in {time.perf_counter() - t0:.2f} s "
          f"(once; every later epoch{' and run' if kept else ''} reuses it)", flush=True)


class MemoryMapped(Dataset):
    """Rows of a uint8 file mapped into memory; only a cheap flip + padded crop per access."""

    def __init__(self, path, n, size, labels):
        self.path, self.shape, self.labels = path, (n, 3, size, size), labels
        self.rows = None  # opened lazily: each DataLoader worker maps the file itself
        self.augment = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(size, padding=4)])

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, i):
        if self.rows is None:
            self.rows = np.memmap(self.path, dtype=np.uint8, mode="r", shape=self.shape)
        image = torch.from_numpy(np.array(self.rows[i]))  # copy one row out of the page cache
        return self.augment(image), self.labels[i], i


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


def make_loader(args, d, dataset, workers: int):
    # Each rank reads its own 1/world of a shuffled permutation, the same permutation on every
    # rank for a given (seed, epoch): shards are disjoint and together cover the dataset.
    sampler = DistributedSampler(dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    extra = dict(persistent_workers=True, prefetch_factor=args.prefetch_factor) if workers else {}
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
    sampler, loader = make_loader(args, d, dataset, workers)
    wait = compute = first_batch = 0.0
    epoch0, losses = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (forgetting this repeats epoch 0)
        t_ready = time.perf_counter()
        for images, labels, idx in loader:  # blocks while the next batch is not ready
            t_got = time.perf_counter()
            if epoch == 0 and not epoch0:
                first_batch = t_got - t_ready  # includes starting the worker processes
            else:
                wait += t_got - t_ready
            if epoch == 0:
                epoch0 += idx.tolist()
            losses.append(train_step(d, model, optimizer, images, labels))
            t_ready = time.perf_counter()
            compute += t_ready - t_got
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
           "prefetch_factor": args.prefetch_factor if workers else None,
           "data_wait_s": wait, "compute_s": compute, "first_batch_s": first_batch,
           "data_wait_fraction": wait / (wait + compute)}
    return model, row, (losses / d.world_size).tolist(), epoch0


# --------------------------------------------------------------------------------------------------
# The four settings


def prepare_cache(args, d, jpegs) -> tuple[Path, str]:
    """Rank 0 preprocesses into the memory-mapped file, then everybody meets at a barrier.
    Returns the file and the directory (a temporary one unless --cache-dir)."""
    cache = [str(args.cache_dir) if args.cache_dir else None]
    if d.rank == 0:
        if cache[0] is None:
            cache[0] = tempfile.mkdtemp(prefix="dp_data_loading_")
        Path(cache[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(cache, src=0)  # every rank learns the directory rank 0 chose
    path = cache_file(cache[0], args.images, args.size, args.seed)
    if d.rank == 0 and not path.exists():
        write_memmap(path, jpegs, args.size, kept=args.cache_dir is not None)
    dist.barrier()
    return path, cache[0]


def run(args, d):
    if args.images // d.world_size < args.batch_size:
        cli.fail(f"--images {args.images} over {d.world_size} ranks leaves "
                 f"{args.images // d.world_size} per rank, less than one --batch-size "
                 f"{args.batch_size}")
    # One thread: the loader workers need the cores too, and the synthetic images come out the
    # same bytes whatever the core count (threads split the float interpolation differently).
    torch.set_num_threads(1)
    jpegs, labels = synthetic_jpegs(args.images, args.raw_size, args.seed)
    path, cache_dir = prepare_cache(args, d, jpegs)
    settings = [  # (name, tag, dataset, num_workers)
        ("on-the-fly, 0 workers", "onthefly_w0", OnTheFly(jpegs, labels, args.size), 0),
        (f"on-the-fly, {args.workers} workers", f"onthefly_w{args.workers}",
         OnTheFly(jpegs, labels, args.size), args.workers),
        ("memmap, 0 workers", "memmap_w0", MemoryMapped(path, args.images, args.size, labels), 0),
        (f"memmap, {args.workers} workers", f"memmap_w{args.workers}",
         MemoryMapped(path, args.images, args.size, labels), args.workers),
    ]
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
    write_outputs(args, d, trained, rows, report.gather(seen),
                  str(path) if args.cache_dir else None)
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


def write_outputs(args, d, trained, rows, indices_per_rank, cache_path) -> None:
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
        cache_file=cache_path)
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
    p.add_argument("--cache-dir", type=Path,
                   help="keep the preprocessed memory-mapped file here (default: a temporary "
                        "directory, removed at the end); must be visible to every rank")
    args = p.parse_args(argv)
    cli.check_positive(args, "images", "raw_size", "size", "epochs", "batch_size",
                       "prefetch_factor", "lr", "timeout_s")
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
