"""DDP weak scaling: throughput at a fixed per-rank batch, with each step split into compute and
exposed communication.

Launch (from the repository root):
    python 01-ddp-basics/ddp_benchmark.py                         # sweep world sizes 1 and 2
    python 01-ddp-basics/ddp_benchmark.py --world-sizes 1,2,4 --json-out runs/ddp_scaling.json
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_benchmark.py --device cuda   # one world size

Without a launcher the script sweeps: it starts `torchrun --nproc_per_node=W` on itself for each
W in --world-sizes, every W with the same OMP_NUM_THREADS (1 unless set: torchrun itself sets it
only for W > 1), then prints the table and writes --json-out. Under torchrun or srun it measures
that one world size.

How a step is split: the same step is timed twice, alternating, with the same data:
    sync    DDP as usual: backward all-reduces the gradients (overlapped with backward)
    nosync  inside `no_sync()`: backward without any all-reduce = the compute alone
exposed communication = median(sync) - median(nosync): the part of the all-reduce that backward
did not hide. Weak scaling efficiency(W) = throughput(W) / (W x throughput(1)).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

FEATURES = 64


# --------------------------------------------------------------------------------------------------
# One world size: the same DDP step timed with and without its all-reduce


def build(args, d):
    """The MLP under DDP, plain SGD, and this rank's rows of one fixed global batch."""
    torch.manual_seed(args.seed)
    model = MLP(args.hidden, depth=args.layers, features=FEATURES).to(d.device)
    ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = classification_batch(args.seed, 0, d.world_size * args.batch_size, features=FEATURES)
    rows = rank_rows(d.rank, args.batch_size)
    return model, ddp, opt, x[rows].to(d.device), y[rows].to(d.device)


def timed_step(ddp, opt, x, y, device, sync: bool) -> float:
    """Seconds of one optimizer step, with DDP's all-reduce (sync) or without it (no_sync)."""
    t0 = timing.clock(device)
    if sync:
        F.cross_entropy(ddp(x), y).backward()  # all-reduce overlapped with backward
    else:
        with ddp.no_sync():                     # the same step without communication
            F.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return timing.clock(device) - t0


def bucket_sizes(ddp) -> list[int]:
    """Bytes of each gradient bucket DDP all-reduces per step, as its logger reports them: after
    the first step DDP rebuilds its buckets in the order gradients arrived (by default with a
    first bucket of about 1 MiB)."""
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
    return [int(size) for size in sizes.split(",") if size.strip()]


