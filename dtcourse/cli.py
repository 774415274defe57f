"""The flags every script shares, and fail(): bad input ends with one line and exit status 2.

A script builds its parser with `parser(__doc__)`, adds the groups it needs and its own flags:

    p = cli.parser(__doc__)
    cli.add_run_args(p)                                   # --device --timeout-s --seed
    cli.add_train_args(p, steps=40, batch_size=32, lr=1e-2)
    cli.add_output_args(p)                                # --metrics-out --export
    p.add_argument("--hidden", type=int, default=128)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "hidden")
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn


def _rank_label() -> str:
    """'[rank r] ' when this process is one of several (read before any group exists)."""
    env = os.environ
    rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK"))
    if rank is None and "SLURM_STEP_NUM_TASKS" in env:
        rank = env.get("SLURM_PROCID")
    return f"[rank {rank}] " if rank is not None else ""


def fail(msg: str) -> NoReturn:
    """Bad input: one line on stderr and exit status 2. Call it on every rank, before the first
    collective, with a message every rank computes alike: then no peer is left waiting."""
    # One write of the whole line: print() writes the text and its newline separately, and
    # ranks sharing a terminal or pipe could interleave between the two.
    sys.stderr.write(f"{_rank_label()}error: {msg}\n")
    sys.stderr.flush()
    sys.exit(2)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of the script's docstring, whose own
    errors (an unknown flag, a bad choice) also end in one line and exit status 2."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    return p


def add_run_args(p: argparse.ArgumentParser, *, seed: bool = True,
                 timeout_s: float = 120.0) -> None:
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA (NCCL) when every process of the node gets a GPU, else "
                   "CPU (gloo)")
    p.add_argument("--timeout-s", type=float, default=timeout_s,
                   help="seconds a collective may wait before the run fails")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def add_train_args(p: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float,
                   grad_accum: bool = True, batch_help: str = "samples per data-parallel rank "
                                                               "per micro-step") -> None:
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    if grad_accum:
        p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=lr, help="learning rate")


def add_output_args(p: argparse.ArgumentParser, *, metrics: bool = True, export: bool = True,
                    json_out: bool = False) -> None:
    if metrics:
        p.add_argument("--metrics-out", type=Path,
                       help="rank 0 writes the run's metrics (losses, throughput, bytes per "
                            "rank) as JSON here")
    if export:
        p.add_argument("--export", type=Path,
                       help="rank 0 writes the trained model's plain state_dict here "
                            "(torch.save; loads into the model without any parallel wrapper)")
    if json_out:
        p.add_argument("--json-out", type=Path, help="rank 0 writes the results as JSON here")


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """fail() naming the first flag among `names` whose value is not > 0 (a count: not >= 1)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            need = "at least 1" if isinstance(value, int) else "positive"
            fail(f"--{name.replace('_', '-')} must be {need}, got {value}")


def check_ckpt_dir(path: Path | None) -> None:
    if path is not None and path.exists() and not path.is_dir():
        fail(f"--ckpt-dir {path} is a file, not a directory of checkpoints")


def add_template_args(p: argparse.ArgumentParser) -> None:
    """The knobs of lesson 01's template (the MLP and its LR schedule), the same flags in every
    script that trains it: DDP, its exercise solutions, Horovod and TensorFlow."""
    p.add_argument("--base-batch", type=int, default=32, help="global batch the base LR is for")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup to the scaled LR")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP")


def check_template_args(args: argparse.Namespace) -> None:
    check_positive(args, "base_batch", "hidden")
    if args.warmup_steps < 0:
        fail(f"--warmup-steps must be >= 0, got {args.warmup_steps}")


def add_gpt_args(p: argparse.ArgumentParser, *, layers: int = 2, dim: int = 64, heads: int = 4,
                 seq_len: int = 32, vocab: int = 256) -> None:
    """The shape of dtcourse.models.GPT, the same flags in every lesson that trains it."""
    p.add_argument("--layers", type=int, default=layers, help="transformer blocks")
    p.add_argument("--dim", type=int, default=dim, help="model width")
    p.add_argument("--heads", type=int, default=heads, help="attention heads (must divide --dim)")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")


def check_gpt_args(args: argparse.Namespace) -> None:
    check_positive(args, "layers", "dim", "heads", "seq_len", "vocab")
    if args.dim % args.heads:
        fail(f"--heads {args.heads} must divide --dim {args.dim}: each head takes dim/heads "
             f"features ({args.dim}/{args.heads} is not a whole number)")


def add_ckpt_args(p: argparse.ArgumentParser, *, keep: bool = False) -> None:
    """Checkpoints with automatic resume, and the fault injection that shows a restart resuming."""
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint here and resume from the newest")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: end)")
    if keep:
        p.add_argument("--keep-ckpts", type=int, default=3, help="keep the newest K checkpoints")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="fault injection: --fail-rank raises once at this step (needs --ckpt-dir)")
    p.add_argument("--fail-rank", type=int, default=0)


def check_ckpt_args(args: argparse.Namespace, world_size: int) -> None:
    if args.ckpt_every < 0:
        fail(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if getattr(args, "keep_ckpts", 1) < 1:
        fail(f"--keep-ckpts must be at least 1, got {args.keep_ckpts}")
    if args.fail_at_step and not args.ckpt_dir:
        fail("--fail-at-step needs --ckpt-dir (the restart resumes from it)")
    if args.fail_at_step and not 0 <= args.fail_rank < world_size:
        fail(f"--fail-rank {args.fail_rank} does not exist at world size {world_size}")
    check_ckpt_dir(args.ckpt_dir)
