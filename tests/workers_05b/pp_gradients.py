"""Test worker (launched by tests/test_05b_pipeline_expert_context.py with torchrun at world size
4): one step of every implementation and schedule of pipeline_parallel.py's Pipeline, the
zero-bubble ones included, for each pipeline size p (on ranks 0..p-1, the others waiting) and
micro-batch count m, with micro-batches of 4 rows. Rank 0 saves, for every configuration the
script accepts, the loss, the ranks that returned one, the gradients of the whole model gathered
from the stages, keyed 'p{p}/{impl}/{schedule}/m{m}', and the order in which each rank ran its
forwards, backwards and (zero bubble) weight gradients (what the script draws as the step's
schedule); the test compares the gradients with the unsplit model's and checks the drawn
schedules.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import launch, report
from dtcourse.data import classification_batch

LESSON = Path(__file__).resolve().parents[2] / "05-advanced" / "b-pipeline-expert-context"
spec = importlib.util.spec_from_file_location(
    "pipeline_parallel", LESSON / "pipeline_parallel.py")
pp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pp)

ROWS = 4  # rows per micro-batch


def one_config(model_args, d, p, group, impl, schedule, m):
    """(loss, gradients of the unsplit model, every rank's order of ops) on rank 0, None
    elsewhere; None if refused."""
    v, batch = pp.virtual_stages(schedule, 0), ROWS * m
    if pp.unsupported(impl, schedule, p, v, m, model_args.layers, batch):
        return None
    loss = grads = order = None
    if d.rank < p:
        pipe = pp.Pipeline(model_args, impl, schedule, p, v, m, batch, d.rank, d.device, group)
        x, y = classification_batch(model_args.seed, 0, batch)
        loss = pipe.step(x, y)
        grads = pipe.full_state(grads=True)
        order = pp.ran(pipe.recorder.events)
    parts = report.gather(grads)
    orders = report.gather(order)[:p]
    # The loss lives on the rank that holds the last stage: p - 1, but rank 0 for zbv (its V
    # ends where it starts). Every rank reports what it returned, so the test sees which one.
    losses = report.gather(None if loss is None else loss.item())
    held = [r for r, value in enumerate(losses) if value is not None]
    return {"loss": losses[held[0]] if held else None, "loss_ranks": held, "batch": batch,
            "grads": pp.merge(g for g in parts if g), "orders": orders, "stages": p * v}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline-sizes", required=True)
    p.add_argument("--microbatches", required=True)
    p.add_argument("--zero-bubble-microbatches", help="m for zb1p and zbv (default: the same)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model_args = pp.parse_args([])  # the script's defaults: seed 0, 8 layers, hidden 64
    counts = {s: [int(m) for m in args.microbatches.split(",")] for s in pp.SCHEDULES}
    counts.update({s: [int(m) for m in (args.zero_bubble_microbatches or args.microbatches)
                       .split(",")] for s in pp.ZERO_BUBBLE})
    checks = {}
    with launch.distributed("cpu", 120) as d:
        for size in map(int, args.pipeline_sizes.split(",")):
            group = dist.new_group(list(range(size))) if size < d.world_size else None
            for impl in ("manual", "torch"):
                for schedule, ms in counts.items():
                    for m in ms:
                        got = one_config(model_args, d, size, group, impl, schedule, m)
                        if got is not None:
                            checks[f"p{size}/{impl}/{schedule}/m{m}"] = got
        if d.rank == 0:
            torch.save(checks, args.out)
        dist.barrier()


if __name__ == "__main__":
    main()
