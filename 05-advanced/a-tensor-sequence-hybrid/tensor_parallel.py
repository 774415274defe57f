"""Tensor and sequence parallelism: Megatron's layers by hand, then the same split with DTensor.

Every rank of the tensor-parallel (TP) group holds a slice of each weight matrix of every block and
sees the whole batch. World size = TP degree here; hybrid_parallelism.py adds data and pipeline
parallelism on a device mesh.

Launch (from the repository root):
    python 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py      # 1 process: whole matrices
    torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py   # by hand
    torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py \
        --impl dtensor
    torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py \
        --sequence-parallel
    torchrun --nproc_per_node=8 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py \
        --device cuda --dim 4096 --heads 32 --seq-len 2048   # one 8-GPU node: TP stays on NVLink

Megatron-LM (Shoeybi et al. 2019), section 3: an MLP  Y = GeLU(X A),  Z = Y B  is split with A by
columns and B by rows, so each rank computes GeLU(X A_i) B_i with no communication in between and
the partial results are summed once. Two conjugate operators carry all the communication:

    f: forward identity,    backward all-reduce    (entry of the block: X is replicated)
    g: forward all-reduce,  backward identity      (exit of the block: sum the partial Z_i)

Attention splits the same way by heads: Q, K and V by columns (each rank owns heads/t heads), the
output projection by rows. So each block costs 2 all-reduces of (b, s, h) forward and 2 backward.
Sequence parallelism (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus an
all-gather (the same bytes per layer) and keeps the activations between blocks sharded along the
sequence, so LayerNorm and the residual stream stop being computed (and stored) t times. At the
model's ends it adds an all-gather before the head (and its backward at the embedding), and an
all-reduce of the norms' partial gradients.

The dense model is the course's GPT (dtcourse.models); set-up, metrics, export and the collective
counter come from the shared module dtcourse.
"""

import contextlib
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing
from dtcourse.comm import CollectiveCounter
from dtcourse.data import token_batch
from dtcourse.models import GPT, Attention, Block, FeedForward, init_gpt

SCRIPT = "05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py"


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
        # bwd: all-reduce (b, s, h) over the TP group. Exposed on a GPU: it is issued here, after
        # the layer's weight gradients are done, so nothing is left to overlap. Megatron-LM issues
        # it inside the linear layer's backward, before the weight-gradient GEMM, and computes
        # that GEMM while it runs (a reduce-scatter under sequence parallelism).
        dist.all_reduce(grad, group=ctx.group)
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
    """Sequence parallelism's all-gather, in f's place at a block's entry (Korthikanti et al. call
    it g, not Shoeybi et al.'s g). Forward: all-gather the sequence shards into the whole X for
    the column-parallel layers. Backward: each rank holds a partial gradient of the whole X;
    reduce-scatter sums it and hands each rank its own shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)  # fwd: all-gather (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None  # bwd: reduce-scatter (b, s, h)


class ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallelism's reduce-scatter, in g's place at a block's exit (Korthikanti et al.'s
    g-bar). Forward: reduce-scatter the partial outputs, so the sum arrives already split along
    the sequence. Backward: all-gather."""

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


class ParallelFeedForward(nn.Module):
    """fc1 column-parallel, GeLU on the local slice (elementwise, so no communication), fc2
    row-parallel: f -> (B, T, 4H/t) -> g."""

    def __init__(self, dense: FeedForward, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.fc1 = ColumnParallelLinear(dense.fc1, group)
        self.fc2 = RowParallelLinear(dense.fc2, group, sequence_parallel)

    def forward(self, x):
        x = (GatherSeq if self.sequence_parallel else CopyToTP).apply(x, self.group)
        return self.fc2(F.gelu(self.fc1(x)))


def parallelize_block_manual(block: Block, group, sequence_parallel: bool) -> Block:
    block.attn = ParallelAttention(block.attn, group, sequence_parallel)
    block.mlp = ParallelFeedForward(block.mlp, group, sequence_parallel)
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
    """After backward (DTensor SP): the norms' gradients come out as Partial DTensors (each rank
    summed over its own positions). Left so, every optimizer op that reads them would all-reduce
    them again (three times per tensor in AdamW: the counter's 'optimizer' pass); turn each into
    Replicate once. (The row-parallel biases need nothing: DTensor adds them before the
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
# Training: every rank builds the same dense GPT, keeps its slices, and trains on the whole batch


def build(args, d):
    """The course's GPT, split over the TP group (= the world here), and AdamW over its slices."""
    # Every rank draws the same dense weights (init_gpt: a pure function of seed and name), then
    # keeps its slices: rank i of t holds exactly the part of the one-process model it computes.
    model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers).to(d.device)
    init_gpt(model, args.seed)
    group = dist.group.WORLD
    if args.impl == "manual":
        parallelize_manual(model, group, args.sequence_parallel)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("tp",))
        parallelize_dtensor(model, mesh, args.sequence_parallel)
    # foreach=False: the per-tensor loop accepts a mix of DTensor and plain parameters (the
    # replicated embedding and head stay plain tensors). Adam is elementwise, so updating slices
    # is updating the dense weights.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    return model, group, optimizer


