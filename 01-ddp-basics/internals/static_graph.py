"""static_graph=True: the model with an unused head again, without find_unused_parameters' price
every step. DDP learns the set of used parameters in step 1 and reuses it: from step 2 on one
all-reduce per step (the gradients), where find_unused_parameters=True needs two (gradients and
used-flags), and the same model as one process on the global batch.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/static_graph.py
"""

import torch
from common import EQUAL_TOL, Demo, TwoHeads, allreduces, local_batch, main, max_diff, \
    one_process, sgd_step, verdict, worst, wrap

from dtcourse import comm, report

SCRIPT = "01-ddp-basics/internals/static_graph.py"


def demo(args, d, checks, exports) -> dict:
    report.print0("\n[static_graph] the same TwoHeads, static_graph=True, "
                  "no find_unused_parameters")
    # static_graph=True promises that the set of used parameters and the order of the backward
    # never change. Step 1 then all-reduces everything after backward (and which parameters took
    # part); from step 2 on DDP marks the unused ones ready up front: no traversal, no flags.
    per_step, models = {}, {}
    for name, kwargs in (("static_graph", {"static_graph": True}),
                         ("find_unused_parameters", {"find_unused_parameters": True})):
        ddp = wrap(TwoHeads, args, d, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        per_step[name] = []
        for step in range(args.steps):
            with comm.CollectiveCounter() as counter:
                sgd_step(ddp, opt, *local_batch(args, d, step))
            per_step[name].append(len(allreduces(counter)))
        models[name] = ddp.module
    exports["static_graph"] = models["static_graph"]
    diff, = worst(d, max_diff(models["static_graph"], one_process(TwoHeads, args, d, args.steps)))
    report.print0(f"  trains {args.steps} steps, = one process on the global batch: "
                  f"{verdict(diff)}")
    report.print0(f"  all-reduces per step: static_graph {per_step['static_graph']}, "
                  f"find_unused_parameters {per_step['find_unused_parameters']}")
    checks["static_graph: = one process"] = diff < EQUAL_TOL
    checks["static_graph: one all-reduce per step after step 1"] = \
        all(n == 1 for n in per_step["static_graph"][1:])
    return {"max_diff_vs_one_process": diff, "allreduces_per_step": per_step}


DEMO = Demo("static_graph", demo)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
