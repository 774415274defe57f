"""Two bugs that only appear at scale, and one memory technique that scale makes necessary.

The two bugs are computations that are right on one GPU and quietly wrong once the model is split;
each is shown wrong, then right, beside what one process computes.

1. The gradient norm for clipping. clip_grad_norm_ on the tensors one rank holds gives the norm of
   its shards, its stage or its TP slices, and every rank clips by a different factor. The global
   norm adds the squares of every element exactly once: TP slices summed over the TP group, the
   tensors TP replicates (LayerNorms, embeddings, the head, row-parallel biases) counted once and
   not t times, stages summed over the pipeline, FSDP shards over the shard group. With DTensor,
   clip_grad_norm_ is right as is once every parameter lives on one mesh.
2. Cross-entropy over a vocabulary split across the TP ranks (Megatron's vocab-parallel LM head).
   The softmax of one rank's slice is not the softmax; gathering the logits (b*s*V numbers) is
   what the split was meant to avoid. Three all-reduces of one number per token are enough: the
   max, the sum of exponentials, and the target's logit; backward is softmax - onehot, locally.

3 is no bug: activation recomputation (Korthikanti et al. 2022), a trade of memory for FLOPs that
runs on one process (rank 0), splits nothing and gives bitwise the same gradients in every mode.
Selective recomputation here is Megatron-LM's core-attention policy (--recompute-granularity
selective): recompute only softmax(QK^T)V, whose score and softmax tensors, b*heads*s*s numbers
each, an eager attention keeps for backward, for 4*b*s*s*h FLOPs a layer against the matmuls'
24*b*s*h*h. What share of full recomputation's saving that is depends on a*s/h: about a third at
this lesson's small model, most of it at GPT-3's shape. FlashAttention never stores the score
matrix, so under it this policy saves next to nothing; the cost model's "selective" is another
policy, torchtitan's per-operator one (cost_model.md).
Saved bytes and FLOPs are measured (saved_tensors_hooks, FlopCounterMode) and compared with
formulas.

Launch (from the repository root):
    python 05-advanced/a-tensor-sequence-hybrid/scale_bugs.py                 # 1 process: no bug
    torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/scale_bugs.py
    torchrun --nproc_per_node=4 05-advanced/a-tensor-sequence-hybrid/scale_bugs.py --bug clip
                            # the 2-D layouts pp 2 x tp 2 and fsdp 2 x tp 2 (by hand, and DTensor)

Every rank also computes the dense model of one process on the same batch: that is the reference
each wrong and right value is printed beside. The tensor-parallel layers are the hand-written ones
of tensor_parallel.py; set-up, printing and the collective counter come from the shared module
dtcourse. With --json-out PATH, rank 0 writes the numbers as JSON there and, beside it (PATH with
the suffix .pt), the tensors they were computed from: every rank's clipped gradients in each
layout, every rank's cross-entropy gradients, and the recomputation modes' gradients, so that they
can be compared with one process outside this script.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtcourse import cli, launch, lessons, report
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, Block, init_gpt

SCRIPT = "05-advanced/a-tensor-sequence-hybrid/scale_bugs.py"
LESSON = Path(__file__).resolve().parent
tp_lesson = lessons.load(LESSON / "tensor_parallel.py")          # the hand-written TP layers
hybrid_lesson = lessons.load(LESSON / "hybrid_parallelism.py")   # DTensor TP + FSDP2 on a mesh


# ==================================================================================================
# 1. The global gradient norm for clipping


def layouts(world: int) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) of the layouts shown: at world 4 the two 2-D layouts pp 2 x tp 2 and
    fsdp 2 x tp 2, at any other world size each dimension alone over all ranks. dp is FSDP2
    (fully_shard) here: its ranks hold different shards of every tensor."""
    if world == 1:
        return [(1, 1, 1)]
    if world == 4:
        return [(2, 1, 2), (1, 2, 2)]
    return [(1, 1, world), (world, 1, 1), (1, world, 1)]


def layout_name(pp: int, dp: int, tp: int) -> str:
    parts = [f"{n} {k}" for n, k in (("pp", pp), ("fsdp", dp), ("tp", tp)) if k > 1]
    return " x ".join(parts) or "one process"


def tp_split_dims(model: nn.Module) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallelism cut it along. The others are whole on
    every TP rank: embeddings, LayerNorms, the head, and the row-parallel layers' biases."""
    dims = {}
    for name, m in model.named_modules():
        if isinstance(m, tp_lesson.ColumnParallelLinear):  # q, k, v, fc1: output features
            dims[f"{name}.weight"] = 0
            if m.bias is not None:
                dims[f"{name}.bias"] = 0
        elif isinstance(m, tp_lesson.RowParallelLinear):   # proj, fc2: input features
            dims[f"{name}.weight"] = 1
    return dims


