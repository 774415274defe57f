"""Exercise 2 of lesson 01: gradient accumulation without dividing the loss, under AdamW and SGD.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex2_no_loss_division.py
    torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex2_no_loss_division.py --grad-accum 4 \\
        --json-out runs/01-ddp-basics/ex2.json --export runs/01-ddp-basics/ex2.pt

ddp_training.py divides each micro-step's loss by --grad-accum, so that the accumulated gradient
is that of the mean loss. This script trains its model four times in one launch from the same
weights on the same batches: with AdamW (the template's optimizer) and with SGD at the same
learning rate, each with the division (`loss / grad_accum`, the lesson's train_step, loaded from
ddp_training.py by path) and without it (`loss`). It prints the losses, how far the weights of the
undivided run end from the divided one, and the ratio of the two runs' first updates; then a
fifth run, AdamW with the division and eps divided by --grad-accum, against the undivided one.
"""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, launch, lessons, report
from dtcourse.data import classification_batch, rank_rows

SCRIPT = "01-ddp-basics/solutions/ex2_no_loss_division.py"
LESSON = Path(__file__).resolve().parents[1]



training = lessons.load(LESSON / "ddp_training.py")


def undivided_train_step(args, d, ddp, optimizer, scheduler, scaler, step: int) -> torch.Tensor:
    """ddp_training.train_step with `loss` where it has `loss / args.grad_accum`: the
    accumulated gradient is grad_accum times the gradient of the mean loss."""
    x_all, y_all = classification_batch(args.seed, step, args.global_batch)
    rows = rank_rows(d.rank, args.batch_size * args.grad_accum)
    x_local, y_local = x_all[rows].to(d.device), y_all[rows].to(d.device)
    step_loss = torch.zeros((), device=d.device)
    for micro in range(args.grad_accum):
        x = x_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        y = y_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        last = micro == args.grad_accum - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()  # the bug: no division by grad_accum
        step_loss += loss.detach().float() / args.grad_accum
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=False)  # as the lesson's train_step
    scheduler.step()
    return step_loss


def train(args, d, optimizer_name: str, divided: bool, eps_over_accum: bool = False):
    """(losses, first update, final plain state dict) of one run."""
    model, ddp, optimizer, scheduler, scaler = training.build(args, d)
    if eps_over_accum:  # AdamW's eps (1e-8) divided by grad_accum
        optimizer.param_groups[0]["eps"] /= args.grad_accum
    if optimizer_name == "sgd":  # the same LR and warmup, plain SGD instead of AdamW
        optimizer = torch.optim.SGD(ddp.parameters(), lr=optimizer.param_groups[0]["initial_lr"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: training.lr_at(s, 1.0, args.warmup_steps))
    step_fn = training.train_step if divided else undivided_train_step
    start = [p.detach().clone() for p in model.parameters()]
    losses, first_update = [], None
    for step in range(args.steps):
        loss = step_fn(args, d, ddp, optimizer, scheduler, scaler, step)
        dist.all_reduce(loss)
        losses.append(loss.item() / d.world_size)
        if step == 0:
            first_update = [p.detach() - s for p, s in zip(model.parameters(), start)]
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return losses, first_update, state


def run(args, d) -> None:
    args.global_batch = d.world_size * args.batch_size * args.grad_accum
    args.precision = "fp32"
    report.print0(f"world {d.world_size} | device {d.device} | global batch {args.global_batch} "
                  f"({d.world_size} ranks x {args.batch_size} x accum {args.grad_accum}) | "
                  f"lr {args.lr * args.global_batch / args.base_batch:g}, {args.steps} steps")
    results = {(opt, divided): train(args, d, opt, divided)
               for opt in ("adamw", "sgd") for divided in (True, False)}
    # AdamW on gradients c times larger is AdamW with eps / c (m grows c-fold, sqrt(v) too)
    eps_run = train(args, d, "adamw", True, eps_over_accum=True)
    shown = sorted({1, 10, 20, args.steps} & set(range(1, args.steps + 1)))
    report.print0(f"{'optimizer':9} {'loss':14}" + "".join(f"{'step ' + str(t):>12}"
                                                            for t in shown)
                  + f"{'first update / divided':>24}{'max |w - w_divided|':>21}")
    out = {}
    for (opt, divided), (losses, update, state) in results.items():
        ref_update, ref_state = results[opt, True][1], results[opt, True][2]
        # first step: how much larger the undivided update is (same weights, same batch)
        ratio = (torch.linalg.vector_norm(torch.cat([u.flatten() for u in update]))
                 / torch.linalg.vector_norm(torch.cat([u.flatten() for u in ref_update]))).item()
        diff = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        name = "loss / grad_accum" if divided else "loss"
        report.print0(f"{opt:9} {name:17}" + "".join(f"{losses[t - 1]:12.4f}" for t in shown)
                      + f"{ratio:21.4f}{diff:21.2e}")
        out[f"{opt} {'divided' if divided else 'undivided'}"] = {
            "losses": losses, "first_update_ratio": ratio, "max_abs_diff_to_divided": diff}
        if args.export and d.rank == 0:
            tag = f"{opt}.{'divided' if divided else 'undivided'}"
            report.save_state_dict(report.variant_path(args.export, tag, several=True), state)
    eps_diff = max((eps_run[2][k] - results["adamw", False][2][k]).abs().max().item()
                   for k in eps_run[2])
    report.print0(f"adamw with loss / grad_accum and eps 1e-8 / {args.grad_accum}: step "
                  f"{args.steps} loss {eps_run[0][-1]:.4f}, max |w - w_undivided| = "
                  f"{eps_diff:.2e}")
    out["adamw divided eps/grad_accum"] = {"losses": eps_run[0],
                                           "max_abs_diff_to_undivided": eps_diff}
    if args.export and d.rank == 0:
        report.save_state_dict(report.variant_path(args.export, "adamw.divided_eps", several=True),
                               eps_run[2])
    if args.json_out and d.rank == 0:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "steps": args.steps,
            "grad_accum": args.grad_accum, "global_batch": args.global_batch,
            "lr": args.lr * args.global_batch / args.base_batch,
            "warmup_steps": args.warmup_steps, "runs": out})
    dist.barrier()  # the files are complete before any rank exits


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=40, batch_size=32, lr=1e-2)
    p.set_defaults(grad_accum=4)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes each run's plain state_dict to PATH with the run's name "
                        "before the suffix (ex2.pt -> ex2.adamw.undivided.pt)")
    cli.add_template_args(p)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "lr", "timeout_s")
    cli.check_template_args(args)
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
