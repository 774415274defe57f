"""FSDP2 (`fully_shard`) on a small MLP: where every parameter goes, how many bytes each rank keeps,
and which collectives one training step runs.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py                       # FULL_SHARD
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py --strategy grad-op    # SHARD_GRAD_OP
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py --strategy no-shard   # NO_SHARD
    torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py --strategy hybrid --shard-size 2

Expected output (the first command; 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo; the full
output, and the other strategies, in 02-fsdp/README.md):
    parameter  placements                   global    local shard on each rank
    2.weight   (Shard(dim=0),)              (25, 30)  r0 (13, 30)  r1 (12, 30)
    ...
      rank 0: params  3,152 B  grads  3,152 B  optimizer  6,328 B  = 12,632 B
      rank 1: params  3,028 B  grads  3,028 B  optimizer  6,080 B  = 12,136 B
    ...
      forward  all-gather     float32   2,040 B  unit 0
      ...
      backward reduce-scatter float32   2,040 B  unit 0
      per step: all-gather 12,608 B, reduce-scatter 6,304 B; DDP would all-reduce 6,180 B once

FSDP1's ShardingStrategy names and their FSDP2 spelling:
    FULL_SHARD     fully_shard(m, reshard_after_forward=True) on a 1-D mesh (N,): params, grads and
                   optimizer state sharded; params all-gathered for forward AND again for backward.
    SHARD_GRAD_OP  reshard_after_forward=False: the forward's gathered params are kept until
                   backward (one all-gather per step instead of two, more memory between them).
    NO_SHARD       a 2-D mesh (N, 1): shard groups of one rank, replicated N times: every rank
                   keeps everything and gradients are all-reduced, which is DDP.
    HYBRID_SHARD   a 2-D mesh (N/S, S): shard inside groups of S ranks (a node, fast links),
                   replicate across groups: reduce-scatter inside a group, all-reduce across.

One training step under FULL_SHARD, per FSDP unit (here: each Linear, then the root):
    forward   all-gather the unit's shards -> full params -> compute -> free the full params
    backward  all-gather again -> compute grads -> reduce-scatter: each rank gets the average
              gradient of its own shard -> free the full params and full grads
    optimizer updates only the local shards (its state is sharded the same way)
"""

import argparse
import gc
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard

FSDP1_NAMES = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "no-shard": "NO_SHARD",
               "hybrid": "HYBRID_SHARD"}
