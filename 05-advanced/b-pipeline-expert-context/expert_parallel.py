"""Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks, with
tokens sent to their experts and brought back by two all-to-alls.

Launch (from the repository root):
    python 05-advanced/b-pipeline-expert-context/expert_parallel.py                # all 8 experts
    torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/expert_parallel.py  # 4 each
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/expert_parallel.py \\
        --top-k 1 --capacity-factor 1

One MoE layer, per group of S tokens (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):

    router: p = softmax(x W_r)              (S, E)   every rank holds the router (replicated)
    top-k:  each token picks its k most probable experts; an expert takes at most
            C = ceil(k * S * capacity_factor / E) tokens per group, first choices first, then in
            token order; an assignment past C is dropped (the token skips that expert: the
            residual connection carries it on unchanged)
    dispatch (S, E, C) one-hot:   expert inputs  (E, C, d) = dispatch^T x
    all-to-all #1:  rank r keeps the slots of its E/W experts, from every rank
    experts:        rank r runs its E/W expert MLPs on (W * groups * C, d) rows
    all-to-all #2:  the outputs go back to the ranks that own the tokens
    combine (S, E, C) = dispatch * p:  y = combine x expert outputs  (S, d)
    load-balancing loss: E * sum_e f_e P_e, f_e = share of tokens whose first choice is e,
            P_e = mean router probability of e. It equals 1 whenever the first choices are
            uniform (f_e = 1/E), but 1 is not its minimum: it falls below 1 when first choices
            and mean probabilities disagree (tokens routed (0.51, 0.49), (0.51, 0.49),
            (0, 1) give 0.893). Its gradient, through P_e (f_e counts argmaxes and has none),
            lowers the probability of the experts that take the most first choices, which
            pushes the router towards uniform loads.

What crosses the network: in this padded (GShard-style) dispatch each all-to-all moves the
capacity slots, not the tokens: every rank sends E/W * groups * C * d values to each other rank,
padding included, whatever the routing. (Dropless dispatchers, MegaBlocks or Megatron-Core's
all-to-all dispatcher, send only the routed tokens in all-to-alls of uneven sizes.) The backward of
an all-to-all is the reverse all-to-all, so the backward pass makes two more.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows

SCRIPT = "05-advanced/b-pipeline-expert-context/expert_parallel.py"


# --------------------------------------------------------------------------------------------------
# The all-to-all, differentiable


class AllToAll(torch.autograd.Function):
    """x: (W, ...) -> (W, ...): block j of this rank's input goes to rank j, and block i of the
    output came from rank i. Its gradient travels the reverse route, which (with equal blocks)
    is the same all-to-all applied to the gradient."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()  # the collective reads and writes flat memory: both sides contiguous
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad)
        return out


# --------------------------------------------------------------------------------------------------
# Routing and the MoE layer


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def route(probs, top_k: int, capacity: int):
    """GShard routing of one batch of groups. probs: (g, S, E) router probabilities.
    Returns dispatch (g, S, E, C) in {0, 1}, combine (g, S, E, C) = dispatch * probability, and
    dropped (g, S, k): True where choice j of token s found its expert full."""
    g, S, E = probs.shape
    weight, choice = probs.topk(top_k, dim=-1)                       # (g, S, k)
    onehot = F.one_hot(choice, E)                                    # (g, S, k, E)
    # Queue position of every (token, choice) at its expert: all first choices queue before any
    # second choice (GShard), tokens in order within a choice. Cumulative count, choice-major.
    queue = onehot.transpose(1, 2).reshape(g, top_k * S, E)
    position = (queue.cumsum(dim=1) - 1).reshape(g, top_k, S, E).transpose(1, 2)
    position = (position * onehot).sum(-1)                           # (g, S, k)
    kept = position < capacity
    slot = F.one_hot(position.clamp(max=capacity - 1), capacity)     # (g, S, k, C)
    dispatch = (onehot.unsqueeze(-1) * slot.unsqueeze(-2) * kept[..., None, None]).to(probs.dtype)
    combine = (dispatch * weight[..., None, None]).sum(2)           # (g, S, E, C)
    return dispatch.sum(2), combine, ~kept


def load_balancing_loss(probs):
    """Switch Transformer's auxiliary loss, E * sum_e f_e P_e, per group and summed over groups.
    probs: (g, S, E) router probabilities; f_e: share of the group's tokens whose first choice is
    e (no gradient), P_e: mean probability of e over the group."""
    E = probs.shape[-1]
    first = F.one_hot(probs.argmax(-1), E).float().mean(1)      # (g, E) f_e
    return (E * (first * probs.mean(1)).sum(-1)).sum()