def train_step(args, model, group, optimizer, x, y, comm: CollectiveCounter) -> torch.Tensor:
    """Forward, backward and AdamW on the TP group's shared batch. `comm.phase` tags the
    collectives with the pass that issues them (recorded only while the counter is active)."""
    comm.phase = "forward"
    logits = model(x)                                   # (B, T, vocab) on every rank
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    comm.phase = "backward"
    loss.backward()
    if args.sequence_parallel and args.impl == "manual":
        allreduce_sequence_parallel_grads(model, group)
    elif args.sequence_parallel:
        reduce_partial_grads(model)
    comm.phase = "optimizer"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train(args, d):
    tp = d.world_size
    model, group, optimizer = build(args, d)
    sp = " + sequence parallel" if args.sequence_parallel else ""
    report.print0(f"tp {tp} | impl {args.impl}{sp} | device {d.device} | batch {args.batch_size} x "
                  f"seq {args.seq_len} x hidden {args.dim} | {args.layers} layers, "
                  f"{args.heads} heads ({args.heads // tp} per rank)")

    losses, step_s, comm = [], [], CollectiveCounter()
    bar = report.progress(args.steps, "train")
    for step in range(args.steps):
        # The TP group shares one batch: every rank builds the whole batch of this step.
        x, y = (t.to(d.device) for t in token_batch(args.seed, step, args.batch_size,
                                                    args.seq_len, args.vocab))
        t0 = timing.clock(d.device)
        # Step 1 runs under the counter (every op passes through Python there, so it is slow);
        # the later steps are the ones timed.
        with comm if step == 0 else contextlib.nullcontext():
            loss = train_step(args, model, group, optimizer, x, y, comm)
        took = timing.clock(d.device) - t0
        if step > 0:
            step_s.append(took)
        losses.append(loss.item())  # the same on every rank: whole batch, replicated head
        bar.update(1)
        done = step + 1
        if d.is_main and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}")
    bar.close()

    traffic = traffic_report(comm.records, args, tp)
    print_traffic(comm.records, traffic, args, tp)
    state = None
    if args.export:  # a collective: every rank gathers the slices back into the dense weights
        state = export_manual(model, group) if args.impl == "manual" else export_dtensor(model)
    report_run(args, d, model, optimizer, losses, step_s, comm.records, traffic, state)


# --------------------------------------------------------------------------------------------------
# Report: the bytes counted on step 1 beside their formula, the metrics JSON and the export


def traffic_report(records, args, tp) -> dict:
    """Measured bytes of one step next to the formula (fp32: 4 bytes per element, r = (t-1)/t).

    Per layer: 2 all-reduces of (b, s, h) forward (g after attention and after the MLP) and 2
    backward (f), each sending 2r x b*s*h elements: 8*b*s*h*r. With sequence parallelism each
    all-reduce becomes a reduce-scatter plus an all-gather of r x b*s*h each: the same volume.
    Sequence parallelism adds, outside the blocks, one all-gather at each end (the embedding's
    gradient, the head's input) and the all-reduce of the partial gradients of replicated
    parameters (sequence_parallel_params; DTensor's row-parallel biases need none)."""
    b, s, h, L, e, r = args.batch_size, args.seq_len, args.dim, args.layers, 4, (tp - 1) / tp
    per_layer = 8 * b * s * h * r * e
    boundary = partial_grads = 0
    if args.sequence_parallel:
        boundary = 2 * b * s * h * r * e
        replicated = 2 * h * (2 * L + 1) + (L * 2 * h if args.impl == "manual" else 0)
        partial_grads = 2 * r * replicated * e
    # Activation collectives are those of a whole (b, s, h) tensor (SP: the gathered one).
    activations = sum(x["sent_bytes"] for x in records if x["tensor_bytes"] == b * s * h * e)
    return {"bytes_per_element": e, "per_layer_formula": per_layer,
            "per_layer_measured": (activations - boundary) / L,
            "boundary_formula": boundary, "partial_grads_formula": partial_grads,
            "activations_measured": activations,
            "total_formula": L * per_layer + boundary + partial_grads,
            "total_measured": sum(x["sent_bytes"] for x in records)}


