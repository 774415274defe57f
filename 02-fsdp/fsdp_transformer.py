"""A GPT-style transformer trained fully sharded with FSDP2 (`fully_shard`): sharding strategies,
bf16 mixed precision, activation checkpointing, CPU offload, and plain DDP on the same model.

Launch (from the repository root):
    python 02-fsdp/fsdp_transformer.py                                     # 1 process
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py                # full sharding
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy grad-op
    torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py --strategy hybrid --shard-size 2
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy ddp  # the same model, DDP
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy full grad-op no-shard ddp
        # ^ one after the other (fresh model each), then a table side by side
    torchrun --nproc_per_node=8 02-fsdp/fsdp_transformer.py --device cuda --mixed-precision bf16 \
        --layers 24 --dim 1024 --heads 16 --seq-len 1024 --vocab 50304 --batch-size 8

Expected output (torchrun --nproc_per_node=2, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    GPT: 2 layers, dim 64, 4 heads, seq 32, vocab 256: 134,528 parameters (P)
    strategy full = FSDP1 FULL_SHARD: mesh (2,) ('shard',), reshard_after_forward=True | world 2 |
        device cpu | fp32 | global batch 16 sequences (2 ranks x 8 x accum 1) = 512 tokens
    step    1/12 | loss 5.5675 | grad norm 0.962
    step    4/12 | loss 5.0002 | grad norm 1.811
    step    8/12 | loss 4.3546 | grad norm 1.292
    step   12/12 | loss 3.7967 | grad norm 1.071
    one step's collectives (rank 0): all-gather 6 calls 1.08 MB float32 | reduce-scatter 3 calls
        0.54 MB float32
    done: 11 timed steps, 3,599 tokens/s | rank 0 holds params 269,056 B, grads 269,056 B,
        optimizer 538,220 B (16P/2 = 1,076,224 B + padding + Adam step counters)

What happens in one step (fully_shard on each block and at the root):
    forward:  before each block, all-gather its parameter shards into full tensors (FSDP unit =
              one block); after the block, free them again (reshard_after_forward=True);
    backward: all-gather each block's parameters again (in reverse order), compute its gradients,
              then reduce-scatter them: every rank receives the average of its own shard only;
    step:     the optimizer updates the local shards: Adam state exists for 1/N of the model.
"""

import argparse
import contextlib
import gc
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

try:  # public since torch 2.6; the same objects lived in torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                    fully_shard)

# --strategy -> (FSDP1 ShardingStrategy it reproduces, reshard_after_forward, what each rank keeps)
STRATEGIES = {
    "full": ("FULL_SHARD", True, "params, grads and optimizer state sharded over all ranks"),
    "grad-op": ("SHARD_GRAD_OP", False, "as full, but params stay gathered from forward to "
                                        "backward (ZeRO-2-like: fewer all-gathers, more memory)"),
    "no-shard": ("NO_SHARD", True, "a 2-D mesh (world, 1): shard groups of one rank, so every "
                                   "rank keeps everything and gradients are all-reduced (DDP)"),
    "hybrid": ("HYBRID_SHARD", True, "a 2-D mesh (world/S, S): shard inside groups of S ranks "
                                     "(a node), replicate across groups (all-reduce)"),
    "ddp": ("-", None, "torch DistributedDataParallel on the same model, for comparison"),
}
# Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's data sheets; the first name that matches
# torch.cuda.get_device_name() wins. Anything else: pass --peak-tflops.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]


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
    p.add_argument("--strategy", nargs="+", choices=list(STRATEGIES), default=["full"],
                   help="one or more: several train one after the other in the same launch "
                        "(fresh model each) and end with a comparison table")
    p.add_argument("--shard-size", type=int, default=None,
                   help="hybrid: ranks per shard group (default: ranks per node, LOCAL_WORLD_SIZE)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient L2 norm")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: compute in bf16 (FSDP: MixedPrecisionPolicy, bf16 params, fp32 "
                        "reduce; DDP: autocast); master weights and Adam stay fp32")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input; recompute the block in backward")
    p.add_argument("--cpu-offload", action="store_true",
                   help="FSDP: keep sharded params, grads and Adam state in CPU memory")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: bf16 peaks of known GPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path,
                   help="rank 0 writes the plain model state_dict here (several strategies: "
                        "one file each, the strategy before the suffix: w.pt -> w.ddp.pt)")
    args = p.parse_args(argv)
    for name in ("layers", "dim", "heads", "seq_len", "vocab", "steps", "batch_size",
                 "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        fail(f"--heads {args.heads} must divide --dim {args.dim}: each head takes dim/heads "
             f"features ({args.dim}/{args.heads} is not a whole number)")
    if min(args.lr, args.timeout_s, args.grad_clip) <= 0:
        fail(f"--lr, --grad-clip and --timeout-s must be positive, got {args.lr}, "
             f"{args.grad_clip} and {args.timeout_s}")
    if "ddp" in args.strategy and args.cpu_offload:
        fail("--cpu-offload is an FSDP feature: use it with --strategy full, grad-op, no-shard "
             "or hybrid, not ddp")
    if args.shard_size is not None and "hybrid" not in args.strategy:
        fail(f"--shard-size applies to --strategy hybrid only, not {' '.join(args.strategy)}")
    if len(set(args.strategy)) != len(args.strategy):
        fail(f"--strategy lists a strategy twice: {' '.join(args.strategy)}")
    return args


