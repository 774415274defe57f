"""Dropless mixture of experts (MegaBlocks, Gale et al., MLSys 2023, arXiv 2211.15841): no
capacity, no dropped token. Each rank counts its tokens per expert, the counts travel in one
all-to-all, and then the tokens themselves in an all-to-all of uneven sizes; every expert runs on
all the tokens that arrive for it, however many, and the results come back by the reverse
all-to-all. The uneven all-to-alls alone do not make it dropless: MegaBlocks' capacity-based
layer (ParallelMLP) sends the same routed rows and drops those past capacity where they arrive;
its dropless layer (dmoe.ParallelDroplessMLP) runs experts that take any number of rows.

Launch (from the repository root):
    python 05-advanced/b-pipeline-expert-context/moe_dropless.py                # all 8 experts
    torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/moe_dropless.py  # 4 each
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/moe_dropless.py --top-k 1

The model, its weights (one seed) and the data are expert_parallel.py's; only the dispatch
differs. On rank r, with N tokens, E experts over W ranks (E / W each), top-k routing:

    router: p = softmax(x W_r) (N, E); each token's k most probable experts, weights p
    sort the N k (token, expert) assignments by expert: rank 0's experts first, then rank 1's ...
    counts (E,) = assignments per expert
    all-to-all of counts: received (W, E/W) = what each rank will send to each local expert
    all-to-all #1, uneven: send sizes = counts summed per destination rank, receive sizes =
        received counts summed per source rank; the rows of x travel, nothing else
    regroup the arrived rows by local expert; each expert runs on all of its rows
    all-to-all #2, uneven (the sizes swapped): the results go home, in the sorted order
    y[t] = sum over t's k experts of p * expert(x[t])   (index_add back to token order)

Nothing is padded and nothing is dropped: in all-to-all #1 a rank sends its rows routed to other
ranks' experts, in #2 the results of the rows other ranks sent it, d values a row: numbers set by
the routing, where expert_parallel.py's capacity version sends its fixed slots. Beside each step
the script counts what expert_parallel.py's capacity rule would have dropped from the same
routing. The backward of an uneven all-to-all is the all-to-all with the
sizes swapped; the count all-to-all needs none (counts carry no gradient).
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, lessons, report, timing

SCRIPT = "05-advanced/b-pipeline-expert-context/moe_dropless.py"
# The model, routing rule, build and step of the capacity version, reused as they are.
ep = lessons.load(Path(__file__).resolve().parent / "expert_parallel.py")


# --------------------------------------------------------------------------------------------------
# The all-to-all of uneven sizes, differentiable


class AllToAllUneven(torch.autograd.Function):
    """x: (sum(send), d) rows, the first send[0] for rank 0, the next send[1] for rank 1, ... ->
    (sum(recv), d), recv[i] rows from rank i. Its gradient goes the reverse route: the same
    all-to-all with send and recv swapped."""

    @staticmethod
    def forward(ctx, x, recv, send):
        ctx.recv, ctx.send = recv, send
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None


# --------------------------------------------------------------------------------------------------
# The dropless layer


class DroplessMoELayer(nn.Module):
    """expert_parallel.MoELayer's router and experts, dispatched without capacity. Built from a
    capacity layer so that one seed gives both the same weights (and the same state_dict keys:
    the export loads into expert_parallel.MoEModel)."""

    def __init__(self, layer):
        super().__init__()
        self.num_experts, self.top_k, self.group_size = layer.num_experts, layer.top_k, \
            layer.group_size
        self.capacity = layer.capacity  # only to count what the capacity rule would drop
        self.router, self.experts = layer.router, layer.experts

    def forward(self, x):
        """x: (N, d) tokens of this rank. Returns y (N, d), the load-balancing loss summed over
        this rank's groups (as the capacity layer computes it), and routing statistics."""
        W, E, k = dist.get_world_size(), self.num_experts, self.top_k
        probs = F.softmax(self.router(x), dim=-1)                    # (N, E)
        weight, choice = probs.topk(k, dim=-1)                       # (N, k)
        # Sort the assignments by expert; experts are numbered rank by rank, so this also sorts
        # them by destination rank.
        order = torch.argsort(choice.reshape(-1), stable=True)       # (N k,)
        token = order // k                                           # token of each assignment
        counts = torch.bincount(choice.reshape(-1), minlength=E)     # (E,)
        # all-to-all of the counts: received[i, e] = rows rank i sends to our local expert e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        received = received.reshape(W, E // W)
        send = counts.reshape(W, E // W).sum(1).tolist()             # rows to each rank
        recv = received.sum(1).tolist()                              # rows from each rank
        # all-to-all #1: each row to the rank of its expert, (N k, d) -> (sum(recv), d), which
        # arrive by source rank and, within a source, by expert
        rows = AllToAllUneven.apply(x[token], recv, send)
        # Regroup by local expert, run each on all of its rows, undo the regrouping.
        local = torch.arange(E // W, device=x.device).repeat(W)      # expert of each arrived run
        by_expert = torch.argsort(local.repeat_interleave(received.reshape(-1)), stable=True)
        sizes = received.sum(0).tolist()                             # rows per local expert
        outs = [self.experts[key](part)
                for key, part in zip(self.experts, rows[by_expert].split(sizes))]
        out = torch.cat(outs)[torch.argsort(by_expert)]
        # all-to-all #2: the results go home, (sum(recv), d) -> (N k, d) in the sorted order
        back = AllToAllUneven.apply(out, send, recv)
        y = torch.zeros_like(x).index_add(0, token, back * weight.reshape(-1)[order, None])
        # Switch load-balancing loss per group of group_size tokens, as expert_parallel.py
        groups = probs.reshape(-1, self.group_size, E)               # (g, S, E)
        aux = ep.load_balancing_loss(groups)
        with torch.no_grad():  # what the capacity rule would drop from this very routing
            _, _, dropped = ep.route(groups, k, self.capacity)
        r = dist.get_rank()
        # rows this rank sends to other ranks in all-to-all #1 (its tokens) and #2 (their results)
        leaving = [sum(send) - send[r], sum(recv) - recv[r]]
        stats = {"routed": counts,                                   # (E,) this rank's rows
                 "computed": torch.tensor(rows.shape[0], device=x.device),  # rows our experts ran
                 "capacity_drops": dropped.sum(),
                 "sent_bytes": torch.tensor(leaving, device=x.device) * x.shape[1]
                 * x.element_size()}
        return y, aux, stats


def build(args, d):
    """expert_parallel.py's model (same seed, same weights, this rank's E / W experts) and
    optimizer, with the dropless layer in place of the capacity one (the same parameters)."""
    model, optimizer, replicated = ep.build(args, d)
    model.moe = DroplessMoELayer(model.moe)
    return model, optimizer, replicated


# --------------------------------------------------------------------------------------------------
# Training: the loop and the report


def train(args, d):
    model, optimizer, replicated = build(args, d)
    world, global_bs = d.world_size, d.world_size * args.batch_size
    C, groups = model.moe.capacity, args.batch_size // args.group_size
    padded = (world - 1) * (args.experts // world) * groups * C * args.hidden * 4
    report.print0(f"dropless: experts {args.experts} over {world} rank(s) "
                  f"({args.experts // world} each) | top-{args.top_k} | no capacity | global "
                  f"batch {global_bs} | the capacity version (factor {args.capacity_factor:g}): "
                  f"{C} slots per expert per group of {args.group_size}, each all-to-all sends "
                  f"{padded} bytes per rank")
    history, t_start = [], None
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        loss, stats, _ = ep.forward_backward(args, d, model, replicated, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = torch.cat([loss.detach().reshape(1), stats["routed"].float(),
                            stats["computed"].float().reshape(1),
                            stats["capacity_drops"].float().reshape(1)])
        dist.all_reduce(totals)  # [global loss, rows per expert, rows computed, capacity drops]
        sent = stats["sent_bytes"]
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # the busiest rank of each all-to-all
        row = {"loss": totals[0].item(), "tokens_per_expert": totals[1:-2].long().tolist(),
               "computed": int(totals[-2]), "capacity_drops": int(totals[-1]),
               "max_sent_bytes": sent.tolist()}
        history.append(row)
        if step == 0 or (step + 1) % 5 == 0:
            report.print0(f"step {step + 1:3d}/{args.steps} | loss {row['loss']:.4f} | tokens "
                          f"per expert {row['tokens_per_expert']} | computed {row['computed']} "
                          f"of {args.top_k * global_bs} | capacity would drop "
                          f"{row['capacity_drops']} | all-to-alls send at most "
                          f"{row['max_sent_bytes'][0]} (out) and {row['max_sent_bytes'][1]} "
                          f"(back) bytes per rank")
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * global_bs / elapsed if t_start else float("nan")
    report_run(args, d, model, optimizer, history, samples_per_s, padded)


def report_run(args, d, model, optimizer, history, samples_per_s, padded):
    per_rank, parts = ep.gather_ranks(d, model, optimizer)
    report.print0(f"done: {args.steps} steps, {samples_per_s:.0f} samples/s")
    metrics = report.metrics(
        d, script=SCRIPT, strategy="expert-parallel-dropless", steps=args.steps,
        global_batch=d.world_size * args.batch_size, losses=[h["loss"] for h in history],
        samples_per_s=samples_per_s, per_rank=per_rank, experts=args.experts, top_k=args.top_k,
        tokens_per_expert=[h["tokens_per_expert"] for h in history],
        computed=[h["computed"] for h in history],
        capacity_drops=[h["capacity_drops"] for h in history],
        max_sent_bytes=[h["max_sent_bytes"] for h in history], padded_sent_bytes=padded)
    report.finish(args, metrics, {k: v for part in parts for k, v in part.items()})


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    ep.add_moe_args(
        p, capacity_help="only for the comparison: the capacity version's slots per expert, "
                         "ceil(k * group_size * factor / E), and the tokens it would drop",
        group_help="S: tokens per group of the load-balancing loss and of the capacity "
                   "comparison (a rank holds whole groups)")
    return ep.check_moe_args(p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
