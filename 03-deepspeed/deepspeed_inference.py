"""DeepSpeed inference: deepspeed.init_inference on the GPT that deepspeed_train.py trained, split
across ranks by tensor parallelism (AutoTP), with its outputs checked against the plain model.

Launch (from the repository root; first train and export the model):
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py --export runs/03-deepspeed/model.pt
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_inference.py --weights runs/03-deepspeed/model.pt
    python 03-deepspeed/deepspeed_inference.py --weights runs/03-deepspeed/model.pt   # 1 process

Tensor parallelism here (Megatron-style, what AutoTP builds from `injection_policy`):
    q, k, v, fc1   column-parallel: each rank keeps width/tp of the output features (whole heads:
                   tp_grain_size is the head size), so attention runs on heads_total/tp heads
    proj, fc2      row-parallel ("LinearAllreduce"): each rank multiplies its slice of the inputs;
                   fwd: all-reduce (sum) of the partial outputs -> the full (B, T, width) again
    embeddings, layer norms, the output layer: replicated on every rank

In DeepSpeed 0.19.8 AutoTP imports the `transformers` package to pick its linear-layer policy, even
for a plain nn.Module. Without it installed this script runs every rank unsplit (tp_size 1) and
says so; `pip install transformers` enables the split (on CPU too).

The model is the course's shared GPT (dtcourse.models), whose attention keeps q, k and v as three
layers, which AutoTP splits by output features (column-parallel: the rows of torch's [out, in]
weight); set-up comes from dtcourse.launch.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse import cli, launch, report
from dtcourse.data import token_batch
from dtcourse.models import GPT, Block

SCRIPT = "03-deepspeed/deepspeed_inference.py"
PROMPT_STEP = 10**6  # the prompts are the data of a step no training run reached
# fp32 on CPU: the split only reorders sums (row-parallel partial products, then the all-reduce),
# so outputs agree to a few float32 ulps of the logits' size; bf16/fp16 round every product.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


# --------------------------------------------------------------------------------------------------
# The engine: the same weights, split by AutoTP, against the plain model


def tp_unavailable_reason(world: int) -> str | None:
    """Why this run cannot split the model, or None when it can."""
    if importlib.util.find_spec("transformers") is None:
        return ("DeepSpeed's AutoTP imports the `transformers` package, which is not installed: "
                "pip install transformers")
    if world == 1:
        return "one process: launch with deepspeed --num_gpus N to split the model N ways"
    return None


def tensor_parallel_engine(model: nn.Module, args, world: int, dtype, deepspeed):
    """(engine, tp, reason): init_inference on a copy of `model`, split `world` ways if it can."""
    reason = tp_unavailable_reason(world)
    tp = 1 if reason else world
    # init_inference wraps (and for tp > 1 rewrites) the module in place: give it its own copy.
    copy = build_model(args).to(dtype)
    copy.load_state_dict(model.state_dict())
    engine = deepspeed.init_inference(
        copy.eval(), dtype=dtype, replace_with_kernel_inject=False,
        tensor_parallel={"tp_size": tp, "tp_grain_size": copy.blocks[0].attn.head_dim},
        # Row-parallel layers of each Block: their partial outputs are all-reduced.
        injection_policy={Block: ("attn.proj", "mlp.fc2")} if tp > 1 else None)
    return engine, tp, reason


@torch.no_grad()
def greedy(engine, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """Append `new` tokens, each the engine's most likely next one (every rank runs the same)."""
    for _ in range(new):
        nxt = engine(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def run(args, model: nn.Module, d, deepspeed) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if dtype != torch.float32 and d.device.type != "cuda":
        cli.fail(f"--dtype {args.dtype} needs CUDA here; use fp32 on CPU")

    # The same prompts on every rank (TP ranks compute one batch together): sequences of the
    # training data's kind, which the model has learnt to continue.
    prompt, targets = token_batch(args.seed, PROMPT_STEP, args.batch_size, args.seq_len, args.vocab)
    prompt = prompt.to(d.device)
    reference = model.to(device=d.device, dtype=dtype)
    with torch.no_grad():
        expected = reference(prompt).float().cpu()

    engine, tp, reason = tensor_parallel_engine(reference, args, d.world_size, dtype, deepspeed)
    report.print0(f"world {d.world_size} | {d.device.type} {args.dtype} | tensor parallel {tp}"
                  + (f" (no split: {reason})" if reason else ""))
    local_width = engine.module.blocks[0].attn.q.weight.shape[0]
    with torch.no_grad():
        got = engine(prompt).float().cpu()
    diff = (got - expected).abs().max().item()
    tol = TOLERANCE[dtype]
    accuracy = (got.argmax(-1) == targets).float().mean().item()  # of the engine's next tokens
    tokens = greedy(engine, prompt[:1, :8], 8)

    head_dim = engine.module.blocks[0].attn.head_dim
    report.print0(f"rank 0 holds q/k/v with {local_width} of {args.dim} output features "
                  f"({local_width // head_dim} heads)")
    report.print0(f"max |deepspeed - plain| over {tuple(got.shape)} logits: ~{diff:.1e} "
                  f"(tolerance {tol:g})")
    report.print0(f"next-token accuracy over the prompts: {accuracy:.1%}")
    report.print0(f"prompt {tokens[0, :8].tolist()} -> greedy {tokens[0, 8:].tolist()} "
                  f"(the data continue {prompt[0, 8:16].tolist()})")
    if d.rank == 0:
        if args.json_out:
            report.write_json(args.json_out, {
                "script": SCRIPT, "world_size": d.world_size, "tensor_parallel": tp,
                "no_split_reason": reason, "dtype": args.dtype, "local_qkv_features": local_width,
                "max_abs_diff": diff, "tolerance": tol, "next_token_accuracy": accuracy,
                "device": str(d.device),
                "deepspeed_version": deepspeed.__version__})
        if args.save_logits:
            report.save_state_dict(args.save_logits, {"plain": expected, "deepspeed": got})
    dist.barrier()
    if diff > tol:
        raise SystemExit(f"[rank {d.rank}] error: DeepSpeed's output differs from the plain "
                         f"model's by {diff:.2e} > {tol:g}")  # exit status 1


# --------------------------------------------------------------------------------------------------
# The trained weights, arguments and launch


def build_model(args) -> GPT:
    return GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)


