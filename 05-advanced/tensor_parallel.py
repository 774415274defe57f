"""Tensor and sequence parallelism: Megatron's layers by hand, then the same split with DTensor.

Every rank of the tensor-parallel (TP) group holds a slice of each weight matrix of every block and
sees the whole batch. World size = TP degree here; hybrid_parallelism.py adds data and pipeline
parallelism on a device mesh.

Launch (from the repository root):
    python 05-advanced/tensor_parallel.py                 # 1 process: t = 1, whole matrices
    torchrun --nproc_per_node=2 05-advanced/tensor_parallel.py                  # manual f/g layers
    torchrun --nproc_per_node=2 05-advanced/tensor_parallel.py --impl dtensor   # parallelize_module
    torchrun --nproc_per_node=2 05-advanced/tensor_parallel.py --sequence-parallel
    torchrun --nproc_per_node=8 05-advanced/tensor_parallel.py --device cuda --hidden 4096 \
        --heads 32 --seq-len 2048                         # one 8-GPU node: TP stays on NVLink

Expected output (torchrun --nproc_per_node=2, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    tp 2 | impl manual | device cpu | batch 8 x seq 16 x hidden 64 | 2 layers, 4 heads (2 per rank)
    step    1/20 | loss 4.2351
    step   10/20 | loss 4.1156
    step   20/20 | loss 3.5636
    TP traffic of one step, counted on step 1 (fp32 = 4 bytes/element; bytes this rank sends, ...):
      all_reduce      x8   of (8, 16, 64)    =    262144 B
    per layer: 131072 B = formula 8*b*s*h*(t-1)/t * 4 B = 8*8*16*64*1/2*4 = 131072 B
    done: 20 steps, median 50.9 ms/step, 2513 tokens/s

Megatron-LM (Shoeybi et al. 2019), section 3: an MLP  Y = GeLU(X A),  Z = Y B  is split with A by
columns and B by rows, so each rank computes GeLU(X A_i) B_i with no communication in between and
the partial results are summed once. Two conjugate operators carry all the communication:

    f: forward identity,    backward all-reduce    (entry of the block: X is replicated)
    g: forward all-reduce,  backward identity      (exit of the block: sum the partial Z_i)

Attention splits the same way by heads: Q, K and V by columns (each rank owns heads/t heads), the
output projection by rows. So each block costs 2 all-reduces of (b, s, h) forward and 2 backward.
Sequence parallelism (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus an
all-gather (the same bytes) and keeps the activations between blocks sharded along the sequence, so
LayerNorm and the residual stream stop being computed (and stored) t times.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail  # argparse's own errors too: one line, exit 2
    p.add_argument("--impl", choices=["manual", "dtensor"], default="manual",
                   help="hand-written f/g layers, or DTensor's parallelize_module")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations between blocks along the sequence (norms, residuals)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per step; every rank of the TP group sees the whole batch")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "hidden", "heads", "layers", "vocab",
                 "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    # The TP degree is the world size; check the shapes it must divide before any process group.
    tp = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", "1")))
    if args.hidden % args.heads:
        fail(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % tp:
        fail(f"--heads {args.heads} is not divisible by the tensor-parallel degree {tp} "
             f"(world size): each rank must own whole attention heads")
    if args.sequence_parallel and args.seq_len % tp:
        fail(f"--seq-len {args.seq_len} is not divisible by the tensor-parallel degree {tp}: "
             f"--sequence-parallel gives each rank seq_len/tp positions")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """Return (rank, world_size, device); gloo on CPU, NCCL on CUDA; python, torchrun or srun.
    (The same set-up as 01-ddp-basics/ddp_training.py, where it is explained.)"""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:  # the first host of the step's allocation
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


# --------------------------------------------------------------------------------------------------
# The dense model: a small GPT. Every parallel version below holds slices of these same weights and
# exports back to this class, so a world-1 run is the reference for all of them.


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        # Separate Q, K, V (not one fused matrix): splitting each by rows of W gives rank i the same
        # heads in all three, which is what both the manual and the DTensor split rely on.
        # K has no bias: q.(k + c) adds the same q.c to every score of a query, which softmax
        # ignores, so that bias would get an exactly-zero gradient, and Adam (which divides by the
        # gradient's size) would turn its float rounding noise into steps of size lr.
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=name != "k") for name in "qkv")
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):  # x: (B, T, H) -> (B, T, H)
        B, T = x.shape[0], x.shape[1]
        # The number of heads is read from the width: all of them dense, heads/t under TP.
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))            # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):  # (B, T, H) -> (B, T, 4H) -> (B, T, H)
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, idx):  # (B, T) token ids -> (B, T, H)
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.emb = Embedding(vocab, hidden, seq_len)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def global_batch(seed: int, step: int, size: int, seq_len: int, vocab: int):
    """The batch of step `step`, a pure function of (seed, step): arithmetic sequences modulo
    `vocab` with a random start and stride, so the next token is predictable from the previous
    two (a task that needs attention). Returns inputs and next-token targets, (size, seq_len) each.
    """
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------------------------
# Tensor parallelism by hand. Communication lives in autograd Functions, so backward is correct by
# construction: each forward collective has its conjugate in backward.


class CopyToTP(torch.autograd.Function):
    """Megatron's f. Forward: identity (every rank already has the whole X). Backward: each rank
    only has the gradient that flowed through its own column slice; the sum over ranks is the
    gradient of X, so all-reduce it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(grad, group=ctx.group)  # bwd: all-reduce (b, s, h) over the TP group
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g. Forward: sum the partial outputs of the row-parallel layer. Backward: the
    gradient of a sum is the same for every addend, so identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(x, group=group)  # fwd: all-reduce (b, s, h) over the TP group
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor for these new names; older
# versions only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_seq(x, group):
    """(B, T/t, H) local shard -> (B, T, H), the shards in rank order along the sequence."""
    t = dist.get_world_size(group)
    x = x.contiguous()
    # The single-tensor all-gather stacks along dim 0, (t*B, T/t, H); lay the chunks along T.
    flat = x.new_empty((t * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_single(flat, x, group=group)
    return torch.cat(flat.chunk(t), dim=1)


def _reduce_scatter_seq(x, group):
    """(B, T, H) partial sums -> (B, T/t, H): rank i keeps the summed i-th slice of the sequence."""
    t = dist.get_world_size(group)
    # reduce_scatter_tensor splits along dim 0: put the sequence chunks first.
    stacked = torch.cat(x.chunk(t, dim=1), dim=0).contiguous()  # (t*B, T/t, H)
    out = x.new_empty((x.shape[0], x.shape[1] // t) + tuple(x.shape[2:]))
    _reduce_scatter_single(out, stacked, group=group)
    return out


def _my_seq_chunk(x, group):
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class GatherSeq(torch.autograd.Function):
    """Sequence parallelism's g (replaces f at a block's entry). Forward: all-gather the sequence
    shards into the whole X for the column-parallel layers. Backward: each rank holds a partial
    gradient of the whole X; reduce-scatter sums it and hands each rank its own shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)  # fwd: all-gather (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None  # bwd: reduce-scatter (b, s, h)


class ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallelism's g-bar (replaces g at a block's exit). Forward: reduce-scatter the
    partial outputs, so the sum arrives already split along the sequence. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)  # fwd: reduce-scatter (b, s, h) -> (b, s/t, h)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None  # bwd: all-gather (b, s/t, h) -> (b, s, h)


class ScatterSeq(torch.autograd.Function):
    """Enter the sequence-parallel region from replicated activations (the embedding output):
    forward keeps this rank's chunk (no communication); backward all-gathers the chunk gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_seq_chunk(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None  # bwd: all-gather (b, s/t, h) -> (b, s, h)


class LeaveSeq(torch.autograd.Function):
    """Leave the sequence-parallel region before the replicated LM head: forward all-gathers; in
    backward every rank holds the same (whole) gradient, so it just keeps its chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)  # fwd: all-gather (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return _my_seq_chunk(grad, ctx.group), None


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i^T + b_i: rank i holds rows i*out/t..(i+1)*out/t of the dense weight (out, in),
    i.e. a slice of the output features. Input X: whole, (..., in). Output: (..., out/t).
    No communication here: the block applies f (or SP's all-gather) once before it, so that Q, K
    and V, which read the same X, share one all-reduce in backward."""

    def __init__(self, dense: nn.Linear, group):
        super().__init__()
        t, i = dist.get_world_size(group), dist.get_rank(group)
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=0)[i].clone())
        self.bias = None if dense.bias is None else \
            nn.Parameter(dense.bias.detach().chunk(t, dim=0)[i].clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i^T + b: rank i holds columns i*in/t..(i+1)*in/t of the dense weight, the
    slice that matches the column-parallel output it receives. Input: (..., in/t). The partial
    products are summed by g (all-reduce) or, with sequence parallelism, by a reduce-scatter that
    leaves (B, T/t, out); the bias is added once, after the sum."""

    def __init__(self, dense: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        t, i = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=1)[i].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())  # replicated

    def forward(self, y):
        partial = F.linear(y, self.weight)                       # (B, T, out) partial sums
        reduce = ReduceScatterSeq if self.sequence_parallel else ReduceFromTP
        return reduce.apply(partial, self.group) + self.bias


class ParallelAttention(nn.Module):
    """Heads split across ranks: Q, K, V column-parallel, proj row-parallel. One f, one g."""

    def __init__(self, dense: Attention, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel, self.head_dim = group, sequence_parallel, dense.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(m, group)
                                  for m in (dense.q, dense.k, dense.v))
        self.proj = RowParallelLinear(dense.proj, group, sequence_parallel)

    def forward(self, x):  # x: (B, T, H), or (B, T/t, H) with sequence parallelism
        x = (GatherSeq if self.sequence_parallel else CopyToTP).apply(x, self.group)
        return Attention.forward(self, x)  # the dense code, on heads/t local heads


class ParallelMLP(nn.Module):
    """fc1 column-parallel, GeLU on the local slice (elementwise, so no communication), fc2
    row-parallel: f -> (B, T, 4H/t) -> g."""

    def __init__(self, dense: MLP, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.fc1 = ColumnParallelLinear(dense.fc1, group)
        self.fc2 = RowParallelLinear(dense.fc2, group, sequence_parallel)

    def forward(self, x):
        x = (GatherSeq if self.sequence_parallel else CopyToTP).apply(x, self.group)
        return self.fc2(F.gelu(self.fc1(x)))


def parallelize_block_manual(block: Block, group, sequence_parallel: bool) -> Block:
    block.attn = ParallelAttention(block.attn, group, sequence_parallel)
    block.mlp = ParallelMLP(block.mlp, group, sequence_parallel)
    return block


def parallelize_manual(model: GPT, group, sequence_parallel: bool) -> GPT:
    """Swap each block's attention and MLP for their TP versions (same attribute names, so the
    state_dict keys stay those of the dense model). With sequence parallelism, the embedding output
    is cut along the sequence and the head's input gathered back, through two module hooks."""
    for block in model.blocks:
        parallelize_block_manual(block, group, sequence_parallel)
    if sequence_parallel:
        model.emb.register_forward_hook(lambda mod, args, out: ScatterSeq.apply(out, group))
        model.head.register_forward_pre_hook(lambda mod, args: (LeaveSeq.apply(args[0], group),))
    return model


def sequence_parallel_params(model: GPT):
    """Replicated parameters that, under sequence parallelism, act on this rank's positions only,
    so each rank's gradient is a partial sum: the LayerNorms (2h each, 2L+1 of them) and the
    row-parallel biases, which are added after the reduce-scatter (h each, 2L of them)."""
    norms = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    biases = [m.bias for m in model.modules() if isinstance(m, RowParallelLinear)]
    return norms + biases


def allreduce_sequence_parallel_grads(model: GPT, group) -> None:
    """After backward (manual SP, as Megatron does): sum those partial gradients over the TP group,
    flattened into one all-reduce instead of one per tensor."""
    grads = [p.grad for p in sequence_parallel_params(model)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # all-reduce (2h(2L+1) + 2Lh,) over the TP group
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def export_manual(model: GPT, group) -> dict:
    """The dense state_dict: all-gather each sharded weight back along the dimension it was cut."""
    cut = {}
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear):
            cut[f"{name}.weight"] = cut[f"{name}.bias"] = 0  # (K has no bias: never looked up)
        elif isinstance(module, RowParallelLinear):
            cut[f"{name}.weight"] = 1
    full = {}
    for key, value in model.state_dict().items():
        if key in cut:
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=cut[key])
        full[key] = value.detach().cpu().clone()
    return full


# --------------------------------------------------------------------------------------------------
# The same split with DTensor: a plan names each submodule's style, and parallelize_module shards
# the weights and installs hooks that convert inputs and outputs between layouts. Replicate and
# Shard(d) say how a tensor lies over the TP mesh; a Partial tensor (the output of a row-parallel
# matmul) still has to be summed. Every redistribution between them is a collective.


def block_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    if not sequence_parallel:
        return {
            # f: the attention input becomes one Replicate DTensor shared by q, k and v, so their
            # three partial input-gradients add up (as Partial) and are all-reduced once.
            "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),          # g: Partial -> Replicate = all-reduce
            "mlp.fc1": ColwiseParallel(),            # f (fc1 is the only reader of x)
            "mlp.fc2": RowwiseParallel(),            # g
        }
    return {
        # The residual stream is a DTensor sharded on the sequence, (B, T/t, H) on each rank.
        "ln1": SequenceParallel(),                   # LayerNorm on local positions, no comm
        "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                   desired_input_layouts=(Replicate(),)),  # all-gather / bwd RS
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),  # RS / AG
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def parallelize_dtensor(model: GPT, mesh, sequence_parallel: bool) -> GPT:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput,
                                                   SequenceParallel, parallelize_module)
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, mesh, {
            # Replicate -> Shard(1): keep this rank's positions; bwd: all-gather the gradient.
            "emb": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                       use_local_output=False),
            "ln_f": SequenceParallel(),
            # Shard(1) -> Replicate: all-gather for the replicated head; bwd: keep own positions.
            "head": PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),), use_local_output=True),
        })
    return model


