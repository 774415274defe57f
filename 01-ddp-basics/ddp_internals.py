"""DDP internals, each shown by running it: find_unused_parameters, static_graph,
gradient_as_bucket_view, bucket_cap_mb, SyncBatchNorm, uneven inputs with Join, and the built-in
compression hooks. Every demo trains a tiny model for a few SGD steps and checks what it claims.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py                    # every demo
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py --demo join        # one of them
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py --json-out runs/ddp_internals.json
    torchrun --nproc_per_node=4 01-ddp-basics/ddp_internals.py --bucket-caps none,0.5,4
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_internals.py --device cuda   # nn.SyncBatchNorm
    python 01-ddp-basics/ddp_internals.py --demo bucket_cap_mb                   # one process

`--export runs/w.pt` writes the plain state dict of each model a demo trains under DDP, one file per
model: runs/w.find_unused_parameters.pt, runs/w.join.pt, runs/w.comm_hooks_bf16.pt, ...

The demos (`--demo NAME`, or all of them):
    find_unused_parameters   a parameter that forward never uses: default DDP raises at the next
                             step; the flag fixes it, at the price of a graph traversal and one
                             more all-reduce every step
    static_graph             the same model without that per-step price: DDP learns the unused
                             set in step 1 and reuses it
    gradient_as_bucket_view  .grad as views into the all-reduce buckets: 4 bytes per parameter
                             fewer, counted from the tensors' storages
    bucket_cap_mb            how many all-reduces a step launches, predicted from the parameter
                             sizes and counted
    sync_batchnorm           BatchNorm statistics over the global batch (nn.SyncBatchNorm, or on a
                             CPU, where torch has no kernel for it, the same math written out)
    join                     ranks with different numbers of batches, under Join: no hang, and the
                             model DDP computes, rebuilt in one process
    comm_hooks               torch's bf16 and fp16 compression hooks: half the bytes, and a weight
                             difference bounded by the format's rounding

Each demo compares with one process where one process is the claim: every rank trains the plain
model on the whole global batch beside DDP, from the same seed, and the difference is printed.
"""

import copy
import math
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, comm, launch, report
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "01-ddp-basics/ddp_internals.py"
DEMOS = ["find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
         "sync_batchnorm", "join", "comm_hooks"]
MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # DDP's documented default (torch/nn/parallel/distributed.py)
# What "equal to one process" means in the printed verdicts: a few float32 roundings of weights of
# size ~0.1-1 after a few steps are ~1e-7; every bug these demos could show moves weights by more
# than 1e-3 (the Join divisor, plain BatchNorm, a missing average).
EQUAL_TOL = 1e-5


# --------------------------------------------------------------------------------------------------
# Tiny models, one per internal


class TwoHeads(nn.Module):
    """(B, 32) -> (B, 10) through a shared trunk and head_a. head_b (an auxiliary task switched
    off, say) exists but forward never uses it, so its parameters get no gradient."""

    def __init__(self, hidden: int = 32, features: int = 32, classes: int = 10):
        super().__init__()
        self.trunk = nn.Linear(features, hidden)
        self.head_a = nn.Linear(hidden, classes)
        self.head_b = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head_a(F.gelu(self.trunk(x)))


class LayerStack(nn.Module):
    """(B, 32) -> width -> `layers` x (width -> width) -> (B, 10), ReLU between, Linear layers
    without bias: each layer is one gradient tensor, so the bucket boundaries are easy to follow.
    Sizes (fp32): 32 x 384 = 48 KiB, 384 x 384 = 576 KiB each, 384 x 10 = 15 KiB."""

    def __init__(self, width: int = 384, layers: int = 5, features: int = 32, classes: int = 10):
        super().__init__()
        dims = [features] + [width] * (layers + 1) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = F.relu(x) if i < len(self.layers) - 1 else x
        return x


class BNNet(nn.Module):
    """(B, 32) -> Linear -> BatchNorm1d -> GELU -> Linear -> (B, 10): the one layer whose output for
    a sample depends on the other samples of the batch."""

    def __init__(self, hidden: int = 16, features: int = 32, classes: int = 10):
        super().__init__()
        self.fc1, self.bn, self.fc2 = (nn.Linear(features, hidden), nn.BatchNorm1d(hidden),
                                       nn.Linear(hidden, classes))

    def forward(self, x):
        return self.fc2(F.gelu(self.bn(self.fc1(x))))


