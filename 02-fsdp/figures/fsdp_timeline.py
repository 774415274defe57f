"""One FSDP2 training step as torch.profiler records it: each unit's all-gathers, its forward and
backward compute, and its reduce-scatter, on every rank.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/figures/fsdp_timeline.py \\
        --json-out runs/fsdp_timeline.json --trace-out runs/fsdp_timeline_trace.json
    python 02-fsdp/figures/fsdp_timeline_figure.py runs/fsdp_timeline.json runs/fsdp_timeline.png

The model, its sharding and its step are fsdp_transformer.py's own (`build` with --strategy full:
fully_shard on every block with reshard_after_forward=True, then on the root with False; and
`train_step`), imported from that file. --steps - 1 steps run first; the last one runs under
torch.profiler (CPU activities, input shapes recorded). Every rank reads its own Chrome trace (rank
0 keeps its file: --trace-out, open it in https://ui.perfetto.dev) for the names FSDP2 gives its
phases with record_function (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):

    FSDP::pre_forward (blocks.0)      unshard before the block's forward: the all-gather, its wait
    FSDP::all_gather (blocks.0)       and the copy-out into the unsharded parameters
    FSDP::post_forward (blocks.0)     reshard after forward (reshard_after_forward=True)
    FSDP::backward_prefetch for X     backward: X's all-gather issued before the current unit's
                                      gradients are computed
    FSDP::pre_backward (blocks.0)     unshard before the block's backward (already prefetched)
    FSDP::post_backward_reduce (..)   the reduce-scatter of the unit's gradients

(the root's names carry no module: `FSDP::pre_forward`), and for the collectives themselves:
`c10d::_allgather_base_` / `c10d::_reduce_scatter_base_` / `c10d::allreduce_` where the main
thread issues them, and gloo's event where a worker thread runs them (`gloo:all_gather`, and
`gloo:all_reduce` for a reduce-scatter, which gloo carries out as an all-reduce of the whole
tensor).

CPU runs only (--device cuda is refused): on a GPU the main thread's boxes would be the times at
which the CPU queued each unit's kernels, not when the GPU ran them, and the NCCL kernels, on
FSDP2's separate all-gather and reduce-scatter streams, could not be matched to their calls by
order as gloo's single work queue allows; read a GPU run in the profiler's own trace instead.
"""

import contextlib
import json
import math
import os
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dtcourse import cli, launch, lessons, report, timing
from dtcourse.data import rank_rows, token_batch

SCRIPT = "02-fsdp/figures/fsdp_timeline.py"
LESSON = Path(__file__).resolve().parents[1]
LAUNCHES = {"c10d::_allgather_base_": "all_gather", "c10d::_reduce_scatter_base_":
            "reduce_scatter", "c10d::allreduce_": "all_reduce"}
PHASE = re.compile(r"FSDP::(\w+?)(?: \((.*)\))?$")  # 'FSDP::pre_forward (blocks.0)'



ft = lessons.load(LESSON / "fsdp_transformer.py")


def run(args, d) -> dict | None:
    """Train --steps steps of fsdp_transformer.py's GPT under --strategy full, the last one
    profiled; rank 0 returns every rank's timeline of that step."""
    lesson = ft.parse_args(["--strategy", "full", "--layers", str(args.layers), "--seed",
                            str(args.seed), "--batch-size", str(args.batch_size)])
    model, mesh, optimizer = ft.build(lesson, "full", d)
    rows = rank_rows(d.rank, lesson.batch_size)
    for step in range(args.steps):
        x, y = token_batch(lesson.seed, step, d.world_size * lesson.batch_size, lesson.seq_len,
                           lesson.vocab)
        x, y = x[rows].to(d.device), y[rows].to(d.device)
        if step < args.steps - 1:
            ft.train_step(lesson, d, model, mesh, optimizer, x, y, contextlib.nullcontext())
            continue
        timing.clock(d.device)  # the device's queue drained (the time itself is not needed)
        dist.barrier()  # both ranks start the profiled step together
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            ft.train_step(lesson, d, model, mesh, optimizer, x, y, contextlib.nullcontext())
            timing.clock(d.device)
    with trace_file(args.trace_out if d.rank == 0 else None) as path:
        prof.export_chrome_trace(str(path))
        mine = rank_events(read_trace(path), d)
    every = report.gather(mine)  # one clock for every process of a machine: side by side
    if d.rank != 0:
        return None
    t0 = min(r["t0_us"] for r in every)
    return {"script": SCRIPT, "world_size": d.world_size, "device": d.device.type,
            "backend": d.backend, "torch_version": torch.__version__, "machine": machine(),
            "layers": lesson.layers, "dim": lesson.dim, "seq_len": lesson.seq_len,
            "vocab": lesson.vocab, "batch_size": lesson.batch_size, "strategy": "full",
            "units": ["root"] + [f"blocks.{i}" for i in range(lesson.layers)],
            "profiled_step": args.steps,
            "ranks": [rank_timeline(r, t0, rank) for rank, r in enumerate(every)]}


