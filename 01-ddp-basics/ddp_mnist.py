"""Your first DDP run: a small ConvNet on digits, one process or many, CPU or GPU.

Launch (from the repository root):
    python 01-ddp-basics/ddp_mnist.py                              # 1 process
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py          # 2 ranks on this machine
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py --dataset mnist --data-dir ~/data
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_mnist.py --device cuda   # 8 GPUs, NCCL

By default the digits are synthetic (seven-segment digits with random shifts, stroke widths and
noise, generated from --seed), so the lesson runs anywhere without a download. With
`--dataset mnist --data-dir DIR`, DIR must already hold torchvision's MNIST files (DIR/MNIST/raw).

Expected output (torchrun --nproc_per_node=2, 2-core AMD EPYC CPU, gloo; see the README):
    world 2 | device cpu | 4096 training images, 1024 test | batch 32 per rank, 64 global
    epoch 1/2 | loss 1.2467 | test accuracy 93.16%
    epoch 2/2 | loss 0.1349 | test accuracy 99.71%

The three DDP ingredients, each marked below with "DDP:":
    1. a process group (gloo on CPU, NCCL on GPUs) that every rank joins;
    2. a DistributedSampler, so each rank reads a different slice of every epoch;
    3. the model wrapped in DistributedDataParallel, which averages gradients during backward.
"""

import argparse
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


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
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic")
    p.add_argument("--data-dir", type=Path, help="folder holding torchvision's MNIST/raw files")
    p.add_argument("--train-size", type=int, default=4096, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=1024, help="synthetic test images")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--metrics-out", type=Path)
    p.add_argument("--export", type=Path)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "train_size", "test_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dataset == "mnist":
        if args.data_dir is None:
            fail("--dataset mnist needs --data-dir DIR (DIR/MNIST/raw from torchvision)")
        if not (args.data_dir / "MNIST" / "raw").is_dir():
            fail(f"no MNIST in {args.data_dir}: expected {args.data_dir / 'MNIST' / 'raw'} "
                 "(download it once with torchvision.datasets.MNIST(DIR, download=True))")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """Same set-up as ddp_training.py: python, torchrun and srun all end up here."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")  # one node; see ddp_training.py for many
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # DDP (1): every rank joins the group. gloo runs on CPU tensors, NCCL on GPU tensors.
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


# --------------------------------------------------------------------------------------------------
# Data

# Seven-segment glyphs: which of the segments (top, top-left, top-right, middle, bottom-left,
# bottom-right, bottom) are lit for each digit.
SEGMENTS = {0: "abcefg", 1: "cf", 2: "acdeg", 3: "acdfg", 4: "bcdf", 5: "abdfg", 6: "abdefg",
            7: "acf", 8: "abcdefg", 9: "abcdfg"}


def synthetic_digits(n: int, seed: int) -> TensorDataset:
    """n 28x28 digit images (1 channel, normalised) and labels, a pure function of (n, seed)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    thick = torch.randint(2, 4, (n,), generator=g)          # stroke width 2 or 3 pixels
    dx = torch.randint(-4, 5, (n,), generator=g)            # position jitter
    dy = torch.randint(-3, 4, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(28), torch.arange(28), indexing="ij")
    yy, xx = yy[None] - dy[:, None, None], xx[None] - dx[:, None, None]  # (n, 28, 28)
    t = thick[:, None, None]
    left, right, top, mid, bottom = 9, 18, 5, 13, 22  # glyph box at the centre of the image
    horizontal = (xx >= left) & (xx <= right)
    segments = {
        "a": horizontal & (yy >= top) & (yy < top + t),
        "d": horizontal & (yy >= mid) & (yy < mid + t),
        "g": horizontal & (yy > bottom - t) & (yy <= bottom),
        "b": (xx >= left) & (xx < left + t) & (yy >= top) & (yy <= mid),
        "c": (xx > right - t) & (xx <= right) & (yy >= top) & (yy <= mid),
        "e": (xx >= left) & (xx < left + t) & (yy >= mid) & (yy <= bottom),
        "f": (xx > right - t) & (xx <= right) & (yy >= mid) & (yy <= bottom),
    }
    images = torch.zeros(n, 28, 28)
    for seg, mask in segments.items():
        lit = torch.tensor([seg in SEGMENTS[d] for d in range(10)])[labels]  # (n,)
        images = torch.maximum(images, (mask & lit[:, None, None]).float())
    images = images * (0.6 + 0.4 * torch.rand(n, 1, 1, generator=g))   # ink intensity
    images = images + 0.25 * torch.randn(n, 28, 28, generator=g)        # sensor noise
    return TensorDataset(((images - 0.15) / 0.35).unsqueeze(1), labels)


