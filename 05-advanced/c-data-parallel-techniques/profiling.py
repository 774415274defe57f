"""Profile data-parallel training with torch.profiler: one trace per rank, a compute vs
communication table read back from the profile, and what the measured communication share says
about scaling (weak scaling, and Amdahl's law for strong scaling).

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/profiling.py \\
        --trace-dir runs/traces
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/profiling.py \\
        --device cuda --hidden 4096 --trace-dir runs/traces

Then open runs/traces/trace_rank0.json in https://ui.perfetto.dev (or chrome://tracing): the
labelled regions of each step and, under `allreduce`, gloo's (or NCCL's) all_reduce op. The
same tracks, every rank in one picture, drawn from the trace files:
    python 05-advanced/c-data-parallel-techniques/figures/trace_timeline.py runs/traces \
        runs/profiling_timeline.png

The profiler runs on a schedule so that start-up does not pollute the numbers:

    step:   1      2        3 4 5
            wait   warmup   active (recorded)        -> on_trace_ready writes trace_rank<r>.json

Each step is labelled with dtcourse.profiling.nvtx_range: data | forward | backward | allreduce |
optimizer, a record_function for torch.profiler and, on CUDA, an NVTX range for Nsight Systems.
Gradients are averaged by one explicit flat all-reduce after backward (no overlap), so the
`allreduce` label is all the time a rank spends in it: the transfer, plus, on a rank that arrives
early, the wait for the slowest rank (load imbalance, not communication). The rank that arrives
last waits for nobody: its share c is the communication itself. --batch-size is per rank (weak
scaling): n ranks give about n (1 - c) times one rank's throughput while the all-reduce keeps its
time, with no ceiling. Amdahl's law bounds strong scaling instead (a fixed global batch split n
ways: compute shrinks, the all-reduce does not).
"""

import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule

from dtcourse import cli, launch, report
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP
from dtcourse.profiling import machine, nvtx_range

SCRIPT = "05-advanced/c-data-parallel-techniques/profiling.py"
REGIONS = ("data", "forward", "backward", "allreduce", "optimizer")


# --------------------------------------------------------------------------------------------------
# A data-parallel step, each part labelled for the profiler


@contextmanager
def region(name: str, device: torch.device):
    """A labelled range of the trace (and of an nsys timeline, on CUDA). On CUDA kernels run
    asynchronously: synchronising before the range closes makes it last until its kernels have
    finished, not just until they were launched (the previous range's synchronisation already
    left the GPU idle at its start)."""
    with nvtx_range(name):
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def average_gradients(model, world: int) -> None:
    """One flat all-reduce of all gradients (communication_overlap.py shows bucketed and
    overlapped versions); it includes waiting for the slower rank."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def train_step(args, d, model, optimizer, step: int) -> torch.Tensor:
    with region("data", d.device):
        x_all, y_all = classification_batch(args.seed, step, d.world_size * args.batch_size)
        rows = rank_rows(d.rank, args.batch_size)
        x, y = x_all[rows].to(d.device), y_all[rows].to(d.device)
    with region("forward", d.device):
        loss = F.cross_entropy(model(x), y)
    with region("backward", d.device):
        loss.backward()
    with region("allreduce", d.device):
        average_gradients(model, d.world_size)
    with region("optimizer", d.device):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def profiled_training(args, d, model, optimizer, trace_path):
    """wait + warmup + active steps under the profiler; returns it and this rank's losses."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda"
                                           else [])
    losses = []
    prof = profile(activities=activities,
                   schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active,
                                     repeat=1),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)))
    # A top-level "course" entry of the trace file says what ran, for figures/trace_timeline.py.
    prof.preset_metadata_json("course", json.dumps({
        "script": SCRIPT, "machine": machine(d.device), "torch_version": torch.__version__,
        "steps": {"wait": args.wait, "warmup": args.warmup, "active": args.active}}))
    with prof:
        for step in range(args.wait + args.warmup + args.active):
            losses.append(train_step(args, d, model, optimizer, step))
            prof.step()  # advances the schedule; marks "ProfilerStep#k" in the trace
    return prof, losses


# --------------------------------------------------------------------------------------------------
# Reading the profile back, and what the communication share bounds


def fractions_of(prof) -> tuple[float, dict, list]:
    """(step time in us, share of each region, names of the communication ops) from the recorded
    steps: ProfilerStep#k events are the whole steps, the labels nest inside them (key_averages
    groups the steps as "ProfilerStep*"). Times: microseconds of CPU wall time, summed over the
    active steps."""
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step_us = sum(t for k, t in totals.items() if k.startswith("ProfilerStep"))
    fractions = {name: totals.get(name, 0.0) / step_us for name in REGIONS}
    fractions["other"] = 1.0 - sum(fractions.values())  # profiler overhead, Python glue
    comm_ops = sorted({k for k in totals if "all_reduce" in k or "allreduce" in k.lower()})
    return step_us, fractions, comm_ops