# --------------------------------------------------------------------------------------------------
# Set-up: the same lines run under python, torchrun and srun (see 01-ddp-basics/ddp_training.py)


def init_distributed(device_arg: str, timeout_s: float):
    """Return (rank, world_size, device) and start the process group (gloo on CPU, NCCL on CUDA)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0])
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
    else:  # plain `python script.py`: a group of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


# --------------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    """Pre-norm decoder block: x + attention(ln1(x)), then x + MLP(ln2(x)). One FSDP unit."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No bias on q, k, v (as in GPT-NeoX, LLaMA): a key bias shifts every score of a query
        # equally, softmax ignores it, so its true gradient is 0 and the float one is rounding
        # noise, which Adam would turn into full-size steps that differ between world sizes.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):  # x: (B, T, D)
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)  # 3 x (B, T, D)
        # (B, T, D) -> (B, H, T, D/H): every head attends over the sequence on its own features
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `layers` blocks, final norm, LM head: (B, T) ids -> logits."""

    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.activation_checkpointing = False

    def forward(self, idx):  # idx: (B, T) token ids
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, D)
        for block in self.blocks:
            if self.activation_checkpointing:
                # Saves only the block's input; backward reruns the block's forward (FSDP
                # all-gathers its parameters for that, as for the backward itself).
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def shard_rows(rows: int, parts: int, index: int) -> slice:
    """Rows of dim 0 that shard `index` of `parts` holds: torch.chunk's split, which FSDP2 and
    DTensor use. Chunks of ceil(rows/parts) rows; the last non-empty one may be shorter and later
    ones empty. FSDP pads every shard to ceil(rows/parts) rows for its all-gather buffers."""
    size = math.ceil(rows / parts)
    start = min(index * size, rows)
    return slice(start, min(start + size, rows))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, layers: int) -> None:
    """GPT-2 initialisation, the same at every world size: each rank draws every *full* tensor
    from one seeded generator (in the same order) and copies the rows its shard holds."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            full = torch.zeros(p.shape)
        elif ".ln" in name or name.startswith("ln_f"):
            full = torch.ones(p.shape)
        else:  # residual projections scaled by 1/sqrt(2L), as in GPT-2
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) \
                else 0.02
            full = torch.randn(p.shape, generator=g) * std
        local = p
        if isinstance(p, DTensor):  # FSDP2 parameter: keep only this rank's rows
            local = p.to_local()
            for mesh_dim, placement in enumerate(p.placements):
                if placement.is_shard():
                    full = full[shard_rows(full.shape[0], p.device_mesh.size(mesh_dim),
                                           p.device_mesh.get_local_rank(mesh_dim))]
        local.copy_(full)


