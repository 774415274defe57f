"""Gradient compression as DDP communication hooks: fp16 / bf16 casts, PowerSGD (low rank), and a
hand-written top-k sparsification with error feedback; bytes sent against the loss they cost.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_compression.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/gradient_compression.py \\
        --powersgd-rank 4 --topk-ratio 0.05 --metrics-out runs/dp_compression.json
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/gradient_compression.py \\
        --device cuda --hidden 2048

A DDP comm hook replaces the all-reduce of each gradient bucket (a flat buffer holding this rank's
gradients of a group of parameters) by any function that returns a future of the averaged bucket:

    none      all_reduce(bucket / W)                               4 bytes per value
    fp16      all_reduce(fp16(bucket) / W), cast back              2 bytes per value
    bf16      all_reduce(bf16(bucket) / W), cast back              2 bytes per value (fp32 range)
    powersgd  G (n x m) ~ P Q^T: all_reduce P (n x r), then Q (m x r)   (n + m) r values
    topk      acc = grad + residual; send the k largest |acc| (values + int32 indices)
              with all_gather; residual = acc - sent stays on this rank for the next step

Error feedback is what makes the lossy ones converge: nothing is thrown away, only delayed. Each
step, sent + new residual = grad + old residual exactly, so over a run sum(sent) + residual =
sum(grads). Every method trains the same MLP from the same weights on the same batches;
figures/dp_figures.py draws the --metrics-out JSON.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "05-advanced/c-data-parallel-techniques/gradient_compression.py"
METHODS = ("none", "fp16", "bf16", "powersgd", "topk")


# --------------------------------------------------------------------------------------------------
# Top-k sparsification with error feedback, written as a DDP comm hook


class TopKState:
    """Per-parameter residuals (what was not sent yet) and, to check that nothing is lost, running
    float64 sums of the true local gradients and of what was sent."""

    def __init__(self, ratio: float, world: int):
        self.ratio, self.world = ratio, world
        self.residual, self.sum_grads, self.sum_sent = {}, {}, {}  # keyed by id(param)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # bucket.buffer(): this rank's local gradients of the bucket's parameters, flat (n,).
    # Residuals are kept per parameter, not per bucket: DDP may regroup buckets after step 1.
    params, grads = bucket.parameters(), bucket.gradients()  # grads: views into the buffer
    acc = torch.cat([g.reshape(-1) + state.residual.get(id(p), torch.zeros_like(g)).reshape(-1)
                     for p, g in zip(params, grads)])  # (n,): gradient + what is still owed
    k = max(1, math.ceil(state.ratio * acc.numel()))
    index = acc.abs().topk(k).indices  # (k,): the k largest magnitudes
    values = acc[index]
    residual = acc.clone()
    residual[index] = 0  # a partition of acc: sent values + residual = acc, exactly

    # Every rank picks different positions, so the sparse vectors cannot be all-reduced in place:
    # gather all (indices, values) pairs, then sum them densely. Sent per rank: k * (4 + 4) bytes.
    gathered_index = [torch.empty(k, dtype=torch.int32, device=acc.device)
                      for _ in range(state.world)]
    gathered_values = [torch.empty(k, dtype=acc.dtype, device=acc.device)
                       for _ in range(state.world)]
    dist.all_gather(gathered_index, index.to(torch.int32))
    dist.all_gather(gathered_values, values)
    average = torch.zeros_like(acc)
    for idx, val in zip(gathered_index, gathered_values):
        average.index_add_(0, idx.long(), val)
    average /= state.world

    # Per parameter: the residual to add next step, and float64 running sums of the true local
    # gradients and of what was sent (for the conservation check).
    sent = torch.zeros_like(acc)
    sent[index] = values
    offset = 0
    for p, g in zip(params, grads):
        part = slice(offset, offset + g.numel())
        state.residual[id(p)] = residual[part].clone()
        state.sum_grads[id(p)] = state.sum_grads.get(id(p), 0) + g.reshape(-1).double()
        state.sum_sent[id(p)] = state.sum_sent.get(id(p), 0) + sent[part].double()
        offset += g.numel()
    bucket.buffer().copy_(average)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())  # already done: the collectives above were synchronous
    return fut


# --------------------------------------------------------------------------------------------------
# The library's hooks beside it, and training with each


def make_model(method, args, d):
    """The MLP (the same start for every method) under DDP with `method`'s comm hook."""
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(d.device)
    ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    state = None
    if method == "none":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif method == "powersgd":
        # Error feedback and warm start on (the defaults): the approximation error of step t is
        # added to the gradient of step t+1, and P/Q of the previous step seed the power iteration.
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start,
                                       random_seed=args.seed)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        state = TopKState(args.topk_ratio, d.world_size)
        ddp.register_comm_hook(state, topk_hook)
    return model, ddp, state