@contextlib.contextmanager
def trace_file(path: Path | None):
    """--trace-out, or a temporary file that is gone afterwards."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "trace.json"


def read_trace(path: Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace, in order of start."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    return sorted(events, key=lambda e: e["ts"])


def rank_events(events: list[dict], d) -> dict:
    """This rank's FSDP phases, collectives and optimizer step, as (start, end) in microseconds."""
    main = next(e["tid"] for e in events if e["name"].startswith("FSDP::root_pre_forward"))

    def span(e):
        return [e["ts"], e["ts"] + e["dur"]]

    phases = []  # (phase, unit, span): unit 'root' where FSDP names no module
    for e in events:
        m = PHASE.match(e["name"]) if e["tid"] == main else None
        if m:
            phases.append((m.group(1), m.group(2) or "root", span(e)))
        elif e["tid"] == main and e["name"].startswith("FSDP::backward_prefetch for "):
            phases.append(("backward_prefetch", e["name"].rsplit(" ", 1)[1], span(e)))
    launches = [(LAUNCHES[e["name"]], span(e), input_elements(e)) for e in events
                if e["tid"] == main and e["name"] in LAUNCHES]
    runs = [e for e in events if e["name"].startswith(f"{d.backend}:")]  # gloo's worker threads
    # Autograd's first node after the root's post_forward: backward has begun.
    post_forward_root = max(s[1] for p, u, s in phases if p == "post_forward" and u == "root")
    backward = next(e["ts"] for e in events if e["tid"] == main and e["ts"] > post_forward_root
                    and e["name"].startswith("autograd::engine::evaluate_function"))
    optimizer = next(e for e in events if e["name"].startswith("Optimizer.step"))
    return {"t0_us": min(e["ts"] for e in events if e["tid"] == main), "phases": phases,
            "launches": launches, "backward_start": backward, "optimizer_step": span(optimizer),
            "runs": [(e["name"], span(e), input_elements(e)) for e in runs]}


def rank_timeline(r: dict, t0: float, rank: int) -> dict:
    """One rank's step in ms from `t0`: compute per unit, FSDP's waits, and every collective
    with the unit it serves, where it was issued and where it ran."""
    def ms(pair):
        return {"start_ms": (pair[0] - t0) / 1e3, "end_ms": (pair[1] - t0) / 1e3}

    def where(phase, unit):
        return [s for p, u, s in r["phases"] if p == phase and u == unit]

    units = sorted({u for _, u, _ in r["phases"] if u != "root"},
                   key=lambda u: int(u.split(".")[-1]))  # blocks.0, blocks.1, ...
    compute = []
    # Forward: the root's own layers (embeddings) run between its pre_forward and the first
    # block's; each block between its pre_forward and post_forward; the head after the last block.
    compute.append(("forward", "root", (where("pre_forward", "root")[0][1],
                                        where("pre_forward", units[0])[0][0])))
    for u in units:
        compute.append(("forward", u, (where("pre_forward", u)[0][1],
                                       where("post_forward", u)[0][0])))
    compute.append(("forward", "root", (where("post_forward", units[-1])[0][1],
                                        where("post_forward", "root")[0][0])))
    # Backward: the head first (up to the last block's pre_backward); each block from its
    # pre_backward (its parameters gathered) to its post_backward; the embeddings last.
    compute.append(("backward", "root", (r["backward_start"],
                                         where("pre_backward", units[-1])[0][0])))
    for u in reversed(units):
        post = min(s[0] for p, uu, s in r["phases"] if uu == u and p.startswith("post_backward"))
        compute.append(("backward", u, (where("pre_backward", u)[0][1], post)))
    root_reduce = where("post_backward_reduce", "root")
    last_block_reduce = where("post_backward_reduce", units[0])[0][1]
    compute.append(("backward", "root", (last_block_reduce, root_reduce[0][0])))

    # Collectives: the unit is the FSDP phase that issued it (all_gather / post_backward_reduce
    # of a unit; anything else, the gradient norm's all-reduce, is "clip_grad_norm_").
    issued_by = [(p, u, s) for p, u, s in r["phases"] if p in ("all_gather",
                                                              "post_backward_reduce")]
    collectives = []
    for i, (kind, span_, elements) in enumerate(r["launches"]):
        owner = next((u for p, u, s in issued_by if s[0] <= span_[0] <= s[1]), None)
        run_ = r["runs"][i] if i < len(r["runs"]) else None  # one queue, run in issue order
        collectives.append({
            "kind": kind, "unit": owner or "clip_grad_norm_",
            "pass": "forward" if span_[0] < r["backward_start"] else "backward",
            "prefetch": any(p == "backward_prefetch" and s[0] <= span_[0] <= s[1]
                            for p, _, s in r["phases"]),
            "issued": ms(span_), "elements": elements,
            "ran": dict(ms(run_[1]), event=run_[0], elements=run_[2]) if run_ else None})
    waits = [{"phase": p, "unit": u, **ms(s)} for p, u, s in r["phases"]
             if p in ("all_gather", "all_gather_copy_out", "post_backward_reduce")]
    return {"rank": rank, "compute": [{"pass": p, "unit": u, **ms(s)} for p, u, s in compute],
            "waits": waits, "collectives": collectives,
            "prefetches": [{"unit": u, **ms(s)} for p, u, s in r["phases"]
                           if p == "backward_prefetch"],
            "backward_start_ms": (r["backward_start"] - t0) / 1e3,
            "optimizer_step": ms(r["optimizer_step"]), "runs": len(r["runs"])}


