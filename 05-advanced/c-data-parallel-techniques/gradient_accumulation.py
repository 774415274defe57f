"""Gradient accumulation under DDP: a large effective batch from small micro-batches, and the bug
that silently multiplies the learning rate.

Launch (from the repository root):
    python 05-advanced/c-data-parallel-techniques/gradient_accumulation.py           # 1 process
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_accumulation.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_accumulation.py \\
        --buggy                                              # the loss not divided by --grad-accum
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/gradient_accumulation.py \\
        --device cuda
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_accumulation.py \\
        --variable-length                       # padded sequences: token mean vs micro-batch means

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

--variable-length: micro-batches of padded sequences with a per-token loss (padding labelled -100,
ignored), where micro-batches hold different numbers of real tokens. Dividing each micro-batch's
mean by A (and letting DDP average the ranks' results) weights a token of a short micro-batch more
than one of a long micro-batch. The loss of the whole batch is the sum of the per-token losses over
the GLOBAL token count: every micro-step backpropagates its token-loss sum divided by that count,
which one all-reduce of the ranks' counts gives before the first micro-step. Both normalisations
train side by side (--normalize) from the same weights on the same data.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, comm, launch, report, timing
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
# Variable-length micro-batches: normalise by the global token count

IGNORE = -100  # the label of a padding position: F.cross_entropy's default ignore_index
NORMALIZATIONS = ("tokens", "microbatch")


def padded_token_batch(seed: int, step: int, sequences: int, max_len: int):
    """The global batch of step t as padded sequences, a pure function of (seed, t): x (S, T, 32)
    per-token features, y (S, T) per-token classes, IGNORE after each sequence's length (drawn
    uniformly from 1..T), as a tokenizer's padding leaves them."""
    x, y = classification_batch(seed, step, sequences * max_len)
    x, y = x.view(sequences, max_len, -1), y.view(sequences, max_len)
    g = torch.Generator().manual_seed((seed + 1) * 1_000_003 + step)
    lengths = torch.randint(1, max_len + 1, (sequences, 1), generator=g)
    return x, y.masked_fill(torch.arange(max_len) >= lengths, IGNORE)


def accumulate_tokens(ddp, x_local, y_local, micro_bs: int, accum: int, normalize: str,
                      tokens_global: int, world: int) -> torch.Tensor:
    """Forward + backward of `accum` micro-batches of padded sequences into .grad; returns this
    rank's sum of per-token losses (detached).

    x_local: (accum * micro_bs, T, 32), y_local: (accum * micro_bs, T), this rank's rows.
    """
    loss_sum = torch.zeros((), device=x_local.device)
    for micro in range(accum):
        rows = slice(micro * micro_bs, (micro + 1) * micro_bs)
        y = y_local[rows].flatten()  # (B*T,)
        with contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync():
            logits = ddp(x_local[rows]).flatten(0, 1)  # (B, T, 10) -> (B*T, 10): one row per token
            # Padding positions (IGNORE) give 0 and are not counted.
            token_sum = F.cross_entropy(logits, y, reduction="sum")
            if normalize == "tokens":
                # Over the token count of the whole global batch (every micro-step, every rank);
                # x world because DDP's all-reduce averages, i.e. divides by world: the step's
                # gradient is that of sum(all token losses) / N, the mean over the global batch's
                # tokens, whatever the micro-batches hold.
                loss = token_sum * world / tokens_global
            else:
                # The fixed-size recipe: this micro-batch's mean (what reduction="mean" returns),
                # divided by accum; DDP then averages the ranks. A mean of means: a token of a
                # short micro-batch weighs more than one of a long micro-batch.
                loss = token_sum / (y != IGNORE).sum() / accum
            loss.backward()
        loss_sum += token_sum.detach()
    return loss_sum


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def flat_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_variable_length(args, d):
    """Each --normalize way trains its own copy of the MLP (the same initial weights) on the same
    padded batches; the log compares them."""
    micro, accum, world = args.batch_size, args.grad_accum, d.world_size
    sequences = micro * accum * world
    runs = {name: build(args, d) for name in args.normalize}  # same seed: same initial weights
    start = flat_weights(runs[args.normalize[0]][0])
    report.print0(f"world {world} | padded sequences of 1 to {args.seq_len} tokens | effective "
                  f"batch {sequences} sequences = micro-batch {micro} x accumulation {accum} x "
                  f"world {world} | SGD lr {args.lr:g}")

    losses = {name: [] for name in runs}
    norms = {name: [] for name in runs}
    tokens_per_step, t0 = [], timing.clock(d.device)
    for step in range(args.steps):
        x_all, y_all = padded_token_batch(args.seed, step, sequences, args.seq_len)
        rows = rank_rows(d.rank, micro * accum)
        x_local, y_local = x_all[rows].to(d.device), y_all[rows].to(d.device)
        # The real tokens of the whole global batch, counted before the first micro-step: one
        # all-reduce of one integer per optimizer step. (Every rank here builds the global batch
        # and could count it alone; a real loader hands each rank only its own rows.)
        tokens = (y_local != IGNORE).sum()
        dist.all_reduce(tokens)
        tokens_global = int(tokens.item())
        tokens_per_step.append(tokens_global)
        if step == 0:
            counts = (y_local != IGNORE).view(accum, -1).sum(dim=1).tolist()
            per_rank = " | ".join(f"rank {r}: " + " ".join(map(str, c))
                                  for r, c in enumerate(report.gather(counts)))
            report.print0(f"step 1 real tokens per micro-batch: {per_rank} | global "
                          f"{tokens_global} of {sequences * args.seq_len} positions")

        sums = []
        for name, (model, ddp, optimizer, _) in runs.items():
            sums.append(accumulate_tokens(ddp, x_local, y_local, micro, accum, name,
                                          tokens_global, world))
            norms[name].append(grad_norm(model))
        if step == 0 and len(runs) == 2:
            # The same weights, the same tokens: the difference is the normalisation alone.
            right, wrong = (flat_grad(runs[n][0]) for n in NORMALIZATIONS)
            apart = ((wrong - right).norm() / right.norm()).item()
            report.print0(f"step 1 gradient, micro-batch means vs token mean: {apart:.2%} apart "
                          f"(norm of the difference / norm of the token-mean gradient)")
        for model, _, optimizer, _ in runs.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        sums = torch.stack(sums)
        dist.all_reduce(sums)  # the token-mean loss over the global batch, for every way
        for name, loss in zip(runs, (sums / tokens_global).tolist()):
            losses[name].append(loss)
        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            report.print0(f"step {done:2d}/{args.steps} | token-mean loss " + "  ".join(
                f"{name} {losses[name][-1]:.4f}" for name in runs))
    elapsed = timing.clock(d.device) - t0

    per_step = {name: run[3].calls / args.steps for name, run in runs.items()}
    report.print0(f"done: {args.steps} steps; per optimizer step 1 all-reduce of the token "
                  f"count, then per way {per_step[args.normalize[0]]:g} gradient all-reduce "
                  f"(no_sync on {accum - 1} of {accum} micro-steps)")
    if len(runs) == 2:
        right, wrong = (flat_weights(runs[n][0]) for n in NORMALIZATIONS)
        off = ((wrong - right).norm() / (right - start).norm()).item()
        report.print0(f"final weights, micro-batch means vs token mean: {off:.2%} of the "
                      f"token-mean run's distance from the start, max |difference| "
                      f"{(wrong - right).abs().max().item():.2e}")
    write_variable_length(args, d, runs, losses, norms, tokens_per_step, per_step, elapsed)


