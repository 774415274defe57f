"""The data-loading bottleneck: decoding and augmenting images on the fly vs reading preprocessed
tensors from a memory-mapped file, with DistributedSampler, num_workers, pin_memory,
persistent_workers and prefetch_factor; reports how much of each step waits for data.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/data_loading.py
    torchrun --nproc_per_node=2 05-advanced/data_loading.py --images 512 --epochs 3 \\
        --json-out runs/data_loading.json --plot runs/dp_data_loading.png
    torchrun --nproc_per_node=8 05-advanced/data_loading.py --device cuda --workers 8

Expected output (the first command, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo;
milliseconds move from run to run on a shared CPU, see 05-advanced/README.md, part 05c):
    setting                  data wait  compute wait fraction first batch
    on-the-fly, 0 workers        0.31s    0.52s         37.4%       0.08s
    on-the-fly, 2 workers        0.22s    1.21s         15.5%       0.52s
    memmap, 0 workers            0.04s    0.60s          5.8%       0.01s
    memmap, 2 workers            0.03s    0.28s          9.0%       0.28s

The point FFCV made (Leclerc et al. 2023): a GPU step can take less time than decoding and
augmenting its batch, so the accelerator waits for the loader. Two fixes, measured here:

    more loader processes     num_workers > 0: decoding runs in parallel with the training step,
                              prefetch_factor batches ahead per worker; persistent_workers keeps
                              them alive between epochs; pin_memory makes the host->GPU copy
                              asynchronous (CUDA only)
    less work per sample      decode + resize once, store uint8 tensors in a memory-mapped file;
                              each step reads rows (page cache) and does only cheap augmentation

The images are synthetic and deterministic (smooth random patterns, JPEG-encoded in memory): no
download, the same bytes on every rank.
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.io import decode_jpeg, encode_jpeg
from torchvision.transforms import v2


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--images", type=int, default=192, help="size of the synthetic dataset")
    p.add_argument("--raw-size", type=int, default=128, help="side of the stored JPEGs")
    p.add_argument("--size", type=int, default=64, help="side of the training crops")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the parallel settings")
    p.add_argument("--prefetch-factor", type=int, default=2, help="batches ahead per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--cache-dir", type=Path,
                   help="where the preprocessed memory-mapped file goes (default: a temp dir, "
                        "removed at the end); must be visible to every rank")
    p.add_argument("--json-out", type=Path, help="rank 0 writes one row per setting here")
    p.add_argument("--plot", type=Path, help="rank 0 draws the data-wait fractions here")
    p.add_argument("--check-out", type=Path,
                   help="rank 0 saves decoded+resized images next to their memmap rows, and "
                        "the sample indices each rank saw, for the tests")
    args = p.parse_args(argv)
    for name in ("images", "raw_size", "size", "epochs", "batch_size", "prefetch_factor"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 1:
        fail(f"--workers must be at least 1 (the parallel settings use it), got {args.workers}")
    if args.size > args.raw_size:
        fail(f"--size {args.size} cannot exceed --raw-size {args.raw_size}")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """(rank, world, device); the process group works under python, torchrun and srun.
    (Explained in 01-ddp-basics/ddp_training.py.)"""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


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


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    if args.images // world < args.batch_size:
        fail(f"--images {args.images} over {world} ranks leaves {args.images // world} per rank, "
             f"less than one --batch-size {args.batch_size}")
    torch.set_num_threads(1)  # the loader workers need the cores too
    jpegs, labels = synthetic_jpegs(args.images, args.raw_size, args.seed)

    # Rank 0 preprocesses into the memory-mapped file, then everybody meets at a barrier.
    cache = [str(args.cache_dir) if args.cache_dir else None]
    if rank == 0:
        if cache[0] is None:
            cache[0] = tempfile.mkdtemp(prefix="dp_data_loading_")
        Path(cache[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(cache, src=0)  # every rank learns the directory rank 0 chose
    path = Path(cache[0]) / f"images_{args.images}x3x{args.size}x{args.size}_seed{args.seed}.u8"
    if rank == 0 and not path.exists():
        t0 = time.perf_counter()
        rows = np.memmap(path.with_suffix(".tmp"), dtype=np.uint8, mode="w+",
                         shape=(args.images, 3, args.size, args.size))
        rows[:] = preprocess(jpegs, args.size).numpy()
        rows.flush()
        del rows
        os.replace(path.with_suffix(".tmp"), path)  # complete file, or none
        print(f"preprocessed {args.images} images into {path} in "
              f"{time.perf_counter() - t0:.2f} s (once; every later epoch and run reuses it)",
              flush=True)
    dist.barrier()

    cuda = device.type == "cuda"
    settings = [  # (name, dataset, num_workers)
        ("on-the-fly, 0 workers", OnTheFly(jpegs, labels, args.size), 0),
        (f"on-the-fly, {args.workers} workers", OnTheFly(jpegs, labels, args.size), args.workers),
        ("memmap, 0 workers", MemoryMapped(path, args.images, args.size, labels), 0),
        (f"memmap, {args.workers} workers", MemoryMapped(path, args.images, args.size, labels),
         args.workers),
    ]
    if rank == 0:
        print(f"world {world} | {args.images} images, {args.epochs} epochs, batch {args.batch_size}"
              f" per rank | pin_memory {cuda} (CUDA only) | persistent_workers, prefetch_factor "
              f"{args.prefetch_factor} when workers > 0", flush=True)
    rows, seen = [], None
    for name, dataset, workers in settings:
        row, indices = train_one_setting(args, rank, world, device, dataset, workers)
        row["setting"] = name
        rows.append(row)
        seen = seen if seen is not None else indices
    all_seen = [None] * world
    dist.all_gather_object(all_seen, seen)
    if rank == 0:
        report(args, world, rows)
        if args.check_out:
            ids = list(range(min(4, args.images)))
            mapped = MemoryMapped(path, args.images, args.size, labels)
            mapped.__getitem__(0)  # opens the map
            args.check_out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"decoded": preprocess([jpegs[i] for i in ids], args.size),
                        "memmap": torch.from_numpy(np.array(mapped.rows[ids])),
                        "indices_per_rank": all_seen}, args.check_out)
    dist.barrier()
    if rank == 0 and args.cache_dir is None:
        shutil.rmtree(cache[0], ignore_errors=True)


def train_one_setting(args, rank, world, device, dataset, workers):
    """Train a fresh model for --epochs; returns the timing row and the indices of epoch 0."""
    torch.manual_seed(args.seed)
    model = SmallCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Each rank reads its own 1/world of a shuffled permutation, the same permutation on every
    # rank for a given (seed, epoch): shards are disjoint and together cover the dataset.
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    extra = dict(persistent_workers=True, prefetch_factor=args.prefetch_factor) if workers else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", drop_last=True, **extra)
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1)
    wait = compute = first_batch = 0.0
    epoch0 = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (forgetting this repeats epoch 0)
        t_ready = time.perf_counter()
        it = iter(loader)
        while True:
            try:
                images, labels, idx = next(it)  # blocks while the batch is not ready
            except StopIteration:
                break
            t_got = time.perf_counter()
            if epoch == 0 and not epoch0:
                first_batch = t_got - t_ready  # includes starting the worker processes
            else:
                wait += t_got - t_ready
            if epoch == 0:
                epoch0 += idx.tolist()
            # non_blocking: with pinned memory the copy overlaps the next operations on CUDA.
            x = images.to(device, non_blocking=True).float().div_(255).sub_(mean)
            loss = F.cross_entropy(model(x), labels.to(device, non_blocking=True))
            loss.backward()
            # Average the gradients over the ranks so that every rank trains the same model
            # (DDP would do this; communication_overlap.py shows how, faster).
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # measure the step, not its launch
            t_ready = time.perf_counter()
            compute += t_ready - t_got
    del it, loader  # shuts the persistent workers down
    # Per-rank sums, then the mean over ranks (one small all-reduce).
    totals = torch.tensor([wait, compute, first_batch, loss.item()], dtype=torch.float64)
    dist.all_reduce(totals)
    wait, compute, first_batch, last_loss = (totals / world).tolist()
    return {"num_workers": workers, "pin_memory": device.type == "cuda",
            "persistent_workers": bool(workers), "prefetch_factor": args.prefetch_factor
            if workers else None, "data_wait_s": wait, "compute_s": compute,
            "first_batch_s": first_batch, "data_wait_fraction": wait / (wait + compute),
            "final_loss": last_loss}, epoch0


def report(args, world, rows):
    print(f"{'setting':<24} {'data wait':>9} {'compute':>8} {'wait fraction':>13} "
          f"{'first batch':>11}")
    for r in rows:
        print(f"{r['setting']:<24} {r['data_wait_s']:8.2f}s {r['compute_s']:7.2f}s "
              f"{r['data_wait_fraction']:13.1%} {r['first_batch_s']:10.2f}s", flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh([r["setting"] for r in rows], [r["data_wait_fraction"] for r in rows],
                color="tab:orange")
        for i, r in enumerate(rows):
            ax.annotate(f"{r['data_wait_fraction']:.0%}", (r["data_wait_fraction"], i),
                        xytext=(3, -3), textcoords="offset points", fontsize=8)
        ax.set_xlim(0, 1)
        ax.invert_yaxis()
        ax.set_xlabel("fraction of step time waiting for the next batch")
        ax.set_title(f"data loading at world {world} (first batch excluded)")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
