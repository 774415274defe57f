"""Uneven inputs with Join: ranks with different numbers of batches. Under
`with Join([ddp]):` a rank that runs out of data keeps answering the others' all-reduces, so
nobody hangs; the demo rebuilds in one process the model DDP computes (steps where a rank has
joined still divide by the world size) and finds it equal.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/join.py
"""


import torch
import torch.nn as nn
import torch.nn.functional as F
from common import EQUAL_TOL, Demo, allreduces, build, local_batch, main, max_diff, sgd_step, \
    verdict, worst, wrap
from torch.distributed.algorithms.join import Join

from dtcourse import comm, report, timing
from dtcourse.models import MLP

SCRIPT = "01-ddp-basics/internals/join.py"


def batches_of(rank: int) -> int:
    """Rank r holds 3 + 2r batches: 3 and 5 at world 2."""
    return 3 + 2 * rank


def demo(args, d, checks, exports) -> dict:
    counts = [batches_of(r) for r in range(d.world_size)]
    report.print0(f"\n[join] MLP; batches per rank: {', '.join(map(str, counts))} (without Join "
                  f"the rank with more would pair its next bucket all-reduce with whatever "
                  f"collective the other calls next: a wrong result, an error or a hang)")

    def make():
        return MLP(hidden=32, depth=1)
    ddp = wrap(make, args, d)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    per_step = []
    t0 = timing.clock(d.device)
    # Under Join, every step of a rank that still trains starts with an all-reduce saying "I am
    # here" (and one saying whether to sync gradients); a rank that ran out answers them, and
    # shadows each gradient bucket's all-reduce with zeros, until every rank has joined.
    with Join([ddp]):
        for step in range(batches_of(d.rank)):
            with comm.CollectiveCounter() as counter:
                sgd_step(ddp, opt, *local_batch(args, d, step))
            per_step.append([r["tensor_bytes"] for r in allreduces(counter)])
    seconds, = worst(d, timing.clock(d.device) - t0)
    exports["join"] = ddp.module
    expected, other = join_reference(make, args, d), join_reference(make, args, d, False)
    diff, diff_other = worst(d, max_diff(ddp.module, expected), max_diff(ddp.module, other))
    report.print0(f"  every rank left the Join block, after {max(counts)} steps ({seconds:.2f} s)")
    report.print0(f"  = the expected model (steps 1-{min(counts)}: every rank's rows; later: the "
                  f"gradient sum of the ranks with batches left / world size {d.world_size}): "
                  f"{verdict(diff)}")
    report.print0(f"  (dividing by the ranks still training instead would be off by "
                  f"{diff_other:.4f})")
    sizes = " + ".join(f"{b:,}" for b in per_step[0])
    report.print0(f"  all-reduces per step under Join: {len(per_step[0])}, of {sizes} B (the "
                  f"gradients: {4 * sum(p.numel() for p in ddp.parameters()):,} B)")
    checks["join: = expected model"] = diff < EQUAL_TOL
    checks["join: the other divisor differs"] = diff_other > 1e-3 or len(set(counts)) == 1
    return {"batches_per_rank": counts, "steps": max(counts), "seconds": seconds,
            "max_diff_vs_expected": diff, "max_diff_vs_active_divisor": diff_other,
            "allreduce_bytes_per_step": per_step[0]}


def join_reference(make, args, d, divisor_is_world: bool = True) -> nn.Module:
    """What DDP under Join computes, in one process. At step t the ranks that still have a batch
    contribute their local gradient; a rank that ran out (joined) shadows the all-reduce with
    zeros; the sum is divided by the world size (Join's default, divide_by_initial_world_size),
    not by the ranks still training. The ranks that stepped all hold the same model, and at the
    end Join broadcasts the last one's to the others. (divisor_is_world=False: the alternative.)"""
    model = build(make, args, d)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(max(batches_of(r) for r in range(d.world_size))):
        active = [r for r in range(d.world_size) if step < batches_of(r)]
        losses = [F.cross_entropy(model(x), y) for x, y in
                  (local_batch(args, d, step, rank=r) for r in active)]
        (sum(losses) / (d.world_size if divisor_is_world else len(active))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


DEMO = Demo("join", demo)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
