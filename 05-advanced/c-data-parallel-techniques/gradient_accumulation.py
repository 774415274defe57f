"""Gradient accumulation under DDP: a large effective batch from small micro-batches, and the bug
that silently multiplies the learning rate.

Launch (from the repository root):
    python 05-advanced/c-data-parallel-techniques/gradient_accumulation.py           # 1 process
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_accumulation.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_accumulation.py \\
        --buggy                                              # the loss not divided by --grad-accum
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/gradient_accumulation.py \\
        --device cuda

One optimizer step with accumulation A on W ranks:

    micro-step 1 .. A-1   forward, backward inside ddp.no_sync(): grads add up in .grad, no comm
    micro-step A          forward, backward: DDP all-reduces (averages) the summed grads
    optimizer.step()      every rank applies the same averaged gradient

Each micro-step's loss is a mean over its B samples. Dividing it by A makes the accumulated
gradient the gradient of the mean over all A*B samples, so the step equals one step on the whole
batch. Forgetting the division (--buggy) gives A times that gradient: for SGD this is the learning
rate multiplied by A; Adam hides it almost completely (it divides by the gradient's own scale), so
the bug surfaces when you switch to SGD, clip gradients, or compare the logged gradient norm (not
the loss) with a run without accumulation; under Adam without clipping, changing A hardly shows it.
"""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, comm, launch, report
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "05-advanced/c-data-parallel-techniques/gradient_accumulation.py"


# --------------------------------------------------------------------------------------------------
# Accumulating micro-steps under DDP


def build(args, d):
    """The MLP under DDP, plain SGD (so a wrong gradient scale is a wrong step size), and a
    counter of the all-reduces DDP launches (one per gradient bucket), to watch no_sync() skip
    them."""
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(d.device)
    ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    allreduces = comm.counting_allreduce(d.world_size)
    ddp.register_comm_hook(None, allreduces)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    return model, ddp, optimizer, allreduces


def accumulate(ddp, x_local, y_local, micro_bs: int, accum: int, divide: bool):
    """Forward + backward of `accum` micro-batches into .grad; returns the mean micro-step loss.

    x_local: (accum * micro_bs, 32), this rank's rows of the global batch.
    """
    mean_loss = torch.zeros((), device=x_local.device)
    for micro in range(accum):
        rows = slice(micro * micro_bs, (micro + 1) * micro_bs)
        # The last micro-step's backward triggers DDP's all-reduce of the *summed* gradients;
        # the others skip it: no communication, .grad just accumulates.
        last = micro == accum - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = F.cross_entropy(ddp(x_local[rows]), y_local[rows])
            (loss / accum if divide else loss).backward()
        mean_loss += loss.detach() / accum
    return mean_loss


def grad_norm(model) -> float:
    return torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()


def first_step_both_ways(args, model, ddp, optimizer, allreduces, x_local, y_local):
    """Step 1's gradients computed both ways on the same weights and samples, the way this run
    does not train first; leaves the training way's in .grad. Returns (mean loss, {'correct':
    grads, 'buggy': grads}) with the averaged gradients copied to the CPU."""
    micro, accum = args.batch_size, args.grad_accum
    accumulate(ddp, x_local, y_local, micro, accum, divide=args.buggy)
    other = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
    other_norm = grad_norm(model)
    optimizer.zero_grad(set_to_none=True)
    allreduces.calls = 0  # that extra all-reduce is not part of training
    step_loss = accumulate(ddp, x_local, y_local, micro, accum, divide=not args.buggy)
    norm = grad_norm(model)  # after the all-reduce: the same on every rank
    if args.buggy:
        report.print0(f"step 1 gradient norm {norm:.4f} = {norm / other_norm:.2f} x the correct "
                      f"{other_norm:.4f} (loss not divided by --grad-accum {accum})")
    else:
        report.print0(f"step 1 gradient norm {norm:.4f} (loss not divided by {accum}, the "
                      f"--buggy way: {other_norm:.4f} = {other_norm / norm:.2f}x)")
    mine = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
    return step_loss, {"correct": other, "buggy": mine} if args.buggy else \
        {"correct": mine, "buggy": other}


# --------------------------------------------------------------------------------------------------
# The loop


def train(args, d):
    model, ddp, optimizer, allreduces = build(args, d)
    micro, accum = args.batch_size, args.grad_accum
    effective = micro * accum * d.world_size
    report.print0(f"world {d.world_size} | effective batch {effective} = micro-batch {micro} x "
                  f"accumulation {accum} x world {d.world_size} | SGD lr {args.lr:g}")

    losses, norms, t0 = [], [], time.perf_counter()
    for step in range(args.steps):
        x_all, y_all = classification_batch(args.seed, step, effective)
        # This rank's rows r*B*A .. (r+1)*B*A - 1, cut into A micro-batches of B in accumulate().
        rows = rank_rows(d.rank, micro * accum)
        x_local, y_local = x_all[rows].to(d.device), y_all[rows].to(d.device)
        if step == 0:
            step_loss, _ = first_step_both_ways(args, model, ddp, optimizer, allreduces,
                                                x_local, y_local)
        else:
            step_loss = accumulate(ddp, x_local, y_local, micro, accum, divide=not args.buggy)
        norms.append(grad_norm(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        dist.all_reduce(step_loss)  # report the mean loss over the global batch
        losses.append(step_loss.item() / d.world_size)
        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            report.print0(f"step {done:2d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                          f"{norms[-1]:.4f}")
    elapsed = time.perf_counter() - t0

    per_step = allreduces.calls / args.steps
    report.print0(f"done: {args.steps} steps, all-reduces per optimizer step: {per_step:g} "
                  f"(no_sync on {accum - 1} of {accum} micro-steps)")
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    metrics = report.metrics(d, script=SCRIPT, strategy="ddp", steps=args.steps,
                             global_batch=effective, losses=losses,
                             samples_per_s=effective * args.steps / elapsed, per_rank=per_rank,
                             grad_accum=accum, buggy=args.buggy, grad_norms=norms,
                             allreduces_per_step=per_step)
    report.finish(args, metrics, model.state_dict())


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=8, lr=0.1,
                       batch_help="samples per rank per micro-step")
    p.set_defaults(grad_accum=4)
    cli.add_output_args(p)
    p.add_argument("--buggy", action="store_true",
                   help="the classic bug: do not divide the micro-step loss by --grad-accum")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "hidden", "log_every", "lr",
                       "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
