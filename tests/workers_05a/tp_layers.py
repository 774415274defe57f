"""Test worker (launched by tests/test_05a_tensor_sequence_hybrid.py with torchrun at world size 4):
the tensor-parallel layers of 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py, hand-written
and DTensor, against dense layers.

For TP degree 4 (all ranks) and TP degree 2 (two groups of two on a (2, 2) mesh), and for each of
ColumnParallelLinear, RowParallelLinear, a whole transformer block (attention + MLP) by hand, by
hand with sequence parallelism, with DTensor and with DTensor + SequenceParallel:
  - the forward output of each rank equals the dense output (or its slice, where it is sharded);
  - every gradient each rank holds equals the matching slice of the dense gradient (the input's
    and every parameter's).
Each check asserts with the tolerance given on the command line; rank 0 prints one line per check.
"""

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtcourse.models import Block

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "tensor_parallel", REPO / "05-advanced" / "a-tensor-sequence-hybrid" / "tensor_parallel.py")
tp_lesson = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tp_lesson)

B, T, H, HEADS = 2, 8, 32, 4


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--rtol", type=float, required=True)
    p.add_argument("--atol", type=float, required=True)
    return p.parse_args()


def close(actual, expected, what, args):
    torch.testing.assert_close(actual, expected, rtol=args.rtol, atol=args.atol,
                               msg=lambda m: f"[rank {dist.get_rank()}] {what}: {m}")


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def shard_of(full, dim, t, i):
    """The slice of a dense tensor that TP rank i of t holds when it is cut along `dim`."""
    return full if dim is None else full.chunk(t, dim=dim)[i]


def manual_cut(module, pname, param):
    """Where tensor_parallel.py's hand-written layers cut a parameter (None: replicated)."""
    if isinstance(module, tp_lesson.ColumnParallelLinear):
        return 0
    if isinstance(module, tp_lesson.RowParallelLinear) and pname == "weight":
        return 1
    return None


def dtensor_cut(module, pname, param):
    """Where DTensor cut it: the dim of its Shard placement (None: replicated)."""
    shards = [p.dim for p in param.placements if isinstance(p, Shard)] \
        if isinstance(param, DTensor) else []
    return shards[0] if shards else None


CUT = {"manual": manual_cut, "dtensor": dtensor_cut}


def check_grads(par_module, dense_module, cut_of, t, i, label, args):
    dense = dict(dense_module.named_parameters())
    n = 0
    for name, p in par_module.named_parameters():
        owner = par_module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else par_module
        cut = cut_of(owner, name.rsplit(".", 1)[-1], p)
        close(local(p.grad), shard_of(dense[name].grad, cut, t, i), f"{label} grad {name}", args)
        n += 1
    assert n == len(dense), f"{label}: {n} parameters compared, dense has {len(dense)}"


def run_checks(mesh, args, log):
    tp_mesh = mesh["tp"]
    group, t, i = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()
    torch.manual_seed(1234)  # same dense layers and data on every rank
    x = torch.randn(B, T, H)
    w_out = torch.randn(B, T, H)  # loss = sum(out * w_out): every output element gets a gradient

    # --- Column-parallel linear: f, then this rank's slice of output features ---------------
    lin = nn.Linear(H, H)
    g_cols = torch.randn(B, T, H)  # upstream gradient of the (sharded) output
    xd = x.clone().requires_grad_()
    yd = lin(xd)
    (yd * g_cols).sum().backward()
    for impl in ("manual", "dtensor"):
        xp = x.clone().requires_grad_()
        if impl == "manual":
            layer = tp_lesson.ColumnParallelLinear(lin, group)
            y = layer(tp_lesson.CopyToTP.apply(xp, group))
        else:
            layer = parallelize_module(copy.deepcopy(lin), tp_mesh, ColwiseParallel())
            y = layer(xp)
        close(y, shard_of(yd, -1, t, i), f"tp{t} column {impl} output", args)
        (y * shard_of(g_cols, -1, t, i)).sum().backward()
        close(xp.grad, xd.grad, f"tp{t} column {impl} input grad", args)
        check_grads(layer, lin, CUT[impl], t, i, f"tp{t} column {impl}", args)
        log.append(f"tp{t} column-parallel {impl}")
    lin.zero_grad()

    # --- Row-parallel linear: this rank's slice of input features, then g --------------------
    xd = x.clone().requires_grad_()
    yd = lin(xd)
    (yd * w_out).sum().backward()
    for impl in ("manual", "dtensor"):
        xp = shard_of(x, -1, t, i).clone().requires_grad_()
        if impl == "manual":
            layer = tp_lesson.RowParallelLinear(lin, group, sequence_parallel=False)
        else:
            layer = parallelize_module(copy.deepcopy(lin), tp_mesh, RowwiseParallel())
        y = layer(xp)
        close(y, yd, f"tp{t} row {impl} output", args)
        (y * w_out).sum().backward()
        close(xp.grad, shard_of(xd.grad, -1, t, i), f"tp{t} row {impl} input grad", args)
        check_grads(layer, lin, CUT[impl], t, i, f"tp{t} row {impl}", args)
        log.append(f"tp{t} row-parallel {impl}")

    # --- A whole block: attention (heads split) + MLP, with and without sequence parallelism --
    block = Block(H, HEADS)  # the course's GPT block, torch's default init under the seed above
    xd = x.clone().requires_grad_()
    yd = block(xd)
    (yd * w_out).sum().backward()
    for impl in ("manual", "dtensor"):
        for sp in (False, True):
            label = f"tp{t} block {impl}{' + sequence parallel' if sp else ''}"
            par = copy.deepcopy(block)
            par.zero_grad(set_to_none=True)
            seq_dim = 1 if sp else None  # with SP the block's input and output are (B, T/t, H)
            xp = shard_of(x, seq_dim, t, i).clone().requires_grad_()
            if impl == "manual":
                tp_lesson.parallelize_block_manual(par, group, sp)
                y = par(xp)
            else:
                parallelize_module(par, tp_mesh, tp_lesson.block_plan(sp))
                inp = DTensor.from_local(xp, tp_mesh, [Shard(1)]) if sp else xp
                y = local(par(inp))
            close(y, shard_of(yd, seq_dim, t, i), f"{label} output", args)
            (y * shard_of(w_out, seq_dim, t, i)).sum().backward()
            if sp and impl == "manual":
                tp_lesson.allreduce_sequence_parallel_grads(par, group)
            elif sp:
                tp_lesson.reduce_partial_grads(par)
            close(xp.grad, shard_of(xd.grad, seq_dim, t, i), f"{label} input grad", args)
            check_grads(par, block, CUT[impl], t, i, label, args)
            log.append(label)


def main():
    args = parse()
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        log = []
        for t in (world, 2):
            mesh = init_device_mesh("cpu", (world // t, t), mesh_dim_names=("dp", "tp"))
            run_checks(mesh, args, log)
        if dist.get_rank() == 0:
            print("\n".join(f"ok: {line}" for line in log), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
