"""Your first DDP run: a small ConvNet on digits, one process or many, CPU or GPU.

Launch (from the repository root):
    python 01-ddp-basics/ddp_mnist.py                              # 1 process
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py          # 2 ranks on this machine
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py --dataset mnist --data-dir ~/data
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_mnist.py --device cuda   # 8 GPUs, NCCL
    srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python 01-ddp-basics/ddp_mnist.py
    mpirun -np 2 python 01-ddp-basics/ddp_mnist.py                 # OpenMPI, one node

The three DDP ingredients, each marked below "DDP (n)":
    1. a process group (gloo on CPU, NCCL on GPUs) that every rank joins (main, then the set-up
       at the end of this file);
    2. a DistributedSampler, so each rank reads a different slice of every epoch (make_loaders);
    3. the model wrapped in DistributedDataParallel, which averages gradients during backward
       (train).

By default the digits are synthetic (seven-segment digits with random shifts, stroke widths and
noise, generated from --seed), so the lesson runs anywhere without a download. With
`--dataset mnist --data-dir DIR`, DIR must already hold torchvision's MNIST files (DIR/MNIST/raw).

This file writes the set-up of ingredient 1 out in full, after the training code: which launcher
started the process (torchrun or any launcher that sets RANK, srun, mpirun), who it is, where the
ranks meet. Every later script of the course imports the same set-up from the shared module
dtcourse.launch, which also checks that the launcher's variables agree with each other.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from dtcourse import cli, report, timing

SCRIPT = "01-ddp-basics/ddp_mnist.py"


def main(argv=None):
    args = parse_args(argv)
    d = init_distributed(args.device, args.timeout_s)  # DDP (1): join the process group
    try:
        train(args, d)
    finally:
        teardown()


# --------------------------------------------------------------------------------------------------
# DDP (2) and (3): each rank reads its own slice; the model is wrapped; the training loop


def train(args, d: Dist):
    train_set, test_set = load_data(args)
    if len(train_set) < d.world_size * args.batch_size:
        cli.fail(f"{len(train_set)} training images cannot give {d.world_size} ranks a batch of "
                 f"{args.batch_size} each")
    train_sampler, train_loader, test_loader = make_loaders(args, d, train_set, test_set)
    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts)
    # DDP (3): wrap the model. Backward now ends with gradients averaged over all ranks.
    model = DDP(ConvNet().to(d.device),
                device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    report.print0(f"world {d.world_size} | device {d.device} | {len(train_set)} training images, "
                  f"{len(test_set)} test | batch {args.batch_size} per rank, "
                  f"{args.batch_size * d.world_size} global")
    accuracy_before = evaluate(model, test_loader, d.device)
    report.print0(f"before training: test accuracy {100 * accuracy_before:.2f}%")
    losses, accuracies, t0 = [], [], timing.clock(d.device)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        epoch_losses = train_epoch(model, optimizer, train_loader, d.device, f"epoch {epoch + 1}")
        # One all-reduce per epoch turns each rank's batch losses into global-batch means.
        dist.all_reduce(epoch_losses)
        losses += (epoch_losses / d.world_size).tolist()
        accuracies.append(evaluate(model, test_loader, d.device))
        report.print0(f"epoch {epoch + 1}/{args.epochs} | loss "
                      f"{epoch_losses.mean() / d.world_size:.4f} | test accuracy "
                      f"{100 * accuracies[-1]:.2f}%")
    samples = len(losses) * args.batch_size * d.world_size
    finish(args, d, model, optimizer, losses, accuracy_before, accuracies,
           samples / (timing.clock(d.device) - t0))


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


def make_loaders(args, d: Dist, train_set, test_set):
    # DDP (2): each rank reads its own slice. The sampler shuffles the indices with (seed, epoch),
    # then rank r takes positions r, r+W, r+2W, ... So the W batches of step t together are exactly
    # the global batch a single process with batch W*B would read at step t.
    train_sampler = DistributedSampler(train_set, num_replicas=d.world_size, rank=d.rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              drop_last=True, pin_memory=d.device.type == "cuda")
    # Evaluation: rank r scores test images r, r+W, r+2W, ...: every image exactly once. (A
    # DistributedSampler pads the last round with repeats when W does not divide the test set, so
    # some images would count twice.) Ranks may then see different numbers of test batches: fine,
    # because the forward pass runs no collective here (no gradients, and ConvNet has no buffers
    # for DDP to broadcast); the one collective of evaluate() comes after the loop.
    test_loader = DataLoader(Subset(test_set, range(d.rank, len(test_set), d.world_size)),
                             batch_size=256)
    return train_sampler, train_loader, test_loader


def train_epoch(model, optimizer, loader, device, desc: str) -> torch.Tensor:
    """One pass over this rank's slice of the training set; this rank's loss of every step."""
    bar = report.progress(len(loader), desc)
    step_losses = []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()          # gradients all-reduced (averaged) here, bucket by bucket
        optimizer.step()         # same averaged gradients -> same weights on every rank
        step_losses.append(loss.detach())
        bar.update()
    bar.close()
    return torch.stack(step_losses)


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


def finish(args, d: Dist, model, optimizer, losses, accuracy_before, accuracies, samples_per_s):
    """Rank 0 writes --metrics-out and --export; every rank waits until they are complete."""
    # Every rank holds a full replica: with Adam, 4 bytes per parameter of weights, 4 of .grad and
    # 8 of moments, the 16 that per_rank counts; DDP's gradient buckets (the default
    # gradient_as_bucket_view=False keeps them beside .grad) hold 4 more, not counted here.
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    metrics = report.metrics(d, script=SCRIPT, strategy="ddp", steps=len(losses),
                             global_batch=args.batch_size * d.world_size, losses=losses,
                             samples_per_s=samples_per_s, per_rank=per_rank,
                             dataset=args.dataset, epochs=args.epochs,
                             test_accuracy_before=accuracy_before, test_accuracy=accuracies)
    report.finish(args, metrics, model.module.state_dict())  # the plain model, without DDP


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
# DDP (1): who am I, where do the ranks meet, and the process group (main calls it first)


class Launch(NamedTuple):
    """This process's place in the job, as its launcher describes it."""
    launcher: str            # torchrun, mpirun, srun or python
    rank: int                # 0 .. world_size-1 over the whole job
    world_size: int          # number of processes
    local_rank: int          # number on this machine: which GPU it takes
    local_world_size: int    # processes on this machine
    master_addr: str | None  # where rank 0 hosts the rendezvous (None: a group of one)
    master_port: int | None


