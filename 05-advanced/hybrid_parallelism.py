"""Hybrid parallelism: data x tensor x pipeline parallel on one named device mesh, the layout that
trains 70B-class models (Megatron-LM, torchtitan).

The world is a 3-D grid of ranks, mesh dims ("pp", "dp", "tp"), TP innermost so that a TP group
is consecutive ranks, i.e. GPUs of one node:
    tp: each block's weights split Megatron-style (DTensor ColwiseParallel / RowwiseParallel;
        tensor_parallel.py builds the same by hand) - activations all-reduced in every layer;
    dp: FSDP2 (`fully_shard`) shards what each TP rank holds over the data-parallel ranks, which
        take different rows of the global batch - parameters all-gathered, gradients
        reduce-scattered, once per step;
    pp: the blocks split into consecutive stages (torch.distributed.pipelining, 1F1B schedule over
        micro-batches) - activations sent point-to-point between neighbouring stages.
dp x tp x pp must equal the world size.

Launch (from the repository root):
    python 05-advanced/hybrid_parallelism.py                                     # 1 process
    torchrun --nproc_per_node=4 05-advanced/hybrid_parallelism.py --dp 2 --tp 2  # FSDP x TP
    torchrun --nproc_per_node=4 05-advanced/hybrid_parallelism.py --tp 2 --pp 2  # TP x PP
    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
        05-advanced/hybrid_parallelism.py --tp 8 --pp 2 --device cuda  # 64 GPUs: dp 4, tp 8, pp 2

Expected output (torchrun --nproc_per_node=4 ... --tp 2 --pp 2, 2-core AMD EPYC CPU (shared),
torch 2.14.1, gloo):
    mesh pp 2 x dp 1 x tp 2 = 4 ranks (tp innermost) | device cpu | global batch 8 (8 per ...
      tp groups [[0, 1], [2, 3]]: consecutive ranks, inside one node: keep TP on NVLink, ...
      dp degree 1: no dp traffic
      pp groups [[0, 2], [1, 3]]: point-to-point activations at stage boundaries only, ...
    step    1/10 | loss 4.2351
    step    5/10 | loss 4.1183
    step   10/10 | loss 4.1156
    traffic of one step, counted on step 2 (fp32, 4 bytes/element; bytes rank 0 sends, ...):
      tp: all_reduce                   131072 B | formula L/p=1 x 8*b*s*h*(t-1)/t*4 = 131072 B
      dp: -                                 0 B | formula 2*(d-1)/d*4*P (FSDP: ...) = 0 B
      pp: send                          32768 B | formula b*s*h*4 per boundary and ... = 32768 B
    done: 10 steps, median 317.7 ms/step
The losses are those of tensor_parallel.py's run (and of one process): the same model and data.
"""