# --------------------------------------------------------------------------------------------------
# What every demo shares: data, building, one process as the reference, differences, timing


def global_batch(args, d, step: int):
    """Step `step`'s global batch (world x batch rows), the same on every rank."""
    x, y = classification_batch(args.seed, step, d.world_size * args.batch_size)
    return x.to(d.device), y.to(d.device)


def local_batch(args, d, step: int, rank: int | None = None):
    """This rank's rows r*B..(r+1)*B-1 of step `step`'s global batch."""
    x, y = global_batch(args, d, step)
    rows = rank_rows(d.rank if rank is None else rank, args.batch_size)
    return x[rows], y[rows]


def build(make, args, d):
    """The plain model, its weights drawn from --seed: every rank and the reference start equal."""
    torch.manual_seed(args.seed)
    return make().to(d.device)


def wrap(make, args, d, **ddp_kwargs) -> DDP:
    return DDP(build(make, args, d), device_ids=[d.device.index] if d.device.type == "cuda"
               else None, **ddp_kwargs)


def one_process(make, args, d, steps: int) -> nn.Module:
    """What DDP must equal: one process, the plain model, SGD on the whole global batch."""
    model = build(make, args, d)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(steps):
        x, y = global_batch(args, d, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def sgd_step(ddp: DDP, opt, x, y) -> None:
    F.cross_entropy(ddp(x), y).backward()  # DDP all-reduces (averages) the gradients here
    opt.step()
    opt.zero_grad(set_to_none=True)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest |a - b| over the floating-point entries of two state dicts (weights and buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa
               if sa[k].is_floating_point())


def worst(d, *values: float) -> list[float]:
    """The largest of each value over the ranks (one small all-reduce): a claim must hold on all."""
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def verdict(diff: float, tol: float = EQUAL_TOL) -> str:
    return f"equal (max |diff| < {tol:.0e})" if diff < tol else f"DIFFERENT (max |diff| {diff:.2e})"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def allreduces(counter: comm.CollectiveCounter) -> list[dict]:
    return [r for r in counter.records if r["kind"] == "all_reduce"]


# --------------------------------------------------------------------------------------------------
# find_unused_parameters


def demo_find_unused_parameters(args, d, checks, exports) -> dict:
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
                  f"~{ratio:.2f}x ({t_finder * 1e3:.2f} ms / {t_plain * 1e3:.2f} ms, rank 0's medians of "
                  f"{args.timing_steps} alternating steps)")
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


# --------------------------------------------------------------------------------------------------
# static_graph


def demo_static_graph(args, d, checks, exports) -> dict:
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


# --------------------------------------------------------------------------------------------------
# gradient_as_bucket_view


def recording_allreduce(log: list):
    """DDP's default reduction (average each bucket with one all-reduce) as a comm hook that also
    notes each bucket's storage: (index, address, bytes)."""
    def hook(state, bucket):
        storage = bucket.buffer().untyped_storage()
        log.append((bucket.index(), storage.data_ptr(), storage.nbytes()))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def gradient_memory(ddp: DDP, buckets: list) -> dict:
    """Bytes of the distinct storages behind DDP's buckets and the .grad tensors: a .grad that is a
    view into a bucket shares its storage and adds nothing."""
    bucket_storage = {ptr: nbytes for _, ptr, nbytes in buckets}
    grad_storage = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                    for p in ddp.parameters()}
    separate = {ptr: n for ptr, n in grad_storage.items() if ptr not in bucket_storage}
    return {"bucket_bytes": sum(bucket_storage.values()), "separate_grad_bytes":
            sum(separate.values()), "total_bytes": sum(bucket_storage.values()) +
            sum(separate.values()), "grads_are_views": not separate}