def build_layout(args, d, pp: int, dp: int, tp: int):
    """The GPT of one process, split this way: hand-written TP layers over `tp`, FSDP2 over `dp`
    (pipeline stages need nothing here: a stage simply runs only its own layers)."""
    from torch.distributed.device_mesh import init_device_mesh
    # rank = (pp_index * dp + dp_index) * tp + tp_index, as in hybrid_parallelism.py
    mesh = init_device_mesh(d.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers).to(d.device)
    init_gpt(model, args.seed)
    if tp > 1:
        tp_lesson.parallelize_manual(model, mesh.get_group("tp"), sequence_parallel=False)
    split = tp_split_dims(model)
    if dp > 1:
        try:
            from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh, model, split


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def forward_backward(model, mesh, x, y) -> None:
    """One step's gradients in this layout. With stages, stage s runs its blocks only: it
    receives the hidden states (b, s, h) from the same (dp, tp) position of stage s-1, sends its
    own to stage s+1, and their gradients come back the same way."""
    pp, stage = mesh["pp"].size(), mesh.get_local_rank("pp")
    if pp == 1:
        loss_of(model(x), y).backward()
        return
    _, dp_i, tp_i = mesh.get_coordinate()

    def peer(s: int) -> int:  # the global rank at stage s, same dp and tp position
        return int(mesh.mesh[s, dp_i, tp_i])

    first, last = stage == 0, stage == pp - 1
    if first:
        h_in = model.emb(x)
    else:
        h_in = torch.empty(*x.shape, model.ln_f.normalized_shape[0], device=x.device)
        dist.recv(h_in, src=peer(stage - 1))              # fwd: activations from stage s-1
        h_in.requires_grad_()
    h, per_stage = h_in, len(model.blocks) // pp
    for block in model.blocks[stage * per_stage:(stage + 1) * per_stage]:
        h = block(h)
    if last:
        loss_of(model.head(model.ln_f(h)), y).backward()
    else:
        dist.send(h.detach().contiguous(), dst=peer(stage + 1))
        grad = torch.empty_like(h)
        dist.recv(grad, src=peer(stage + 1))              # bwd: their gradient, from stage s+1
        h.backward(grad)
    if not first:
        dist.send(h_in.grad.contiguous(), dst=peer(stage - 1))


def held_gradients(model, split: dict) -> list[tuple[str, torch.Tensor, int | None]]:
    """(name, the gradient this rank holds, TP split dim or None): FSDP2's gradients are DTensors,
    of which this rank holds one shard; another stage's layers have no gradient here."""
    from torch.distributed.tensor import DTensor
    out = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            out.append((name, g, split.get(name)))
    return out


def squares(pieces, device) -> torch.Tensor:
    """The sum of the squares of the gradients in `pieces`: one float32 number to send."""
    total = torch.zeros((), device=device)
    for _, g, _ in pieces:
        total = total + g.float().square().sum()
    return total


def own_norm(pieces, mesh) -> torch.Tensor:
    """WRONG: what clip_grad_norm_ computes from the tensors one rank holds."""
    return squares(pieces, mesh.device_type).sqrt()


def every_square_summed(pieces, mesh) -> torch.Tensor:
    """WRONG under TP: all-reduce every square over all groups, so each tensor that TP replicates
    is counted t times."""
    sq = squares(pieces, mesh.device_type)
    dist.all_reduce(sq)  # over the whole layout (pp x dp x tp)
    return sq.sqrt()


def global_norm(pieces, mesh) -> torch.Tensor:
    """RIGHT: every element of the model counted once.
    TP: the slices of a split tensor add up over the TP group; a replicated tensor is the same on
        every TP rank, so it is added once, after the TP all-reduce.
    PP: each stage holds other layers: sum over the stages.
    FSDP: each rank holds other rows of every tensor: sum over the shard group.
    (Plain data-parallel replicas, as in DDP, hold identical gradients: they are left out.)"""
    split = squares([p for p in pieces if p[2] is not None], mesh.device_type)
    dist.all_reduce(split, group=mesh.get_group("tp"))       # 1 float over the TP group
    sq = split + squares([p for p in pieces if p[2] is None], mesh.device_type)
    dist.all_reduce(sq, group=mesh.get_group("pp"))          # 1 float over the stages
    dist.all_reduce(sq, group=mesh.get_group("dp"))          # 1 float over the FSDP shards
    return sq.sqrt()


def clip_factor(norm, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)


def dense_slice(full: torch.Tensor, split_dim, mesh) -> torch.Tensor:
    """The part of a one-process tensor this rank holds: its TP slice, then its FSDP shard (rows
    cut as torch.chunk cuts them, as DTensor's Shard(0) does)."""
    if split_dim is not None:
        full = full.chunk(mesh["tp"].size(), dim=split_dim)[mesh.get_local_rank("tp")]
    chunks, i = full.chunk(mesh["dp"].size(), dim=0), mesh.get_local_rank("dp")
    return chunks[i] if i < len(chunks) else full.narrow(0, 0, 0)


