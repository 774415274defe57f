"""DeepSpeed inference: deepspeed.init_inference on the GPT that deepspeed_train.py trained, split
across ranks by tensor parallelism (AutoTP), with its outputs checked against the plain model.

Launch (from the repository root; first train and export the model):
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py --export runs/03-deepspeed/model.pt
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_inference.py --weights runs/03-deepspeed/model.pt
    python 03-deepspeed/deepspeed_inference.py --weights runs/03-deepspeed/model.pt   # 1 process

Expected output (deepspeed --num_gpus 2 with transformers installed; 2-core AMD EPYC CPU (shared),
torch 2.14.1, deepspeed 0.19.8, gloo):
    world 2 | cpu fp32 | tensor parallel 2
    rank 0 holds q/k/v with 32 of 64 output features (2 heads)
    max |deepspeed - plain| over (4, 32, 64) logits: 1.91e-06 (tolerance 0.0001)
    prompt [44, 47, 53, 0, 3, 59, 3, 39] -> greedy [62, 20, 40, 47, 27, 39, 62, 20]

Tensor parallelism here (Megatron-style, what AutoTP builds from `injection_policy`):
    q, k, v, fc1   column-parallel: each rank keeps width/tp of the output features (whole heads:
                   tp_grain_size is the head size), so attention runs on heads_total/tp heads
    proj, fc2      row-parallel ("LinearAllreduce"): each rank multiplies its slice of the inputs;
                   fwd: all-reduce (sum) of the partial outputs -> the full (B, T, width) again
    embeddings, layer norms, the tied output layer: replicated on every rank

In DeepSpeed 0.19.8 AutoTP imports the `transformers` package to pick its linear-layer policy, even
for a plain nn.Module. Without it installed this script runs every rank unsplit (tp_size 1) and
says so; `pip install transformers` enables the split (on CPU too).
"""