def input_elements(event: dict) -> int | None:
    """Elements of the whole tensor of a collective, from the shapes the profiler recorded: the
    larger of its first two tensors (c10d::_allgather_base_ gets (output, this rank's shard),
    _reduce_scatter_base_ (shard, input)); where the backend runs it, its one tensor."""
    sizes = []
    for dims in (event.get("args", {}).get("Input Dims") or [])[:2]:
        while dims and isinstance(dims[0], list):
            dims = dims[0]
        if dims:
            sizes.append(math.prod(dims))
    return max(sizes) if sizes else None


def machine() -> str:
    """'2-core AMD EPYC ...', for the figure's title."""
    name = "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores}-core {name}"


def print_summary(t: dict) -> None:
    report.print0(f"fsdp_timeline | world {t['world_size']} | {t['device']} | {t['backend']} | "
                  f"GPT {t['layers']} blocks, dim {t['dim']} | units: {', '.join(t['units'])}")
    report.print0(f"step {t['profiled_step']}, rank 0, in the order issued (ms from the start of "
                  "the step; ~: depends on the machine's speed and load)")
    for c in t["ranks"][0]["collectives"]:
        ran = c["ran"] or {"start_ms": float("nan"), "end_ms": float("nan")}
        report.print0(f"  {c['pass']:<8} {c['kind']:<14} {c['unit']:<16} "
                      f"{'prefetch' if c['prefetch'] else '':<8} {c['elements']:>7,} elements  "
                      f"issued ~{c['issued']['start_ms']:.1f}, ran ~{ran['start_ms']:.1f} to "
                      f"~{ran['end_ms']:.1f}")


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    p.set_defaults(device="cpu")  # a picture of gloo's threads: see the docstring
    p.add_argument("--steps", type=int, default=3, help="training steps; the last one is profiled")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (FSDP units)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per rank (fsdp_transformer.py's default is 8: 32 gives the "
                        "compute boxes a visible width)")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the step's timeline here")
    p.add_argument("--trace-out", type=Path,
                   help="rank 0 writes the profiler's Chrome trace of the step here")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "layers", "batch_size", "timeout_s")
    if args.steps < 2:
        cli.fail(f"--steps must be at least 2 (the first step pays FSDP's lazy initialisation; "
                 f"the last is profiled), got {args.steps}")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        cli.fail("--device cuda: this picture is drawn from CPU runs only (gloo's worker "
                 "threads; on a GPU the main thread's boxes would be kernel launches, not GPU "
                 "compute): run it with --device cpu")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        t = run(args, d)
        if d.rank == 0:
            print_summary(t)
            if args.json_out:
                report.write_json(args.json_out, t)
        dist.barrier()  # the files are complete before any rank exits


if __name__ == "__main__":
    main()
