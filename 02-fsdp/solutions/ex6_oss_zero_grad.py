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

For both `oss` runs the script also looks, after each backward, at the gradients that each rank's
optimizer is about to step (those of the parameters its OSS partition owns): whether each .grad
is still a view into one of ShardedDataParallel's reduce buckets, and how far it is from the mean
of the ranks' gradients (what DDP steps with) and from this rank's own gradient (computed beside,
on a plain copy of the model with the same weights and rows).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, launch, lessons, report
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "02-fsdp/solutions/ex6_oss_zero_grad.py"
LESSON = Path(__file__).resolve().parents[1]



oss_lesson = lessons.load(LESSON / "fairscale_oss.py")

# The three runs: the lesson's ddp and oss, and oss with the optimizer's zero_grad.
VARIANTS = {"ddp": ("ddp", None), "oss wrapped.zero_grad()": ("oss", "wrapped"),
            "oss opt.zero_grad()": ("oss", "opt")}


def step(impl: str, clear: str | None, args, d, wrapped, opt, plain, t: int):
    """fairscale_oss.train_step with the zero_grad call chosen; returns (the global mean loss,
    for `oss` what the owners step with: `stepped_with`, else None)."""
    x, y = classification_batch(args.seed, t, d.world_size * args.batch_size)
    rows = rank_rows(d.rank, args.batch_size)
    if clear == "wrapped":
        wrapped.zero_grad()  # the wrapper's: zeroes the .grad views and its reduce buckets
    else:
        # torch's: sets every .grad to None. ShardedDataParallel made them views into its
        # buckets in the first forward (after step 1's zero_grad), so from step 2 on backward
        # gives each parameter a fresh tensor outside the buckets, and what is reduced to the
        # owner is the bucket, which no .grad points to any more.
        opt.zero_grad(set_to_none=True)
    own = own_gradients(args, d, plain, x[rows], y[rows]) if impl == "oss" else None
    loss = F.cross_entropy(wrapped(x[rows].to(d.device)), y[rows].to(d.device))
    loss.backward()  # ddp: all-reduce; oss: each gradient reduced to the rank that owns it
    seen = stepped_with(d, wrapped, opt, plain, own) if impl == "oss" else None
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / d.world_size).item(), seen


def own_gradients(args, d, plain, x, y) -> list:
    """This rank's own gradient of every parameter, before any reduction: a plain copy of the
    model with the same weights, on the same rows."""
    copy = MLP(args.hidden).to(d.device)
    copy.load_state_dict(plain.state_dict())
    F.cross_entropy(copy(x.to(d.device)), y.to(d.device)).backward()
    return [q.grad for q in copy.parameters()]


def stepped_with(d, wrapped, opt, plain, own: list) -> dict:
    """After backward, over the parameters this rank's OSS partition owns (the ones its optimizer
    steps), on every rank: how many .grad are views into a reduce bucket, and the largest
    |g - mean of the ranks' g| and |g - this rank's own g|."""
    mean = [g.clone() for g in own]
    for g in mean:
        dist.all_reduce(g)  # sum of the ranks' own gradients ...
        g /= d.world_size  # ... / N: what DDP steps with
    buffers = [b.buffer.untyped_storage().data_ptr() for b in wrapped._bucket_list]
    owned = {id(q) for group in opt.optim.param_groups for q in group["params"]}
    views, count, to_mean, to_own = 0, 0, 0.0, 0.0
    for q, g_mean, g_own in zip(plain.parameters(), mean, own):
        if id(q) not in owned:
            continue
        count += 1
        views += q.grad.untyped_storage().data_ptr() in buffers
        to_mean = max(to_mean, (q.grad - g_mean).abs().max().item())
        to_own = max(to_own, (q.grad - g_own).abs().max().item())
    totals = torch.tensor([views, count], dtype=torch.float64, device=d.device)
    dist.all_reduce(totals)
    worst = torch.tensor([to_mean, to_own], dtype=torch.float64, device=d.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"bucket_views": int(totals[0]), "owned": int(totals[1]),
            "max_diff_to_mean": worst[0].item(), "max_diff_to_own": worst[1].item()}


def run(args, d) -> bool:
    report.print0(f"world {d.world_size} | device {d.device} | global batch "
                  f"{d.world_size * args.batch_size} | {args.steps} AdamW steps | "
                  "ShardedDataParallel + OSS, cleared two ways, against DDP")
    weights, losses, seen = {}, {}, {}
    for name, (impl, clear) in VARIANTS.items():
        wrapped, opt, _, plain = oss_lesson.build(impl, args, d.device)
        weights[name], losses[name], seen[name] = [], [], []
        for t in range(args.steps):
            loss, stepped = step(impl, clear, args, d, wrapped, opt, plain, t)
            losses[name].append(loss)
            seen[name].append(stepped)
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
    print_stepped_with(args, seen)
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "steps": args.steps, "lr": args.lr,
            "global_batch": d.world_size * args.batch_size, "losses": losses,
            "max_abs_diff_to_ddp": drift,
            "stepped_with": {name: seen[name] for name in VARIANTS if name != "ddp"}})
    dist.barrier()  # the file is complete before any rank exits
    return True


def print_stepped_with(args, seen: dict) -> None:
    """Step 1 and steps 2..T apart: how many owned .grad are bucket views, and the largest
    distances to the ranks' mean gradient and to the rank's own."""
    report.print0("the gradients each owner steps with (its own parameters; largest over the "
                  "steps and ranks)")
    report.print0(f"{'run':24}{'steps':>7}{'.grad in a bucket':>19}{'max |g - g_mean|':>18}"
                  f"{'max |g - g_own|':>17}")
    for name, per_step in seen.items():
        if name == "ddp":
            continue
        spans = [(1, per_step[:1])] + ([(f"2-{args.steps}", per_step[1:])] if args.steps > 1
                                       else [])
        for label, part in spans:
            views = {s["bucket_views"] for s in part}
            owned = {s["owned"] for s in part}
            said = ("all" if views == owned else "none" if views == {0} else "some") + \
                f" of {max(owned)}"
            report.print0(f"{name:24}{label!s:>7}{said:>19}"
                          f"{max(s['max_diff_to_mean'] for s in part):18.1e}"
                          f"{max(s['max_diff_to_own'] for s in part):17.1e}")


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
