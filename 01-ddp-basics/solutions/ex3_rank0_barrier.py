"""Exercise 3 of lesson 01: a barrier that only rank 0 reaches, inside ddp_training.py's loop.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex3_rank0_barrier.py --timeout-s 5
    torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex3_rank0_barrier.py --timeout-s 5 \\
        --barrier-at-step 3 --json-out runs/01-ddp-basics/ex3_barrier.json

The lesson's model, optimizer and train_step (loaded from ddp_training.py by path) train as
usual; after the optimizer step of --barrier-at-step, rank 0 alone calls dist.barrier() under
`if rank == 0:`. Every rank catches what its next collective raises and prints it (prefixed with
its rank), with the seconds it waited: which collective each rank was in, and what it was told.
With --json-out PATH each rank writes its own outcome (ex3_barrier.json -> ex3_barrier.rank0.json, ...): the group is broken
by then, so no rank can collect the others'.
"""

import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dtcourse import cli, launch, lessons, report

SCRIPT = "01-ddp-basics/solutions/ex3_rank0_barrier.py"
LESSON = Path(__file__).resolve().parents[1]



training = lessons.load(LESSON / "ddp_training.py")


def run(args, d) -> dict:
    args.global_batch = d.world_size * args.batch_size * args.grad_accum
    _, ddp, optimizer, scheduler, scaler = training.build(args, d)
    report.print0(f"world {d.world_size} | device {d.device} | rank 0 alone calls dist.barrier() "
                  f"after step {args.barrier_at_step} | --timeout-s {args.timeout_s:g}")
    where, t0 = "training", None
    try:
        for step in range(args.steps):
            where = f"step {step + 1}: forward/backward (DDP's gradient all-reduce)"
            loss = training.train_step(args, d, ddp, optimizer, scheduler, scaler, step)
            where = f"step {step + 1}: the loss all-reduce"
            dist.all_reduce(loss)
            if step + 1 == args.barrier_at_step and d.rank == 0:  # the bug: one rank only
                where = f"step {step + 1}: dist.barrier() (rank 0 only)"
                t0 = time.perf_counter()  # host clock: how long the host waits for the timeout
                dist.barrier()
            if step + 1 == args.barrier_at_step:
                t0 = t0 or time.perf_counter()  # host clock: as above
        outcome = {"rank": d.rank, "error": None, "where": "finished every step"}
    except Exception as exc:  # noqa: BLE001 - the point: show what each rank is told
        waited = time.perf_counter() - t0 if t0 else None  # host clock: as above
        lines = str(exc).strip().splitlines() or [""]
        first = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", lines[0])  # drop gloo's source path
        outcome = {"rank": d.rank, "error": type(exc).__name__, "message": first,
                   "where": where, "waited_s": waited}
        wait_for_every_rank_to_fail(d, args.timeout_s)
    return outcome


def wait_for_every_rank_to_fail(d, timeout_s: float) -> None:
    """Stay alive until every rank has caught its own error.

    A rank that leaves closes its connections, and a rank still waiting is then told
    "Connection closed by peer" instead of its own timeout. The group's collectives are broken,
    but the rendezvous store every rank registered with still answers.
    """
    if d.world_size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    store.set(f"ex3/caught/{d.rank}", "1")
    store.wait([f"ex3/caught/{r}" for r in range(d.world_size)], timedelta(seconds=3 * timeout_s))


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, timeout_s=10.0)
    cli.add_train_args(p, steps=6, batch_size=32, lr=1e-2)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    cli.add_template_args(p)
    p.add_argument("--barrier-at-step", type=int, default=3,
                   help="after this step rank 0 alone enters dist.barrier()")
    args = p.parse_args(argv)
    args.precision = "fp32"
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "lr", "timeout_s",
                       "barrier_at_step")
    cli.check_template_args(args)
    if args.barrier_at_step > args.steps:
        cli.fail(f"--barrier-at-step {args.barrier_at_step} is past --steps {args.steps}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        outcome = run(args, d)
        if outcome["error"]:
            # one write() for both lines: both ranks print at once into the same pipe, and
            # print() writes the text and its newline separately, which can interleave them.
            # Where the rank was, then what gloo said (which of the two messages a rank gets
            # depends on whose timer fires first; see the README's solution)
            sys.stdout.write(f"[rank {d.rank}] {outcome['error']} after {outcome['waited_s']:.1f} "
                             f"s in {outcome['where']}\n[rank {d.rank}]   {outcome['message']}\n")
            sys.stdout.flush()
        else:
            report.print0("every rank finished every step")
        if args.json_out:  # the group is broken: each rank writes its own file
            report.write_json(report.variant_path(args.json_out, f"rank{d.rank}", several=True),
                              {"script": SCRIPT, "world_size": d.world_size,
                               "timeout_s": args.timeout_s, **outcome})
if __name__ == "__main__":
    main()