def strong_scaling_bound(comm: float, world: int, n: int) -> float:
    """Amdahl's law for this run's global batch (world x --batch-size rows) split over n ranks.
    Measured on `world` ranks, a step is compute (1 - comm) + all-reduce comm; one process does
    the whole batch's compute, world (1 - comm), with no all-reduce; n ranks do world (1 - comm) / n
    each, plus the all-reduce, which does not shrink. The speedup over one process is at most
    world (1 - comm) / (world (1 - comm) / n + comm), and never above world (1 - comm) / comm."""
    work = world * (1.0 - comm)
    return work / (work / n + comm)


def run(args, d):
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(d.device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # start equal (DDP would do this)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    trace_path = args.trace_dir / f"trace_rank{d.rank}.json"
    prof, losses = profiled_training(args, d, model, optimizer, trace_path)

    step_us, fractions, comm_ops = fractions_of(prof)
    mine = report.held_bytes(params=model.parameters(), optimizer=optimizer, device=d.device)
    per_rank = report.gather({**mine, "step_ms": step_us / args.active / 1e3,
                              "fractions": fractions, "trace": str(trace_path)})
    # The rank that reached the all-reduce last waited for nobody: its share is the transfer.
    shares = [row["fractions"]["allreduce"] for row in per_rank]
    comm = min(shares)
    bounds = {n: strong_scaling_bound(comm, d.world_size, n) for n in (8, 64, 1024)}
    print_table(args, d.world_size, per_rank, comm_ops, comm, bounds)

    losses = torch.stack(losses)
    dist.all_reduce(losses)  # mean over the global batch, per step
    steps = len(losses)
    metrics = report.metrics(
        d, script=SCRIPT, strategy="data parallel, one flat all-reduce", steps=steps,
        global_batch=d.world_size * args.batch_size, losses=(losses / d.world_size).tolist(),
        samples_per_s=d.world_size * args.batch_size / (step_us / args.active / 1e6),
        per_rank=per_rank, active_steps=args.active, comm_fraction=comm, comm_ops=comm_ops,
        wait_fraction=[x - comm for x in shares], weak_scaling_efficiency=1.0 - comm,
        amdahl_bound={str(n): b for n, b in bounds.items()})
    report.finish(args, metrics, model.state_dict())


def print_table(args, world, per_rank, comm_ops, comm, bounds) -> None:
    """Every time and share of time is measured, and which rank reaches the all-reduce last
    depends on scheduling: those are printed with a leading `~`."""
    report.print0(f"world {world} | {args.active} profiled steps per rank | traces in "
                  f"{args.trace_dir} | ~: depends on the machine's speed")
    report.print0(f"{'rank':<5} {'step ms':>8} " + " ".join(f"{n:>9}"
                                                            for n in (*REGIONS, "other")))
    for r, row in enumerate(per_rank):
        report.print0(f"{r:<5} {'~' + format(row['step_ms'], '.2f'):>8} " + " ".join(
            f"{'~' + format(row['fractions'][n], '.1%'):>9}" for n in (*REGIONS, "other")))
    report.print0(f"communication ops seen in the profile: {', '.join(comm_ops)}")
    shares = [row["fractions"]["allreduce"] for row in per_rank]
    last = shares.index(comm)
    waits = ", ".join(f"rank ~{r} ~{x - comm:.1%}" for r, x in enumerate(shares) if r != last)
    report.print0(f"communication: ~{comm:.1%} of a step, the all-reduce of rank ~{last}, the last "
                  "to reach it; the other ranks' extra all-reduce time is waiting for it"
                  + (f": {waits}" if waits else ""))
    report.print0(f"weak scaling (--batch-size per rank, as run): n ranks give n x ~{1 - comm:.2f} "
                  "the throughput of one process (no all-reduce) if the all-reduce keeps its "
                  "time: no ceiling")
    limit = f"~{world * (1 - comm) / comm:.1f}x" if comm > 0 else "none"
    report.print0("strong scaling (Amdahl: this run's global batch split n ways, the all-reduce "
                  "not shrinking): speedup over one process at most "
                  + ", ".join(f"~{b:.1f}x at {n}" for n, b in bounds.items())
                  + f" (limit {limit})")


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p)
    p.add_argument("--wait", type=int, default=1, help="profiler schedule: steps skipped")
    p.add_argument("--warmup", type=int, default=1, help="profiler schedule: traced, discarded")
    p.add_argument("--active", type=int, default=3, help="profiler schedule: steps recorded")
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--trace-dir", type=Path, default=Path("runs/traces"),
                   help="each rank writes trace_rank<r>.json here")
    args = p.parse_args(argv)
    cli.check_positive(args, "active", "batch_size", "hidden", "lr", "timeout_s")
    if args.wait < 0 or args.warmup < 0:
        cli.fail(f"--wait and --warmup must be >= 0, got {args.wait} and {args.warmup}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