def reduce_partial_grads(model: GPT) -> None:
    """After backward (DTensor SP): the norms' weight gradients come out as Partial DTensors (each
    rank summed over its own positions). Left so, every optimizer op that reads them would
    all-reduce them again (three times per tensor in AdamW, measured with CommCounter); turn each
    into Replicate once. (The row-parallel biases need nothing: DTensor adds them before the
    reduce-scatter, so their gradients come from the all-gathered, whole output gradient.)"""
    from torch.distributed.tensor import DTensor, Replicate
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.grad.placements))


def export_dtensor(model: GPT) -> dict:
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------
# Counting the traffic


def _is_dtensor_op(types) -> bool:
    # Without importing DTensor where it is not used: none exists if its module was never loaded.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(issubclass(t, module.DTensor) for t in types)


class CommCounter(TorchDispatchMode):
    """Records every collective that reaches the dispatcher while it is active: dist.* calls (the
    manual layers, FSDP, pipelining) and DTensor's functional collectives alike."""

    def __init__(self):
        super().__init__()
        self.records = []  # one dict per collective, see _collective

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_dtensor_op(types):
            # DTensor runs first: it turns the op into local ops and collectives, which then come
            # back through this mode on plain tensors and are counted.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        record = _collective(func._schema.name, args)
        if record is not None:
            self.records.append(record)
        return out


