"""Exercise 4 of lesson 02: the hand-written FSDP without `self._free([rec])`, the line that frees
each gathered weight after its gradient's reduce-scatter.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex4_keep_after_reduce.py
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex4_keep_after_reduce.py \\
        --json-out runs/02-fsdp/ex4_free.json --export runs/02-fsdp/ex4.pt

fsdp_from_scratch.py's `_reduce_scatter_grad` ends with `self._free([rec])`: once a parameter's
gradient is reduced, its gathered full weight is dropped. This script trains the lesson's TiedLM
with the lesson's FullyShardedDataParallel (loaded from fsdp_from_scratch.py by path) and with a
subclass whose `_reduce_scatter_grad` is the same minus that line, from the same weights on the
same batches, and prints for each the metric that the lesson's run reports, the most full
parameter bytes gathered at once (`peak_gathered_bytes`), with what is still gathered when
backward returns, the final loss and how far the weights of the two runs are apart.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, launch, lessons, report
from dtcourse.data import rank_rows

SCRIPT = "02-fsdp/solutions/ex4_keep_after_reduce.py"
LESSON = Path(__file__).resolve().parents[1]



scratch = lessons.load(LESSON / "fsdp_from_scratch.py")


class KeepAfterReduce(scratch.FullyShardedDataParallel):
    """The lesson's FSDP with `self._free([rec])` removed from `_reduce_scatter_grad`."""

    def _reduce_scatter_grad(self, rec) -> None:
        grad = F.pad(rec.full.grad.reshape(-1).float(), (0, rec.padded - rec.numel))
        piece = torch.empty_like(rec.shard)
        scratch.reduce_scatter(piece, grad, op=dist.ReduceOp.SUM)
        piece /= self.world
        rec.shard.grad = piece if rec.shard.grad is None else rec.shard.grad + piece
        rec.full.grad = None
        # (the lesson frees the gathered weight here)


def train(args, d, cls):
    """The lesson's train loop with the FSDP class given; the numbers the exercise compares."""
    torch.manual_seed(args.seed)
    model = scratch.TiedLM().to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    fsdp = cls(model)
    optimizer = scratch.make_optimizer("adamw", fsdp.parameters(), args.lr)
    losses, after_backward = [], 0
    for step in range(args.steps):
        x, y = scratch.global_batch(args.seed, step, d.world_size * args.batch_size)
        rows = rank_rows(d.rank, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        logits = fsdp(x[rows].to(d.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y[rows].to(d.device).flatten())
        loss.backward()
        after_backward = max(after_backward, fsdp.gathered_bytes)  # before the final free
        fsdp.finish_gradient_synchronization()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / d.world_size).item())
    full = fsdp.gather_full_params()
    return {"losses": losses, "peak_gathered_bytes": fsdp.peak_gathered_bytes,
            "gathered_when_backward_returns": after_backward, "model_bytes": 4 * n_params,
            "gathered_bytes_after_step": fsdp.gathered_bytes}, scratch.plain_state_dict(full)


def run(args, d) -> None:
    report.print0(f"hand-written FSDP | world {d.world_size} | TiedLM | adamw | {args.steps} steps"
                  " | with and without the free() after each reduce-scatter")
    runs, states = {}, {}
    for name, cls in (("lesson", scratch.FullyShardedDataParallel),
                      ("no free", KeepAfterReduce)):
        runs[name], states[name] = train(args, d, cls)
    diff = max((states["no free"][k] - states["lesson"][k]).abs().max().item()
               for k in states["lesson"])
    model_bytes = runs["lesson"]["model_bytes"]
    report.print0(f"{'run':8} {'final loss':>10} {'peak gathered B':>16} "
                  f"{'gathered when backward returns B':>33}  (the whole model: {model_bytes:,} B)")
    for name, r in runs.items():
        report.print0(f"{name:8} {r['losses'][-1]:10.4f} {r['peak_gathered_bytes']:16,} "
                      f"{r['gathered_when_backward_returns']:33,}")
    report.print0(f"max |w_no_free - w_lesson| = {diff:.1e} after {args.steps} steps")
    if d.rank == 0:
        if args.json_out:
            report.write_json(args.json_out, {"script": SCRIPT, "world_size": d.world_size,
                                              "steps": args.steps, "runs": runs,
                                              "max_abs_diff": diff})
        if args.export:
            for name, state in states.items():
                report.save_state_dict(report.variant_path(args.export, name.replace(" ", "_"),
                                                           several=True), state)
    dist.barrier()  # the files are complete before any rank exits


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=8, batch_size=8, lr=1e-2, grad_accum=False,
                       batch_help="sequences per rank")
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes each run's plain state_dict to PATH with the run's name "
                        "before the suffix (ex4.pt -> ex4.lesson.pt, ex4.no_free.pt)")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)
    sys.exit(0)


if __name__ == "__main__":
    main()