def clipped_error(pieces, factor, reference: dict, mesh) -> float:
    """max |this rank's gradients x factor - the one-process clipped gradients|, over all ranks."""
    err = torch.zeros((), device=mesh.device_type)
    for name, g, split_dim in pieces:
        want = dense_slice(reference[name], split_dim, mesh)
        err = torch.maximum(err, (g * factor - want).abs().max())
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def one_process_clip(args, d, x, y):
    """The reference: clip_grad_norm_ on the whole model, on the whole batch."""
    model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers).to(d.device)
    init_gpt(model, args.seed)
    loss_of(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
    return norm.item(), {n: p.grad for n, p in model.named_parameters()}


def every_rank(prefix: str, named: dict) -> dict:
    """Every rank's tensors `named`, copied to the CPU and gathered (all_gather_object: pickled,
    a lesson-sized model), under f"{prefix}/rank{r}/{name}": for the tensor file of --json-out."""
    out = {}
    mine = {k: v.detach().cpu().clone() for k, v in named.items()}  # clone: not a view of a
    for r, theirs in enumerate(report.gather(mine)):                # larger buffer (FSDP2's)
        out.update({f"{prefix}/rank{r}/{k}": v for k, v in theirs.items()})
    return out


def clip_layout(args, d, layout, x, y, reference: dict, tensors: dict) -> dict:
    """One layout: its gradients, the wrong norms and the right one, and how far the gradients
    clipped by each are from the one-process clipped gradients. Every rank's gradients clipped by
    the right norm (and by FSDP2's clip_grad_norm_) go into `tensors`, with its mesh coordinate."""
    pp, dp, tp = layout
    mesh, model, split = build_layout(args, d, pp, dp, tp)
    rows = rank_rows(mesh.get_local_rank("dp"), x.shape[0] // dp)  # FSDP: data parallel
    forward_backward(model, mesh, x[rows], y[rows])
    pieces = held_gradients(model, split)

    own = own_norm(pieces, mesh)
    right = global_norm(pieces, mesh)
    right_factor = clip_factor(right, args.max_norm)
    name = layout_name(pp, dp, tp)
    out = {"layout": name, "pp": pp, "dp": dp, "tp": tp,
           "own_norm_per_rank": report.gather(own.item()), "right_norm": right.item(),
           "own_clipped_error": clipped_error(pieces, clip_factor(own, args.max_norm),
                                              reference, mesh),
           "right_clipped_error": clipped_error(pieces, right_factor, reference, mesh)}
    mine = {"coord": torch.tensor(mesh.get_coordinate())}       # (pp, dp, tp) index of this rank
    mine |= {f"right/{n}": g * right_factor for n, g, _ in pieces}
    if tp > 1:
        every = every_square_summed(pieces, mesh)
        out["every_square_norm"] = every.item()
        out["every_square_clipped_error"] = clipped_error(
            pieces, clip_factor(every, args.max_norm), reference, mesh)
    if dp > 1:
        # FSDP2's gradients are DTensors: clip_grad_norm_'s norm is a DTensor reduced over their
        # mesh, the dp ranks. It knows nothing of a TP group built by hand (dp x tp below).
        from torch.distributed.tensor import DTensor
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
        out["fsdp2_clip_grad_norm"] = norm
        out["fsdp2_clip_grad_norm_per_rank"] = report.gather(norm)
        clipped = held_gradients(model, split)                  # clipped in place just now
        out["fsdp2_clipped_error"] = clipped_error(clipped, 1.0, reference, mesh)
        mine |= {f"fsdp2/{n}": g for n, g, _ in clipped}
    tensors.update(every_rank(f"clip/{name}", mine))
    return out


def replicate_on_tp(model: nn.Module, tp_mesh) -> None:
    """Every parameter that apply_tp leaves whole (embeddings, LayerNorms, head) becomes a
    Replicate DTensor on the tp mesh, so that FSDP2 then puts every parameter on one 2-D (dp, tp)
    mesh. torchtitan's plans reach the same state another way: their norms are SequenceParallel
    (Replicate parameters) and their embedding and head are split. Inputs enter these modules as
    Replicate DTensors and leave as plain tensors: the activations between modules do not change,
    and no collective is added (every tp rank already computes the same values)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def params(_, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh,
                                                                            [Replicate()])))

    def inputs(_, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) else a for a in args)

    def outputs(_, out, mesh):
        return out.to_local()

    whole = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.LayerNorm))]
    for module in whole + [model.head]:
        distribute_module(module, tp_mesh, params, input_fn=inputs, output_fn=outputs)


def clip_dtensor_layout(args, d, x, y, reference: dict, tensors: dict,
                        one_mesh: bool) -> dict:
    """fsdp 2 x tp 2 the DTensor way (hybrid_parallelism.py's apply_tp, then apply_fsdp).
    As apply_tp leaves it (one_mesh False): the block matrices become DTensors on the 2-D (dp, tp)
    mesh; the embeddings, norms and head, which TP leaves whole, plain tensors that FSDP2 puts on
    the 1-D dp mesh. DTensor reduces a norm over its own mesh, so each mesh's norm is right by
    itself, but clip_grad_norm_ stacks every tensor's norm into one DTensor, and one DTensor has
    one mesh. With one_mesh, replicate_on_tp first: every parameter on the (dp, tp) mesh, and
    clip_grad_norm_ as it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh(d.device.type, (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    with torch.device("meta"):
        whole = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    model = hybrid_lesson.Stage(whole, 0, 1).to_empty(device=d.device)  # names as GPT's
    init_gpt(model, args.seed, layers=args.layers)
    hybrid_lesson.apply_tp(model, mesh["tp"])
    if one_mesh:
        replicate_on_tp(model, mesh["tp"])
    hybrid_lesson.apply_fsdp(model, mesh["dp"], reshard_after_forward=True)
    rows = rank_rows(mesh.get_local_rank("dp"), x.shape[0] // 2)
    loss_of(model(x[rows]), y[rows]).backward()
    meshes = len({p.grad.device_mesh for p in model.parameters()})
    library = error = None
    try:
        # torch 2.14 raises with two meshes, while stacking the norms, before any gradient has
        # changed; a version that does not raise has clipped them, and the check below sees it.
        library = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        library = (library.full_tensor() if isinstance(library, DTensor) else library).item()
    except RuntimeError as exc:
        error = str(exc).split(", but got")[0].splitlines()[0]
    if error is not None:
        # RIGHT: one total norm per mesh, each reduced over its own ranks (a tensor that TP
        # replicates sits on the dp mesh only, so it is counted once), then their squares added.
        by_mesh = {}
        for p in model.parameters():
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
        norms = [torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
                 for params in by_mesh.values()]
        right = torch.stack(norms).square().sum().sqrt()
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, args.max_norm, right)
    name = "fsdp 2 x tp 2, DTensor" + (", one mesh" if one_mesh else "")
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # all-gathers
    if d.is_main:
        tensors.update({f"clip/{name}/full/{n}": g for n, g in full.items()})
    return {"layout": name, "pp": 1, "dp": 2, "tp": 2, "meshes": meshes,
            "clip_grad_norm": library, "clip_grad_norm_error": error,
            "right_norm": library if error is None else right.item(),
            "right_clipped_error": max((g - reference[n]).abs().max().item()
                                       for n, g in full.items())}


def clip_demo(args, d, tensors: dict) -> dict:
    """Bug 1 on every layout of this world size, printed beside the one-process norm."""
    x, y = (t.to(d.device) for t in token_batch(args.seed, 0, args.batch_size, args.seq_len,
                                                 args.vocab))
    ref_norm, reference = one_process_clip(args, d, x, y)
    p0 = report.print0
    p0(f"1. Gradient norm for clipping | GPT {args.layers} layers, dim {args.dim}, {args.heads} "
       f"heads, vocab {args.vocab} | batch {args.batch_size} x {args.seq_len} tokens | max_norm "
       f"{args.max_norm}")
    p0(f"  one process: clip_grad_norm_ = {ref_norm:.6f}")
    results = []
    for layout in layouts(d.world_size):
        r = clip_layout(args, d, layout, x, y, reference, tensors)
        results.append(r)
        what = " (hand-written TP layers)" if r["tp"] > 1 else ""
        p0(f"  {r['layout']}{what}")
        own = ", ".join(f"{v:.6f}" for v in r["own_norm_per_rank"])
        p0(f"    wrong: {r['own_norm_per_rank'][0]:.6f} (rank 0's own norm; ranks: {own}), "
           f"right: {r['right_norm']:.6f}, one process: {ref_norm:.6f}")
        errors = [f"own norm {r['own_clipped_error']:.2e}"]
        if "every_square_norm" in r:
            p0(f"    wrong: {r['every_square_norm']:.6f} (every square all-reduced: the tensors "
               f"TP replicates counted {r['tp']} times)")
            errors.append(f"every square {r['every_square_clipped_error']:.2e}")
        if "fsdp2_clip_grad_norm" in r:
            if r["tp"] == 1:
                p0(f"    clip_grad_norm_ on FSDP2's DTensor gradients: "
                   f"{r['fsdp2_clip_grad_norm']:.6f} (right)")
                errors.append(f"FSDP2 clip_grad_norm_ ~{r['fsdp2_clipped_error']:.1e}")
            else:
                ranks = ", ".join(f"{v:.6f}" for v in r["fsdp2_clip_grad_norm_per_rank"])
                p0(f"    wrong: {r['fsdp2_clip_grad_norm']:.6f} (clip_grad_norm_ on FSDP2's "
                   f"DTensor gradients, rank 0; ranks: {ranks}): reduced over dp, blind to the "
                   f"hand-made TP group")
                errors.append(f"FSDP2 clip_grad_norm_ {r['fsdp2_clipped_error']:.2e}")
        errors.append(f"right ~{r['right_clipped_error']:.1e}")
        p0(f"    max |clipped gradient - one process|: {', '.join(errors)}")
    if d.world_size == 4:
        for one_mesh in (False, True):
            r = clip_dtensor_layout(args, d, x, y, reference, tensors, one_mesh)
            results.append(r)
            if one_mesh:
                p0(f"  {r['layout']} (apply_tp, then every parameter TP leaves whole made a "
                   f"Replicate DTensor on the tp mesh, then apply_fsdp)")
            else:
                p0(f"  {r['layout']} (hybrid_parallelism.py's apply_tp, apply_fsdp)")
            if r["clip_grad_norm_error"]:
                p0(f"    wrong: clip_grad_norm_ raises RuntimeError: {r['clip_grad_norm_error']}")
                p0(f"    right: {r['right_norm']:.6f} (one norm per mesh, {r['meshes']} meshes, "
                   f"squares added), one process: {ref_norm:.6f}")
            else:
                p0(f"    right: {r['clip_grad_norm']:.6f} (clip_grad_norm_ as it is: parameters "
                   f"on {r['meshes']} mesh), one process: {ref_norm:.6f}")
            p0(f"    max |clipped gradient - one process|: right ~{r['right_clipped_error']:.1e}")
    return {"one_process_norm": ref_norm, "max_norm": args.max_norm, "layouts": results}


# ==================================================================================================
# 2. Cross-entropy over a vocabulary split across the TP ranks


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_j exp z_j) - z_target, where rank i of the TP group holds only the
    logits of vocabulary ids [i V/t, (i+1) V/t). Three all-reduces of one float per token; the
    logits never leave their rank."""

    @staticmethod
    def forward(ctx, logits, target, group):
        # logits: (N, V/t) this rank's slice of the vocabulary; target: (N,) ids in [0, V)
        n = logits.shape[-1]
        start = dist.get_rank(group) * n
        big = logits.max(dim=-1).values
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)   # (N,): the max over all V
        z = logits - big.unsqueeze(-1)                            # exp() cannot overflow now
        mine = (target >= start) & (target < start + n)           # tokens whose target is here
        local = torch.where(mine, target - start, 0)
        z_target = torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(z_target, group=group)                    # (N,): the owner's value
        e = z.exp()
        sum_exp = e.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)                     # (N,): sum over all V
        ctx.save_for_backward(e / sum_exp.unsqueeze(-1), local, mine)
        return sum_exp.log() - z_target

    @staticmethod
    def backward(ctx, grad):
        # d loss / d z_j = softmax_j - [j == target], on this rank's slice: no communication.
        softmax, local, mine = ctx.saved_tensors
        g = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None


def own_slice_cross_entropy(logits, target, group):
    """WRONG: the softmax of each rank's own slice. The rank owning a token's target computes
    log(sum over its slice of exp z) - z_target, the others 0; summing over the ranks (g: an
    all-reduce forward, identity backward) gives every token one loss, with the wrong
    normaliser."""
    n = logits.shape[-1]
    start = dist.get_rank(group) * n
    mine = (target >= start) & (target < start + n)
    local = torch.where(mine, target - start, 0)
    per_token = torch.logsumexp(logits, dim=-1) - logits.gather(-1, local.unsqueeze(-1))[:, 0]
    return tp_lesson.ReduceFromTP.apply(torch.where(mine, per_token, 0.0), group)


class GatherVocab(torch.autograd.Function):
    """The baseline the split avoids: all-gather the logits (N, V/t) -> (N, V). Every rank then
    computes the same loss, so backward keeps this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, logits, group):
        ctx.group = group
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)   # (N, V/t) from every rank
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        t, i = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=-1)[i], None


def vocab_inputs(args, device):
    """Hidden states (b, s, h) before the LM head, its weight (V, h) and the targets (b, s)."""
    g = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(args.batch_size, args.seq_len, args.dim, generator=g)
    weight = torch.randn(args.vocab, args.dim, generator=g) * args.dim ** -0.5
    target = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g)
    return hidden.to(device), weight.to(device), target.to(device)


