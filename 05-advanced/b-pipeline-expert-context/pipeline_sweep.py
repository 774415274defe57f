"""Measure the pipeline bubble and the activation memory of the schedules of pipeline_parallel.py,
for a list of micro-batch counts m and pipeline sizes p, beside the formulas (p - 1) / (m + p - 1)
and, interleaved with v stages per rank, (p - 1) / (v m + p - 1); zero bubble (--schedules zb1p,zbv)
(p - 1) / (3 m + p - 1) and (p - 1) / (6 m + p - 1) (pipeline_parallel.bubble_formula).

Launch (from the repository root, with D=05-advanced/b-pipeline-expert-context; about 6 minutes,
most of it the simulated compute's sleeps):
    torchrun --nproc_per_node=4 $D/pipeline_sweep.py --microbatches 1-16 --pipeline-sizes 2,4 \\
        --layer-ms 25 --json-out runs/pp_sweep.json
    python $D/figures/pp_figures.py runs/pp_sweep.json runs/pp_bubble.png   # draw it

For each p, implementation (manual, torch), schedule (by default gpipe, 1f1b, interleaved with
v = 2) and m: one untimed warm-up step, then one measured step of pipeline_parallel.py's Pipeline,
with the simulated compute time of --layer-ms, on a batch of m micro-batches of 4 rows. A
pipeline of p < world ranks runs on ranks 0..p-1 while the others wait for it. Combinations the
schedule refuses (torch's 1F1B with m < p, for one) are listed as skipped, with the reason; a
formula outside its range (pipeline_parallel.formula_holds: interleaved with p not dividing m,
zb1p with m < p, zbv with m < 2p - 1) is marked with a *.
"""

import argparse

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report
from dtcourse.data import classification_batch
from pipeline_parallel import (
    FORMULA_RANGE,
    SCHEDULES,
    ZERO_BUBBLE,
    Pipeline,
    add_model_args,
    bubble_formula,
    formula_holds,
    too_few_layers,
    unsupported,
    virtual_stages,
)

SCRIPT = "05-advanced/b-pipeline-expert-context/pipeline_sweep.py"
ROWS_PER_MICROBATCH = 4  # every m uses micro-batches of 4 rows (batch 4 m)


def measure(args, d, p: int, group, impl: str, schedule: str, m: int):
    """One configuration: every rank's bubble, micro-batches held and activation bytes (all ranks
    join the gather; ranks >= p contribute nothing). Returns rank 0's row."""
    batch = ROWS_PER_MICROBATCH * m
    v = virtual_stages(schedule, 0)
    why = unsupported(impl, schedule, p, v, m, args.layers, batch)
    if why:  # every rank reaches the same verdict
        return {"p": p, "impl": impl, "schedule": schedule, "m": m, "skipped": why}
    mine = None
    if d.rank < p:
        pipe = Pipeline(args, impl, schedule, p, v, m, batch, d.rank, d.device, group)
        x, y = classification_batch(args.seed, 0, batch)
        pipe.step(x, y, fixed_cost=False)  # warm-up (first-call costs), untimed
        for q in pipe.parameters():
            q.grad = None
        pipe.step(x, y, fixed_cost=True)
        mine = pipe.measured()
        mine.pop("events")  # the sweep keeps the numbers; pipeline_parallel.py keeps the timeline
    per_rank = [r for r in report.gather(mine) if r is not None]
    bubble = sum(r["bubble"] for r in per_rank) / p
    return {"p": p, "impl": impl, "schedule": schedule, "m": m, "v": v, "bubble": bubble,
            "formula": bubble_formula(schedule, p, v, m)[0],
            "formula_holds": formula_holds(schedule, p, m), "per_rank": per_rank}


