"""ZeRO stages 1 and 2 written by hand: a sharded optimizer in ~150 lines of torch.distributed.

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/zero_from_scratch.py              # stage 2, AdamW
    torchrun --nproc_per_node=3 03-deepspeed/zero_from_scratch.py --stage 1 --optimizer sgd
    python 03-deepspeed/zero_from_scratch.py                                   # 1 process

Expected output (torchrun --nproc_per_node=2, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    ShardedOptimizer stage 2 over adamw | world 2 | global batch 32
    step   1/20 | loss 2.3060
    step  10/20 | loss 2.2500
    step  20/20 | loss 1.8534
    rank 0: optimizer state 49,152 bytes (55% of the unsharded 89,168), 3 parameter tensors
    rank 1: optimizer state 40,016 bytes (45% of the unsharded 89,168), 8 parameter tensors

The idea (Rajbhandari et al. 2020, "ZeRO", stages P_os and P_os+g): every rank keeps the whole
model, but each parameter has ONE owner rank, and only the owner keeps optimizer state for it and
updates it. After the update the owner broadcasts the new values, so all replicas stay equal.

    stage 1: backward -> all-reduce every gradient (all ranks hold all averaged gradients)
             -> each rank steps the parameters it owns -> broadcast each parameter from its owner
    stage 2: backward, and as soon as a gradient is complete -> reduce it to its owner only and
             free it elsewhere -> owner steps -> broadcast from the owner

Per rank: Adam state 8P/N instead of 8P (both stages); gradients kept P/N at stage 2 instead of P.
Communication per step: stage 1 all-reduce (2P) + broadcasts (P); stage 2 reduce (P) + broadcasts
(P). DeepSpeed does the same with flat buffers, buckets and reduce-scatter / all-gather.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


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
            had_grad = torch.tensor([float(p in self._reduced) for g in self.param_groups
                                     for p in g["params"]])
            dist.all_reduce(had_grad, group=self.group)  # exactly one owner reports each one
            flat = [p for g in self.param_groups for p in g["params"]]
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
        return sum(v.numel() * v.element_size() for s in self.inner.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)

    def state_dict(self):
        """This rank's shard only: save one file per rank (as DeepSpeed does)."""
        return {"rank": self.rank, "world": self.world, "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        if (state_dict["rank"], state_dict["world"]) != (self.rank, self.world):
            raise ValueError(f"shard of rank {state_dict['rank']}/{state_dict['world']} loaded on "
                             f"rank {self.rank}/{self.world}")
        self.inner.load_state_dict(state_dict["inner"])


# --------------------------------------------------------------------------------------------------
# Running it: the usual set-up, a model with a frozen and a tied parameter, deterministic data


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--stage", type=int, choices=[1, 2], default=2)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0 or args.timeout_s <= 0:
        fail("--steps and --batch-size must be >= 1, --lr and --timeout-s positive")
    return args


def init_distributed(timeout_s: float):
    """(rank, world) with a gloo group started: under torchrun, srun, or alone (a group of one).
    ShardedOptimizer works the same on NCCL with CUDA tensors; this demo trains on the CPU."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        if "MASTER_ADDR" not in env:
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


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


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """Global batch of step `step`, a pure function of (seed, step); labels from a fixed random
    teacher. Rank r takes rows r*B..(r+1)*B-1 (as in 01-ddp-basics/ddp_training.py)."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def param_groups(model):
    """Weight decay on matrices, none on biases: two groups, the second added later."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}


def main(argv=None):
    args = parse_args(argv)
    rank, world = init_distributed(args.timeout_s)
    try:
        torch.manual_seed(args.seed)
        model = TiedNet()  # same seed on every rank: identical replicas, no broadcast needed
        cls, extra = OPTIMIZERS[args.optimizer]
        groups = param_groups(model)
        opt = ShardedOptimizer(groups[:1], cls, stage=args.stage, lr=args.lr, **extra)
        opt.add_param_group(groups[1])
        global_bs = world * args.batch_size
        if rank == 0:
            print(f"ShardedOptimizer stage {args.stage} over {args.optimizer} | world {world} | "
                  f"global batch {global_bs}", flush=True)
        losses = []
        for step in range(args.steps):
            x, y = global_batch(args.seed, step, global_bs)
            rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
            loss = F.cross_entropy(model(x[rows]), y[rows])
            loss.backward()  # stage 2: gradients leave for their owners during this call
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0 and ((step + 1) % 10 == 0 or step == 0):
                print(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f}", flush=True)

        # Optimizer state per rank, next to what one unsharded optimizer would hold.
        whole = sum(2 * p.numel() * p.element_size() if args.optimizer == "adamw"
                    else p.numel() * p.element_size() for p in model.parameters()
                    if p.requires_grad)
        per_rank = [None] * world
        owned = sum(len(g["params"]) for g in opt.inner.param_groups)
        dist.all_gather_object(per_rank, {"optim_bytes": opt.state_bytes(), "owned_params": owned})
        if rank == 0:
            for r, info in enumerate(per_rank):
                print(f"rank {r}: optimizer state {info['optim_bytes']:,} bytes "
                      f"({info['optim_bytes'] / whole:.0%} of the unsharded {whole:,}), "
                      f"{info['owned_params']} parameter tensors", flush=True)
            if args.export:
                args.export.parent.mkdir(parents=True, exist_ok=True)
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           args.export)
            if args.metrics_out:
                args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
                args.metrics_out.write_text(json.dumps({
                    "script": "03-deepspeed/zero_from_scratch.py",
                    "strategy": f"sharded-stage{args.stage}-{args.optimizer}",
                    "world_size": world, "steps": args.steps, "global_batch": global_bs,
                    "losses": losses, "unsharded_optim_bytes": whole, "per_rank": per_rank,
                    "torch_version": torch.__version__}, indent=1))
        dist.barrier()
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
