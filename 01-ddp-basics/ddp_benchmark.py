"""DDP weak scaling: throughput at a fixed per-rank batch, with each step split into compute and
exposed communication.

Launch (from the repository root):
    python 01-ddp-basics/ddp_benchmark.py                         # sweep world sizes 1 and 2
    python 01-ddp-basics/ddp_benchmark.py --world-sizes 1,2,4 --json-out runs/ddp_scaling.json
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_benchmark.py --device cuda   # one world size

Without a launcher the script sweeps: it starts `torchrun --nproc_per_node=W` on itself for each
W in --world-sizes, then prints the table and writes --json-out. Under torchrun or srun it measures
that one world size.

How a step is split: the same step is timed twice, alternating, with the same data:
    sync    DDP as usual: backward all-reduces the gradients (overlapped with backward)
    nosync  inside `no_sync()`: backward without any all-reduce = the compute alone
exposed communication = median(sync) - median(nosync): the part of the all-reduce that backward
did not hide. Weak scaling efficiency(W) = throughput(W) / (W x throughput(1)).

Expected output (python 01-ddp-basics/ddp_benchmark.py, 2-core AMD EPYC CPU, gloo; see README):
    world  samples/s  step ms  compute ms  exposed comm ms  efficiency
        1       ...
        2       ...
"""

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


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
    p.add_argument("--world-sizes", default="1,2", help="sweep: comma-separated world sizes")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (fixed)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width")
    p.add_argument("--layers", type=int, default=4, help="MLP hidden layers")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps")
    p.add_argument("--iters", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP gradient bucket size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--json-out", type=Path, help="write the rows (a list of dicts) here")
    args = p.parse_args(argv)
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        fail(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    for name in ("batch_size", "hidden", "layers", "iters"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.world_sizes) < 1 or args.warmup < 0:
        fail("world sizes must be at least 1 and --warmup at least 0")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """Same set-up as ddp_training.py (torchrun or srun variables)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    return rank, world, device


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args):
    """One world size (we are a rank started by torchrun/srun): returns the row on rank 0."""
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        torch.manual_seed(args.seed)
        layers = [nn.Linear(64, args.hidden), nn.GELU()]
        for _ in range(args.layers - 1):
            layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(args.hidden, 10)).to(device)
        params = sum(p.numel() for p in model.parameters())
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=args.bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(args.seed + rank)
        x = torch.randn(args.batch_size, 64, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)

        def step(sync: bool) -> float:
            synchronize(device)
            t0 = time.perf_counter()
            if sync:
                F.cross_entropy(ddp(x), y).backward()  # all-reduce overlapped with backward
            else:
                with ddp.no_sync():                     # the same step without communication
                    F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            return time.perf_counter() - t0

        for _ in range(args.warmup):
            step(True)
            step(False)
        times = {True: [], False: []}
        for _ in range(args.iters):  # alternate, so both kinds see the same machine load
            for sync in (True, False):
                dist.barrier()
                times[sync].append(step(sync))
        # The slowest rank sets the pace of a synchronous step: take the max over ranks.
        medians = torch.tensor([statistics.median(times[True]), statistics.median(times[False])])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        step_s, compute_s = medians.tolist()
        return rank, {
            "world_size": world, "per_rank_batch": args.batch_size, "params": params,
            "grad_bytes": params * 4, "step_time_s": step_s, "compute_s": compute_s,
            "exposed_comm_s": max(0.0, step_s - compute_s),
            "samples_per_s": world * args.batch_size / step_s,
            "backend": dist.get_backend(), "device": str(device),
            "torch_version": torch.__version__,
        }
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def sweep(args, argv):
    """No launcher: run `torchrun --nproc_per_node=W` on this script for each W, then compare."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            out = Path(tmp) / f"w{world}.json"
            with socket.socket() as s:  # a free port for this world size's rendezvous
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = ["torchrun", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
                   f"--master_port={port}", __file__, *strip_sweep_args(argv),
                   "--json-out", str(out)]
            print(f"running world size {world} ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"world size {world} failed:\n{proc.stderr[-3000:]}")
            rows += json.loads(out.read_text())
    base = next((r for r in rows if r["world_size"] == 1), None)
    for row in rows:  # weak scaling: ideal throughput grows W times
        row["scaling_efficiency"] = (row["samples_per_s"] / (row["world_size"]
                                     * base["samples_per_s"]) if base else None)
    return rows


def strip_sweep_args(argv):
    """Our own arguments minus --world-sizes / --json-out (the sweep sets those per run)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--world-sizes", "--json-out"):
            skip = True
            continue
        if a.startswith(("--world-sizes=", "--json-out=")):
            continue
        out.append(a)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    launched = "RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ
    if launched:
        rank, row = measure(args)
        row["scaling_efficiency"] = 1.0 if row["world_size"] == 1 else None
        rows = [row] if rank == 0 else []
    else:
        rows = sweep(args, argv)
    if not rows:
        return
    print(f"{'world':>5} {'samples/s':>10} {'step ms':>8} {'compute ms':>11} "
          f"{'exposed comm ms':>16} {'efficiency':>11}")
    for r in rows:
        eff = "-" if r["scaling_efficiency"] is None else f"{100 * r['scaling_efficiency']:.0f}%"
        print(f"{r['world_size']:>5} {r['samples_per_s']:>10.0f} {1e3 * r['step_time_s']:>8.1f} "
              f"{1e3 * r['compute_s']:>11.1f} {1e3 * r['exposed_comm_s']:>16.1f} {eff:>11}")
    print(f"model: {rows[0]['params'] / 1e6:.2f}M parameters "
          f"({rows[0]['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients all-reduced per step), "
          f"{rows[0]['per_rank_batch']} samples per rank, {rows[0]['backend']} on "
          f"{rows[0]['device']}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