def head_loss(hidden, weight, target, loss_fn, group, comm=None, name=""):
    """Mean loss of the LM head; returns (loss, d hidden, d weight, d logits). `comm`, if given,
    tags the collectives of forward and backward with `name`."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if comm is not None:
        comm.phase = f"{name}/forward"
    # f: x is whole on every rank; backward sums the slices' contributions to its gradient
    x = tp_lesson.CopyToTP.apply(hidden, group) if group is not None else hidden
    logits = (x @ weight.t()).flatten(0, 1)                 # (N, V/t): this rank's columns
    logits.retain_grad()
    loss = loss_fn(logits, target.flatten())
    if comm is not None:
        comm.phase = f"{name}/backward"
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, logits.grad


def vocab_demo(args, d, tensors: dict) -> dict:
    """Bug 2 over a TP group of all ranks: wrong, right and gathered, against one process, and the
    bytes of each counted by the CollectiveCounter. Every rank's loss and gradients of each go into
    `tensors`."""
    group, t, i = dist.group.WORLD, d.world_size, d.rank
    hidden, weight, target = vocab_inputs(args, d.device)
    mine = weight.chunk(t, dim=0)[i]                         # rows i V/t .. (i+1) V/t - 1
    ref = head_loss(hidden, weight, target, F.cross_entropy, None)   # one process, dense

    def compare(run, kind: str) -> dict:
        """The loss and gradients of a split run, each beside the one process's slice."""
        loss, dh, dw, dz = run
        tensors.update(every_rank(f"vocab_ce/{kind}", {"loss": loss, "logits": dz, "weight": dw,
                                                       "hidden": dh}))
        want = (ref[3].chunk(t, dim=-1)[i], ref[2].chunk(t, dim=0)[i], ref[1])
        err = torch.stack([(a - b).abs().max() for a, b in zip((dz, dw, dh), want)])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        return {"loss": loss.item(), "grad_error": dict(zip(("logits", "weight", "hidden"),
                                                            err.tolist()))}

    wrong = compare(head_loss(hidden, mine, target,
                              lambda z, y: own_slice_cross_entropy(z, y, group).mean(), group),
                    "wrong")
    comm = CollectiveCounter()
    with comm:
        right = head_loss(hidden, mine, target,
                          lambda z, y: VocabParallelCrossEntropy.apply(z, y, group).mean(), group,
                          comm, "vocab-parallel")
        gathered = head_loss(hidden, mine, target,
                             lambda z, y: F.cross_entropy(GatherVocab.apply(z, group), y), group,
                             comm, "gathered")
    right, gathered = compare(right, "right"), compare(gathered, "gathered")

    def sent(phase):
        records = [r for r in comm.records if r["phase"] == phase]
        return len(records), sum(r["sent_bytes"] for r in records)

    N, V, h, r = args.batch_size * args.seq_len, args.vocab, args.dim, (t - 1) / t
    formula = {"vocab-parallel/forward": 3 * 2 * r * N * 4,      # all-reduces of (b*s,)
               "gathered/forward": r * N * V * 4,                 # all-gather of (b, s, V)
               "backward": 2 * r * N * h * 4}                     # f: all-reduce of (b, s, h)
    measured = {phase: sent(phase) for phase in ("vocab-parallel/forward", "gathered/forward",
                                                 "vocab-parallel/backward", "gathered/backward")}
    report.print0(f"2. Vocabulary-parallel cross-entropy | logits (b {args.batch_size}, s "
                  f"{args.seq_len}, V {V}) split over tp {t} | hidden {h}")
    report.print0(f"  loss  wrong: {wrong['loss']:.6f} (softmax over each rank's own slice), "
                  f"right: {right['loss']:.6f}, one process: {ref[0].item():.6f}")
    for what, name in (("logits", "logits"), ("weight", "head weight"), ("hidden", "hidden")):
        report.print0(f"  max |d {name:<11} - one process|  wrong: "
                      f"{wrong['grad_error'][what]:.2e}, right: ~{right['grad_error'][what]:.1e}")
    report.print0("  bytes each rank sends, counted (calls x tensor size x ring algorithm's share, "
                  "fp32):")
    vp, ga = measured["vocab-parallel/forward"], measured["gathered/forward"]
    report.print0(f"    loss, vocab-parallel:  {vp[0]} all-reduces of (b*s,) {vp[1]:>8} B | "
                  f"formula 3 x 2(t-1)/t*b*s*4 = {formula['vocab-parallel/forward']:.0f} B")
    times = f", {ga[1] / vp[1]:.1f}x the bytes" if vp[1] else ""
    report.print0(f"    loss, gathered logits: {ga[0]} all-gather of (b, s, V) {ga[1]:>6} B | "
                  f"formula (t-1)/t*b*s*V*4 = {formula['gathered/forward']:.0f} B (loss "
                  f"{gathered['loss']:.6f}{times})")
    report.print0(f"    backward, both: f's all-reduce of (b, s, h), the hidden states' gradient: "
                  f"{measured['vocab-parallel/backward'][1]} B and "
                  f"{measured['gathered/backward'][1]} B | formula 2(t-1)/t*b*s*h*4 = "
                  f"{formula['backward']:.0f} B")
    return {"one_process_loss": ref[0].item(), "wrong": wrong, "right": right,
            "gathered": gathered, "measured": {k: {"calls": c, "sent_bytes": b}
                                               for k, (c, b) in measured.items()},
            "formula_bytes": formula}