def sweep(args, d):
    configs = [(p, impl, schedule, m) for p in args.pipeline_sizes for impl in ("manual", "torch")
               for schedule in args.schedules for m in args.microbatches]
    groups = {}
    rows = []
    bar = report.progress(len(configs), "sweep")
    for p, impl, schedule, m in configs:
        if p not in groups:  # new_group is collective over all ranks, even those that sit out
            groups[p] = dist.new_group(list(range(p))) if p < d.world_size else None
        r = measure(args, d, p, groups[p], impl, schedule, m)
        rows.append(r)
        bar.update(1)
        if d.rank == 0 and "skipped" not in r:
            bar.write(f"{impl:6s} {schedule:11s} p={p} v={r['v']} m={m:2d} | bubble ~"
                      f"{r['bubble']:.3f} measured, {r['formula']:.3f}"
                      f"{'' if r['formula_holds'] else '*'} formula | held "
                      f"{[x['peak_held_microbatches'] for x in r['per_rank']]} | rank 0 "
                      f"activations {r['per_rank'][0]['peak_activation_bytes'] / 1024:.1f} KiB")
    bar.close()
    outside = sorted({r["schedule"] for r in rows if not r.get("formula_holds", True)})
    if outside:
        report.print0("* outside the formula's range (" + "; ".join(
            f"{s}: {FORMULA_RANGE[s]}" for s in outside) + "): the schedule can take longer")
    for r in rows:
        if "skipped" in r:
            report.print0(f"skipped {r['impl']} {r['schedule']} p={r['p']} m={r['m']}: "
                          f"{r['skipped']}")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "layers": args.layers,
            "layer_ms": args.layer_ms, "rows_per_microbatch": ROWS_PER_MICROBATCH,
            "device": str(d.device), "backend": d.backend, "torch_version": torch.__version__,
            "runs": rows})
    dist.barrier()  # the file is complete before any rank exits


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def int_list(text: str) -> list[int]:
    """'1-16' or '1,4,6' -> a list of ints."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a list like 1-16 or 1,4,6, got {text!r}")
    return out


def schedule_list(text: str) -> list[str]:
    """'gpipe,zbv' -> ['gpipe', 'zbv'], each a schedule of pipeline_parallel.py."""
    names = text.split(",")
    unknown = [n for n in names if n not in SCHEDULES + ZERO_BUBBLE]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {','.join(unknown)}: choose among "
                                         f"{','.join(SCHEDULES + ZERO_BUBBLE)}")
    return names


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--microbatches", type=int_list, default=[1, 2, 4, 8], metavar="LIST",
                   help=f"micro-batch counts m to measure (micro-batches of "
                        f"{ROWS_PER_MICROBATCH} rows)")
    p.add_argument("--pipeline-sizes", type=int_list, metavar="LIST",
                   help="pipeline sizes p, each run on ranks 0..p-1 (default: the world size)")
    p.add_argument("--schedules", type=schedule_list, default=",".join(SCHEDULES), metavar="LIST",
                   help=f"schedules to measure, of {','.join(SCHEDULES + ZERO_BUBBLE)}")
    add_model_args(p)
    args = p.parse_args(argv)
    cli.check_positive(args, "layers", "hidden", "timeout_s")
    if min(args.microbatches) < 1:
        cli.fail(f"--microbatches must be at least 1, got {min(args.microbatches)}")
    if args.layer_ms < 0:
        cli.fail(f"--layer-ms must be >= 0, got {args.layer_ms:g}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        args.pipeline_sizes = args.pipeline_sizes or [d.world_size]
        # Before any collective: every p must fit the ranks, and the model must have a layer for
        # each of the 2 p stages of the interleaved schedule.
        for p in args.pipeline_sizes:
            if not 1 <= p <= d.world_size:
                cli.fail(f"--pipeline-sizes {p} must lie between 1 and the world size "
                         f"{d.world_size}")
        if 2 * max(args.pipeline_sizes) > args.layers:
            cli.fail(too_few_layers(max(args.pipeline_sizes), 2, args.layers))
        sweep(args, d)


if __name__ == "__main__":
    main()
