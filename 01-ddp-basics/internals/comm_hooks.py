"""Communication hooks: DDP's all-reduce of each gradient bucket replaced, with one call,
`ddp.register_comm_hook(state, hook)`, by torch's bf16 and fp16 compression hooks. Half the bytes
cross the network, and the weights differ from the fp32 run's by no more than the format's
rounding allows (the bound is computed below the training code).

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/comm_hooks.py
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Demo, allreduces, local_batch, main, worst, wrap
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dtcourse import comm, report
from dtcourse.models import MLP

SCRIPT = "01-ddp-basics/internals/comm_hooks.py"
# name: (hook, the dtype it sends). bf16_compress_hook casts the bucket to bfloat16, divides by
# the world size, all-reduces it and copies the result back into the fp32 bucket;
# fp16_compress_hook does the same in float16. "none": DDP's own fp32 all-reduce.
HOOKS = {"none": (None, torch.float32), "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
         "fp16": (default_hooks.fp16_compress_hook, torch.float16)}


def make():
    return MLP(hidden=64, depth=2)


def train(args, d, hook, dtype) -> dict:
    """args.steps SGD steps of DDP with `hook` in place of its all-reduce (None: DDP's own)."""
    ddp = wrap(make, args, d)
    local: dict = {}
    if hook is not None:
        # The lesson, one call: from now on DDP hands each gradient bucket to the hook
        # (default_hooks.bf16_compress_hook, say) instead of all-reducing it; the hook returns a
        # future of the averaged bucket. `recording` passes the bucket on unchanged, after noting
        # each rank's |gradient| for the rounding bound.
        ddp.register_comm_hook(state=None, hook=recording(hook, local))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    grads1, bound, first_step_bound = None, None, None
    for step in range(args.steps):
        x, y = local_batch(args, d, step)
        with comm.CollectiveCounter() as counter:
            F.cross_entropy(ddp(x), y).backward()  # the hook runs here, once per bucket
        if step == 0:
            grads1 = [p.grad.clone() for p in ddp.parameters()]
        if hook is not None:
            step_bound = step_rounding_bound(ddp, local, dtype, d.world_size)
            if first_step_bound is None:
                first_step_bound, bound = step_bound, [torch.zeros_like(b) for b in step_bound]
            # SGD moves each weight by lr x gradient: the gradients' errors add up. A
            # heuristic, not a rigorous bound: after step 1 the runs' weights differ by some
            # dw = O(u), so their gradients also differ by about H dw (H the loss's Hessian),
            # also first order in u; summing the rounding bounds alone holds while lr x |H| is
            # small (a few small steps, as here), and the checks in demo() test that it held
            bound = [a + args.lr * b for a, b in zip(bound, step_bound)]
        opt.step()
        opt.zero_grad(set_to_none=True)
    sent = allreduces(counter)
    return {"model": ddp.module, "grads1": grads1, "bound": bound,
            "first_step_bound": first_step_bound,
            "bytes": sum(r["tensor_bytes"] for r in sent), "calls": len(sent),
            "dtypes": sorted({r["dtype"] for r in sent})}


def demo(args, d, checks, exports) -> dict:
    report.print0("\n[comm_hooks] MLP, DDP's all-reduce replaced by torch's cast hooks "
                  "(default_hooks.bf16_compress_hook, fp16_compress_hook)")
    runs = {}
    for name, (hook, dtype) in HOOKS.items():
        runs[name] = train(args, d, hook, dtype)
        exports[f"comm_hooks_{name}"] = runs[name]["model"]
    base = runs["none"]
    report.print0(f"  hook  all-reduced per step  step 1: |g - g_fp32| <= u sum_r |g_r|  "
                  f"max |w - w_fp32| after {args.steps} steps  bound if lr|H| small")
    report.print0(f"  none  {base['bytes']:>8,} B {base['dtypes'][0]}")
    out = {"steps": args.steps, "none": {"bytes": base["bytes"], "calls": base["calls"],
                                         "dtypes": base["dtypes"]}}
    for name in ("bf16", "fp16"):
        run = runs[name]
        w_a, w_b = list(run["model"].parameters()), list(base["model"].parameters())
        # step 1: both runs start from the same weights and data, so their gradients differ by
        # the hook's rounding alone, which rounding_bound bounds on every element
        g_excess = max(((g - g0).abs() - b).max().item() for g, g0, b in
                       zip(run["grads1"], base["grads1"], run["first_step_bound"]))
        w_diff = max((a - b).abs().max().item() for a, b in zip(w_a, w_b))
        w_bound = max(b.max().item() for b in run["bound"])
        elem_excess = max(((a - b).abs() - bb).max().item() for a, b, bb in
                          zip(w_a, w_b, run["bound"]))
        g_excess, w_diff, w_bound, elem_excess = worst(d, g_excess, w_diff, w_bound, elem_excess)
        u = torch.finfo(HOOKS[name][1]).eps / 2
        holds = f"every element (u = 2^{round(math.log2(u))})" if g_excess <= 0 else "NO"
        report.print0(f"  {name}  {run['bytes']:>8,} B {run['dtypes'][0]:9}  {holds:38}  "
                      f"{w_diff:<30.1e}  {w_bound:.1e}")
        checks[f"comm_hooks {name}: half the bytes"] = 2 * run["bytes"] == base["bytes"]
        checks[f"comm_hooks {name}: step-1 gradients within the rounding bound"] = g_excess <= 0
        checks[f"comm_hooks {name}: weights within the summed rounding bound"] = w_diff <= w_bound
        out[name] = {"bytes": run["bytes"], "calls": run["calls"], "dtypes": run["dtypes"],
                     "bytes_ratio": run["bytes"] / base["bytes"], "unit_roundoff": u,
                     "step1_grad_excess_over_bound": g_excess, "max_weight_diff": w_diff,
                     "weight_bound": w_bound, "elementwise_excess_over_bound": elem_excess}
    report.print0("  hand-written hooks (top-k with error feedback, PowerSGD beside them): "
                  "05-advanced/c-data-parallel-techniques/gradient_compression.py")
    return out


# --------------------------------------------------------------------------------------------------
# The rounding bound: how far a cast hook's average can be from the exact one


def rounding_bound(abs_sum: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    """Largest |averaged gradient through a cast hook - exact average|, per element, where
    abs_sum = sum over ranks of |local gradient|.

    The hook rounds each rank's gradient to `dtype` (relative error <= u = eps / 2: 2^-8 for
    bf16's 8 significant bits, 2^-11 for fp16's 11), divides by the world size (exact for a power
    of 2), and the all-reduce sums in `dtype`, rounding each of its world - 1 partial sums (each
    <= abs_sum / world). To first order: u x abs_sum / world + (world - 1) x u x abs_sum / world
    = u x abs_sum. The bound adds u x abs_sum / world (one more rounding, of the division, when
    the world is not a power of 2), world x u^2 x abs_sum (the second-order terms) and 2^-23 x
    abs_sum (the float32 rounding of the exact average). Values below the format's normal range
    round to its subnormal spacing `tiny` instead: (world + 1) x tiny."""
    info = torch.finfo(dtype)
    u, tiny = info.eps / 2, info.smallest_normal * info.eps
    return abs_sum * (u * (1 + 1 / world + world * u) + 2 ** -23) + (world + 1) * tiny


def recording(hook, local: dict):
    """Wraps a comm hook: notes each parameter's local |gradient| before the hook compresses it."""
    def wrapped(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            local[p] = g.detach().abs().clone()
        return hook(state, bucket)
    return wrapped


def step_rounding_bound(ddp, local: dict, dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    """This step's rounding_bound for every parameter, from the ranks' local |gradients|."""
    # sum over ranks of |local gradient|: one fp32 all-reduce per tensor, outside the counted step
    sums = [local[p].clone() for p in ddp.parameters()]
    for s in sums:
        dist.all_reduce(s)
    return [rounding_bound(s, dtype, world) for s in sums]


DEMO = Demo("comm_hooks", demo)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