# ==================================================================================================
# 3. Selective activation recomputation


class Layer(Block):
    """The course's GPT block (dtcourse.models.Block: the same submodules), with attention's core
    written out as the paper counts it, scores = q k^T / sqrt(d) + causal mask, softmax, @ v,
    and a choice of what to recompute in backward:
      none       every activation backward needs is kept
      full       only the layer's input is kept; backward runs the layer's forward again (up to
                 the last tensor it needs: torch's early stop)
      selective  the core's inputs q, k, v are kept; backward recomputes the scores and softmax
                 (b*heads*s*s numbers), cheap in FLOPs next to the linear layers."""

    def __init__(self, dim: int, heads: int, seq_len: int, recompute: str):
        super().__init__(dim, heads)
        self.recompute = recompute
        # A buffer (not an activation): added, so nothing is saved for it.
        self.register_buffer("causal", torch.full((seq_len, seq_len), float("-inf")).triu(1),
                             persistent=False)

    def core(self, q, k, v):  # (B, heads, T, d) each -> (B, heads, T, d)
        scores = q @ k.transpose(-2, -1) * self.attn.head_dim ** -0.5 + self.causal
        return torch.softmax(scores, dim=-1) @ v    # keeps the softmax: (B, heads, T, T)

    def attention(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.attn.head_dim).transpose(1, 2)
                   for m in (self.attn.q, self.attn.k, self.attn.v))
        if self.recompute == "selective":
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.attn.proj(y.transpose(1, 2).reshape(B, T, -1))

    def layer(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x):
        if self.recompute == "full":
            return checkpoint(self.layer, x, use_reentrant=False)
        return self.layer(x)