def train(method, args, d, counter):
    """--steps of SGD with momentum; returns the model, the hook's state, the mean loss over the
    global batch, (payload bytes, ring wire bytes) this rank handed to collectives per step,
    and samples/s."""
    model, ddp, state = make_model(method, args, d)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    losses, sent, t0 = [], [], timing.clock(d.device)
    for step in range(args.steps):
        x_all, y_all = classification_batch(args.seed, step, d.world_size * args.batch_size)
        rows = rank_rows(d.rank, args.batch_size)
        loss = F.cross_entropy(ddp(x_all[rows].to(d.device)), y_all[rows].to(d.device))
        counter.bytes, counter.wire, counter.counting = 0, 0.0, True
        loss.backward()  # DDP runs the hook per bucket and waits for its future before returning
        counter.counting = False
        sent.append((counter.bytes, round(counter.wire)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # mean loss over the global batch (not counted: not a gradient)
        losses.append(mean.item() / d.world_size)
    samples_per_s = args.steps * d.world_size * args.batch_size / (timing.clock(d.device) - t0)
    return model, optimizer, state, losses, sent, samples_per_s


# --------------------------------------------------------------------------------------------------
# Measuring what is sent


class CollectiveBytes:
    """Counts the bytes this rank hands to all_reduce / all_gather while `counting` is True.

    Every hook here, ours and torch's, calls `dist.all_reduce` / `dist.all_gather` through the
    module attribute, so wrapping those two functions for the duration of training sees every
    payload, including the P and Q all-reduces PowerSGD launches from futures' callbacks. (A
    dispatcher-level counter such as dtcourse.comm.CollectiveCounter is thread-local: on gloo
    those callbacks run on the communication thread, and it sees only the first all-reduce.)
    `bytes` is the payload per rank; `wire` what a ring sends for it per rank: 2(W-1)/W x the
    payload of an all-reduce, (W-1) x the payload of an all-gather (every rank receives every
    other rank's piece), so top-k's advantage shrinks as W grows.
    """

    def __init__(self, world: int):
        self.counting, self.bytes, self.wire, self.world = False, 0, 0.0, world

    def __enter__(self):
        self.originals = dist.all_reduce, dist.all_gather

        W = self.world

        def all_reduce(tensor, *args, **kwargs):
            if self.counting:
                self.bytes += tensor.numel() * tensor.element_size()
                self.wire += 2 * (W - 1) / W * tensor.numel() * tensor.element_size()
            return self.originals[0](tensor, *args, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            if self.counting:
                self.bytes += tensor.numel() * tensor.element_size()
                self.wire += (W - 1) * tensor.numel() * tensor.element_size()
            return self.originals[1](tensor_list, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_gather = self.originals


def run(args, d):
    rows, trained = [], []
    with CollectiveBytes(d.world_size) as counter:
        for method in args.methods:
            model, optimizer, state, losses, sent, samples_per_s = train(method, args, d,
                                                                         counter)
            dense = sum(p.numel() * 4 for p in model.parameters())  # fp32 grads, uncompressed
            dense_wire = 2 * (d.world_size - 1) / d.world_size * dense  # one ring all-reduce
            # Median bytes per step after PowerSGD's warm-up of plain all-reduces (the other
            # methods send the same amount every step).
            later = sorted(sent[args.powersgd_start:]) or sorted(sent)
            steady, wire = later[len(later) // 2]
            tail = losses[-5:]
            rows.append({"method": method, "bytes_per_step": steady, "dense_bytes": dense,
                         "compression_ratio": dense / steady, "wire_bytes_per_step": wire,
                         "wire_ratio": dense_wire / wire if wire else None, "losses": losses,
                         "final_loss": sum(tail) / len(tail),
                         "bytes_each_step": [b for b, _ in sent], "samples_per_s": samples_per_s})
            trained.append((model, optimizer))
    print_table(args, d.world_size, rows)
    write_outputs(args, d, trained, rows)


def print_table(args, world, rows) -> None:
    base = next((r for r in rows if r["method"] == "none"), None)
    report.print0(f"world {world} | {args.steps} steps | dense gradients "
                  f"{rows[0]['dense_bytes']} B per rank per step | powersgd rank "
                  f"{args.powersgd_rank} | top-k {args.topk_ratio:g}")
    report.print0("loss   " + " ".join(f"{r['method']:>9}" for r in rows))
    for step in sorted({0, args.steps - 1, *range(args.log_every - 1, args.steps,
                                                  args.log_every)}):
        report.print0(f"{step + 1:5d}  " + " ".join(f"{r['losses'][step]:9.4f}" for r in rows))
    # ratio: payload against the dense gradient; on the wire: what a ring sends per rank at this
    # world size against a dense all-reduce (top-k's all-gather grows with W, the others do not)
    report.print0(f"{'method':<9} {'bytes/step':>10} {'ratio':>7} {'wire ratio':>11} "
                  f"{'loss, last 5 steps':>18} {'vs none':>8}")
    for r in rows:
        # + 0.0 turns a rounded -0.0 into 0.0
        r["loss_cost"] = round(r["final_loss"] - base["final_loss"], 4) + 0.0 if base else None
        cost = f"{r['loss_cost']:+8.4f}" if base else "       -"
        wire = "-" if r["wire_ratio"] is None else f"{r['wire_ratio']:.1f}x"
        report.print0(f"{r['method']:<9} {r['bytes_per_step']:10d} "
                      f"{r['compression_ratio']:6.1f}x {wire:>11} {r['final_loss']:18.4f} {cost}")


# --------------------------------------------------------------------------------------------------
# Outputs, arguments and launch


def write_outputs(args, d, trained, rows) -> None:
    """--export: one plain state dict per method (PATH itself when there is one method, else PATH
    with the method before the suffix); --metrics-out: the rows, with the contract's top-level
    fields taken from the first method."""
    for (model, _), row in zip(trained, rows):
        row["export"] = None if args.export is None else \
            str(report.variant_path(args.export, row["method"], several=len(rows) > 1))
        if d.rank == 0 and args.export:
            report.save_state_dict(row["export"], model.state_dict())
    model, optimizer = trained[0]
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    metrics = report.metrics(d, script=SCRIPT, strategy=f"ddp, {rows[0]['method']} hook",
                             steps=args.steps, global_batch=d.world_size * args.batch_size,
                             losses=rows[0]["losses"], samples_per_s=rows[0]["samples_per_s"],
                             per_rank=per_rank, methods=rows)
    report.finish(args, metrics)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=30, batch_size=32, lr=0.05, grad_accum=False,
                       batch_help="samples per rank per step")
    cli.add_output_args(p)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    p.add_argument("--powersgd-rank", type=int, default=2, help="rank r of P (n x r), Q (m x r)")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="plain all-reduce for the first steps (PowerSGD's warm-up; >= 2)")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="fraction of values sent")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "hidden", "powersgd_rank", "log_every", "lr",
                       "timeout_s")
    if args.powersgd_start < 2:
        cli.fail(f"--powersgd-start must be >= 2 with error feedback, got {args.powersgd_start}")
    if not 0 < args.topk_ratio <= 1:
        cli.fail(f"--topk-ratio must be in (0, 1], got {args.topk_ratio}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