def _collective(name: str, args):
    """Kind, shape of the whole tensor (the gathered output, the unreduced input), group size t
    and the bytes this rank sends with ring algorithms (what NCCL uses for large messages):
    all-reduce 2(t-1)/t of the buffer, all-gather and reduce-scatter (t-1)/t of the whole tensor,
    send all of it. c10d ops (from dist.*) carry the ProcessGroup; DTensor's functional ones its
    registered name."""
    if name == "c10d::allreduce_":                            # (tensors, group, op, ...)
        kind, shape, group = "all_reduce", args[0][0].shape, args[1]
    elif name == "_c10d_functional::all_reduce":              # (input, op, group name)
        kind, shape, group = "all_reduce", args[0].shape, args[2]
    elif name == "c10d::_allgather_base_":                    # (output, input, group, ...)
        kind, shape, group = "all_gather", args[0].shape, args[2]
    elif name == "_c10d_functional::all_gather_into_tensor":  # (input, group size, group name)
        kind, shape, group = "all_gather", (args[0].shape[0] * args[1], *args[0].shape[1:]), args[2]
    elif name == "c10d::_reduce_scatter_base_":               # (output, input, group, ...)
        kind, shape, group = "reduce_scatter", args[1].shape, args[2]
    elif name == "_c10d_functional::reduce_scatter_tensor":   # (input, op, group size, group name)
        kind, shape, group = "reduce_scatter", args[0].shape, args[3]
    elif name == "c10d::send":                                # (tensors, group, peer, tag)
        kind, shape, group = "send", args[0][0].shape, args[1]
    else:
        return None
    pg = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else \
        dist.distributed_c10d._resolve_process_group(group)
    t = pg.size()
    share = {"all_reduce": 2 * (t - 1) / t, "all_gather": (t - 1) / t,
             "reduce_scatter": (t - 1) / t, "send": 1}[kind]
    elem = (args[0][0] if isinstance(args[0], list) else args[0]).element_size()
    return {"kind": kind, "shape": list(shape), "t": t, "elem_bytes": elem,
            "bytes": round(share * _numel(shape) * elem), "group": pg.group_name}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def traffic_report(records, args, tp) -> dict:
    """Measured bytes of one step next to the formula (fp32: 4 bytes per element, r = (t-1)/t).

    Per layer: 2 all-reduces of (b, s, h) forward (g after attention and after the MLP) and 2
    backward (f), each sending 2r x b*s*h elements: 8*b*s*h*r. With sequence parallelism each
    all-reduce becomes a reduce-scatter plus an all-gather of r x b*s*h each: the same volume.
    Sequence parallelism adds, outside the blocks, one all-gather at each end (the embedding's
    gradient, the head's input) and the all-reduce of the partial gradients of replicated
    parameters (sequence_parallel_params; DTensor's row-parallel biases need none)."""
    b, s, h, L, e, r = args.batch_size, args.seq_len, args.hidden, args.layers, 4, (tp - 1) / tp
    per_layer = 8 * b * s * h * r * e
    boundary = partial_grads = 0
    if args.sequence_parallel:
        boundary = 2 * b * s * h * r * e
        replicated = 2 * h * (2 * L + 1) + (L * 2 * h if args.impl == "manual" else 0)
        partial_grads = 2 * r * replicated * e
    activations = sum(x["bytes"] for x in records if _numel(x["shape"]) == b * s * h)
    return {"bytes_per_element": e, "per_layer_formula": per_layer,
            "per_layer_measured": (activations - boundary) / L,
            "boundary_formula": boundary, "partial_grads_formula": partial_grads,
            "activations_measured": activations,
            "total_formula": L * per_layer + boundary + partial_grads,
            "total_measured": sum(x["bytes"] for x in records)}