def load_data(args):
    if args.dataset == "synthetic":
        # Different seeds, so the test digits are not the training digits.
        return (synthetic_digits(args.train_size, args.seed),
                synthetic_digits(args.test_size, args.seed + 1))
    from torchvision import datasets, transforms  # only needed for real MNIST
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    # download=False: a missing dataset is an error (checked in parse_args), never a silent hang.
    return (datasets.MNIST(args.data_dir, train=True, download=False, transform=tf),
            datasets.MNIST(args.data_dir, train=False, download=False, transform=tf))


# --------------------------------------------------------------------------------------------------
# Model


class ConvNet(nn.Module):
    """(B, 1, 28, 28) -> conv 16 -> pool -> conv 32 -> pool -> (B, 32*7*7) -> 64 -> 10 logits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # (B, 16, 14, 14)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # (B, 32, 7, 7)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def evaluate(model, loader, device) -> float:
    """Accuracy over the whole test set: each rank counts its slice, then one all-reduce."""
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen]
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        counts[0] += (model(x).argmax(1) == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)  # sum over ranks
    model.train()
    return (counts[0] / counts[1]).item()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    train_set, test_set = load_data(args)
    if len(train_set) < world * args.batch_size:
        fail(f"{len(train_set)} training images cannot give {world} ranks a batch of "
             f"{args.batch_size} each")
    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts)

    # DDP (2): each rank reads its own slice. The sampler shuffles the indices with (seed, epoch),
    # then rank r takes positions r, r+W, r+2W, ... So the W batches of step t together are exactly
    # the global batch a single process with batch W*B would read at step t.
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              drop_last=True, pin_memory=device.type == "cuda")
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    # DDP (3): wrap the model. Backward now ends with gradients averaged over all ranks.
    model = DDP(ConvNet().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        print(f"world {world} | device {device} | {len(train_set)} training images, "
              f"{len(test_set)} test | batch {args.batch_size} per rank, "
              f"{args.batch_size * world} global", flush=True)
    accuracy_before = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"before training: test accuracy {100 * accuracy_before:.2f}%", flush=True)
    losses, accuracies, t0 = [], [], time.perf_counter()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", leave=False,
                   disable=(rank != 0) or None) if tqdm else train_loader
        step_losses = []
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()          # gradients all-reduced (averaged) here, bucket by bucket
            optimizer.step()         # same averaged gradients -> same weights on every rank
            step_losses.append(loss.detach())
        # One all-reduce per epoch turns each rank's batch losses into global-batch means.
        epoch_losses = torch.stack(step_losses)
        dist.all_reduce(epoch_losses)
        losses += (epoch_losses / world).tolist()
        accuracies.append(evaluate(model, test_loader, device))
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} | loss {epoch_losses.mean() / world:.4f} | "
                  f"test accuracy {100 * accuracies[-1]:.2f}%", flush=True)
    elapsed = time.perf_counter() - t0

    params = list(model.parameters())
    held = {"param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params),
            "optim_bytes": sum(v.numel() * v.element_size() for st in optimizer.state.values()
                               for v in st.values() if torch.is_tensor(v)),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else None}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, held)  # every rank holds a full replica: 16 bytes/param

    if rank == 0 and args.export:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.export.with_suffix(".tmp")
        torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, tmp)
        os.replace(tmp, args.export)
    if rank == 0 and args.metrics_out:
        import json
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text(json.dumps({
            "script": "01-ddp-basics/ddp_mnist.py", "strategy": "ddp", "world_size": world,
            "dataset": args.dataset, "epochs": args.epochs, "steps": len(losses),
            "global_batch": args.batch_size * world, "losses": losses,
            "test_accuracy_before": accuracy_before, "test_accuracy": accuracies,
            "samples_per_s": args.epochs * len(train_loader) * args.batch_size * world / elapsed,
            "device": str(device), "torch_version": torch.__version__, "per_rank": per_rank,
        }, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
