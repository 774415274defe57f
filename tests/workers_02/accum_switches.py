"""Test worker (launched by tests/test_02_fsdp.py with torchrun at world size 2): FSDP2's gradient
accumulation switches, counted and checked on the lesson's GPT.

The model, its sharding (one fully_shard unit per block, then the root), its initial weights and
the optimizer come from 02-fsdp/fsdp_transformer.py's `build` (strategy `full`); every optimizer
step is the script's own `train_step`, which turns gradient sync off on the micro-steps before the
last. Each mode trains a fresh model for --steps optimizer steps of --grad-accum micro-steps on the
same data:

- default: FSDP2's defaults (the blocks resharded after forward and after backward, the root
  after backward);
- keep: `set_reshard_after_backward(False)` before the first micro-step and back to True before
  the last, so the units stay gathered from one micro-step to the next;
- keep+forward: as keep, with `set_reshard_after_forward(False)` on every unit throughout;
- stale: as keep+forward, but reshard_after_backward stays False on the last micro-step too, so
  the gathered copies outlive optimizer.step() (the mistake the lesson warns about).

Rank 0 writes --out (JSON): per mode, the all-gathers and reduce-scatters of each optimizer step
(forward and backward of all its micro-steps, as `train_step` counts them); and --weights (torch):
per mode, the full state dict of the sharded parameters after the last step.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dtcourse import launch
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch

SCRIPT = Path(__file__).resolve().parents[2] / "02-fsdp" / "fsdp_transformer.py"
MODES = ("default", "keep", "keep+forward", "stale")


def lesson():
    spec = importlib.util.spec_from_file_location("fsdp_transformer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def units(model, fsdp_module_type) -> list:
    return [m for m in model.modules() if isinstance(m, fsdp_module_type)]


def run_mode(ft, args, d, mode: str) -> tuple[list, dict]:
    """Train one fresh model in `mode`; return (per-step collective counts, full state dict)."""
    model, mesh, optimizer = ft.build(args, "full", d)
    assert len(units(model, ft.FSDPModule)) == args.layers + 1  # the blocks and the root
    if mode in ("keep+forward", "stale"):
        model.set_reshard_after_forward(False)  # every unit, the root included (recurse=True)
    rows = rank_rows(d.rank, args.batch_size * args.grad_accum)
    counts = []
    for step in range(args.steps):
        x_all, y_all = token_batch(args.seed, step, d.world_size * args.batch_size
                                   * args.grad_accum, args.seq_len, args.vocab)
        backwards = []  # train_step calls `between` after every backward but the last

        def between():
            backwards.append(1)
            if len(backwards) == args.grad_accum - 1 and mode in ("keep", "keep+forward"):
                model.set_reshard_after_backward(True)  # the last micro-step reshards

        if mode != "default":
            model.set_reshard_after_backward(False)
        comm = CollectiveCounter()
        ft.train_step(args, d, model, mesh, optimizer, x_all[rows].to(d.device),
                      y_all[rows].to(d.device), comm, between)
        calls = {kind: s["calls"] for kind, s in comm.summary().items()}
        counts.append({"all_gather": calls.get("all_gather", 0),
                       "reduce_scatter": calls.get("reduce_scatter", 0)})
    # The weights the optimizer updated are the shards; in `stale` the modules still hold
    # the gathered copies, so put the shards back in place before reading them.
    for unit in units(model, ft.FSDPModule):
        unit.reshard()
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    return counts, sd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    cli_args = p.parse_args()
    ft = lesson()
    # the script's defaults (GPT of 2 blocks, dim 64), 2 sequences per micro-step
    args = ft.parse_args(["--device", "cpu", "--batch-size", "2",
                          "--grad-accum", str(cli_args.grad_accum),
                          "--steps", str(cli_args.steps)])
    with launch.distributed("cpu", 120) as d:
        counts, weights = {}, {}
        for mode in MODES:
            counts[mode], weights[mode] = run_mode(ft, args, d, mode)
        if d.rank == 0:
            cli_args.out.write_text(json.dumps(
                {"grad_accum": args.grad_accum, "steps": args.steps, "layers": args.layers,
                 "world_size": d.world_size, "counts": counts}, indent=1))
            torch.save(weights, cli_args.weights)


if __name__ == "__main__":
    main()