def global_batch(seed: int, step: int, size: int, seq_len: int, vocab: int):
    """The global batch of step `step`: `size` sequences, a pure function of (seed, step).

    A toy language: a fixed random permutation of the vocabulary (drawn from the seed) gives
    each token's successor, and every sequence starts at a random token. Predicting the next
    token is learnable in a few dozen steps. Rank r keeps rows r*B..(r+1)*B-1: D ranks with
    batch B see exactly what one process with batch D*B sees.
    """
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 12345))
    g = torch.Generator().manual_seed(seed * 100003 + step)
    seq = [torch.randint(vocab, (size,), generator=g)]
    for _ in range(seq_len):
        seq.append(successor[seq[-1]])
    seq = torch.stack(seq, dim=1)  # (size, T + 1)
    return seq[:, :-1], seq[:, 1:]  # inputs and next-token targets, (size, T) each


# --------------------------------------------------------------------------------------------------
# Communication: record the collectives of one step (what FSDP sends, in which dtype)


class CollectiveLog(TorchDispatchMode):
    """While active, records every c10d collective that passes the dispatcher: FSDP2's all-gathers
    and reduce-scatters, HSDP's all-reduce, and DDP's all-reduce (through its Python comm hook).
    bytes = the full tensor's size (the all-gather output, the reduce-scatter input), as
    nccl-tests counts it; a ring moves (n-1)/n of that per rank, 2(n-1)/n for an all-reduce."""

    KINDS = (("allgather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
             ("allreduce", "all-reduce"), ("broadcast", "broadcast"))

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = next((k for key, k in self.KINDS if key in func.__name__), None)
        if getattr(func, "namespace", "") == "c10d" and kind:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)]
            biggest = max(tensors, key=lambda t: t.numel() * t.element_size())
            self.calls.append({"op": kind, "dtype": str(biggest.dtype).replace("torch.", ""),
                               "bytes": biggest.numel() * biggest.element_size(),
                               "group_size": self._group_size(args)})
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _group_size(args):
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(a).size()
                except (RuntimeError, AttributeError):  # a ReduceOp, or an older torch
                    continue
        return None

    def summary(self) -> dict:
        out = {}
        for c in self.calls:
            s = out.setdefault(c["op"], {"calls": 0, "bytes": 0, "dtypes": [], "group_sizes": []})
            s["calls"] += 1
            s["bytes"] += c["bytes"]
            for key, value in (("dtypes", c["dtype"]), ("group_sizes", c["group_size"])):
                if value not in s[key]:
                    s[key].append(value)
        return out


# --------------------------------------------------------------------------------------------------
# Wrapping