def demo_gradient_as_bucket_view(args, d, checks, exports) -> dict:
    params = sum(p.numel() for p in LayerStack().parameters())
    report.print0(f"\n[gradient_as_bucket_view] LayerStack, {params:,} parameters "
                  f"({4 * params:,} B of fp32 gradients), measured after step {args.steps}'s "
                  f"backward")
    # Without the view, backward writes each .grad, DDP copies it into its flat bucket, all-reduces
    # the bucket and copies the average back: the gradients exist twice. With it, each .grad IS a
    # slice of its bucket (same storage): backward accumulates straight into the bucket.
    out, trained = {}, {}
    for view in (False, True):
        ddp = wrap(LayerStack, args, d, gradient_as_bucket_view=view)
        log: list = []
        ddp.register_comm_hook(None, recording_allreduce(log))
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        for step in range(args.steps):
            log.clear()
            x, y = local_batch(args, d, step)
            F.cross_entropy(ddp(x), y).backward()
            if step == args.steps - 1:
                out[view] = gradient_memory(ddp, log)
            opt.step()
            opt.zero_grad(set_to_none=True)
        trained[view] = ddp.module
    off, on = out[False], out[True]
    report.print0(f"  gradient_as_bucket_view=False: buckets {off['bucket_bytes']:,} B + separate "
                  f".grad {off['separate_grad_bytes']:,} B = {off['total_bytes']:,} B")
    report.print0(f"  gradient_as_bucket_view=True:  buckets {on['bucket_bytes']:,} B + separate "
                  f".grad {on['separate_grad_bytes']:,} B = {on['total_bytes']:,} B (every .grad a "
                  f"view into a bucket: {on['grads_are_views']})")
    saved = off["total_bytes"] - on["total_bytes"]
    diff, = worst(d, max_diff(trained[False], trained[True]))
    report.print0(f"  saved {saved:,} B = {saved / params:g} B x {params:,} parameters; the "
                  f"weights after {args.steps} steps: "
                  f"{'bitwise equal' if diff == 0 else verdict(diff)}")
    checks["gradient_as_bucket_view: saves 4 B per parameter"] = saved == 4 * params and \
        on["grads_are_views"]
    return {"params": params, "without_view": off, "with_view": on, "saved_bytes": saved,
            "saved_bytes_per_param": saved / params, "max_diff_between_runs": diff}


# --------------------------------------------------------------------------------------------------
# bucket_cap_mb