class Dist(NamedTuple):
    """This process in the started group, and the device it computes on."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07', 'node5' -> 'node5'
    (what `scontrol show hostnames` prints first)."""
    # The first entry ends at the first comma outside brackets; each [ranges] becomes its first.
    entry = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist).group(0)
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)


def who_am_i(env) -> Launch:
    """Read the launcher's variables (`env` is os.environ).

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process it
    starts. mpirun and srun start the processes themselves and describe them in their own words;
    nobody tells them where to meet. Under mpirun on one node that is this machine; across nodes
    you pass the master with `-x MASTER_ADDR=... -x MASTER_PORT=...`. Under srun every task
    derives the same answer from what srun gives them all: the first host of the step's node
    list, and a port computed from the job and step ids. With no launcher at all, the process is
    rank 0 of 1.
    """
    if "RANK" in env:  # torchrun (also `srun torchrun`, one torchrun per node: torchrun numbers)
        return Launch("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1)),
                      env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if "OMPI_COMM_WORLD_RANK" in env:  # mpirun (OpenMPI)
        world, here = int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
        addr = env.get("MASTER_ADDR")
        if not addr:
            if here != world:  # several nodes: only you know which host runs rank 0
                cli.fail(f"mpirun started {world} processes on several nodes ({here} on this one) "
                         f"and MASTER_ADDR is not set: pass -x MASTER_ADDR=<rank 0's host> "
                         f"-x MASTER_PORT=<port>")
            addr = "127.0.0.1"  # one node: rank 0 is on this machine
        return Launch("mpirun", int(env["OMPI_COMM_WORLD_RANK"]), world,
                      int(env["OMPI_COMM_WORLD_LOCAL_RANK"]), here, addr,
                      int(env.get("MASTER_PORT", "29500")))
    # An srun task. (A batch script's own process has SLURM_PROCID too, but it is not a task of a
    # step, SLURM_STEP_NUM_TASKS is unset: it runs as one process.)
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST")
                                                    or env["SLURM_JOB_NODELIST"])
        if env.get("MASTER_PORT"):
            port = int(env["MASTER_PORT"])
        else:  # 20000 + (10 x job + step) mod 10000: one port per step, below the ephemeral range
            step = env.get("SLURM_STEP_ID", "0")
            step = int(step) if step.isdigit() else 0  # the 'batch' step counts as 0
            port = 20000 + (int(env["SLURM_JOB_ID"]) * 10 + step) % 10000
        # tasks per node, '4(x2),3' = 4, 4 and 3 on nodes 0, 1 and 2: this node's count
        per_node = [int(n) for n, times in re.findall(r"(\d+)(?:\(x(\d+)\))?",
                                                      env.get("SLURM_STEP_TASKS_PER_NODE", ""))
                    for _ in range(int(times or 1))]
        node = int(env.get("SLURM_NODEID", 0))
        here = per_node[node] if node < len(per_node) else int(env["SLURM_LOCALID"]) + 1
        return Launch("srun", int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]),
                      int(env["SLURM_LOCALID"]), here, addr, port)
    return Launch("python", 0, 1, 0, 1, None, None)


