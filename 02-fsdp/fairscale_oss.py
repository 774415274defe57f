"""Where FSDP comes from: fairscale's OSS sharded optimizer with ShardedDataParallel, next to
torch's ZeroRedundancyOptimizer and plain DDP, on the same model and data; they must end with the
same weights. fairscale's own FullyShardedDataParallel runs only on CUDA.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py                  # ddp, zero, oss
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py --impl oss
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py --device cuda    # adds fairscale FSDP

Expected output (the first command; 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    world 2 | device cpu | global batch 64 | 20 AdamW steps | ddp, zero, oss
    fsdp: skipped on cpu: fairscale's FullyShardedDataParallel needs CUDA: it runs its all-gather
        and gradient reduce-scatter on CUDA streams (torch.cuda.Stream)
    impl  final loss max |w - w_ddp|   bytes held by each rank: params | grads | optimizer state
    ddp       1.5067               0   88,104/88,104 | 88,104/88,104 | 176,232/176,232
    zero      1.5067               0   88,104/88,104 | 88,104/88,104 | 131,076/45,156
    oss       1.5067               0   88,104/88,104 | 88,104/88,104 | 44,128/132,104

The lineage (ZeRO, Rajbhandari et al. 2019, stage by stage):
    fairscale OSS (2020)          ZeRO-1: each rank keeps the Adam state of 1/N of the params,
                                  steps them, then broadcasts the updated params to the others.
    + ShardedDataParallel         ZeRO-2: each gradient is *reduced* (not all-reduced) to the one
                                  rank that owns it; the other ranks drop it.
    torch ZeroRedundancyOptimizer OSS upstreamed into torch (1.8): ZeRO-1 beside plain DDP.
    fairscale FSDP (2021)         ZeRO-3: params sharded too -> upstreamed as torch FSDP (FSDP1,
                                  flat parameters), rewritten as FSDP2 (per-parameter DTensors).
"""

import argparse
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