import argparse
import contextlib
import gc
import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# FSDP2 warns when the root's output is a view (an in-place op on it would skip a hook; we do
# none), and DTensor when full_tensor() gathers a weight sharded over both dp and tp in two steps.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


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
    p.add_argument("--dp", type=int, default=-1,
                   help="data-parallel (FSDP) degree; -1: world size / (tp x pp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--microbatches", type=int, default=4,
                   help="micro-batches per step when --pp > 1 (1F1B needs at least pp)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per data-parallel rank per step (shared by its TP and PP peers)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("tp", "pp", "microbatches", "steps", "batch_size", "seq_len", "hidden", "heads",
                 "layers", "vocab", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")

    # Shapes, then degrees, checked before any process group exists (the world size comes from
    # the launcher's environment).
    if args.hidden % args.heads:
        fail(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % args.tp:
        fail(f"--heads {args.heads} is not divisible by --tp {args.tp}: each TP rank must own "
             f"whole attention heads")
    if args.layers % args.pp:
        fail(f"--layers {args.layers} is not divisible by --pp {args.pp}: stages get equal blocks")
    if args.pp > 1 and (args.batch_size % args.microbatches or args.microbatches < args.pp):
        fail(f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} and "
             f"be at least --pp {args.pp} (the 1F1B schedule)")
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", "1")))
    if args.dp == -1:
        if world % (args.tp * args.pp):
            fail(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}")
        args.dp = world // (args.tp * args.pp)
    if args.dp < 1 or args.dp * args.tp * args.pp != world:
        fail(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = "
             f"{args.dp * args.tp * args.pp}, but the world size is {world}")
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
# The model: tensor_parallel.py's small GPT (same classes, same state_dict keys), with the blocks in
# a ModuleDict so that a pipeline stage can drop the blocks it does not own and keep the names.


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        # K has no bias: softmax ignores it, its gradient is exactly zero (tensor_parallel.py).
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=name != "k") for name in "qkv")
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):  # x: (B, T, H) -> (B, T, H); heads/tp local heads under TP
        B, T = x.shape[0], x.shape[1]
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
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

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.emb = Embedding(vocab, hidden, seq_len)
        self.blocks = nn.ModuleDict({str(i): Block(hidden, heads) for i in range(layers)})
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        # A pipeline stage holds only some of these: token ids in on the first stage, hidden
        # states (B, T, H) between stages, logits out of the last one.
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def global_batch(seed: int, step: int, size: int, seq_len: int, vocab: int):
    """tensor_parallel.py's deterministic batch: arithmetic sequences modulo vocab (inputs and
    next-token targets, (size, seq_len) each), a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------------------------
# The three dimensions, applied in this order: cut the stage (pp), split the weights (tp), shard
# what is left over the data-parallel ranks (dp).


def keep_stage(model: GPT, stage: int, stages: int) -> GPT:
    """Stage s keeps blocks [s*L/pp, (s+1)*L/pp); the first keeps the embedding, the last the
    final norm and the head. Names are unchanged, so a stage's state_dict is a slice of the
    model's."""
    per_stage = len(model.blocks) // stages
    for name in list(model.blocks):
        if not stage * per_stage <= int(name) < (stage + 1) * per_stage:
            del model.blocks[name]
    if stage != 0:
        model.emb = None
    if stage != stages - 1:
        model.ln_f = model.head = None
    return model