def build_mesh(strategy: str, shard_size: int, world: int, device):
    """The device mesh of the strategy; None for DDP."""
    if strategy == "ddp":
        return None
    if strategy in ("full", "grad-op"):
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    shard = 1 if strategy == "no-shard" else shard_size
    return init_device_mesh(device.type, (world // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


def shard_model(model: GPT, strategy: str, mesh, args, device):
    """fully_shard every block, then the root (embeddings, final norm, head become its unit).

    Why per block: FSDP gathers one unit at a time, so peak memory holds the shards plus ~one
    block's full parameters; wrapping only the root would gather the whole model at once.
    Children first: a parameter belongs to the innermost fully_shard'ed module that owns it.
    """
    kw = {"mesh": mesh, "reshard_after_forward": STRATEGIES[strategy][1]}
    if args.mixed_precision == "bf16":
        # all-gather and compute in bf16; gradients reduced (and kept) in fp32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if args.cpu_offload:
        # shards, grads and the optimizer step live in CPU memory; pinned memory needs CUDA
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def local_bytes(t) -> int:
    """Bytes this rank holds for t: the local shard of a DTensor (without FSDP's padding)."""
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        if "hybrid" in args.strategy:
            if args.shard_size is None:
                args.shard_size = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
            if args.shard_size < 1 or world % args.shard_size:
                fail(f"--strategy hybrid needs the world size ({world}) to be a multiple of the "
                     f"shard group size --shard-size ({args.shard_size}): the mesh is "
                     f"(replicas, shard) = (world / shard-size, shard-size)")
        results = [train(args, strategy, rank, world, device) for strategy in args.strategy]
        if rank == 0:
            write_results(args, results)
        dist.barrier()  # files are complete before any rank exits
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def train(args, strategy, rank, world, device):
    """Train a fresh model with one strategy; return (metrics, full state dict) on rank 0."""
    global_bs = world * args.batch_size * args.grad_accum  # every rank is data-parallel
    torch.manual_seed(args.seed)

    # Build on the meta device: shapes only, no memory. A model too big for one device never
    # exists in full anywhere; each rank allocates its shards after fully_shard.
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.layers, args.heads)
    model.activation_checkpointing = args.activation_checkpointing
    n_params = sum(p.numel() for p in model.parameters())
    mesh = build_mesh(strategy, args.shard_size, world, device)
    if mesh is not None:
        shard_model(model, strategy, mesh, args, device)
    # Materialise: allocate (sharded) storage, then fill it. With CPU offload the shards live
    # on the CPU and FSDP copies them to the GPU for each all-gather.
    model.to_empty(device="cpu" if args.cpu_offload else device)
    init_weights(model, args.seed, args.layers)
    if mesh is None:  # DDP: every rank holds the whole model; gradients all-reduced in buckets
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        # A Python comm hook (the default all-reduce, as a hook) so CollectiveLog sees it.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        model.register_comm_hook(None, allreduce_hook)
    else:  # what fully_shard did: every parameter is now a DTensor holding this rank's rows
        p = next(iter(model.parameters()))
        assert isinstance(p, DTensor) and p.placements[-1].is_shard(), p

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    autocast = strategy == "ddp" and args.mixed_precision == "bf16"

    if rank == 0:
        print(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq "
              f"{args.seq_len}, vocab {args.vocab}: {n_params:,} parameters (P)", flush=True)
        layout = "no sharding" if mesh is None else (
            f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, reshard_after_forward="
            f"{STRATEGIES[strategy][1]}")
        name = "torch DDP" if strategy == "ddp" else f"FSDP1 {STRATEGIES[strategy][0]}"
        print(f"strategy {strategy} = {name}: {layout} | world {world} "
              f"| device {device} | {args.mixed_precision}"
              f"{' + act. ckpt' * args.activation_checkpointing}"
              f"{' + cpu offload' * args.cpu_offload} | global batch {global_bs} sequences "
              f"({world} ranks x {args.batch_size} x accum {args.grad_accum}) = "
              f"{global_bs * args.seq_len} tokens", flush=True)

    losses, grad_norms, comms, t_start = [], [], None, None
    rows = slice(rank * args.batch_size * args.grad_accum,
                 (rank + 1) * args.batch_size * args.grad_accum)
    for step in range(args.steps):
        if step == 1:  # step 0 pays for lazy initialisation and warm-up: time the rest
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_start = time.perf_counter()
        x_all, y_all = global_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        x_local, y_local = x_all[rows].to(device), y_all[rows].to(device)

        # Record the collectives of the last step (a complete, steady-state step).
        log = CollectiveLog() if step == args.steps - 1 else contextlib.nullcontext()
        optimizer.zero_grad(set_to_none=True)  # here, so the grads still exist for the report
        step_loss = torch.zeros((), device=device)
        with log:
            for micro in range(args.grad_accum):
                last = micro == args.grad_accum - 1
                if mesh is not None:
                    # FSDP's no_sync(): keep unsharded grads, reduce-scatter on the last only
                    model.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext()
                else:
                    sync = contextlib.nullcontext() if last else model.no_sync()
                mb = slice(micro * args.batch_size, (micro + 1) * args.batch_size)
                with sync, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    logits = model(x_local[mb])  # (B, T, vocab)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y_local[mb].flatten())
                    (loss / args.grad_accum).backward()
                step_loss += loss.detach().float() / args.grad_accum
        if step == args.steps - 1:
            comms = log.summary()
        # The global gradient norm: on DTensor grads the local sums of squares are all-reduced
        # over the shard group, so every rank clips by the same factor as one process would.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        grad_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        optimizer.step()

        dist.all_reduce(step_loss)  # sum of the ranks' means -> mean over the global batch
        losses.append(step_loss.item() / world)
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            print(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                  f"{grad_norms[-1]:.3f}", flush=True)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timed = args.steps - 1
    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    tokens_per_s = timed * global_bs * args.seq_len / elapsed if timed else float("nan")

    # Model state this rank holds right after the last step (grads not yet zeroed).
    held = {
        "param_bytes": sum(local_bytes(p) for p in model.parameters()),
        "grad_bytes": sum(local_bytes(p.grad) for p in model.parameters()),
        # Adam: exp_avg + exp_avg_sq (sharded like the parameter) + `step`, a 4-byte scalar per
        # parameter tensor that every rank keeps whole.
        "optim_bytes": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                           if torch.is_tensor(v)),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, held)
    # Export: gather the full, unsharded state dict to rank 0's CPU (a collective: every rank).
    full_sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if args.export else None
    mfu = model_flops_utilization(args, n_params, tokens_per_s, world, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the next strategy measures its own peak
    if rank != 0:
        return None
    group = 1 if mesh is None else mesh.size(mesh.ndim - 1)  # ranks one model is sharded over
    print("one step's collectives (rank 0): " + (" | ".join(
        f"{op} {s['calls']} call{'s' * (s['calls'] != 1)} {s['bytes'] / 1e6:.2f} MB "
        f"{'/'.join(s['dtypes'])}"
        for op, s in comms.items()) or "none (a group of one rank skips them)"), flush=True)
    print(f"done: {timed} timed steps, {tokens_per_s:,.0f} tokens/s"
          f"{'' if mfu is None else f', MFU {mfu:.1%}'} | rank 0 holds params "
          f"{held['param_bytes']:,} B, grads {held['grad_bytes']:,} B, optimizer "
          f"{held['optim_bytes']:,} B (16P/{group} = {16 * n_params // group:,} B + padding + "
          f"Adam step counters)", flush=True)
    metrics = {
        "script": "02-fsdp/fsdp_transformer.py", "strategy": strategy,
        "fsdp1_name": STRATEGIES[strategy][0], "mesh": None if mesh is None else list(mesh.shape),
        "world_size": world, "steps": args.steps, "global_batch": global_bs,
        "grad_accum": args.grad_accum, "seq_len": args.seq_len, "params": n_params,
        "param_tensors": len(list(model.parameters())), "mixed_precision": args.mixed_precision,
        "activation_checkpointing": args.activation_checkpointing,
        "cpu_offload": args.cpu_offload, "losses": losses, "grad_norms": grad_norms,
        "samples_per_s": tokens_per_s / args.seq_len, "tokens_per_s": tokens_per_s, "mfu": mfu,
        "comms_per_step": comms, "device": str(device), "torch_version": torch.__version__,
        "per_rank": per_rank,
    }
    return metrics, full_sd


def model_flops_utilization(args, n_params: int, tokens_per_s: float, world: int, device):
    """MFU = achieved FLOP/s / peak. FLOPs per token = 6N + 12*L*H*Q*T (DESIGN.md section 4),
    N = parameters that multiply (the embedding look-ups do not), H*Q = dim, T = seq_len."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or (next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)
                                if args.mixed_precision == "bf16" else None)
    if peak is None:
        return None  # unknown device, or fp32 without --peak-tflops
    n_matmul = n_params - (args.vocab + args.seq_len) * args.dim
    flops_per_token = 6 * n_matmul + 12 * args.layers * args.dim * args.seq_len
    return tokens_per_s * flops_per_token / (world * peak * 1e12)


def write_results(args, results):
    """Rank 0: exports, metrics, and with several strategies a side-by-side table."""
    several = len(results) > 1
    if several:
        print(f"\n{'strategy':9} {'loss':>7} {'tokens/s':>9} {'params B':>10} {'grads B':>10} "
              f"{'optim B':>10}  collectives per step (bytes; bytes held by rank 0)")
        for metrics, _ in results:
            held = metrics["per_rank"][0]
            comms = ", ".join(f"{op} {s['bytes']:,}" for op, s in metrics["comms_per_step"].items())
            print(f"{metrics['strategy']:9} {metrics['losses'][-1]:7.4f} "
                  f"{metrics['tokens_per_s']:9,.0f} {held['param_bytes']:10,} "
                  f"{held['grad_bytes']:10,} {held['optim_bytes']:10,}  {comms or '-'}")
    if args.export:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        for metrics, full_sd in results:
            path = args.export.with_suffix(f".{metrics['strategy']}{args.export.suffix}") \
                if several else args.export
            tmp = path.with_suffix(".tmp")
            torch.save(full_sd, tmp)
            os.replace(tmp, path)
    if args.metrics_out:
        import json
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        out = {"runs": {m["strategy"]: m for m, _ in results}} if several else results[0][0]
        args.metrics_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