# --------------------------------------------------------------------------------------------------
# Training


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        train(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def train(args, rank, tp, device):
    torch.manual_seed(args.seed)
    # Every rank builds the same dense model from the same seed, then keeps its slices.
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq_len).to(device)
    group = dist.group.WORLD  # world size = TP degree in this script
    if args.impl == "manual":
        parallelize_manual(model, group, args.sequence_parallel)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
        parallelize_dtensor(model, mesh, args.sequence_parallel)
    # foreach=False: the per-tensor loop accepts a mix of DTensor and plain parameters (the
    # replicated embedding and head stay plain tensors). Adam is elementwise, so updating slices
    # is updating the dense weights.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    if rank == 0:
        sp = " + sequence parallel" if args.sequence_parallel else ""
        print(f"tp {tp} | impl {args.impl}{sp} | device {device} | batch {args.batch_size} x seq "
              f"{args.seq_len} x hidden {args.hidden} | {args.layers} layers, {args.heads} heads "
              f"({args.heads // tp} per rank)", flush=True)

    losses, step_s, counter = [], [], CommCounter()
    for step in range(args.steps):
        # The TP group shares one batch: every rank builds the whole batch of this step.
        x, y = (t.to(device) for t in global_batch(args.seed, step, args.batch_size, args.seq_len,
                                                   args.vocab))
        t0 = time.perf_counter()
        # Step 1 runs under the counter (every op passes through Python there, so it is slow);
        # the later steps are the ones timed.
        with counter if step == 0 else contextlib.nullcontext():
            logits = model(x)                                   # (B, T, vocab) on every rank
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            if args.sequence_parallel and args.impl == "manual":
                allreduce_sequence_parallel_grads(model, group)
            elif args.sequence_parallel:
                reduce_partial_grads(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > 0:
            step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())  # the same on every rank: whole batch, replicated head
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            print(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}", flush=True)

    traffic = traffic_report(counter.records, args, tp)
    state = export_manual(model, group) if args.impl == "manual" else export_dtensor(model)
    report_results(args, rank, tp, device, model, optimizer, losses, step_s, counter.records,
                   traffic, state)


