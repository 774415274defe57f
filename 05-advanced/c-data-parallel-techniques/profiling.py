"""Profile data-parallel training with torch.profiler: one trace per rank, a compute vs
communication table read back from the profile, and what the measured communication share says
about scaling (weak scaling, and Amdahl's law for strong scaling).

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/profiling.py \\
        --trace-dir runs/traces
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/profiling.py \\
        --device cuda --hidden 4096 --trace-dir runs/traces

Then open runs/traces/trace_rank0.json in https://ui.perfetto.dev (or chrome://tracing): the
labelled regions of each step and, under `allreduce`, the collective: gloo's all_reduce on a
worker thread, or on CUDA NCCL's all-reduce kernel on a GPU stream. The same tracks, every rank
in one picture, drawn from the trace files:
    python 05-advanced/c-data-parallel-techniques/figures/trace_timeline.py runs/traces \
        runs/profiling_timeline.png

The profiler runs on a schedule so that start-up does not pollute the numbers:

    step:   1      2        3 4 5
            wait   warmup   active (recorded)        -> on_trace_ready writes trace_rank<r>.json

Each step is labelled with dtcourse.profiling.nvtx_range: data | forward | backward | barrier |
allreduce | optimizer, a record_function for torch.profiler and, on CUDA, an NVTX range for
Nsight Systems. Gradients are averaged by one explicit all-reduce of one flat buffer after
backward (no overlap; packing the buffer ends `backward`, unpacking it starts `optimizer`).

A rank that reaches the all-reduce early waits inside it for the last rank, and the all-reduce's
own time cannot tell that wait from the transfer; which rank is last changes from step to step.
So a barrier comes just before the all-reduce (Megatron-LM's timers offer the same,
Timer.start(barrier=True) in megatron/core/timers.py): every rank waits there for the slowest
one (load imbalance, not communication), and the all-reduce then starts on all ranks together,
so `allreduce` is the transfer itself. The barrier costs one small round trip of its own (the
`barrier` time of the last rank to arrive); a training step would leave it out. The
communication share c is the `allreduce` share, averaged over the ranks. --batch-size is per
rank (weak scaling): n ranks give about n (1 - c) times one rank's throughput while the
all-reduce keeps its time, with no ceiling. Amdahl's law bounds strong scaling instead (a fixed
global batch split n ways: compute shrinks, the all-reduce does not).
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
REGIONS = ("data", "forward", "backward", "barrier", "allreduce", "optimizer")


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


def pack_gradients(model) -> torch.Tensor:
    """All gradients in one flat buffer, so that one collective averages them all (DDP fills its
    buckets during backward too; communication_overlap.py shows bucketed and overlapped
    versions)."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def unpack_gradients(model, flat: torch.Tensor, world: int) -> None:
    """The all-reduced sum, divided by the world size, back into each parameter's .grad."""
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
        flat = pack_gradients(model)
    # Measuring only: every rank waits here for the slowest one, so that the all-reduce below
    # starts on all ranks together and its range holds the transfer, not the waiting.
    with region("barrier", d.device):
        # (on NCCL an all-reduce of one float, on this rank's GPU)
        dist.barrier(device_ids=[d.device.index] if d.device.type == "cuda" else None)
    # Only the collective in this range (the copies into and out of the flat buffer are local
    # work, kept in backward and optimizer).
    with region("allreduce", d.device):
        dist.all_reduce(flat)
    with region("optimizer", d.device):
        unpack_gradients(model, flat, d.world_size)
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


