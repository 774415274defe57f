"""Exercise 1 of lesson 04: collective_ops.py's table with all_to_all's input changed to 100r + j,
and every rank's result of reduce_scatter and all_to_all.

Launch (from the repository root):
    torchrun --nproc_per_node=3 04-nccl-operations/solutions/ex1_all_to_all_100r.py
    python 04-nccl-operations/solutions/ex1_all_to_all_100r.py               # n = 1
    torchrun --nproc_per_node=4 04-nccl-operations/solutions/ex1_all_to_all_100r.py --device cuda

The exercise's edit, made here without touching the lesson: collective_ops.py's all_to_all row
(input x[j] = 10r + j) is replaced by one whose rank r sends x[j] = 100r + j to rank j; everything
else (the other eleven rows, the closed-form checks, the table) is the lesson's own code. Rank 0's
column of the table shows one rank only, so the lines after it list every rank's result of the
two collectives whose result differs from rank to rank in a way worth deriving by hand.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import cli, launch, lessons, report

SCRIPT = "04-nccl-operations/solutions/ex1_all_to_all_100r.py"
LESSON = Path(__file__).resolve().parents[1]



ops = lessons.load(LESSON / "collective_ops.py")


def all_to_all_100r(r, n, dev):
    x = ops.vec([100 * r + j for j in range(n)], dev)  # element j goes to rank j
    out = torch.empty(n, device=dev)
    dist.all_to_all_single(out, x)  # out[k] = rank k's element r
    return out, ops.vec([100 * k + r for k in range(n)], dev)


def with_new_all_to_all(collectives: list) -> list:
    """The lesson's table, its all_to_all row replaced."""
    return [("all_to_all", all_to_all_100r, "x[j] = 100r + j, j < n", "y[k] = 100k + r")
            if fn is ops.all_to_all else (label, fn, inp, exp)
            for label, fn, inp, exp in collectives]


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, seed=False)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    args = p.parse_args(argv)
    cli.check_positive(args, "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    ops.COLLECTIVES = with_new_all_to_all(ops.COLLECTIVES)  # what run_all iterates over
    with launch.distributed(args.device, args.timeout_s) as d:
        rows = ops.run_all(d.rank, d.world_size, d.device)
        ops.print_table(args, d, rows)  # rank 0 prints, and writes --json-out
        report.print0("every rank's result:")
        for row in rows:
            if row["op"] in ("reduce_scatter(SUM)", "all_to_all"):
                ranks = "  ".join(f"rank {k}: {ops.fmt(v)}" for k, v in enumerate(row["results"]))
                report.print0(f"{row['op']:<22}{ranks}")
    if not all(row["pass"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