def choose_device(device_arg: str, me: Launch) -> torch.device:
    """--device auto|cpu|cuda: the GPU of this local rank when CUDA is asked for or available.

    auto takes the GPUs only when every process of this machine gets one: a two-process
    torchrun on a one-GPU laptop runs on the CPU (and says so) instead of failing, except in a
    SLURM job."""
    if device_arg == "cuda" and not torch.cuda.is_available():
        cli.fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    srun_bound = me.launcher == "srun" and count == 1  # srun --gpus-per-task=1: sees its GPU only
    if device_arg == "auto" and me.local_world_size > count and not srun_bound:
        if os.environ.get("SLURM_JOB_ID"):  # a GPU allocation that trains on its CPUs: a mistake
            cli.fail(f"--device auto: {me.local_world_size} processes on this node but {count} "
                     f"GPU(s) in SLURM job {os.environ['SLURM_JOB_ID']}: start at most {count} "
                     f"per node, or pass --device cpu")
        if me.local_rank == 0:
            print(f"--device auto: {me.local_world_size} processes on this node but {count} "
                  f"GPU(s): running on the CPU with gloo", file=sys.stderr, flush=True)
        return torch.device("cpu")
    if me.local_rank < count:
        return torch.device("cuda", me.local_rank)
    if srun_bound:
        return torch.device("cuda", 0)
    cli.fail(f"local rank {me.local_rank} has no GPU: only {count} visible on this node "
             f"(start at most {count} processes per node)")


def init_distributed(device_arg: str, timeout_s: float) -> Dist:
    me = who_am_i(os.environ)
    device = choose_device(device_arg, me)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device: set it first
    else:  # one CPU thread per rank: more would split reductions by core count, changing digits
        torch.set_num_threads(1)
    # DDP (1): every rank joins the group. gloo runs on CPU tensors, NCCL on GPU tensors. The
    # timeout bounds every collective: a rank that never arrives becomes an error, not a hang.
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if me.master_addr is None:  # one process: a group of one on an in-memory store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:  # rank 0 hosts a TCP store at MASTER_ADDR:MASTER_PORT; the others connect to it
        os.environ.update(MASTER_ADDR=me.master_addr, MASTER_PORT=str(me.master_port))
        dist.init_process_group(backend, init_method="env://", rank=me.rank,
                                world_size=me.world_size, timeout=timeout,
                                # bind the group to this rank's GPU (NCCL); nothing on CPU
                                device_id=device if device.type == "cuda" else None)
    return Dist(me.rank, me.world_size, me.local_rank, device)


def teardown() -> None:
    # DDP's reducer holds the process group in reference cycles; freed only at interpreter exit,
    # gloo's threads can then abort a run that has already finished. Collect them first.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic")
    p.add_argument("--data-dir", type=Path, help="folder holding torchvision's MNIST/raw files")
    p.add_argument("--train-size", type=int, default=4096, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=1024, help="synthetic test images")
    args = p.parse_args(argv)
    cli.check_positive(args, "epochs", "batch_size", "train_size", "test_size", "lr", "timeout_s")
    if args.dataset == "mnist":
        if args.data_dir is None:
            cli.fail("--dataset mnist needs --data-dir DIR (DIR/MNIST/raw from torchvision)")
        if not (args.data_dir / "MNIST" / "raw").is_dir():
            cli.fail(f"no MNIST in {args.data_dir}: expected {args.data_dir / 'MNIST' / 'raw'} "
                     "(download it once with torchvision.datasets.MNIST(DIR, download=True))")
    return args


if __name__ == "__main__":
    main()