SIZES = (16, 30, 25, 10)  # layer widths: 25 rows split unevenly over 2 ranks, 30, 25, 10 over 4


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK")
    print(f"{f'[rank {rank}] ' if rank else ''}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--strategy", choices=list(FSDP1_NAMES), default="full")
    p.add_argument("--shard-size", type=int, default=2, help="hybrid: ranks per shard group")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=60, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes placements, bytes, collectives")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.shard_size < 1 or args.timeout_s <= 0:
        fail("--batch-size and --shard-size must be at least 1, --timeout-s positive")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """torchrun/srun or plain python (a group of one); gloo on CPU, NCCL on CUDA."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
                   LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(env.get("LOCAL_RANK", 0))) if use_cuda else \
        torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend, timeout = ("nccl" if use_cuda else "gloo"), timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


class Collectives(TorchDispatchMode):
    """Records the c10d collectives issued while active, in order: (phase, op, dtype, bytes of
    the full tensor: the all-gather output / reduce-scatter input / all-reduced tensor)."""

    def __init__(self):
        super().__init__()
        self.phase, self.calls = "", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if getattr(func, "namespace", "") == "c10d" and any(
                k in name for k in ("allgather", "reduce_scatter", "allreduce")):
            tensors = [t for t in torch.utils._pytree.tree_leaves(args) if torch.is_tensor(t)]
            big = max(tensors, key=torch.Tensor.numel)
            op = "all-gather" if "allgather" in name else \
                "reduce-scatter" if "reduce_scatter" in name else "all-reduce"
            self.calls.append((self.phase, op, str(big.dtype).replace("torch.", ""),
                               big.numel() * big.element_size()))
        return func(*args, **(kwargs or {}))


def nbytes(t) -> int:
    """Bytes this rank holds: a DTensor's local shard, as stored (FSDP's padding not counted)."""
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    if args.strategy == "hybrid" and world % args.shard_size:
        fail(f"--strategy hybrid needs the world size ({world}) to be a multiple of the shard "
             f"group size --shard-size ({args.shard_size})")
    shard_group = {"full": world, "grad-op": world, "no-shard": 1, "hybrid": args.shard_size}[
        args.strategy]
    # The mesh: 1-D (N,) shards over every rank; 2-D (replicas, shard) for no-shard and hybrid.
    if args.strategy in ("full", "grad-op"):
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device.type, (world // shard_group, shard_group),
                                mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(args.seed)  # the same full model on every rank before sharding
    layers = [nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    model = nn.Sequential(layers[0], nn.GELU(), layers[1], nn.GELU(), layers[2]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    before = sum(nbytes(p) for p in model.parameters())

    # Shard: each Linear is one FSDP unit (gathered and freed on its own), then the root.
    reshard = args.strategy != "grad-op"
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    # Every parameter is now a DTensor: a global shape, a placement per mesh dimension, and the
    # local rows this rank stores. Shard(0) splits dim 0 like torch.chunk; Replicate() copies.
    names, params = zip(*model.named_parameters())
    assert all(isinstance(p, DTensor) and p.placements[-1] == Shard(0) for p in params)
    local_shapes = [None] * world
    dist.all_gather_object(local_shapes, [tuple(p.to_local().shape) for p in params])

    if rank == 0:
        print(f"world {world} | strategy {args.strategy} = FSDP1 {FSDP1_NAMES[args.strategy]} | "
              f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} | reshard_after_forward="
              f"{reshard} | MLP {' -> '.join(map(str, SIZES))}: {n_params:,} parameters (P)")
        print(f"\n{'parameter':10} {'placements':28} {'global':9} local shard on each rank")
        for i, (name, p) in enumerate(zip(names, params)):
            shards = "  ".join(f"r{r} {str(s[i]):8}" for r, s in enumerate(local_shapes))
            print(f"{name:10} {str(p.placements):28} {str(tuple(p.shape)):9} {shards}")

    # One training step, recording every collective (rank 0 prints its own view).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(args.seed + 1)
    x_all = torch.randn(world * args.batch_size, SIZES[0], generator=g)
    y_all = torch.randint(SIZES[-1], (world * args.batch_size,), generator=g)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)  # this rank's samples
    log = Collectives()
    with log:
        log.phase = "forward"
        loss = F.cross_entropy(model(x_all[rows].to(device)), y_all[rows].to(device))
        log.phase = "backward"
        loss.backward()
    optimizer.step()  # local: each rank updates its shards with its shards' Adam state

    held = {"param_bytes": sum(nbytes(p) for p in params),
            "grad_bytes": sum(nbytes(p.grad) for p in params),
            "optim_bytes": sum(nbytes(v) for s in optimizer.state.values() for v in s.values()
                               if torch.is_tensor(v))}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, held)
    if rank == 0:
        report(args, world, shard_group, model, params, names, n_params, before, per_rank, log)


def unit_sizes(model, shard_group: int) -> dict:
    """Bytes of each unit's all-gather output: every rank's shard padded to ceil(rows/S) rows,
    concatenated over the S ranks of the shard group. Used to name the unit of each collective."""
    units = {}
    for name, module in model.named_modules():
        if hasattr(module, "unshard"):  # a fully_shard'ed module (FSDPModule)
            own = [p for n, p in module.named_parameters()
                   if not any(n.startswith(c + ".") for c, m in module.named_children()
                              if hasattr(m, "unshard"))]
            size = sum(math.ceil(p.shape[0] / shard_group) * shard_group
                       * math.prod(p.shape[1:]) * 4 for p in own)
            units.setdefault(size, []).append(name or "root")
    return units


def report(args, world, shard_group, model, params, names, n_params, before, per_rank, log):
    total = [sum(r.values()) for r in per_rank]
    print(f"\nbytes each rank holds (fp32): before sharding {before:,} B of parameters on every "
          f"rank; after one AdamW step:")
    for r, held in enumerate(per_rank):
        print(f"  rank {r}: params {held['param_bytes']:6,} B  grads {held['grad_bytes']:6,} B  "
              f"optimizer {held['optim_bytes']:6,} B  = {total[r]:,} B")
    print(f"  formula 16P/{shard_group} = {16 * n_params / shard_group:,.0f} B (+ Adam's 4-byte "
          f"step counter per parameter tensor: {4 * len(params)} B); sum over ranks "
          f"{sum(total):,} B")

    units = unit_sizes(model, shard_group)
    print(f"\none training step, the collectives in order (rank 0; "
          f"{'none: every rank holds everything' if world == 1 else 'bytes = full tensor'}):")
    for phase, op, dtype, size in log.calls:
        # HSDP's all-reduce runs on a reduced shard (1/S of the unit) across the replicas
        unit = ", ".join(units.get(size * shard_group if op == "all-reduce" else size, ["?"]))
        print(f"  {phase:8} {op:14} {dtype:8} {size:6,} B  unit {unit}")
    moved = {}
    for _, op, _, size in log.calls:
        moved[op] = moved.get(op, 0) + size
    if moved:
        print("  per step: " + ", ".join(f"{op} {b:,} B" for op, b in moved.items()) +
              f"; DDP would all-reduce {4 * n_params:,} B once")
    if args.json_out:
        import json
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({
            "script": "02-fsdp/fsdp_basics.py", "strategy": args.strategy, "world_size": world,
            "params": n_params, "parameters": {n: list(p.shape) for n, p in zip(names, params)},
            "per_rank": per_rank, "collectives": log.calls}, indent=1))


if __name__ == "__main__":
    main()