def measure(args, d) -> dict:
    """One world size (this process is a rank started by torchrun or srun): the row."""
    model, ddp, opt, x, y = build(args, d)
    for _ in range(args.warmup):
        timed_step(ddp, opt, x, y, d.device, True)
        timed_step(ddp, opt, x, y, d.device, False)
    times = {True: [], False: []}
    for _ in range(args.iters):  # alternate, so both kinds see the same machine load
        for sync in (True, False):
            dist.barrier()
            times[sync].append(timed_step(ddp, opt, x, y, d.device, sync))
    # The slowest rank sets the pace of a synchronous step: take the max over ranks.
    medians = torch.tensor([statistics.median(times[True]), statistics.median(times[False])],
                           dtype=torch.float64, device=d.device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    step_s, compute_s = medians.tolist()
    params = sum(p.numel() for p in model.parameters())
    return {"world_size": d.world_size, "per_rank_batch": args.batch_size, "params": params,
            "grad_bytes": report.tensor_bytes(model.parameters()),
            "bucket_bytes": bucket_sizes(ddp), "step_time_s": step_s,
            "compute_s": compute_s, "exposed_comm_s": max(0.0, step_s - compute_s),
            "samples_per_s": d.world_size * args.batch_size / step_s,
            "threads_per_rank": torch.get_num_threads(),
            "backend": d.backend, "device": str(d.device), "torch_version": torch.__version__}


# --------------------------------------------------------------------------------------------------
# The sweep: one torchrun per world size, then the comparison


def sweep(args, argv) -> list[dict]:
    """No launcher: run `torchrun --nproc_per_node=W` on this script for each W, then compare."""
    rows = []
    # The same CPU threads per rank at every W: torchrun sets OMP_NUM_THREADS=1 only when it
    # starts more than one process, which would give world 1 all the cores and bias the ratio.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            out = Path(tmp) / f"w{world}.json"
            # --standalone: torchrun picks a free port for this world size's rendezvous
            # torchrun as a module of this interpreter: the `torchrun` on PATH may belong to
            # another environment
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={world}", __file__, *strip_sweep_args(argv),
                   "--json-out", str(out)]
            print(f"running world size {world} ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
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


def print_table(rows) -> None:
    """The sweep's table. Every measured column is printed with a leading `~`: it depends on the
    machine's speed and load, not on the code (world sizes are exact, and so is world 1's
    efficiency, 100% by definition)."""
    def approx(x: float, decimals: int, width: int, suffix: str = "") -> str:
        return f"~{x:.{decimals}f}{suffix}".rjust(width)

    print(f"{'world':>5} {'samples/s':>10} {'step ms':>8} {'compute ms':>11} "
          f"{'exposed comm ms':>16} {'efficiency':>11}   (~: depends on the machine's speed)")
    for r in rows:
        if r["scaling_efficiency"] is None:
            eff = "-".rjust(11)
        elif r["world_size"] == 1:  # the reference itself
            eff = f"{100 * r['scaling_efficiency']:.0f}%".rjust(11)
        else:
            eff = approx(100 * r["scaling_efficiency"], 0, 11, "%")
        print(f"{r['world_size']:>5} {approx(r['samples_per_s'], 0, 10)} "
              f"{approx(1e3 * r['step_time_s'], 1, 8)} {approx(1e3 * r['compute_s'], 1, 11)} "
              f"{approx(1e3 * r['exposed_comm_s'], 1, 16)} {eff}")
    buckets = rows[-1]["bucket_bytes"]
    print(f"model: {rows[0]['params'] / 1e6:.2f}M parameters "
          f"({rows[0]['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients all-reduced per step, in "
          f"{len(buckets)} bucket(s) of {', '.join(f'{b / 2**20:.2f}' for b in buckets)} MiB), "
          f"{rows[0]['per_rank_batch']} samples per rank, {rows[0]['backend']} on "
          f"{rows[0]['device']}, {rows[0]['threads_per_rank']} CPU thread(s) per rank", flush=True)


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--world-sizes", default="1,2", help="sweep: comma-separated world sizes")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (fixed)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width")
    p.add_argument("--layers", type=int, default=4, help="MLP hidden layers")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps")
    p.add_argument("--iters", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP gradient bucket size in MiB (default: DDP's own, 25 MiB after a "
                        "first bucket of 1 MiB)")
    args = p.parse_args(argv)
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        cli.fail(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    cli.check_positive(args, "batch_size", "hidden", "layers", "iters", "bucket_cap_mb",
                       "timeout_s")
    if min(args.world_sizes) < 1 or args.warmup < 0:
        cli.fail("world sizes must be at least 1 and --warmup at least 0")
    return args


def launched() -> bool:
    """Started by torchrun, srun (or another launcher) as one rank of a world, not by hand?"""
    try:
        return launch.detect(os.environ).launcher != "python"
    except launch.LaunchError:
        return True  # inconsistent launcher variables: setup() says which, and exits 2


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if launched():
        with launch.distributed(args.device, args.timeout_s) as d:
            row = measure(args, d)
        row["scaling_efficiency"] = 1.0 if row["world_size"] == 1 else None
        rows = [row] if d.rank == 0 else []
    else:
        rows = sweep(args, argv)
    if rows:  # rank 0, or the sweep
        print_table(rows)
        if args.json_out:
            report.write_json(args.json_out, rows)


if __name__ == "__main__":
    main()