import argparse
import gc
import importlib.util
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ_LEN = 64, 32
# fp32 on CPU: the split only reorders sums (row-parallel partial products, then the all-reduce),
# so outputs agree to a few float32 ulps of the logits' size; bf16/fp16 round every product.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--weights", type=Path, required=True,
                   help="plain fp32 state_dict written by deepspeed_train.py --export")
    p.add_argument("--layers", type=int, default=2, help="must match the trained model")
    p.add_argument("--width", type=int, default=64, help="must match the trained model")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="inference dtype (bf16 / fp16 need CUDA)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the comparison here")
    p.add_argument("--save-logits", type=Path,
                   help="rank 0 saves the plain and the DeepSpeed logits (torch.save) here")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.weights.is_file():
        fail(f"--weights {args.weights}: no such file (write it with deepspeed_train.py --export)")
    if args.batch_size < 1 or args.timeout_s <= 0:
        fail("--batch-size must be >= 1 and --timeout-s positive")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """(rank, world, device, deepspeed): the same set-up as deepspeed_train.py (see there)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        fail("run this script with the deepspeed launcher, torchrun or plain python")
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    env["DS_ACCELERATOR"] = device.type
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in env:  # plain `python`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device, deepspeed


# --------------------------------------------------------------------------------------------------
# The model: deepspeed_train.py's GPT, repeated here because every script of the course stands
# alone (the state_dict keys must match the exported file).


class Attention(nn.Module):
    def __init__(self, width: int, head_dim: int = 16):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)  # why: see deepspeed_train.py
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        # The head count comes from the width of q: under TP each rank has heads_total / tp.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=2, width=64, vocab=VOCAB, seq_len=SEQ_LEN):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def tp_unavailable_reason(world: int) -> str | None:
    """Why this run cannot split the model, or None when it can."""
    if importlib.util.find_spec("transformers") is None:
        return ("DeepSpeed's AutoTP imports the `transformers` package, which is not installed: "
                "pip install transformers")
    if world == 1:
        return "one process: launch with deepspeed --num_gpus N to split the model N ways"
    return None


def load_model(args) -> nn.Module:
    """The plain GPT with the exported weights, checked before any process group exists."""
    model = GPT(args.layers, args.width)
    try:
        weights = torch.load(args.weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, corrupt, or not written by torch.save
        fail(f"--weights {args.weights}: not a readable state dict ({type(exc).__name__})")
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # wrong --layers / --width for this file
        fail(f"--weights {args.weights} does not fit GPT(layers={args.layers}, "
             f"width={args.width}): {str(exc).splitlines()[0]}")
    return model.eval()


def main(argv=None):
    args = parse_args(argv)
    model = load_model(args)
    rank, world, device, deepspeed = init_distributed(args.device, args.timeout_s)
    try:
        run(args, model, rank, world, device, deepspeed)
    finally:
        gc.collect()  # DeepSpeed's engines sit in reference cycles holding process groups
        dist.destroy_process_group()


def run(args, model, rank, world, device, deepspeed):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if dtype != torch.float32 and device.type != "cuda":
        fail(f"--dtype {args.dtype} needs CUDA here; use fp32 on CPU")

    # The same prompt on every rank (TP ranks compute one batch together).
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(VOCAB, (args.batch_size, SEQ_LEN), generator=g).to(device)
    reference = model.to(device=device, dtype=dtype)
    with torch.no_grad():
        expected = reference(prompt).float().cpu()

    reason = tp_unavailable_reason(world)
    tp = 1 if reason else world
    if rank == 0:
        print(f"world {world} | {device.type} {args.dtype} | tensor parallel {tp}"
              + (f" (no split: {reason})" if reason else ""), flush=True)
    # init_inference wraps (and for tp > 1 rewrites) the module in place: give it its own copy.
    copy = GPT(args.layers, args.width).to(dtype)
    copy.load_state_dict(reference.state_dict())
    engine = deepspeed.init_inference(
        copy.eval(), dtype=dtype, replace_with_kernel_inject=False,
        tensor_parallel={"tp_size": tp, "tp_grain_size": copy.blocks[0].attn.head_dim},
        # Row-parallel layers of each Block: their partial outputs are all-reduced.
        injection_policy={Block: ("attn.proj", "mlp.fc2")} if tp > 1 else None)
    local_width = engine.module.blocks[0].attn.q.weight.shape[0]
    with torch.no_grad():
        got = engine(prompt).float().cpu()
    diff = (got - expected).abs().max().item()
    tol = TOLERANCE[dtype]

    # Greedy continuation of one prompt, by the engine: the trained model has learnt the data's
    # successor table, so each next token is usually that table's entry for the last one.
    tokens = prompt[:1, :8]
    with torch.no_grad():
        for _ in range(8):
            nxt = engine(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)

    if rank == 0:
        print(f"rank 0 holds q/k/v with {local_width} of {args.width} output features "
              f"({local_width // copy.blocks[0].attn.head_dim} heads)", flush=True)
        print(f"max |deepspeed - plain| over {tuple(got.shape)} logits: {diff:.2e} "
              f"(tolerance {tol:g})", flush=True)
        print(f"prompt {tokens[0, :8].tolist()} -> greedy {tokens[0, 8:].tolist()}", flush=True)
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps({
                "script": "03-deepspeed/deepspeed_inference.py", "world_size": world,
                "tensor_parallel": tp, "no_split_reason": reason, "dtype": args.dtype,
                "local_qkv_features": local_width, "max_abs_diff": diff, "tolerance": tol,
                "device": str(device), "deepspeed_version": deepspeed.__version__}, indent=1))
        if args.save_logits:
            args.save_logits.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"plain": expected, "deepspeed": got}, args.save_logits)
    dist.barrier()
    if diff > tol:
        print(f"[rank {rank}] error: DeepSpeed's output differs from the plain model's by "
              f"{diff:.2e} > {tol:g}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