def local_bytes(tensors) -> int:
    """Bytes this rank holds (a DTensor counts its local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
               for t in tensors if t is not None)


def report_results(args, rank, tp, device, model, optimizer, losses, step_s, records, traffic,
                   state):
    per_rank_local = {
        "param_bytes": local_bytes(model.parameters()),
        "grad_bytes": local_bytes(p.grad for p in model.parameters()),
        "optim_bytes": local_bytes(v for s in optimizer.state.values() for v in s.values()
                                   if torch.is_tensor(v) and v.dim() > 0),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    per_rank = [None] * tp
    dist.all_gather_object(per_rank, per_rank_local)
    if rank == 0:
        b, s, h = args.batch_size, args.seq_len, args.hidden
        print("TP traffic of one step, counted on step 1 (fp32 = 4 bytes/element; bytes this "
              "rank sends, ring algorithms):", flush=True)
        groups = {}
        for r in records:
            key = (r["kind"], tuple(r["shape"]), r["t"])
            groups.setdefault(key, []).append(r["bytes"])
        for (kind, shape, t), sent in groups.items():
            print(f"  {kind:<15} x{len(sent):<3} of {shape!s:<14} = {sum(sent):>9} B")
        print(f"per layer: {traffic['per_layer_measured']:.0f} B = formula 8*b*s*h*(t-1)/t * 4 B "
              f"= 8*{b}*{s}*{h}*{tp - 1}/{tp}*4 = {traffic['per_layer_formula']:.0f} B",
              flush=True)
        if args.sequence_parallel:
            print(f"sequence parallelism adds {traffic['boundary_formula']:.0f} B at the "
                  f"embedding and head, {traffic['partial_grads_formula']:.0f} B of partial "
                  f"gradients: total {traffic['total_measured']} B = formula "
                  f"{traffic['total_formula']:.0f} B", flush=True)
        median_ms = 1000 * statistics.median(step_s) if step_s else float("nan")
        tokens_per_s = b * s / statistics.median(step_s) if step_s else float("nan")
        print(f"done: {args.steps} steps, median {median_ms:.1f} ms/step, {tokens_per_s:.0f} "
              f"tokens/s", flush=True)
        if args.export:
            args.export.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.export.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, args.export)
        if args.metrics_out:
            metrics = {
                "script": "05-advanced/tensor_parallel.py",
                "strategy": f"tp-{args.impl}" + ("-sp" if args.sequence_parallel else ""),
                "world_size": tp, "tp": tp, "steps": args.steps, "global_batch": b,
                "seq_len": s, "hidden": h, "layers": args.layers, "losses": losses,
                "step_ms": [1000 * t for t in step_s], "median_step_ms": median_ms,
                "samples_per_s": b / statistics.median(step_s) if step_s else float("nan"),
                "tokens_per_s": tokens_per_s, "collectives": records, "traffic": traffic,
                "device": str(device), "torch_version": torch.__version__, "per_rank": per_rank,
            }
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps(metrics, indent=1))
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()