def expected_buckets(sizes: list[int], cap_mb: float | None) -> list[int]:
    """Bucket sizes DDP forms from gradients of `sizes` bytes, in the order they become ready.

    From step 2 on (DDP rebuilds its buckets at the start of it) the order is the order in which
    step 1's gradients arrived: for a stack of layers, the reverse of the parameter order. A bucket
    closes when it reaches its cap, the tensor that crosses it included. The first bucket's cap is
    dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), so that the first all-reduce starts early, but only
    when bucket_cap_mb is left at its default; given explicitly, every bucket has the same cap."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else int(cap_mb * MiB)
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MiB)
    buckets, current, limit = [], 0, first
    for size in sizes:
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + ([current] if current else [])


def cap_label(cap: float | None) -> str:
    return f"none ({DEFAULT_BUCKET_CAP_MB})" if cap is None else f"{cap:g}"


def demo_bucket_cap_mb(args, d, checks, exports) -> dict:
    sizes = [p.numel() * p.element_size() for p in reversed(list(LayerStack().parameters()))]
    report.print0(f"\n[bucket_cap_mb] LayerStack's gradients in the order backward produces them: "
                  f"{', '.join(f'{s:,}' for s in sizes)} B")
    report.print0("  bucket_cap_mb  first cap  expected buckets (B)                  all-reduces "
                  "counted   step time")
    ddps = [wrap(LayerStack, args, d, bucket_cap_mb=cap) for cap in args.bucket_caps]
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in ddps]
    counted, times = {}, {i: [] for i in range(len(ddps))}
    for step in range(3 + args.timing_steps):
        x, y = local_batch(args, d, step)
        for i, (ddp, opt) in enumerate(zip(ddps, opts)):  # in turn: the same load for every cap
            if step == 2:  # after the rebuild at the start of step 2
                with comm.CollectiveCounter() as counter:
                    sgd_step(ddp, opt, x, y)
                counted[i] = [r["tensor_bytes"] for r in allreduces(counter)]
            else:
                seconds = timed(lambda: sgd_step(ddp, opt, x, y), d.device)
                if step >= 3:
                    times[i].append(seconds)
    step_s = worst(d, *(statistics.median(times[i]) for i in range(len(ddps))))
    rows = []
    for i, cap in enumerate(args.bucket_caps):
        expected = expected_buckets(sizes, cap)
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap is None else int(cap * MiB)
        buckets = " + ".join(f"{b:,}" for b in expected)
        agree = "as expected" if counted[i] == expected else "NOT as expected"
        report.print0(f"  {cap_label(cap):13}  {first / MiB:5g} MiB  {buckets:36}  "
                      f"{len(counted[i]):>2} ({agree})      {step_s[i] * 1e3:.1f} ms")
        checks[f"bucket_cap_mb {cap_label(cap)}: counted = expected"] = counted[i] == expected
        rows.append({"bucket_cap_mb": cap, "first_bucket_bytes": first, "expected": expected,
                     "counted": counted[i], "step_s": step_s[i]})
    return {"gradient_sizes": sizes, "rows": rows}


# --------------------------------------------------------------------------------------------------
# SyncBatchNorm


class AllReduceSum(torch.autograd.Function):
    """Sum over the ranks, differentiable: the backward of a sum that every rank uses is again a
    sum over the ranks of the gradients flowing into it."""

    @staticmethod
    def forward(ctx, tensor):
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReduceBatchNorm(nn.BatchNorm1d):
    """BatchNorm whose training statistics cover the samples of every rank: one all-reduce of
    (per-channel sum, per-channel sum of squares, count). mean = sum / n, var = sumsq / n - mean^2
    (fine for activations of unit scale; torch's CUDA kernel combines per-rank means and variances
    instead, which does not lose digits when |mean| >> std). Running statistics as BatchNorm:
    the unbiased variance, var x n / (n - 1), with n the global count."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))                          # all but the channel dim
        c = x.shape[1]
        count = x.new_full((1,), x.numel() // c)
        total = AllReduceSum.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        shape = [1, c] + [1] * (x.dim() - 2)
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum if self.momentum is not None else \
                1.0 / self.num_batches_tracked.item()
            self.running_mean.mul_(1 - m).add_(m * mean)
            self.running_var.mul_(1 - m).add_(m * var * n / (n - 1))
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def to_allreduce_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm of `module` replaced by AllReduceBatchNorm, weights and statistics kept."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        new = AllReduceBatchNorm(module.num_features, module.eps, module.momentum).to(
            module.weight.device)
        new.load_state_dict(module.state_dict())
        return new
    for name, child in module.named_children():
        module.add_module(name, to_allreduce_batchnorm(child))
    return module