IMPLS = ("ddp", "zero", "oss", "fsdp")
FSDP_NEEDS_CUDA = ("fairscale's FullyShardedDataParallel needs CUDA: it runs its all-gather and "
                   "gradient reduce-scatter on CUDA streams (torch.cuda.Stream)")


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK")
    print(f"{f'[rank {rank}] ' if rank else ''}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--impl", choices=[*IMPLS, "all"], default="all",
                   help="all: ddp, zero, oss, and fsdp where CUDA is available")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the runs' metrics JSON here")
    p.add_argument("--export", type=Path,
                   help="rank 0 writes each run's plain state_dict to PATH with the "
                        "implementation's name before the suffix (out.pt -> out.oss.pt)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.hidden < 1:
        fail("--steps, --batch-size and --hidden must be at least 1")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """torchrun/srun or plain python (a group of one); gloo on CPU, NCCL on CUDA."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
                   LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(env.get("LOCAL_RANK", 0))) if use_cuda else \
        torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend, timeout = ("nccl" if use_cuda else "gloo"), timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


class MLP(nn.Module):
    """The classifier of 01-ddp-basics: 32 features -> 10 classes."""

    def __init__(self, hidden: int = 128, features: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """Step `step`'s global batch, a pure function of (seed, step); labels from a fixed teacher."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def build(impl: str, args, device):
    """(wrapped model, optimizer, the optimizer whose .state this rank holds, plain module)."""
    torch.manual_seed(args.seed)  # every implementation starts from the same weights
    model = MLP(args.hidden).to(device)
    adamw = {"lr": args.lr, "weight_decay": 0.01}
    ids = [device.index] if device.type == "cuda" else None
    if impl == "ddp":  # all-reduce every gradient; every rank steps everything
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return DDP(model, device_ids=ids), opt, opt, model
    if impl == "zero":  # DDP's all-reduce + a sharded optimizer step, then broadcast the params
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      **adamw)
        return DDP(model, device_ids=ids), opt, opt.optim, model
    if impl == "oss":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw)  # partitions by size
        return ShardedDataParallel(model, opt), opt, opt.optim, model
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP  # impl == "fsdp", CUDA
    wrapped = FairscaleFSDP(model, flatten_parameters=True, mixed_precision=False)
    opt = torch.optim.AdamW(wrapped.parameters(), **adamw)  # the flat shards
    return wrapped, opt, opt, None


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run(impl: str, args, rank, world, device):
    wrapped, opt, local_opt, plain = build(impl, args, device)
    global_bs = world * args.batch_size
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    losses, t0 = [], None
    for step in range(args.steps):
        if step == 1:
            t0 = time.perf_counter()
        x, y = global_batch(args.seed, step, global_bs)
        if impl == "oss":
            # ShardedDataParallel's own zero_grad: its small grads are views into reduce buckets;
            # torch's default set_to_none=True would orphan them and the buckets would keep
            # summing old gradients into the next step (silently wrong weights).
            wrapped.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x[rows].to(device)), y[rows].to(device))
        loss.backward()  # ddp/zero: all-reduce; oss: reduce to the owner; fsdp: reduce-scatter
        opt.step()  # zero/oss: step the own partition, then broadcast it to the other ranks
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    elapsed = time.perf_counter() - t0 if t0 else float("nan")
    params = list(wrapped.parameters())
    held = {"param_bytes": nbytes(params), "grad_bytes": nbytes(p.grad for p in params),
            "optim_bytes": nbytes(v for s in local_opt.state.values() for v in s.values()
                                  if torch.is_tensor(v)),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else None}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, held)
    if plain is not None:
        state = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
    else:  # fairscale FSDP: state_dict() all-gathers the full parameters (a collective)
        state = {k: v.detach().cpu().clone() for k, v in wrapped.state_dict().items()}
    return {"strategy": impl, "losses": losses, "per_rank": per_rank,
            "samples_per_s": (args.steps - 1) * global_bs / elapsed}, state


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        compare(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def compare(args, rank, world, device):
    impls = list(IMPLS) if args.impl == "all" else [args.impl]
    skipped = {}
    if "fsdp" in impls and device.type != "cuda":
        impls.remove("fsdp")
        skipped["fsdp"] = f"skipped on {device.type}: {FSDP_NEEDS_CUDA}"
    if {"oss", "fsdp"} & set(impls):
        try:
            import fairscale  # noqa: F401
        except ImportError:
            fail("fairscale is not installed: pip install fairscale==0.4.13")
    if rank == 0:
        print(f"world {world} | device {device} | global batch {world * args.batch_size} | "
              f"{args.steps} AdamW steps | {', '.join(impls)}", flush=True)
        for impl, why in skipped.items():
            print(f"{impl}: {why}", flush=True)

    runs, states = {}, {}
    for impl in impls:
        runs[impl], states[impl] = run(impl, args, rank, world, device)
    if rank != 0:
        return
    ref = states[impls[0]]
    print(f"{'impl':5} {'final loss':>10} {'max |w - w_' + impls[0] + '|':>15}   bytes held by "
          f"each rank: params | grads | optimizer state")
    for impl in impls:
        diff = max((states[impl][k] - ref[k]).abs().max().item() for k in ref) \
            if states[impl].keys() == ref.keys() else float("nan")
        held = " | ".join("/".join(f"{h[k]:,}" for h in runs[impl]["per_rank"])
                          for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        print(f"{impl:5} {runs[impl]['losses'][-1]:10.4f} {diff:15.3g}   {held}", flush=True)
    if args.export:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        for impl, state in states.items():
            path = args.export.with_suffix(f".{impl}{args.export.suffix}")
            torch.save(state, path)
    if args.metrics_out:
        import json
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text(json.dumps({
            "script": "02-fsdp/fairscale_oss.py", "strategy": "+".join(impls),
            "world_size": world, "steps": args.steps, "global_batch": world * args.batch_size,
            "device": str(device), "torch_version": torch.__version__, "runs": runs,
            "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
