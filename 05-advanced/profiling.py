"""Profile data-parallel training with torch.profiler: one trace per rank, a compute vs
communication table read back from the profile, and Amdahl's law on the measured fraction.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/profiling.py --trace-dir runs/traces
    torchrun --nproc_per_node=8 05-advanced/profiling.py --device cuda --trace-dir runs/traces

Then open runs/traces/trace_rank0.json in https://ui.perfetto.dev (or chrome://tracing): the
labelled regions of each step and, under `allreduce`, gloo's (or NCCL's) all_reduce op.

Expected output (the first command, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo;
milliseconds move from run to run on a shared CPU, see 05-advanced/README.md, part 05c):
    rank   step ms      data   forward  backward allreduce optimizer     other
    0        69.58      0.4%     19.5%     38.6%     40.8%      0.4%      0.2%
    1        71.88      0.3%      5.8%     65.4%     27.8%      0.4%      0.2%
    Amdahl: communication is 34.3% of a step (mean over ranks); ... the speedup is at most
    2.4x at 8, 2.8x at 64, 2.9x at 1024 (limit 2.9x)

The profiler runs on a schedule so that start-up does not pollute the numbers:

    step:   1      2        3 4 5
            wait   warmup   active (recorded)        -> on_trace_ready writes trace_rank<r>.json

Each step is labelled with record_function: data | forward | backward | allreduce | optimizer.
Gradients are averaged by one explicit flat all-reduce after backward (no overlap), so the
`allreduce` share is exactly the communication a step waits for: the serial part of Amdahl's law.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


REGIONS = ("data", "forward", "backward", "allreduce", "optimizer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--wait", type=int, default=1, help="profiler schedule: steps skipped")
    p.add_argument("--warmup", type=int, default=1, help="profiler schedule: traced, discarded")
    p.add_argument("--active", type=int, default=3, help="profiler schedule: steps recorded")
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--trace-dir", type=Path, default=Path("runs/traces"),
                   help="each rank writes trace_rank<r>.json here")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the summary table here")
    args = p.parse_args(argv)
    for name in ("active", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.wait < 0 or args.warmup < 0:
        fail(f"--wait and --warmup must be >= 0, got {args.wait} and {args.warmup}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
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


class MLP(nn.Module):
    """32 features -> 10 classes."""

    def __init__(self, hidden: int, features: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """Step `step`'s global batch, a pure function of (seed, step); labels from a fixed teacher."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def amdahl(serial: float, n: int) -> float:
    """Speedup bound on n ranks when a fraction `serial` of the step does not shrink with n."""
    return 1.0 / (serial + (1.0 - serial) / n)


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # start equal (DDP would do this)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    trace_path = args.trace_dir / f"trace_rank{rank}.json"

    def region(name):
        # On CUDA, kernels run asynchronously: synchronise at region edges so that the CPU-side
        # times the profiler records are the regions' real durations (only while profiling).
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return record_function(name)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    steps = args.wait + args.warmup + args.active
    with profile(activities=activities,
                 schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active,
                                   repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path))) as prof:
        for step in range(steps):
            with region("data"):
                x_all, y_all = global_batch(args.seed, step, world * args.batch_size)
                mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
                x, y = x_all[mine].to(device), y_all[mine].to(device)
            with region("forward"):
                loss = F.cross_entropy(model(x), y)
            with region("backward"):
                loss.backward()
            with region("allreduce"):
                # One flat all-reduce of all gradients (see communication_overlap.py for
                # bucketed and overlapped versions); includes waiting for the slower rank.
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                dist.all_reduce(flat)
                flat /= world
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
            with region("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            prof.step()  # advances the schedule; marks "ProfilerStep#k" in the trace

    # Read the recorded steps back: ProfilerStep#k events are the whole steps, the labels nest
    # inside them (key_averages groups the steps as "ProfilerStep*"). Times: microseconds of
    # CPU wall time, summed over the active steps.
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step_us = sum(t for k, t in totals.items() if k.startswith("ProfilerStep"))
    fractions = {name: totals.get(name, 0.0) / step_us for name in REGIONS}
    fractions["other"] = 1.0 - sum(fractions.values())  # profiler overhead, Python glue
    comm_ops = sorted({k for k in totals if "all_reduce" in k or "allreduce" in k.lower()})
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"step_ms": step_us / args.active / 1e3,
                                      "fractions": fractions, "trace": str(trace_path)})
    if rank == 0:
        report(args, world, per_rank, comm_ops)
    dist.barrier()


def report(args, world, per_rank, comm_ops):
    print(f"world {world} | {args.active} profiled steps per rank | traces in {args.trace_dir}")
    print(f"{'rank':<5} {'step ms':>8} " + " ".join(f"{n:>9}" for n in (*REGIONS, "other")))
    for r, row in enumerate(per_rank):
        print(f"{r:<5} {row['step_ms']:8.2f} " + " ".join(
            f"{row['fractions'][n]:9.1%}" for n in (*REGIONS, "other")))
    comm = sum(row["fractions"]["allreduce"] for row in per_rank) / world
    print(f"communication ops seen in the profile: {', '.join(comm_ops)}")
    bounds = {n: amdahl(comm, n) for n in (8, 64, 1024)}
    limit = f"{1 / comm:.1f}x" if comm > 0 else "none"
    print(f"Amdahl: communication is {comm:.1%} of a step (mean over ranks); if it stayed that "
          f"long while the rest split n ways, the speedup is at most "
          + ", ".join(f"{b:.1f}x at {n}" for n, b in bounds.items()) + f" (limit {limit})",
          flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({
            "world_size": world, "active_steps": args.active, "per_rank": per_rank,
            "comm_fraction": comm, "comm_ops": comm_ops,
            "amdahl_bound": {str(n): b for n, b in bounds.items()}}, indent=1))


if __name__ == "__main__":
    main()
