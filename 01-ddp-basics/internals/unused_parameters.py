"""find_unused_parameters: a parameter that forward never uses. Default DDP raises at the next
step; the flag fixes it, at the price of a graph traversal and one more all-reduce every step.

TwoHeads has a trunk and two heads; forward uses head_a only. DDP waits for every parameter's
gradient before a step's reduction is finished, and head_b's never comes. The demo shows the
error, trains with find_unused_parameters=True (= one process on the global batch), and counts
what the flag costs on a model that uses every parameter.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/unused_parameters.py
    python 01-ddp-basics/internals/unused_parameters.py           # one process
"""

import re
import statistics

import torch
from common import EQUAL_TOL, Demo, TwoHeads, allreduces, local_batch, main, max_diff, \
    one_process, sgd_step, timed, verdict, worst, wrap

from dtcourse import cli, comm, report
from dtcourse.models import MLP

SCRIPT = "01-ddp-basics/internals/unused_parameters.py"


def demo(args, d, checks, exports) -> dict:
    report.print0("\n[find_unused_parameters] TwoHeads: forward uses trunk and head_a, "
                  "never head_b")
    # 1. Default DDP. Every parameter's gradient hook must fire before a bucket is complete; the
    #    bucket holding head_b never is, so backward returns with it unreduced, and the next
    #    forward finds the previous reduction unfinished and raises (on every rank alike, before
    #    any collective: no rank is left waiting).
    ddp = wrap(TwoHeads, args, d)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    error, failed_at = "", None
    for step in range(args.steps):
        try:
            sgd_step(ddp, opt, *local_batch(args, d, step))
        except RuntimeError as exc:
            error, failed_at = str(exc), step + 1
            break
    sentences = re.split(r"(?<=\.)\s+", error.strip())
    missing = re.search(r"did not receive grad for rank \d+: ([\d ]+)", error)
    names = [n for n, p in ddp.module.named_parameters() if p.requires_grad]  # the reducer's order
    indices = [int(i) for i in missing.group(1).split()] if missing else []
    unused = [names[i] for i in indices]
    del ddp, opt
    if failed_at:
        report.print0(f"  default DDP: step {failed_at} raises RuntimeError: {sentences[0]}")
        report.print0(f"    {sentences[1] if len(sentences) > 1 else ''}")
        report.print0(f"    parameters without a gradient on rank 0: {' '.join(map(str, indices))}"
                      f" = {', '.join(unused)}")
    else:
        report.print0("  default DDP: NO error (expected one at step 2)")
    checks["find_unused_parameters: default DDP raises"] = bool(failed_at) and "Expected to have " \
        "finished reduction in the prior iteration" in error

    # 2. find_unused_parameters=True: at the end of each forward DDP walks the autograd graph
    #    from the outputs and notes every parameter it does not reach; when the first gradient
    #    hook fires in backward it marks those ready (their gradient: zero in the bucket, .grad
    #    left None, as in one process).
    ddp = wrap(TwoHeads, args, d, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    for step in range(args.steps):
        sgd_step(ddp, opt, *local_batch(args, d, step))
    exports["find_unused_parameters"] = ddp.module
    diff, = worst(d, max_diff(ddp.module, one_process(TwoHeads, args, d, args.steps)))
    report.print0(f"  find_unused_parameters=True: {args.steps} steps, = one process on the global "
                  f"batch: {verdict(diff)}")
    checks["find_unused_parameters: = one process"] = diff < EQUAL_TOL

    # 3. Its price, on a model that uses every parameter (where the flag is not needed): the
    #    traversal, and an all-reduce of one int32 "used" flag per parameter tensor each step.
    def make():
        return MLP(hidden=64, depth=6)
    plain, finder = wrap(make, args, d), wrap(make, args, d, find_unused_parameters=True)
    opts = {m: torch.optim.SGD(m.parameters(), lr=args.lr) for m in (plain, finder)}
    counts, times = {}, {plain: [], finder: []}
    for step in range(2 + args.timing_steps):
        x, y = local_batch(args, d, step)
        for m in (plain, finder):  # alternate, so that both see the same load on the machine
            if step == 1:
                with comm.CollectiveCounter() as counter:
                    sgd_step(m, opts[m], x, y)
                counts[m] = allreduces(counter)
            else:
                seconds = timed(lambda: sgd_step(m, opts[m], x, y), d.device)
                if step >= 2:
                    times[m].append(seconds)
    # rank 0's own timings (every rank runs the same steps): the two medians and their ratio, so
    # that the three printed numbers are of one statistic, from one rank
    t_plain, t_finder = statistics.median(times[plain]), statistics.median(times[finder])
    ratio = t_finder / t_plain
    flags = [r for r in counts[finder] if r["dtype"] == "int32"]
    n_tensors = len(list(plain.parameters()))
    report.print0(f"  its price where nothing is unused (MLP, {n_tensors} parameter tensors): "
                  f"{len(counts[finder])} all-reduces per step instead of {len(counts[plain])} "
                  f"(+{sum(r['tensor_bytes'] for r in flags)} B of int32 used-flags), step time "
                  f"~{ratio:.2f}x ({t_finder * 1e3:.2f} ms / {t_plain * 1e3:.2f} ms, rank 0's "
                  f"medians of {args.timing_steps} alternating steps)")
    checks["find_unused_parameters: one more all-reduce, of int32 flags"] = \
        len(counts[finder]) == len(counts[plain]) + 1 and \
        sum(r["tensor_bytes"] for r in flags) == 4 * n_tensors
    return {"failed_at_step": failed_at, "error": error, "error_first_sentence": sentences[0],
            "unused_indices": indices, "unused_names": unused, "max_diff_vs_one_process": diff,
            "allreduces_per_step": {"default": len(counts[plain]),
                                    "find_unused_parameters": len(counts[finder])},
            "flag_bytes": sum(r["tensor_bytes"] for r in flags), "param_tensors": n_tensors,
            "step_s": {"default": t_plain, "find_unused_parameters": t_finder},
            "time_ratio": ratio}


def check_args(args) -> None:
    if args.steps < 2:
        cli.fail(f"--steps {args.steps}: find_unused_parameters needs at least 2 (default DDP "
                 f"reports the unused parameter when the second step starts)")


DEMO = Demo("find_unused_parameters", demo, timed=True, check_args=check_args)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