def sync_batchnorm_model(args, d) -> tuple[nn.Module, str, str]:
    """BNNet with nn.SyncBatchNorm when this device runs it; else the math written out.
    Returns (model, which, why not SyncBatchNorm)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(build(BNNet, args, d))
    try:  # one training forward on a copy: every rank tries it, every rank gets the same answer
        copy.deepcopy(model)(torch.zeros(2, 32, device=d.device))
        return model, "nn.SyncBatchNorm", ""  # CUDA (and the other devices torch lists)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        return to_allreduce_batchnorm(model), "hand-written sync BN", \
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def demo_sync_batchnorm(args, d, checks, exports) -> dict:
    report.print0(f"\n[sync_batchnorm] BNNet, {d.world_size} ranks x {args.batch_size} rows "
                  f"against one process on all {d.world_size * args.batch_size}")
    sync_model, which, why = sync_batchnorm_model(args, d)
    if why:
        report.print0(f"  nn.SyncBatchNorm on {d.device.type}: {why}")
        report.print0("  so the same statistics by hand: one all-reduce of per-channel sum, sum of "
                      "squares and count per BatchNorm")
    ddp_sync = DDP(sync_model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    ddp_plain = wrap(BNNet, args, d)     # BatchNorm on this rank's rows only
    ref = build(BNNet, args, d)          # one process, the whole global batch
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (ddp_sync, ddp_plain, ref)]
    rows = rank_rows(d.rank, args.batch_size)
    out_diff = {}
    for step in range(args.steps):
        x_all, y_all = global_batch(args, d, step)
        outs = [ddp_sync(x_all[rows]), ddp_plain(x_all[rows]), ref(x_all)]
        if step == 0:  # the same weights everywhere: only the statistics differ
            out_diff = {"sync": (outs[0] - outs[2][rows]).abs().max().item(),
                        "plain": (outs[1] - outs[2][rows]).abs().max().item()}
        for out, y, opt in zip(outs, (y_all[rows], y_all[rows], y_all), opts):
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    exports["sync_batchnorm"], exports["plain_batchnorm"] = ddp_sync.module, ddp_plain.module
    out_sync, out_plain, w_sync, w_plain = worst(
        d, out_diff["sync"], out_diff["plain"], max_diff(ddp_sync.module, ref),
        max_diff(ddp_plain.module, ref))
    report.print0(f"  step 1 outputs vs one process: {which} {verdict(out_sync)}; plain BatchNorm "
                  f"off by up to {out_plain:.4f}")
    report.print0(f"  after {args.steps} steps, weights and running statistics: {which} "
                  f"{verdict(w_sync)}; plain BatchNorm off by up to {w_plain:.4f}")
    checks["sync_batchnorm: = one process"] = out_sync < EQUAL_TOL and w_sync < EQUAL_TOL
    checks["sync_batchnorm: plain BatchNorm differs"] = out_plain > 1e-3 or d.world_size == 1
    return {"implementation": which, "sync_batchnorm_error": why,
            "step1_output_diff": {"sync": out_sync, "plain": out_plain},
            "final_diff": {"sync": w_sync, "plain": w_plain}}


# --------------------------------------------------------------------------------------------------
# Uneven inputs: Join


def batches_of(rank: int) -> int:
    """Rank r holds 3 + 2r batches: 3 and 5 at world 2."""
    return 3 + 2 * rank


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


def demo_join(args, d, checks, exports) -> dict:
    counts = [batches_of(r) for r in range(d.world_size)]
    report.print0(f"\n[join] MLP; batches per rank: {', '.join(map(str, counts))} (without Join "
                  f"the rank with more would pair its next bucket all-reduce with whatever "
                  f"collective the other calls next: a wrong result, an error or a hang)")

    def make():
        return MLP(hidden=32, depth=1)
    ddp = wrap(make, args, d)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    per_step = []
    t0 = time.perf_counter()
    # Under Join, every step of a rank that still trains starts with an all-reduce saying "I am
    # here" (and one saying whether to sync gradients); a rank that ran out answers them, and
    # shadows each gradient bucket's all-reduce with zeros, until every rank has joined.
    with Join([ddp]):
        for step in range(batches_of(d.rank)):
            with comm.CollectiveCounter() as counter:
                sgd_step(ddp, opt, *local_batch(args, d, step))
            per_step.append([r["tensor_bytes"] for r in allreduces(counter)])
    seconds, = worst(d, time.perf_counter() - t0)
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


# --------------------------------------------------------------------------------------------------
# Built-in communication hooks: bf16 and fp16 compression


HOOKS = {"none": (None, torch.float32), "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
         "fp16": (default_hooks.fp16_compress_hook, torch.float16)}


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


def demo_comm_hooks(args, d, checks, exports) -> dict:
    report.print0("\n[comm_hooks] MLP, DDP's all-reduce replaced by torch's cast hooks "
                  "(default_hooks.bf16_compress_hook, fp16_compress_hook)")

    def make():
        return MLP(hidden=64, depth=2)
    runs = {}
    for name, (hook, dtype) in HOOKS.items():
        ddp = wrap(make, args, d)
        local: dict = {}
        if hook is not None:
            ddp.register_comm_hook(None, recording(hook, local))
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        grads1, bound, first_step_bound = None, None, None
        for step in range(args.steps):
            x, y = local_batch(args, d, step)
            with comm.CollectiveCounter() as counter:
                F.cross_entropy(ddp(x), y).backward()
            if step == 0:
                grads1 = [p.grad.clone() for p in ddp.parameters()]
            if hook is not None:
                # sum over ranks of |local gradient|: one fp32 all-reduce per tensor, outside the
                # counted step
                sums = [local[p].clone() for p in ddp.parameters()]
                for s in sums:
                    dist.all_reduce(s)
                step_bound = [rounding_bound(s, dtype, d.world_size) for s in sums]
                if first_step_bound is None:
                    first_step_bound, bound = step_bound, [torch.zeros_like(b) for b in step_bound]
                # SGD moves each weight by lr x gradient: the gradients' errors add up. A
                # heuristic, not a rigorous bound: after step 1 the runs' weights differ by some
                # dw = O(u), so their gradients also differ by about H dw (H the loss's Hessian),
                # also first order in u; summing the rounding bounds alone holds while lr x |H| is
                # small (a few small steps, as here), and the checks below test that it held
                bound = [a + args.lr * b for a, b in zip(bound, step_bound)]
            opt.step()
            opt.zero_grad(set_to_none=True)
        sent = allreduces(counter)
        exports[f"comm_hooks_{name}"] = ddp.module
        runs[name] = {"model": ddp.module, "grads1": grads1, "bound": bound,
                      "first_step_bound": first_step_bound,
                      "bytes": sum(r["tensor_bytes"] for r in sent), "calls": len(sent),
                      "dtypes": sorted({r["dtype"] for r in sent})}
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
# Arguments and launch


RUN = {"find_unused_parameters": demo_find_unused_parameters, "static_graph": demo_static_graph,
       "gradient_as_bucket_view": demo_gradient_as_bucket_view,
       "bucket_cap_mb": demo_bucket_cap_mb, "sync_batchnorm": demo_sync_batchnorm,
       "join": demo_join, "comm_hooks": demo_comm_hooks}


def parse_caps(text: str) -> list[float | None]:
    caps = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            cap = None if item == "none" else float(item)
        except ValueError:
            cli.fail(f"--bucket-caps: {item!r} is neither a size in MiB nor 'none'")
        if cap is not None and cap <= 0:
            cli.fail(f"--bucket-caps: {item} MiB is not a positive size")
        caps.append(cap)
    return caps


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=4, batch_size=8, lr=0.1, grad_accum=False)
    cli.add_output_args(p, metrics=False, json_out=True)
    p.add_argument("--demo", choices=["all"] + DEMOS, default="all", help="which internal to show")
    p.add_argument("--bucket-caps", default="none,1,2,25",
                   help="bucket_cap_mb values to compare, in MiB ('none': DDP's default)")
    p.add_argument("--timing-steps", type=int, default=20,
                   help="steps timed per variant (the medians of the step times)")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s", "timing_steps")
    if args.steps < 2 and args.demo in ("all", "find_unused_parameters"):
        cli.fail(f"--steps {args.steps}: find_unused_parameters needs at least 2 (default DDP "
                 f"reports the unused parameter when the second step starts)")
    args.bucket_caps = parse_caps(args.bucket_caps)
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        report.print0(f"world {d.world_size} | device {d.device} | {args.batch_size} rows per "
                      f"rank, {d.world_size * args.batch_size} global | SGD lr {args.lr:g}, "
                      f"{args.steps} steps per demo")
        checks: dict[str, bool] = {}
        exports: dict[str, nn.Module] = {}
        results = {name: RUN[name](args, d, checks, exports) for name in DEMOS
                   if args.demo in ("all", name)}
        failed = [name for name, ok in checks.items() if not ok]
        report.print0(f"\nFAIL: {'; '.join(failed)}" if failed else
                      f"\nall {len(checks)} checks hold")
        if args.json_out and d.rank == 0:
            report.write_json(args.json_out, {
                "script": SCRIPT, "world_size": d.world_size, "device": str(d.device),
                "torch_version": torch.__version__, "batch_size": args.batch_size,
                "global_batch": d.world_size * args.batch_size, "steps": args.steps,
                "lr": args.lr, "seed": args.seed, "demos": results, "checks": checks,
                "exports": {tag: str(report.variant_path(args.export, tag, True))
                            for tag in exports} if args.export else {}})
        if args.export and d.rank == 0:
            # one plain state dict per trained model: runs/x.pt -> runs/x.join.pt, ...
            for tag, model in exports.items():
                report.save_state_dict(report.variant_path(args.export, tag, True),
                                       model.state_dict())
        dist.barrier()  # the file is complete before any rank exits
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