def print_traffic(records, traffic, args, tp) -> None:
    """Rank 0 prints the counted collectives, one line per (pass, kind, size), and the formulas."""
    b, s, h = args.batch_size, args.seq_len, args.dim
    report.print0("TP traffic of step 1 (fp32 = 4 bytes/element; bytes this rank sends, ring "
                  "algorithms):")
    groups = {}
    for r in records:
        groups.setdefault((r["phase"], r["kind"], r["tensor_bytes"]), []).append(r["sent_bytes"])
    for (phase, kind, size), sent in groups.items():
        what = "(b, s, h)" if size == b * s * h * 4 else f"({size // 4},)"
        report.print0(f"  {phase:<9} {kind:<15} x{len(sent):<3} of {what:<9} {size:>6} B each, "
                      f"sends {sum(sent):>7} B")
    report.print0(f"per layer: {traffic['per_layer_measured']:.0f} B = formula 8*b*s*h*(t-1)/t * "
                  f"4 B = 8*{b}*{s}*{h}*{tp - 1}/{tp}*4 = {traffic['per_layer_formula']:.0f} B")
    if args.sequence_parallel:
        report.print0(f"sequence parallelism adds {traffic['boundary_formula']:.0f} B at the "
                      f"embedding and head, {traffic['partial_grads_formula']:.0f} B of partial "
                      f"gradients: total {traffic['total_measured']} B = formula "
                      f"{traffic['total_formula']:.0f} B")


def report_run(args, d, model, optimizer, losses, step_s, records, traffic, state) -> None:
    b, s = args.batch_size, args.seq_len
    median_s = statistics.median(step_s) if step_s else float("nan")
    report.print0(f"done: {args.steps} steps, median {1000 * median_s:.1f} ms/step, "
                  f"{b * s / median_s:.0f} tokens/s")
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    metrics = report.metrics(
        d, script=SCRIPT, strategy=f"tp-{args.impl}" + ("-sp" if args.sequence_parallel else ""),
        steps=args.steps, global_batch=b, losses=losses, samples_per_s=b / median_s,
        per_rank=per_rank, tp=d.world_size, seq_len=s, dim=args.dim, layers=args.layers,
        step_ms=[1000 * t for t in step_s], median_step_ms=1000 * median_s,
        tokens_per_s=b * s / median_s, collectives=records, traffic=traffic)
    report.finish(args, metrics, state)


# --------------------------------------------------------------------------------------------------
# Arguments and launch



def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--impl", choices=["manual", "dtensor"], default="manual",
                   help="hand-written f/g layers, or DTensor's parallelize_module")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations between blocks along the sequence (norms, residuals)")
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=8, lr=3e-3, grad_accum=False,
                       batch_help="sequences per step; every rank of the TP group sees the whole "
                                  "batch")
    cli.add_output_args(p)
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=16, vocab=64)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "log_every", "lr", "timeout_s")
    # The TP degree is the world size; check the shapes it must divide before any process group.
    tp = launch.launched().world_size
    cli.check_gpt_args(args)
    if args.heads % tp:
        cli.fail(f"--heads {args.heads} is not divisible by the tensor-parallel degree {tp} "
                 f"(world size): each rank must own whole attention heads")
    if args.sequence_parallel and args.seq_len % tp:
        cli.fail(f"--seq-len {args.seq_len} is not divisible by the tensor-parallel degree {tp}: "
                 f"--sequence-parallel gives each rank seq_len/tp positions")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