def read_profile(prof, first_step: int) -> tuple[list[dict], list[str]]:
    """(one row per recorded step: its number, and the milliseconds of the whole step and of each
    label in it; the names of the collective ops in the profile). ProfilerStep events are the
    whole steps (events() names them "ProfilerStep*"), and the labels nest inside them; times are
    CPU wall time."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    rows = []
    for k, step in enumerate(steps):
        row = {"step": first_step + k, "step_ms": step.time_range.elapsed_us() / 1e3,
               **{name: 0.0 for name in REGIONS}}
        for e in events:
            if e.name in REGIONS and step.time_range.start <= e.time_range.start \
                    < step.time_range.end:
                row[e.name] += e.time_range.elapsed_us() / 1e3
        rows.append(row)
    # The collective's own ops: c10d::allreduce_ (the call), gloo:all_reduce or nccl:all_reduce
    # (the backend's op) and, on CUDA, NCCL's kernels; not this script's `allreduce` label, and
    # not the barrier's.
    comm_ops = sorted({e.name for e in events if e.name not in REGIONS
                       and "barrier" not in e.name.lower()
                       and ("all_reduce" in e.name or "allreduce" in e.name.lower())})
    return rows, comm_ops


def fractions(rows: list[dict]) -> dict:
    """Share of each label in this rank's recorded steps, summed over the steps; `other` is the
    rest (profiler overhead, Python glue)."""
    total = sum(r["step_ms"] for r in rows)
    out = {name: sum(r[name] for r in rows) / total for name in REGIONS}
    out["other"] = 1.0 - sum(out.values())
    return out


def communication(per_rank: list[dict]) -> dict:
    """What the barrier separates. comm: the `allreduce` share (the transfer: every rank starts it
    together), averaged over the ranks; wait_fraction[r]: rank r's `barrier` share (the time it
    waited for the slowest rank, plus the barrier's own round trip). Per step, the last rank to
    arrive is the one that waited least."""
    steps = list(zip(*[row["steps"] for row in per_rank]))  # steps[s][r]: rank r's row of step s
    return {"comm": sum(row["fractions"]["allreduce"] for row in per_rank) / len(per_rank),
            "wait_fraction": [row["fractions"]["barrier"] for row in per_rank],
            "last_rank": [min(range(len(ranks)), key=lambda r: ranks[r]["barrier"])
                          for ranks in steps]}


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

    rows, comm_ops = read_profile(prof, first_step=args.wait + args.warmup)
    mine = report.held_bytes(params=model.parameters(), optimizer=optimizer, device=d.device)
    step_ms = sum(r["step_ms"] for r in rows) / len(rows)
    per_rank = report.gather({**mine, "step_ms": step_ms, "fractions": fractions(rows),
                              "steps": rows, "trace": str(trace_path)})
    comm = communication(per_rank)
    c = comm["comm"]
    bounds = {n: strong_scaling_bound(c, d.world_size, n) for n in (8, 64, 1024)}
    print_table(args, d.world_size, per_rank, comm_ops, comm, bounds)

    losses = torch.stack(losses)
    dist.all_reduce(losses)  # mean over the global batch, per step
    steps = len(losses)
    metrics = report.metrics(
        d, script=SCRIPT, strategy="data parallel, one flat all-reduce", steps=steps,
        global_batch=d.world_size * args.batch_size, losses=(losses / d.world_size).tolist(),
        samples_per_s=d.world_size * args.batch_size / (step_ms / 1e3),
        per_rank=per_rank, active_steps=args.active, comm_fraction=c, comm_ops=comm_ops,
        last_rank_per_step=comm["last_rank"], wait_fraction=comm["wait_fraction"],
        weak_scaling_efficiency=1.0 - c,
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
    report.print0(f"collective ops in the profile: {', '.join(comm_ops)}")
    report.print0("per recorded step, ms: barrier (the wait for the slowest rank) and allreduce "
                  "(started by all ranks together: the transfer)")
    report.print0(f"{'step':<5} " + " ".join(f"{f'barrier r{r}':>10}" for r in range(world)) + " "
                  + " ".join(f"{f'allred r{r}':>9}" for r in range(world)) + "  last to arrive")
    for k, last in enumerate(comm["last_rank"]):
        rows = [row["steps"][k] for row in per_rank]
        report.print0(f"{rows[0]['step']:<5} "
                      + " ".join(f"{'~' + format(r['barrier'], '.2f'):>10}" for r in rows) + " "
                      + " ".join(f"{'~' + format(r['allreduce'], '.2f'):>9}" for r in rows)
                      + f"  rank ~{last}")
    c = comm["comm"]
    waits = ", ".join(f"rank ~{r} ~{w:.1%}" for r, w in enumerate(comm["wait_fraction"]))
    report.print0(f"communication: ~{c:.1%} of a step (the allreduce column, mean over the "
                  f"ranks); waiting for the slowest rank: {waits}")
    report.print0(f"weak scaling (--batch-size per rank, as run): n ranks give n x ~{1 - c:.2f} "
                  "the throughput of one process (no all-reduce) if the all-reduce keeps its "
                  "time: no ceiling")
    limit = f"~{world * (1 - c) / c:.1f}x" if c > 0 else "none"
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