def apply_tp(model: GPT, tp_mesh) -> None:
    """Megatron's split of every block over the tp mesh dim (see tensor_parallel.py, where the
    same is written by hand): Q, K, V and fc1 by columns, proj and fc2 by rows; one all-reduce
    after attention and one after the MLP, forward and backward."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, parallelize_module)
    plan = {
        "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                   desired_input_layouts=(Replicate(),)),  # one f for q, k, v
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
    }
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: GPT, dp_mesh, reshard_after_forward: bool) -> None:
    """FSDP2 over the dp mesh dim: each block is one unit (its parameters all-gathered just before
    it runs, its gradients reduce-scattered as soon as they are ready), the root holds the rest.
    A TP-split weight becomes a 2-D DTensor, sharded over dp and over tp."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def build_schedule(stage_model: GPT, stage: int, stages: int, pp_mesh, device, microbatches: int):
    """A 1F1B schedule over this rank's stage. The loss of a micro-batch is divided by their
    number, so the accumulated gradient is that of the mean loss over the whole batch (newer
    torch can do that division itself, `scale_grads`; we turn it off to be explicit)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / microbatches

    pipe_stage = PipelineStage(stage_model, stage, stages, device, group=pp_mesh.get_group())
    extra = {"scale_grads": False} if "scale_grads" in inspect.signature(
        Schedule1F1B.__init__).parameters else {}
    return Schedule1F1B(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn, **extra)


# --------------------------------------------------------------------------------------------------
# Where the traffic goes: tensor_parallel.py's CommCounter (explained there), which also counts the
# pipeline's point-to-point sends; each record names its group, hence its mesh dim.


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


def layout_advice(mesh, args) -> list:
    """Which ranks form each group, and where each kind of group belongs on real hardware."""
    grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    groups = {"tp": grid.reshape(-1, args.tp).tolist(),
              "dp": grid.permute(0, 2, 1).reshape(-1, args.dp).tolist(),
              "pp": grid.permute(1, 2, 0).reshape(-1, args.pp).tolist()}
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size()))
    where = {
        "tp": "consecutive ranks, inside one node: keep TP on NVLink, it all-reduces activations "
              "in every layer" if per_node % args.tp == 0 else
              f"WARNING: tp {args.tp} does not fit in the {per_node} ranks of a node, so TP's "
              f"per-layer all-reduces would cross the network",
        "dp": "FSDP all-gathers weights and reduce-scatters gradients once per step, overlapped "
              "with compute: fine across nodes",
        "pp": "point-to-point activations at stage boundaries only, the least traffic: fine "
              "across nodes, on the slowest links",
    }
    return [f"  {d} groups {groups[d]}: {where[d]}" if getattr(args, d) > 1 else
            f"  {d} degree 1: no {d} traffic" for d in ("tp", "dp", "pp")]


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


def train(args, rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    # rank = (pp_index * dp + dp_index) * tp + tp_index: tp varies fastest.
    mesh = init_device_mesh(device.type, (args.pp, args.dp, args.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in ("pp", "dp", "tp"))
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq_len).to(device)
    keep_stage(model, pp_rank, args.pp)
    apply_tp(model, mesh["tp"])
    tp_local_shapes = [tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                       for p in model.parameters()]  # what FSDP will shard over dp
    # With micro-batches, resharding after each forward would all-gather again for every one.
    apply_fsdp(model, mesh["dp"], reshard_after_forward=args.pp == 1)
    schedule = build_schedule(model, pp_rank, args.pp, mesh["pp"], device, args.microbatches) \
        if args.pp > 1 else None
    # foreach=False: parameters live on different meshes (2-D dp x tp, 1-D dp).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    global_bs = args.dp * args.batch_size
    if rank == 0:
        print(f"mesh pp {args.pp} x dp {args.dp} x tp {args.tp} = {world} ranks (tp innermost) | "
              f"device {device} | global batch {global_bs} ({args.batch_size} per dp rank"
              f"{f', {args.microbatches} micro-batches' if args.pp > 1 else ''}) | {args.layers} "
              f"layers, {args.layers // args.pp} per stage", flush=True)
        print("\n".join(layout_advice(mesh, args)), flush=True)

    counter = CommCounter()
    losses, step_s = [], []
    for step in range(args.steps):
        # Data-parallel rank r takes rows r*B..(r+1)*B-1; its TP and PP peers take the same rows.
        x, y = global_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        rows = slice(dp_rank * args.batch_size, (dp_rank + 1) * args.batch_size)
        x, y = x[rows].to(device), y[rows].to(device)
        t0 = time.perf_counter()
        # Step 2 runs under the counter (step 1 also carries the pipeline's one-time exchange of
        # shapes); the steps after it are timed.
        with counter if step == 1 else contextlib.nullcontext():
            if schedule is None:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
            else:
                mb_losses = []
                schedule.step(*([x] if first else []),
                              **({"target": y, "losses": mb_losses} if last else {}))
                loss = torch.stack(mb_losses).sum() if last else torch.zeros((), device=device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > 1:
            step_s.append(time.perf_counter() - t0)
        # Mean loss over the global batch: the last stage of each data-parallel rank holds its
        # rows' mean (tp times, once per TP rank); everyone else adds zero.
        report = loss.detach().float().reshape(1) if last else torch.zeros(1, device=device)
        dist.all_reduce(report)
        losses.append(report.item() / (args.dp * args.tp))
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            print(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}", flush=True)

    state = export_state(model, rank, dp_rank, tp_rank, world)
    dim_of_group = {mesh.get_group(d).group_name: d for d in ("pp", "dp", "tp")}
    comm_bytes = {}  # "dim/kind" -> bytes this rank sent in the counted step
    for r in counter.records:
        key = f"{dim_of_group.get(r['group'], 'world')}/{r['kind']}"
        comm_bytes[key] = comm_bytes.get(key, 0) + r["bytes"]
    formula = traffic_formula(args, tp_local_shapes, first, last)
    report_results(args, rank, world, device, model, optimizer, losses, step_s, comm_bytes,
                   formula, state)


def traffic_formula(args, tp_local_shapes, first: bool, last: bool) -> dict:
    """What this rank should send per step on each mesh dim, in bytes (fp32, 4 per element).
    b = this data-parallel rank's batch; t, d, p = the tp, dp, pp degrees; P = the parameters
    this rank holds after the TP split, before FSDP shards them (dim 0 padded to a multiple of
    d, as FSDP pads it)."""
    b, s, h, e = args.batch_size, args.seq_len, args.hidden, 4
    t, d = args.tp, args.dp
    P = sum(-(-shape[0] // d) * d * _numel(shape[1:]) for shape in tp_local_shapes)
    # FSDP all-gathers weights before forward and again before backward (they were freed after
    # forward), and reduce-scatters gradients; with a pipeline it keeps them between the
    # micro-batches instead (reshard_after_forward=False): one all-gather.
    passes = 3 if args.pp == 1 else 2
    # The pipeline sends activations (b, s, h) forward and their gradients backward, per stage
    # boundary: the first stage sends forward only, the last backward only, the others both.
    boundaries = 0 if args.pp == 1 else (not last) + (not first)
    return {"tp": args.layers // args.pp * 8 * b * s * h * (t - 1) / t * e,
            "dp": passes * (d - 1) / d * P * e,
            "pp": boundaries * b * s * h * e}


def export_state(model: GPT, rank: int, dp_rank: int, tp_rank: int, world: int):
    """The dense state_dict on rank 0: full_tensor() all-gathers each DTensor over its stage's
    dp x tp ranks; then one rank per stage sends its stage's dict to rank 0 (as pickled objects:
    fine for a lesson-sized model, a real one would write sharded checkpoints instead)."""
    from torch.distributed.tensor import DTensor
    stage_sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in model.state_dict().items()}
    parts = [None] * world
    dist.all_gather_object(parts, stage_sd if dp_rank == 0 and tp_rank == 0 else None)
    return {k: v for part in parts if part for k, v in part.items()} if rank == 0 else None


def local_bytes(tensors) -> int:
    """Bytes this rank holds (a DTensor counts its local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
               for t in tensors if t is not None)


