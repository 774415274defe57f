"""ZeRO stages 1 and 2 written by hand: a sharded optimizer in ~150 lines of torch.distributed.

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/zero_from_scratch.py              # stage 2, AdamW
    torchrun --nproc_per_node=3 03-deepspeed/zero_from_scratch.py --stage 1 --optimizer sgd
    python 03-deepspeed/zero_from_scratch.py                                   # 1 process
    torchrun --nproc_per_node=2 03-deepspeed/zero_from_scratch.py --device cuda  # NCCL

The idea (Rajbhandari et al. 2020, "ZeRO", stages P_os and P_os+g): every rank keeps the whole
model, but each parameter has ONE owner rank, and only the owner keeps optimizer state for it and
updates it. After the update the owner broadcasts the new values, so all replicas stay equal.

    stage 1: backward -> all-reduce every gradient (all ranks hold all averaged gradients)
             -> each rank steps the parameters it owns -> broadcast each parameter from its owner
    stage 2: backward, and as soon as a gradient is complete -> reduce it to its owner only and
             free it elsewhere -> owner steps -> broadcast from the owner

Per rank: Adam state 8P/N instead of 8P (both stages); gradients kept P/N at stage 2 instead of P.
Communication per step: stage 1 all-reduce (2P) + broadcasts (P); stage 2 reduce (P) + broadcasts
(P). DeepSpeed 0.19 cuts one flat buffer of all parameters into N equal partitions instead of
dealing out whole parameters; its backward all-reduces each bucket of gradients (stage 1 at the
last micro-step, stage 2 as each bucket fills) and each rank keeps its partition's slice (one
`reduce` per owner with use_multi_rank_bucket_allreduce false), and one all-gather of the
partitions replaces the broadcasts. Only its stage 3 reduce-scatters.

Set-up, metrics and export come from the course's shared module, dtcourse; the data is its
classification_batch (lesson 01's task).
"""


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows

SCRIPT = "03-deepspeed/zero_from_scratch.py"


class ShardedOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer_cls` so that each rank keeps state for, and updates, only its parameters.

    params: an iterable of tensors or of param-group dicts, as for any torch optimizer.
    optimizer_cls: e.g. torch.optim.AdamW; **kwargs go to it (lr, weight_decay, ...).
    stage: 1 or 2 (how gradients are averaged before the update, see below).

    Ownership: parameters are dealt out largest first, each to the rank that owns the fewest bytes
    so far: every rank computes the same assignment, and each holds about 1/N of the state bytes.

    Gradients are averaged over the ranks before the update:
      stage 1 uses an all-reduce of its own in step(), so the class works on a plain model; with
        DDP the all-reduce would run during backward instead (DDP's buckets) and do the same work.
      stage 2 reduces each gradient to its owner from a hook that runs as soon as backward has
        accumulated it, then drops it on the other ranks. A full set of gradients never exists on
        any rank, which is the point of stage 2; the owner adds each micro-step's average to its
        own buffer, so gradient accumulation (several backwards per step) works too.
    Parameters with requires_grad=False, or without a gradient this step, are skipped (every rank
    runs the same graph, so they agree on which). A tied parameter is one tensor: it is owned,
    reduced and broadcast once.
    """

    def __init__(self, params, optimizer_cls, *, stage: int = 1, group=None, **kwargs):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        self.stage, self.group = stage, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.owner, self.owned_bytes = {}, [0] * self.world
        self._owned_groups, self._reduced, self._hooks = [], {}, []
        self.optimizer_cls, self.inner = optimizer_cls, None
        super().__init__(params, defaults=dict(kwargs))  # calls add_param_group for each group
        # The real optimizer sees this rank's parameters only, group by group (so the same group
        # index means the same hyper-parameters in both).
        self.inner = optimizer_cls(self._owned_groups, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # checks duplicates, fills in the defaults
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: -t.numel() * t.element_size()):
            # Deterministic on every rank: same order, ties go to the lowest rank. Frozen
            # parameters get an owner too but no state, so they do not count towards balance.
            owner = min(range(self.world), key=lambda r: self.owned_bytes[r])
            self.owner[p] = owner
            self.owned_bytes[owner] += p.numel() * p.element_size() * p.requires_grad
            if self.stage == 2 and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._reduce_to_owner))
        owned = {**{k: v for k, v in group.items() if k != "params"},
                 "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        if self.inner is None:
            self._owned_groups.append(owned)
        else:
            self.inner.add_param_group(owned)

    def _src(self, p) -> int:
        """Global rank of the owner (collectives name global ranks, ownership is group-local)."""
        return dist.get_global_rank(self.group, self.owner[p]) if self.group else self.owner[p]

    @torch.no_grad()
    def _reduce_to_owner(self, p) -> None:
        # stage 2, during backward: sum this gradient onto its owner only (a reduce, half the
        # traffic of an all-reduce), then free it here unless we own it.
        dist.reduce(p.grad, dst=self._src(p), op=dist.ReduceOp.SUM, group=self.group)
        if self.owner[p] == self.rank:
            self._reduced[p] = self._reduced.get(p, 0) + p.grad / self.world
        p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:  # average over ranks: every rank gets every gradient
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
                        p.grad.div_(self.world)
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        else:
            # Owned gradients come from the reduce buffers; which parameters had one this step
            # is the same on all ranks, so ask the owners.
            for p, grad in self._reduced.items():
                p.grad = grad
            flat = [p for g in self.param_groups for p in g["params"]]
            had_grad = torch.tensor([float(p in self._reduced) for p in flat],
                                    device=flat[0].device)  # NCCL reduces device tensors only
            dist.all_reduce(had_grad, group=self.group)  # exactly one owner reports each one
            stepped = [p for p, had in zip(flat, had_grad.tolist()) if had]
            self._reduced = {}
        # Hyper-parameters (an LR scheduler changes them on this object) flow to the inner groups.
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.inner.step()  # updates the owned parameters only; their state lives here only
        for p in stepped:
            dist.broadcast(p.data, src=self._src(p), group=self.group)  # owner -> replicas
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the module's .grad of every parameter
        self._reduced = {}

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (Adam moments / momentum; 0-dim counters
        excluded)."""
        return report.tensor_bytes(t for t in report.optimizer_tensors(self.inner) if t.dim() > 0)

    def state_dict(self):
        """This rank's shard only: save one file per rank (as DeepSpeed does)."""
        return {"rank": self.rank, "world": self.world, "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        if (state_dict["rank"], state_dict["world"]) != (self.rank, self.world):
            raise ValueError(f"shard of rank {state_dict['rank']}/{state_dict['world']} loaded on "
                             f"rank {self.rank}/{self.world}")
        self.inner.load_state_dict(state_dict["inner"])


# --------------------------------------------------------------------------------------------------
# A model with the cases a sharded optimizer must handle, and its param groups


class TiedNet(nn.Module):
    """32 features -> 10 classes, with the cases a sharded optimizer must handle: `mix2` reuses
    `mix1`'s weight (tied), `frozen` never has a gradient, and biases go in their own group."""

    def __init__(self, hidden: int = 64, features: int = 32, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.mix1, self.mix2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.mix2.weight = self.mix1.weight  # tied: one Parameter used twice
        self.mix3 = nn.Linear(hidden, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        h = F.gelu(self.mix1(h)) + self.frozen(h)
        h = F.gelu(self.mix3(F.gelu(self.mix2(h))))
        return self.out(h)


def param_groups(model):
    """Weight decay on matrices, none on biases: two groups, the second added later."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}


# --------------------------------------------------------------------------------------------------
# Training with it


def train(args, d):
    torch.manual_seed(args.seed)
    model = TiedNet().to(d.device)  # same seed on every rank: identical replicas, no broadcast
    cls, extra = OPTIMIZERS[args.optimizer]
    groups = param_groups(model)
    opt = ShardedOptimizer(groups[:1], cls, stage=args.stage, lr=args.lr, **extra)
    opt.add_param_group(groups[1])
    global_bs = d.world_size * args.batch_size
    report.print0(f"ShardedOptimizer stage {args.stage} over {args.optimizer} | world "
                  f"{d.world_size} | global batch {global_bs}")
    losses, held, t_start = [], None, None
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        x, y = classification_batch(args.seed, step, global_bs)
        rows = rank_rows(d.rank, args.batch_size)
        loss = F.cross_entropy(model(x[rows].to(d.device)), y[rows].to(d.device))
        loss.backward()  # stage 2: gradients leave for their owners during this call
        opt.step()
        if step == args.steps - 1:  # after the step: stage 2 holds its owned gradients only
            held = report.held_bytes(params=model.parameters(), optimizer=opt.inner,
                                     device=d.device)
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / d.world_size)
        if (step + 1) % 10 == 0 or step == 0:
            report.print0(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f}")
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    samples_per_s = global_bs * (args.steps - 1) / elapsed if t_start else float("nan")
    report_run(args, d, model, opt, losses, held, samples_per_s)


def report_run(args, d, model, opt, losses, held, samples_per_s):
    """Optimizer state per rank, next to what one unsharded optimizer would hold; metrics."""
    whole = sum(2 * p.numel() * p.element_size() if args.optimizer == "adamw"
                else p.numel() * p.element_size() for p in model.parameters()
                if p.requires_grad)
    owned = sum(len(g["params"]) for g in opt.inner.param_groups)
    per_rank = report.gather({**held, "state_bytes": opt.state_bytes(), "owned_params": owned})
    for r, info in enumerate(per_rank):
        report.print0(f"rank {r}: optimizer state {info['state_bytes']:,} bytes "
                      f"({info['state_bytes'] / whole:.0%} of the unsharded {whole:,}), "
                      f"{info['owned_params']} parameter tensors")
    metrics = report.metrics(d, script=SCRIPT, strategy=f"sharded-stage{args.stage}-"
                             f"{args.optimizer}", steps=args.steps,
                             global_batch=d.world_size * args.batch_size, losses=losses,
                             samples_per_s=samples_per_s, per_rank=per_rank,
                             unsharded_state_bytes=whole)
    report.finish(args, metrics, model.state_dict())


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=16, lr=1e-2, grad_accum=False,
                       batch_help="samples per rank per step")
    cli.add_output_args(p)
    p.add_argument("--stage", type=int, choices=[1, 2], default=2)
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
