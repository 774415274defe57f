"""Test worker (launched by tests/test_05c_data_parallel_techniques.py with torchrun at world size
2): runs two hand-written mechanisms of 05-advanced/c-data-parallel-techniques through the lesson
scripts' own functions and saves what the test compares.

- gradient_accumulation.py: step 1's averaged gradients computed both ways (the loss divided by
  --grad-accum, and the --buggy way) on the same weights and samples, by `first_step_both_ways`,
  the function the script trains step 1 with;
- gradient_compression.py: the top-k hook's bookkeeping after `train("topk", ...)`, the function
  the script trains each method with: the float64 sums of the true local gradients and of what
  was sent, and the residual still owed, per parameter.

Rank 0 saves {'grads': {'correct': ..., 'buggy': ...}, 'error_feedback': {'sum_grads': ...,
'sum_sent': ..., 'residual': ...}} to --out; the test asserts on it.
"""

import argparse
import importlib.util
from pathlib import Path

import torch

from dtcourse import launch
from dtcourse.data import classification_batch, rank_rows

LESSON = Path(__file__).resolve().parents[2] / "05-advanced" / "c-data-parallel-techniques"


def lesson(name: str):
    spec = importlib.util.spec_from_file_location(name, LESSON / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accumulation_grads(d) -> dict:
    accum = lesson("gradient_accumulation")
    args = accum.parse_args(["--hidden", "32", "--batch-size", "8", "--grad-accum", "2"])
    model, ddp, optimizer, allreduces = accum.build(args, d)
    x_all, y_all = classification_batch(args.seed, 0, d.world_size * 8 * 2)
    rows = rank_rows(d.rank, 8 * 2)
    _, grads = accum.first_step_both_ways(args, model, ddp, optimizer, allreduces,
                                          x_all[rows].to(d.device), y_all[rows].to(d.device))
    return grads


def error_feedback(d, steps: int) -> dict:
    compress = lesson("gradient_compression")
    args = compress.parse_args(["--steps", str(steps), "--methods", "topk"])
    with compress.CollectiveBytes(d.world_size) as counter:
        model, _, state, _, _, _ = compress.train("topk", args, d, counter)
    names = {id(p): n for n, p in model.named_parameters()}
    return {kind: {names[i]: t.cpu() for i, t in store.items()}
            for kind, store in (("sum_grads", state.sum_grads), ("sum_sent", state.sum_sent),
                                ("residual", state.residual))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--topk-steps", type=int, default=30)
    args = p.parse_args()
    with launch.distributed("cpu", 120) as d:
        out = {"grads": accumulation_grads(d), "error_feedback": error_feedback(d, args.topk_steps)}
        if d.rank == 0:
            torch.save(out, args.out)


if __name__ == "__main__":
    main()