class MoELayer(nn.Module):
    """Top-k mixture of experts. Built with all E experts; `keep_experts` leaves a rank its own
    E / W. With all experts local (one process) the all-to-alls are identities: the plain MoE."""

    def __init__(self, hidden, ffn, experts, top_k, capacity_factor, group_size):
        super().__init__()
        self.num_experts, self.top_k, self.group_size = experts, top_k, group_size
        self.capacity = math.ceil(top_k * group_size * capacity_factor / experts)
        self.router = nn.Linear(hidden, experts, bias=False)
        # Keys are global expert ids, so a rank's state_dict names match the unsplit model's.
        self.experts = nn.ModuleDict({str(e): Expert(hidden, ffn) for e in range(experts)})

    def keep_experts(self, ids):
        self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in ids})

    def forward(self, x):
        """x: (tokens, d) of this rank, tokens a multiple of group_size. Returns y (tokens, d),
        the load-balancing loss summed over this rank's groups, and routing statistics."""
        W, E, C = dist.get_world_size(), self.num_experts, self.capacity
        d = x.shape[-1]
        xg = x.reshape(-1, self.group_size, d)                       # (g, S, d)
        probs = F.softmax(self.router(xg), dim=-1)                   # (g, S, E)
        dispatch, combine, dropped = route(probs, self.top_k, C)
        # expert-major slots: (E, g, C, d); block j of dim 0 = the experts of rank j
        slots = torch.einsum("gsec,gsd->egcd", dispatch, xg)
        g = xg.shape[0]
        # all-to-all #1: (W, E/W, g, C, d) of ours -> (W, E/W, g, C, d) from every rank
        received = AllToAll.apply(slots.reshape(W, E // W, g, C, d))
        outputs = []
        for i, key in enumerate(self.experts):                      # E/W local experts
            rows = received[:, i].reshape(W * g * C, d)              # its slots, all ranks
            outputs.append(self.experts[key](rows).reshape(W, g, C, d))
        # all-to-all #2: the expert outputs go home -> (E, g, C, d) for our own tokens
        back = AllToAll.apply(torch.stack(outputs, dim=1)).reshape(E, g, C, d)
        y = torch.einsum("gsec,egcd->gsd", combine, back).reshape_as(x)
        aux = load_balancing_loss(probs)                             # summed over groups
        stats = {"routed": F.one_hot(probs.topk(self.top_k, -1)[1], E).sum((0, 1, 2)),  # (E,)
                 "dropped": dropped.reshape(-1, self.top_k)}              # (tokens, k)
        return y, aux, stats


# --------------------------------------------------------------------------------------------------
# The model (data: dtcourse.data.classification_batch, one token per row)


class MoEModel(nn.Module):
    """embed (32 -> d) -> x + MoE(LayerNorm(x)) -> head (d -> 10 classes)."""

    def __init__(self, hidden=64, ffn=128, experts=8, top_k=2, capacity_factor=1.25,
                 group_size=16, features=32, classes=10):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(hidden, ffn, experts, top_k, capacity_factor, group_size)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.embed(x)
        y, aux, stats = self.moe(self.norm(h))
        return self.head(h + y), aux, dict(stats, moe_out=y)


# --------------------------------------------------------------------------------------------------
# Training: build, one step's forward and backward, the loop, the report


def build(args, d):
    """The model with this rank's E / W experts, AdamW, and the replicated parameters (those
    whose gradients need an all-reduce)."""
    torch.manual_seed(args.seed)
    model = MoEModel(args.hidden, args.ffn, args.experts, args.top_k, args.capacity_factor,
                     args.group_size)
    per_rank_experts = args.experts // d.world_size
    mine = range(d.rank * per_rank_experts, (d.rank + 1) * per_rank_experts)
    model.moe.keep_experts(mine)  # the same seed built every expert; keep ours, drop the rest
    model.to(d.device)
    # Replicated parameters (embed, norm, router, head) see only this rank's tokens: their
    # gradients are all-reduced. Expert parameters already receive every rank's tokens through
    # the all-to-all, so their gradients are complete where they live.
    replicated = [p for n, p in model.named_parameters() if not n.startswith("moe.experts.")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, optimizer, replicated


def forward_backward(args, d, model, replicated, step: int):
    """This rank's tokens of step `step`'s global batch through the model, then backward: every
    gradient is that of the global loss. Returns (loss share, routing statistics, tokens)."""
    global_bs = d.world_size * args.batch_size
    x_all, y_all = classification_batch(args.seed, step, global_bs)
    rows = rank_rows(d.rank, args.batch_size)
    x, y = x_all[rows].to(d.device), y_all[rows].to(d.device)
    logits, aux, stats = model(x)
    # This rank's share of the global mean loss: summed over ranks it is the global loss.
    total_groups = global_bs // args.group_size
    loss = F.cross_entropy(logits, y, reduction="sum") / global_bs \
        + args.aux_weight * aux / total_groups
    loss.backward()  # two more all-to-alls run inside, in reverse order
    for p in replicated:
        dist.all_reduce(p.grad)  # sum of the ranks' shares = gradient of the global loss
    return loss, stats, x


def train(args, d):
    model, optimizer, replicated = build(args, d)
    world, global_bs, C = d.world_size, d.world_size * args.batch_size, model.moe.capacity
    per_rank_experts, groups = args.experts // world, args.batch_size // args.group_size
    a2a_bytes = (world - 1) * per_rank_experts * groups * C * args.hidden * 4
    report.print0(f"experts {args.experts} over {world} rank(s) ({per_rank_experts} each) | "
                  f"top-{args.top_k} | capacity {C} slots per expert per group of "
                  f"{args.group_size} tokens | global batch {global_bs} | each all-to-all sends "
                  f"{a2a_bytes} bytes per rank")
    losses, t_start = [], None
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        loss, stats, _ = forward_backward(args, d, model, replicated, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = torch.cat([loss.detach().reshape(1), stats["routed"].float(),
                            stats["dropped"].sum().float().reshape(1)])
        dist.all_reduce(totals)  # [global loss, tokens routed to each expert, dropped]
        losses.append(totals[0].item())
        if step == 0 or (step + 1) % 5 == 0:
            report.print0(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f} | tokens per "
                          f"expert {totals[1:-1].long().tolist()} | dropped {int(totals[-1])} of "
                          f"{args.top_k * global_bs}")
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * global_bs / elapsed if t_start else float("nan")
    report_run(args, d, model, optimizer, losses, samples_per_s, totals)


def gather_ranks(d, model, optimizer):
    """Every rank's held bytes, and the parts of the unsplit model's state_dict: every rank's
    experts, and the replicated rest (any rank's)."""
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    parts = report.gather({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return per_rank, parts


def report_run(args, d, model, optimizer, losses, samples_per_s, last_totals):
    per_rank, parts = gather_ranks(d, model, optimizer)
    report.print0(f"done: {args.steps} steps, {samples_per_s:.0f} samples/s")
    metrics = report.metrics(
        d, script=SCRIPT, strategy="expert-parallel", steps=args.steps,
        global_batch=d.world_size * args.batch_size, losses=losses, samples_per_s=samples_per_s,
        per_rank=per_rank, experts=args.experts, top_k=args.top_k, capacity=model.moe.capacity,
        tokens_per_expert_last_step=last_totals[1:-1].tolist(),
        dropped_last_step=int(last_totals[-1]))
    report.finish(args, metrics, {k: v for part in parts for k, v in part.items()})


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def add_moe_args(p, capacity_help="slots per expert = ceil(k * group_size * factor / E)",
                 group_help="S: tokens that share one capacity budget (a rank holds whole groups)"):
    """The flags of the MoE layer (moe_dropless.py takes the same ones)."""
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=64, lr=3e-3, grad_accum=False,
                       batch_help="tokens per rank per step (each rank routes its own tokens)")
    cli.add_output_args(p)
    p.add_argument("--experts", type=int, default=8, help="E: experts, divided among the ranks")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=1.25, help=capacity_help)
    p.add_argument("--group-size", type=int, default=16, help=group_help)
    p.add_argument("--aux-weight", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128, help="width of each expert's MLP")


def check_moe_args(args):
    """Bad degrees end every rank with one line, before any process group exists."""
    cli.check_positive(args, "experts", "top_k", "group_size", "hidden", "ffn", "steps",
                       "batch_size", "capacity_factor", "lr", "timeout_s")
    if args.aux_weight < 0:
        cli.fail(f"--aux-weight must be >= 0, got {args.aux_weight:g}")
    if args.top_k > args.experts:
        cli.fail(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    if args.batch_size % args.group_size:
        cli.fail(f"--batch-size {args.batch_size} is not a multiple of --group-size "
                 f"{args.group_size}: a rank routes whole groups")
    world = launch.launched().world_size  # before any process group: every rank fails alike
    if args.experts % world:
        cli.fail(f"--experts {args.experts} is not divisible by the world size {world}: every "
                 f"rank must hold the same number of experts")
    return args


def parse_args(argv=None):
    p = cli.parser(__doc__)
    add_moe_args(p)
    return check_moe_args(p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
