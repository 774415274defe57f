"""gradient_as_bucket_view=True: each .grad a view into DDP's flat all-reduce buckets, so the
gradients are stored once instead of twice: 4 bytes per fp32 parameter fewer, counted from the
tensors' storages, and bitwise the same weights.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/bucket_view.py
"""

import torch
import torch.nn.functional as F
from common import Demo, LayerStack, local_batch, main, max_diff, verdict, worst, wrap
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import report

SCRIPT = "01-ddp-basics/internals/bucket_view.py"


def demo(args, d, checks, exports) -> dict:
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


DEMO = Demo("gradient_as_bucket_view", demo)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