MODES = ("none", "full", "full, no early stop", "selective")


def recompute_run(args, mode: str, device) -> dict:
    """Forward and backward of `layers` layers in one mode: bytes saved for backward (measured
    by saved_tensors_hooks, each storage counted once, parameters and buffers left out), FLOPs
    of forward and of the whole step (FlopCounterMode: matrix multiplications), gradients."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(args.seed)  # the same weights in every mode
    layers = nn.Sequential(*(Layer(args.dim, args.heads, args.seq_len, mode.split(",")[0])
                             for _ in range(args.layers))).to(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch_size, args.seq_len, args.dim, generator=g).to(device)
    grad_out = torch.randn(x.shape, generator=g).to(device)
    x.requires_grad_()

    state = {t.untyped_storage().data_ptr() for t in [*layers.parameters(), *layers.buffers()]}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            kept[storage.data_ptr()] = storage.nbytes()  # a storage saved twice counts once
        return t

    # torch's checkpoint stops recomputing once backward has what it needs (early stop, on by
    # default): the last matmul of a recomputed region, whose output nothing saved, is skipped.
    with FlopCounterMode(display=False) as flops, set_checkpoint_early_stop(mode != MODES[2]):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layers(x)
        forward_flops = flops.get_total_flops()
        out.backward(grad_out)  # no loss op: nothing else is saved
    grads = {"input": x.grad} | {n: p.grad for n, p in layers.named_parameters()}
    return {"saved_bytes": sum(kept.values()), "forward_flops": forward_flops,
            "step_flops": flops.get_total_flops(), "grads": grads}


def recompute_formulas(args) -> dict:
    """Per layer, fp32 (4 bytes), no dropout; b, s, h, a = batch, sequence, width, heads.
    Kept for backward, in numbers of s*b*h: the input of ln1 (1), of q/k/v (ln1's output, 1), q
    and k (2), v (1), the input of proj (1), of ln2 (1), of fc1 (1), of GELU (4), of fc2 (4): 16;
    plus the softmax output a*s*s*b, plus LayerNorm's mean and 1/std per position (2 x 2 x s*b).
    The paper (16-bit, dropout): sbh(34 + 5as/h) bytes = the same 16 sbh at 2 bytes, 2 sbh of
    dropout masks, and 5as^2b = softmax output (2) + its dropout mask (1) + dropout output (2).
    Full recomputation keeps each layer's input, selective the core's inputs q, k, v instead of
    the softmax output (both already in the 16 sbh).
    Forward FLOPs: q, k, v, proj 4 x 2sbh^2, fc1 and fc2 2 x 8sbh^2, q k^T and softmax @ v
    2 x 2bs^2h: F = 24bsh^2 + 4bs^2h; backward 2F. Recomputing a layer adds F, less fc2's
    8bsh^2 with early stop; recomputing the core adds q k^T's 2bs^2h (softmax @ v is skipped)."""
    b, s, h, a, L, e = args.batch_size, args.seq_len, args.dim, args.heads, args.layers, 4
    linear = 16 * s * b * h + 4 * s * b
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    extra = {"none": 0, "full": fwd - 8 * b * s * h * h, MODES[2]: fwd,
             "selective": 2 * b * s * s * h}
    return {
        "saved_bytes": {"none": L * e * (linear + a * s * s * b), "full": L * e * s * b * h,
                        MODES[2]: L * e * s * b * h, "selective": L * e * linear},
        "step_flops": {mode: L * (3 * fwd + extra[mode]) for mode in MODES},
        "forward_flops": L * fwd,
        "paper_16bit_per_layer": s * b * h * (34 + 5 * a * s / h),
    }


def recompute_demo(args, d, tensors: dict) -> dict | None:
    """Rank 0 measures (one process's computation: nothing here is split); each mode's
    gradients go into `tensors`."""
    if not d.is_main:
        return None
    runs = {mode: recompute_run(args, mode, d.device) for mode in MODES}
    formula = recompute_formulas(args)
    base = runs["none"]
    same = {mode: all(torch.equal(g, base["grads"][n]) for n, g in r["grads"].items())
            for mode, r in runs.items()}
    for mode, r in runs.items():
        tensors.update({f"recompute/{mode}/{n}": g for n, g in r["grads"].items()})
    b, s, h, a = args.batch_size, args.seq_len, args.dim, args.heads
    print(f"3. Activation recomputation (no bug: memory for FLOPs, one process) | {args.layers} "
          f"layers, b {b}, s {s}, h {h}, {a} heads, fp32, no dropout")
    print(f"  {'recompute':<20} {'saved for backward':>19} {'formula':>10} {'of none':>8} | "
          f"{'FLOPs fwd+bwd':>13} {'formula':>11} {'recomputed':>10} | gradients = none")
    for mode, r in runs.items():
        extra = (r["step_flops"] - base["step_flops"]) / base["forward_flops"]
        print(f"  {mode:<20} {r['saved_bytes']:>17} B {formula['saved_bytes'][mode]:>8} B "
              f"{r['saved_bytes'] / base['saved_bytes']:>8.3f} | {r['step_flops']:>13} "
              f"{formula['step_flops'][mode]:>11} {extra:>+9.3f}F | "
              f"{'bitwise' if same[mode] else 'NOT bitwise'}")
    saves = {mode: base["saved_bytes"] - runs[mode]["saved_bytes"] for mode in MODES}
    print(f"  selective saves {saves['selective']} B, full {saves['full']} B: "
          f"{saves['selective'] / saves['full']:.3f} of full's saving at this as/h = "
          f"{a * s / h:g}")
    print(f"  F = one forward, {base['forward_flops']} FLOPs = formula L(24bsh^2 + 4bs^2h) = "
          f"{formula['forward_flops']}")
    print(f"  per layer: the paper's sbh(34 + 5as/h) (16-bit, dropout) = "
          f"{formula['paper_16bit_per_layer']:.0f} B; this model's 4(16sbh + as^2b + 4sb) (fp32, "
          f"no dropout) = {formula['saved_bytes']['none'] // args.layers} B")
    return {mode: {k: v for k, v in r.items() if k != "grads"} | {"grads_equal_none": same[mode]}
            for mode, r in runs.items()} | {"formula": formula}


# ==================================================================================================
# Arguments and launch


def run(args, d) -> None:
    results = {"script": SCRIPT, "world_size": d.world_size, "device": str(d.device),
               "torch_version": torch.__version__}
    tensors = {}  # name -> tensor, the values behind the printed errors
    if args.bug in ("clip", "all"):
        results["clip"] = clip_demo(args, d, tensors)
    if args.bug in ("vocab-ce", "all"):
        results["vocab_ce"] = vocab_demo(args, d, tensors)
    if args.bug in ("recompute", "all"):
        results["recompute"] = recompute_demo(args, d, tensors)
    if d.is_main and args.json_out:
        report.write_json(args.json_out, results)
        report.save_state_dict(args.json_out.with_suffix(".pt"), tensors)
    dist.barrier()  # the files are complete before any rank exits


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--bug", choices=["clip", "vocab-ce", "recompute", "all"], default="all",
                   help="which to show: the clipping norm, vocab-parallel cross-entropy, "
                        "activation recomputation (not a bug: a memory technique), or all three")
    p.add_argument("--max-norm", type=float, default=0.5, help="clip_grad_norm_'s max_norm")
    p.add_argument("--batch-size", type=int, default=4,
                   help="sequences of the step, the one process's batch (FSDP ranks take equal "
                        "shares; TP and PP ranks all see it)")
    cli.add_run_args(p)
    p.add_argument("--json-out", type=Path,
                   help="rank 0 writes the results as JSON here, and beside it (the same path "
                        "with the suffix .pt, torch.save) the tensors they were computed from")
    cli.add_gpt_args(p, layers=2, dim=64, heads=8, seq_len=64, vocab=256)
    args = p.parse_args(argv)
    cli.check_positive(args, "max_norm", "batch_size", "timeout_s")
    cli.check_gpt_args(args)
    # Before any process group, so that every rank fails alike: the degrees of the layouts shown
    # at this world size must split the model and the batch evenly.
    world = launch.launched().world_size
    shown = layouts(world)
    for flag, value, degree, why in (
            ("heads", args.heads, max(tp for _, _, tp in shown), "tp: each rank owns whole heads"),
            ("layers", args.layers, max(pp for pp, _, _ in shown), "pp: stages get equal layers"),
            ("batch-size", args.batch_size, max(dp for _, dp, _ in shown),
             "fsdp: ranks get equal rows"),
            ("vocab", args.vocab, world, "vocab-parallel cross-entropy over all ranks: equal "
                                         "slices")):
        if value % degree:
            cli.fail(f"--{flag} {value} is not divisible by {degree} ({why}; world size {world})")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
