"""FSDP2 (`fully_shard`) on a small MLP: where every parameter goes, how many bytes each rank keeps,
and which collectives one training step runs.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py                       # FULL_SHARD
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py --strategy grad-op    # SHARD_GRAD_OP
    torchrun --nproc_per_node=2 02-fsdp/fsdp_basics.py --strategy no-shard   # NO_SHARD
    torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py --strategy hybrid --shard-size 2

FSDP1's ShardingStrategy names and their FSDP2 spelling:
    FULL_SHARD     fully_shard(m, reshard_after_forward=True) on a 1-D mesh (N,): params, grads and
                   optimizer state sharded; params all-gathered for forward AND again for backward.
    SHARD_GRAD_OP  reshard_after_forward=False: the forward's gathered params are kept until
                   backward (one all-gather per step instead of two, more memory between them).
    NO_SHARD       a 2-D mesh (N, 1): shard groups of one rank, replicated N times: every rank
                   keeps everything and gradients are all-reduced: DDP's arithmetic, but one
                   all-reduce per unit (not DDP's buckets), with copies of a unit's parameters
                   and gradients while it is in use.
    HYBRID_SHARD   a 2-D mesh (N/S, S): shard inside groups of S ranks (a node, fast links),
                   replicate across groups: reduce-scatter inside a group, all-reduce across.

One training step under FULL_SHARD, per FSDP unit (here: each Linear, then the root):
    forward   all-gather the unit's shards -> full params -> compute -> free the full params
    backward  all-gather again -> compute grads -> reduce-scatter: each rank gets the average
              gradient of its own shard -> free the full params and full grads
    optimizer updates only the local shards (its state is sharded the same way)

The output, for every strategy, is in 02-fsdp/README.md.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dtcourse import cli, launch, report
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard

SCRIPT = "02-fsdp/fsdp_basics.py"
FSDP1_NAMES = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "no-shard": "NO_SHARD",
               "hybrid": "HYBRID_SHARD"}
SIZES = (16, 30, 25, 10)  # layer widths: 25 rows split unevenly over 2 ranks, 30, 25, 10 over 4


# --------------------------------------------------------------------------------------------------
# The mesh, the sharding, and one step


def build_mesh(strategy: str, shard_group: int, d):
    """1-D (N,) shards over every rank; 2-D (replicas, shard) for no-shard and hybrid."""
    if strategy in ("full", "grad-op"):
        return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(d.device.type, (d.world_size // shard_group, shard_group),
                            mesh_dim_names=("replicate", "shard"))


def build_sharded_mlp(args, mesh, device):
    """The same full MLP on every rank (same seed), then sharded: each Linear is one FSDP unit
    (gathered and freed on its own), then the root. Children first: a parameter belongs to the
    innermost fully_shard'ed module that owns it."""
    torch.manual_seed(args.seed)
    layers = [nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    model = nn.Sequential(layers[0], nn.GELU(), layers[1], nn.GELU(), layers[2]).to(device)
    before = report.tensor_bytes(model.parameters())
    reshard = args.strategy != "grad-op"
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    # The root (it owns no parameter here) stays unsharded after forward, as torch recommends.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    # Every parameter is now a DTensor: a global shape, a placement per mesh dimension, and the
    # local rows this rank stores. Shard(0) splits dim 0 like torch.chunk; Replicate() copies.
    assert all(isinstance(p, DTensor) and p.placements[-1] == Shard(0)
               for p in model.parameters())
    return model, before


def one_step(args, d, model, optimizer) -> CollectiveCounter:
    """Forward, backward and AdamW on this rank's rows of one global batch, counting every
    collective that forward and backward issue."""
    g = torch.Generator().manual_seed(args.seed + 1)
    x_all = torch.randn(d.world_size * args.batch_size, SIZES[0], generator=g)
    y_all = torch.randint(SIZES[-1], (d.world_size * args.batch_size,), generator=g)
    rows = rank_rows(d.rank, args.batch_size)
    with CollectiveCounter() as comm:
        comm.phase = "forward"  # all-gather each unit before it runs
        loss = F.cross_entropy(model(x_all[rows].to(d.device)), y_all[rows].to(d.device))
        comm.phase = "backward"  # all-gather again, then reduce-scatter each unit's gradient
        loss.backward()
    optimizer.step()  # local: each rank updates its shards with its shards' Adam state
    return comm


def run(args, d):
    if args.strategy == "hybrid" and d.world_size % args.shard_size:
        cli.fail(f"--strategy hybrid needs the world size ({d.world_size}) to be a multiple of "
                 f"the shard group size --shard-size ({args.shard_size})")
    shard_group = {"full": d.world_size, "grad-op": d.world_size, "no-shard": 1,
                   "hybrid": args.shard_size}[args.strategy]
    mesh = build_mesh(args.strategy, shard_group, d)
    model, before = build_sharded_mlp(args, mesh, d.device)
    names, params = zip(*model.named_parameters())
    local_shapes = report.gather([tuple(p.to_local().shape) for p in params])
    report.print0(f"world {d.world_size} | strategy {args.strategy} = FSDP1 "
                  f"{FSDP1_NAMES[args.strategy]} | mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}"
                  f" | reshard_after_forward={args.strategy != 'grad-op'} | MLP "
                  f"{' -> '.join(map(str, SIZES))}: {sum(p.numel() for p in params):,} "
                  f"parameters (P)")
    if d.is_main:
        print_placements(names, params, local_shapes)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = one_step(args, d, model, optimizer)
    per_rank = report.gather(report.held_bytes(params=params, optimizer=optimizer,
                                               device=d.device))
    if d.is_main:
        print_bytes(before, per_rank, params, shard_group)
        print_collectives(comm, model, params, shard_group, d.world_size)
    if args.json_out and d.is_main:
        report.write_json(args.json_out, {
            "script": SCRIPT, "strategy": args.strategy, "world_size": d.world_size,
            "mesh": list(mesh.shape), "params": sum(p.numel() for p in params),
            "parameters": {n: list(p.shape) for n, p in zip(names, params)},
            "per_rank": per_rank, "collectives": comm.records, "comms": comm.summary()})


# --------------------------------------------------------------------------------------------------
# What rank 0 prints: placements, bytes held, the collectives in order


def print_placements(names, params, local_shapes) -> None:
    print(f"\n{'parameter':10} {'placements':28} {'global':9} local shard on each rank")
    for i, (name, p) in enumerate(zip(names, params)):
        shards = "  ".join(f"r{r} {str(s[i]):8}" for r, s in enumerate(local_shapes))
        print(f"{name:10} {str(p.placements):28} {str(tuple(p.shape)):9} {shards}".rstrip())


def print_bytes(before: int, per_rank: list, params, shard_group: int) -> None:
    n_params = sum(p.numel() for p in params)
    total = [h["param_bytes"] + h["grad_bytes"] + h["optim_bytes"] for h in per_rank]
    print(f"\nbytes each rank holds (fp32): before sharding {before:,} B of parameters on every "
          f"rank; after one AdamW step:")
    for r, held in enumerate(per_rank):
        print(f"  rank {r}: params {held['param_bytes']:6,} B  grads {held['grad_bytes']:6,} B  "
              f"optimizer {held['optim_bytes']:6,} B  = {total[r]:,} B")
    print(f"  formula 16P/{shard_group} = {16 * n_params / shard_group:,.0f} B (+ Adam's 4-byte "
          f"step counter per parameter tensor: {4 * len(params)} B); sum over ranks "
          f"{sum(total):,} B")


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


def print_collectives(comm, model, params, shard_group: int, world: int) -> None:
    """Each collective of the step: tensor = the whole tensor (all-gather output, reduce-scatter
    input, all-reduced buffer), sent = what this rank sends of it on a ring."""
    units = unit_sizes(model, shard_group)
    what = "none: every rank holds everything" if world == 1 else \
        "tensor = the whole tensor, sent = this rank's ring share"
    print(f"\none training step, the collectives in order (rank 0; {what}):")
    for r in comm.records:
        # HSDP's all-reduce runs on a reduced shard (1/S of the unit) across the replicas
        size = r["tensor_bytes"] * (shard_group if r["kind"] == "all_reduce" else 1)
        print(f"  {r['phase']:8} {r['kind']:14} {r['dtype']:8} tensor {r['tensor_bytes']:6,} B  "
              f"sent {r['sent_bytes']:6,} B  group {r['group_size']}  unit "
              f"{', '.join(units.get(size, ['?']))}")
    summary = comm.summary()
    if summary:
        n_params = sum(p.numel() for p in params)
        ddp_sent = round(2 * (world - 1) / world * 4 * n_params)
        print("  per step: " + ", ".join(f"{kind} {s['tensor_bytes']:,} B (sent "
                                         f"{s['sent_bytes']:,} B)" for kind, s in summary.items())
              + f"; DDP would all-reduce {4 * n_params:,} B once (sent {ddp_sent:,} B)")


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--strategy", choices=list(FSDP1_NAMES), default="full")
    p.add_argument("--shard-size", type=int, default=2, help="hybrid: ranks per shard group")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank")
    args = p.parse_args(argv)
    cli.check_positive(args, "batch_size", "shard_size", "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
