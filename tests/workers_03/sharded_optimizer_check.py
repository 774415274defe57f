"""Test worker, launched by torchrun: trains 03-deepspeed/zero_from_scratch.py's TiedNet with
ShardedOptimizer (stages 1 and 2 over AdamW and SGD), with torch's ZeroRedundancyOptimizer under
DDP, and, inside every rank, with the plain optimizer on the whole global batch (the one-process
reference). Rank 0 saves every final state_dict and each rank's optimizer-state bytes to argv[1];
tests/test_03_deepspeed.py compares them.

Each step is two micro-batches (gradient accumulation), so stage 2's reduce-to-owner buffers are
exercised across backwards; the second param group is added with add_param_group.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import launch, report
from dtcourse.data import classification_batch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("zero_from_scratch",
                                              REPO / "03-deepspeed" / "zero_from_scratch.py")
zfs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zfs)

STEPS, GLOBAL_BATCH, LR = 4, 12, 1e-2  # 12 rows split evenly over 2 or 3 ranks


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors, 0-dim step counters excluded (as
    ShardedOptimizer.state_bytes counts them)."""
    return report.tensor_bytes(t for t in report.optimizer_tensors(optimizer) if t.dim() > 0)


def train(model, optimizer, rows: slice, forward=None):
    forward = forward or model
    for step in range(STEPS):
        x, y = classification_batch(0, step, GLOBAL_BATCH)
        x, y = x[rows], y[rows]
        half = len(x) // 2
        for part in (slice(0, half), slice(half, None)):  # two micro-steps per optimizer step
            (F.cross_entropy(forward(x[part]), y[part]) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    out = Path(sys.argv[1])
    with launch.distributed("cpu"):
        check(out)


def check(out: Path):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    def fresh():
        torch.manual_seed(0)
        return zfs.TiedNet()

    results, per_rank_bytes, plain_bytes = {"initial": fresh().state_dict()}, {}, {}
    for name, (cls, extra) in zfs.OPTIMIZERS.items():
        model = fresh()  # one process, the whole batch: what every sharded run must reproduce
        plain = cls(zfs.param_groups(model), lr=LR, **extra)
        results[f"plain-{name}"] = train(model, plain, slice(None))
        plain_bytes[name] = state_bytes(plain)

        for stage in (1, 2):
            model = fresh()
            groups = zfs.param_groups(model)
            opt = zfs.ShardedOptimizer(groups[:1], cls, stage=stage, lr=LR, **extra)
            opt.add_param_group(groups[1])
            results[f"sharded{stage}-{name}"] = train(model, opt, mine)
            per_rank_bytes[f"sharded{stage}-{name}"] = opt.state_bytes()

        model = fresh()
        ddp = DDP(model)  # averages the gradients; ZeroRedundancyOptimizer only shards the state
        groups = zfs.param_groups(model)
        zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, lr=LR,
                                       weight_decay=groups[0]["weight_decay"], **extra)
        zero.add_param_group(groups[1])
        results[f"zero_redundancy-{name}"] = train(model, zero, mine, forward=ddp)

    gathered = [None] * world
    dist.all_gather_object(gathered, per_rank_bytes)
    if rank == 0:
        torch.save({"world": world, "results": results, "per_rank_bytes": gathered,
                    "plain_bytes": plain_bytes}, out)
    dist.barrier()


if __name__ == "__main__":
    main()
