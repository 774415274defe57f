"""Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks, with
tokens sent to their experts and brought back by two all-to-alls.

Launch (from the repository root):
    python 05-advanced/expert_parallel.py                          # 1 process, all 8 experts
    torchrun --nproc_per_node=2 05-advanced/expert_parallel.py     # 4 experts per rank
    torchrun --nproc_per_node=4 05-advanced/expert_parallel.py --top-k 1 --capacity-factor 1

Output of `torchrun --nproc_per_node=2 05-advanced/expert_parallel.py` (2-core AMD EPYC CPU,
shared; torch 2.14.1, gloo):
    experts 8 over 2 rank(s) (4 each) | top-2 | capacity 5 slots per expert per group of 16
        tokens | global batch 128 | each all-to-all sends 20480 bytes per rank
    step   1/20 | loss 2.4253 | tokens per expert [38, 27, 20, 25, 34, 38, 31, 43] | dropped
        17 of 256
    ...
    step  20/20 | loss 1.3933 | tokens per expert [23, 45, 29, 21, 43, 30, 29, 36] | dropped
        17 of 256

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
            P_e = mean router probability of e; smallest (1) when the load is uniform.

What crosses the network: each all-to-all moves the capacity slots, not the tokens: every rank
sends E/W * groups * C * d values to each other rank, padding included, whatever the routing.
The backward of an all-to-all is the reverse all-to-all, so the backward pass makes two more.
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail  # argparse's own errors too: one line, exit 2
    p.add_argument("--experts", type=int, default=8, help="E: experts, divided among the ranks")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="slots per expert = ceil(k * group_size * factor / E)")
    p.add_argument("--group-size", type=int, default=16,
                   help="S: tokens that share one capacity budget (a rank holds whole groups)")
    p.add_argument("--aux-weight", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128, help="width of each expert's MLP")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64,
                   help="tokens per rank per step (each rank routes its own tokens)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--check-out", type=Path,
                   help="rank 0 saves step 1's inputs, MoE outputs, drops, weights and gradients")
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("experts", "top_k", "group_size", "hidden", "ffn", "steps", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    if args.capacity_factor <= 0 or args.lr <= 0 or args.timeout_s <= 0 or args.aux_weight < 0:
        fail("--capacity-factor, --lr and --timeout-s must be positive, --aux-weight >= 0")
    if args.batch_size % args.group_size:
        fail(f"--batch-size {args.batch_size} is not a multiple of --group-size "
             f"{args.group_size}: a rank routes whole groups")
    return args


# --------------------------------------------------------------------------------------------------
# Set-up: the same lines run under python, torchrun and srun (see 01-ddp-basics/ddp_training.py)


def init_distributed(device_arg: str):
    """Return (rank, world_size, device); the process group starts after the inputs are checked."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def start_process_group(device, timeout_s: float):
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python script.py`: a group of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)


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
# Model


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
        # Switch load-balancing loss per group: E * sum_e f_e P_e (first choices)
        first = F.one_hot(probs.argmax(-1), E).float().mean(1)      # (g, E) f_e
        aux = (E * (first * probs.mean(1)).sum(-1)).sum()           # summed over groups
        stats = {"routed": F.one_hot(probs.topk(self.top_k, -1)[1], E).sum((0, 1, 2)),  # (E,)
                 "dropped": dropped.reshape(-1, self.top_k)}              # (tokens, k)
        return y, aux, stats


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


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """The global batch of step `step`, a pure function of (seed, step) (as in lesson 01)."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


# --------------------------------------------------------------------------------------------------
# Training


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    if args.experts % world:
        fail(f"--experts {args.experts} is not divisible by the world size {world}: every rank "
             "must hold the same number of experts")
    start_process_group(device, args.timeout_s)
    try:
        train(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def gather_to_rank0(obj, rank, world):
    got = [None] * world if rank == 0 else None
    dist.gather_object(obj, got, dst=0)
    return got


def train(args, rank, world, device):
    torch.manual_seed(args.seed)
    model = MoEModel(args.hidden, args.ffn, args.experts, args.top_k, args.capacity_factor,
                     args.group_size)
    per_rank_experts = args.experts // world
    mine = range(rank * per_rank_experts, (rank + 1) * per_rank_experts)
    model.moe.keep_experts(mine)  # the same seed built every expert; keep ours, drop the rest
    model.to(device)
    # Replicated parameters (embed, norm, router, head) see only this rank's tokens: their
    # gradients are all-reduced. Expert parameters already receive every rank's tokens through
    # the all-to-all, so their gradients are complete where they live.
    replicated = [p for n, p in model.named_parameters() if not n.startswith("moe.experts.")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    global_bs, C = world * args.batch_size, model.moe.capacity
    groups = args.batch_size // args.group_size
    a2a_bytes = (world - 1) * per_rank_experts * groups * C * args.hidden * 4
    if rank == 0:
        print(f"experts {args.experts} over {world} rank(s) ({per_rank_experts} each) | "
              f"top-{args.top_k} | capacity {C} slots per expert per group of "
              f"{args.group_size} tokens | global batch {global_bs} | each all-to-all sends "
              f"{a2a_bytes} bytes per rank", flush=True)

    losses, t_start = [], None
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for step in range(args.steps):
        if step == 1:
            t_start = time.perf_counter()
        x_all, y_all = global_batch(args.seed, step, global_bs)
        rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        x, y = x_all[rows].to(device), y_all[rows].to(device)
        logits, aux, stats = model(x)
        # This rank's share of the global mean loss: summed over ranks it is the global loss.
        total_groups = global_bs // args.group_size
        loss = F.cross_entropy(logits, y, reduction="sum") / global_bs \
            + args.aux_weight * aux / total_groups
        loss.backward()  # two more all-to-alls run inside, in reverse order
        for p in replicated:
            dist.all_reduce(p.grad)  # sum of the ranks' shares = gradient of the global loss
        if step == 0 and args.check_out:
            save_check(args.check_out, model, initial, x, stats, rank, world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        report = torch.cat([loss.detach().reshape(1), stats["routed"].float(),
                            stats["dropped"].sum().float().reshape(1)])
        dist.all_reduce(report)  # [global loss, tokens routed to each expert, dropped]
        losses.append(report[0].item())
        if rank == 0 and (step == 0 or (step + 1) % 5 == 0):
            routed = report[1:-1].long().tolist()
            print(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f} | tokens per expert "
                  f"{routed} | dropped {int(report[-1])} of {args.top_k * global_bs}", flush=True)
    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * global_bs / elapsed if t_start else float("nan")
    report_results(args, model, optimizer, losses, samples_per_s, report, rank, world, device)


def save_check(path, model, initial, x, stats, rank, world):
    """Everything a test needs to recompute step 1 in one process: consolidated weights before
    the step, inputs, MoE outputs, dropped assignments and consolidated gradients."""
    local = {"weights": initial, "x": x.cpu(), "moe_out": stats["moe_out"].detach().cpu(),
             "dropped": stats["dropped"].cpu(),
             "grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters()}}
    parts = gather_to_rank0(local, rank, world)
    if rank == 0:
        merged = {"weights": {k: v for part in parts for k, v in part["weights"].items()},
                  "grads": {k: v for part in parts for k, v in part["grads"].items()}}
        for key in ("x", "moe_out", "dropped"):
            merged[key] = torch.cat([part[key] for part in parts])
        atomic_save(merged, path)


def report_results(args, model, optimizer, losses, samples_per_s, last_report, rank, world,
                   device):
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
    local = {"param_bytes": nbytes(model.parameters()),
             "grad_bytes": nbytes(p.grad for p in model.parameters()),
             "optim_bytes": nbytes(v for s in optimizer.state.values() for v in s.values()
                                   if torch.is_tensor(v)),
             "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
             else None}
    per_rank = gather_to_rank0(local, rank, world)
    weights = gather_to_rank0({k: v.detach().cpu() for k, v in model.state_dict().items()},
                              rank, world)
    if rank == 0:
        print(f"done: {args.steps} steps, {samples_per_s:.0f} samples/s", flush=True)
        if args.export:
            atomic_save({k: v for part in weights for k, v in part.items()}, args.export)
        if args.metrics_out:
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps({
                "script": "05-advanced/expert_parallel.py", "strategy": "expert-parallel",
                "world_size": world, "steps": args.steps, "global_batch": world * args.batch_size,
                "experts": args.experts, "top_k": args.top_k, "capacity": model.moe.capacity,
                "losses": losses, "tokens_per_expert_last_step": last_report[1:-1].tolist(),
                "dropped_last_step": int(last_report[-1]), "samples_per_s": samples_per_s,
                "device": str(device), "torch_version": torch.__version__,
                "per_rank": per_rank}, indent=1))
    dist.barrier()


def atomic_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
