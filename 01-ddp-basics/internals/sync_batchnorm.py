"""SyncBatchNorm: BatchNorm statistics over the global batch. Under DDP each rank's BatchNorm sees
only its own rows, which is not one process on the global batch; nn.SyncBatchNorm computes the
statistics over all ranks. torch has no CPU kernel for it, so on a CPU the demo runs the same math
written out (AllReduceBatchNorm, below) and compares both with one process.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/sync_batchnorm.py
    torchrun --nproc_per_node=8 01-ddp-basics/internals/sync_batchnorm.py --device cuda
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import EQUAL_TOL, Demo, build, global_batch, main, max_diff, verdict, worst, wrap
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import report
from dtcourse.data import rank_rows

SCRIPT = "01-ddp-basics/internals/sync_batchnorm.py"


class BNNet(nn.Module):
    """(B, 32) -> Linear -> BatchNorm1d -> GELU -> Linear -> (B, 10): the one layer whose output for
    a sample depends on the other samples of the batch."""

    def __init__(self, hidden: int = 16, features: int = 32, classes: int = 10):
        super().__init__()
        self.fc1, self.bn, self.fc2 = (nn.Linear(features, hidden), nn.BatchNorm1d(hidden),
                                       nn.Linear(hidden, classes))

    def forward(self, x):
        return self.fc2(F.gelu(self.bn(self.fc1(x))))


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


def demo(args, d, checks, exports) -> dict:
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
# The same statistics written out, for devices without nn.SyncBatchNorm (a CPU)


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


DEMO = Demo("sync_batchnorm", demo)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