def load_model(args) -> nn.Module:
    """The plain GPT with the exported weights, checked before any process group exists."""
    model = build_model(args)
    try:
        weights = torch.load(args.weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, corrupt, or not written by torch.save
        cli.fail(f"--weights {args.weights}: not a readable state dict ({type(exc).__name__})")
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # a shape flag that does not match the file
        cli.fail(f"--weights {args.weights} does not fit GPT(vocab={args.vocab}, seq_len="
                 f"{args.seq_len}, dim={args.dim}, layers={args.layers}): "
                 f"{str(exc).splitlines()[0]}")
    return model.eval()


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--weights", type=Path, required=True,
                   help="plain fp32 state_dict written by deepspeed_train.py --export")
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)  # as trained
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="inference dtype (bf16 / fp16 need CUDA)")
    p.add_argument("--batch-size", type=int, default=4, help="prompts compared")
    p.add_argument("--save-logits", type=Path,
                   help="rank 0 saves the plain and the DeepSpeed logits (torch.save) here")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.weights.is_file():
        cli.fail(f"--weights {args.weights}: no such file (write it with deepspeed_train.py "
                 "--export)")
    cli.check_positive(args, "batch_size", "timeout_s")
    cli.check_gpt_args(args)
    return args



def main(argv=None):
    args = parse_args(argv)
    model = load_model(args)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, model, d, launch.start_deepspeed(d))


if __name__ == "__main__":
    main()
