"""Exercise 6 of lesson 02: ShardedDataParallel with torch's zero_grad instead of its own.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex6_oss_zero_grad.py
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex6_oss_zero_grad.py --steps 40 \\
        --json-out runs/02-fsdp/ex6_zero_grad.json

fairscale_oss.py clears the gradients of its `oss` run (OSS + ShardedDataParallel) with the
wrapper's `zero_grad()`. Here the same run is repeated with the optimizer's `opt.zero_grad()`,
torch's Optimizer.zero_grad(set_to_none=True), which OSS does not override, and both are compared
with plain DDP after every step: the largest |w - w_ddp| over all weights. The lesson's own
`build` is reused, loaded from fairscale_oss.py by path, and its `train_step` is repeated with
only the zero_grad call changed.
"""

import sys
from pathlib import Path

import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, launch, lessons, report
from dtcourse.data import classification_batch, rank_rows

SCRIPT = "02-fsdp/solutions/ex6_oss_zero_grad.py"
LESSON = Path(__file__).resolve().parents[1]



oss_lesson = lessons.load(LESSON / "fairscale_oss.py")

# The three runs: the lesson's ddp and oss, and oss with the optimizer's zero_grad.
VARIANTS = {"ddp": ("ddp", None), "oss wrapped.zero_grad()": ("oss", "wrapped"),
            "oss opt.zero_grad()": ("oss", "opt")}


def step(impl: str, clear: str | None, args, d, wrapped, opt, plain, t: int):
    """fairscale_oss.train_step with the zero_grad call chosen; returns the global mean loss."""
    x, y = classification_batch(args.seed, t, d.world_size * args.batch_size)
    rows = rank_rows(d.rank, args.batch_size)
    if clear == "wrapped":
        wrapped.zero_grad()  # the wrapper's: zeroes the .grad views and its reduce buckets
    else:
        opt.zero_grad(set_to_none=True)  # torch's: drops every .grad, the buckets keep their sums
    loss = F.cross_entropy(wrapped(x[rows].to(d.device)), y[rows].to(d.device))
    loss.backward()  # ddp: all-reduce; oss: each gradient reduced to the rank that owns it
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / d.world_size).item()


def run(args, d) -> bool:
    report.print0(f"world {d.world_size} | device {d.device} | global batch "
                  f"{d.world_size * args.batch_size} | {args.steps} AdamW steps | "
                  "ShardedDataParallel + OSS, cleared two ways, against DDP")
    weights, losses = {}, {}
    for name, (impl, clear) in VARIANTS.items():
        wrapped, opt, _, plain = oss_lesson.build(impl, args, d.device)
        weights[name], losses[name] = [], []
        for t in range(args.steps):
            losses[name].append(step(impl, clear, args, d, wrapped, opt, plain, t))
            weights[name].append([p.detach().clone() for p in plain.parameters()])
    ref = weights["ddp"]
    drift = {name: [max((a - b).abs().max().item() for a, b in zip(ws, rs))
                    for ws, rs in zip(weights[name], ref)] for name in VARIANTS}
    shown = sorted({1, 2, 3, 5, 10, args.steps} & set(range(1, args.steps + 1)))
    report.print0("max |w - w_ddp| after step t")
    report.print0(f"{'run':24}" + "".join(f"{'t=' + str(t):>9}" for t in shown)
                  + f"{'final loss':>12}")
    for name in VARIANTS:
        cells = "".join(f"{drift[name][t - 1]:9.1e}" for t in shown)
        report.print0(f"{name:24}{cells}{losses[name][-1]:12.4f}")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "steps": args.steps, "lr": args.lr,
            "global_batch": d.world_size * args.batch_size, "losses": losses,
            "max_abs_diff_to_ddp": drift})
    dist.barrier()  # the file is complete before any rank exits
    return True


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=32, lr=3e-3, grad_accum=False,
                       batch_help="samples per rank")
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "hidden", "lr", "timeout_s")
    try:
        import fairscale  # noqa: F401
    except ImportError:
        cli.fail("fairscale is not installed: pip install fairscale==0.4.13")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        ok = run(args, d)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