def write_variable_length(args, d, runs, losses, norms, tokens_per_step, per_step,
                          elapsed) -> None:
    """--export: one plain state dict per way (PATH with the way before the suffix when both
    train: w.tokens.pt, w.microbatch.pt); --metrics-out: the contract's fields from the first
    way, and one entry per way."""
    several = len(runs) > 1
    variants = []
    for name, (model, _, _, _) in runs.items():
        path = None if args.export is None else report.variant_path(args.export, name, several)
        if path is not None and d.rank == 0:
            report.save_state_dict(path, model.state_dict())
        variants.append({"normalize": name, "losses": losses[name], "grad_norms": norms[name],
                         "allreduces_per_step": per_step[name],
                         "export": None if path is None else str(path)})
    first = runs[args.normalize[0]]
    per_rank = report.gather(report.held_bytes(params=first[0].parameters(),
                                               optimizer=first[2], device=d.device))
    sequences = args.batch_size * args.grad_accum * d.world_size
    # Throughput of the whole run: every way trains on every batch.
    metrics = report.metrics(d, script=SCRIPT, strategy="ddp", steps=args.steps,
                             global_batch=sequences, losses=losses[args.normalize[0]],
                             samples_per_s=sequences * args.steps * len(runs) / elapsed,
                             tokens_per_s=sum(tokens_per_step) * len(runs) / elapsed,
                             per_rank=per_rank, grad_accum=args.grad_accum, buggy=False,
                             variable_length=True, seq_len=args.seq_len,
                             tokens_per_step=tokens_per_step, variants=variants)
    report.finish(args, metrics)


# --------------------------------------------------------------------------------------------------
# The loop


def train(args, d):
    model, ddp, optimizer, allreduces = build(args, d)
    micro, accum = args.batch_size, args.grad_accum
    effective = micro * accum * d.world_size
    report.print0(f"world {d.world_size} | effective batch {effective} = micro-batch {micro} x "
                  f"accumulation {accum} x world {d.world_size} | SGD lr {args.lr:g}")

    losses, norms, t0 = [], [], timing.clock(d.device)
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
    elapsed = timing.clock(d.device) - t0

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
    p.add_argument("--variable-length", action="store_true",
                   help="padded sequences of random length with a per-token loss; --batch-size "
                        "counts sequences")
    p.add_argument("--normalize", nargs="+", choices=NORMALIZATIONS,
                   help="with --variable-length, the ways trained side by side: 'tokens' (sum of "
                        "token losses / global token count) and/or 'microbatch' (each "
                        "micro-batch's mean / --grad-accum); none given: both")
    p.add_argument("--seq-len", type=int, default=16,
                   help="with --variable-length, positions per sequence (lengths 1..seq-len)")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "hidden", "log_every", "lr",
                       "seq_len", "timeout_s")
    if args.variable_length:
        if args.buggy:
            cli.fail("--buggy is the fixed-length lesson; with --variable-length the wrong way is "
                     "--normalize microbatch")
        # Keep the order NORMALIZATIONS gives (tokens first), without repeats.
        args.normalize = [n for n in NORMALIZATIONS if n in (args.normalize or NORMALIZATIONS)]
    elif args.normalize:
        cli.fail("--normalize needs --variable-length (fixed-size micro-batches have one way)")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        (train_variable_length if args.variable_length else train)(args, d)


if __name__ == "__main__":
    main()