def report_results(args, rank, world, device, model, optimizer, losses, step_s, comm_bytes,
                   formula, state):
    per_rank_local = {
        "param_bytes": local_bytes(model.parameters()),
        "grad_bytes": local_bytes(p.grad for p in model.parameters()),
        "optim_bytes": local_bytes(v for s in optimizer.state.values() for v in s.values()
                                   if torch.is_tensor(v) and v.dim() > 0),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "comm_bytes": comm_bytes, "comm_formula": formula,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, per_rank_local)
    if rank == 0:
        print("traffic of one step, counted on step 2 (fp32, 4 bytes/element; bytes rank 0 "
              "sends, ring algorithms):", flush=True)
        what = {"tp": f"L/p={args.layers // args.pp} x 8*b*s*h*(t-1)/t*4",
                "dp": f"{3 if args.pp == 1 else 2}*(d-1)/d*4*P (FSDP: all-gather"
                      f"{' x2' if args.pp == 1 else ''}, reduce-scatter)",
                "pp": "b*s*h*4 per boundary and direction"}
        for dim in ("tp", "dp", "pp"):
            mine = {k.split("/")[1]: v for k, v in comm_bytes.items() if k.startswith(dim + "/")}
            print(f"  {dim}: {', '.join(sorted(mine)) or '-':<26} {sum(mine.values()):>8} B | "
                  f"formula {what[dim]} = {formula[dim]:.0f} B", flush=True)
        median_ms = 1000 * statistics.median(step_s) if step_s else float("nan")
        global_bs = args.dp * args.batch_size
        print(f"done: {args.steps} steps, median {median_ms:.1f} ms/step", flush=True)
        if args.export:
            args.export.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.export.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, args.export)
        if args.metrics_out:
            metrics = {
                "script": "05-advanced/hybrid_parallelism.py",
                "strategy": f"pp{args.pp}-dp{args.dp}-tp{args.tp}",
                "world_size": world, "dp": args.dp, "tp": args.tp, "pp": args.pp,
                "microbatches": args.microbatches if args.pp > 1 else 1,
                "steps": args.steps, "global_batch": global_bs, "losses": losses,
                "step_ms": [1000 * t for t in step_s], "median_step_ms": median_ms,
                "samples_per_s": global_bs / statistics.median(step_s) if step_s else None,
                "tokens_per_s": global_bs * args.seq_len / statistics.median(step_s)
                if step_s else None,
                "device": str(device), "torch_version": torch.__version__, "per_rank": per_rank,
            }
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps(metrics, indent=1))
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()
