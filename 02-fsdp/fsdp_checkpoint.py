"""Sharded checkpoints of an FSDP2 model with torch.distributed.checkpoint (DCP): every rank writes
its own shards, training resumes from the newest complete checkpoint (also at another world size:
DCP reshards on load), and a full unsharded state dict is exported for inference.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 10
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 20
        # ^ resumes at step 10
    torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 30 \
        --batch-size 8   # resumes the world-2 checkpoint on 4 ranks (same global batch)
    torchrun --nproc_per_node=2 --max-restarts=1 02-fsdp/fsdp_checkpoint.py \
        --ckpt-dir runs/fsdp_ft --ckpt-every 5 --fail-at-step 8 --fail-rank 1

Expected output of the last one (2-core AMD EPYC CPU (shared), torch 2.14.1, gloo): rank 1 raises
at step 8 (torchrun logs its traceback on stderr), torchrun restarts both ranks, and they resume
from the newest complete checkpoint:
    world 2 | device cpu | global batch 32 | steps 0..20
    step    1/20 | loss 2.2999
    step    5/20 | loss 2.1448
    saved sharded checkpoint runs/fsdp_ft/step_000005
    resumed from runs/fsdp_ft/step_000005 (step 5, saved by 2 ranks, loaded on 2)
    world 2 | device cpu | global batch 32 | steps 5..20
    step    6/20 | loss 1.7424
    ...
    step   20/20 | loss 1.2295
    saved sharded checkpoint runs/fsdp_ft/step_000020
    done: steps 5..20, 384 samples/s

A checkpoint is a directory:
    step_000010/
        .metadata         written last by rank 0: global shapes, and which file holds which chunk
        __0_0.distcp      rank 0's shards (its rows of every parameter and of its Adam state)
        __1_0.distcp      rank 1's shards
It is written as .tmp_step_000010 and renamed when every rank has finished, so a directory named
step_* is always complete; the newest one is resumed. Loading maps the saved chunks onto the
shards the *current* ranks hold, whatever the world size that saved them.
"""

import argparse
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard


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
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (total, resume included)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warmup of the LR")
    p.add_argument("--hidden", type=int, default=90, help="width (90 rows split unevenly on 4)")
    p.add_argument("--depth", type=int, default=3, help="residual blocks (one FSDP unit each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint here and resume from the newest")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: end)")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="fault injection: --fail-rank raises once at this step (needs --ckpt-dir)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "hidden", "depth", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    if args.warmup_steps < 0 or args.ckpt_every < 0:
        fail("--warmup-steps and --ckpt-every must be >= 0")
    if args.fail_at_step and not args.ckpt_dir:
        fail("--fail-at-step needs --ckpt-dir (the restart resumes from it)")
    if args.ckpt_dir and args.ckpt_dir.exists() and not args.ckpt_dir.is_dir():
        fail(f"--ckpt-dir {args.ckpt_dir} is a file, not a directory of checkpoints")
    return args


# --------------------------------------------------------------------------------------------------
# Set-up: the same lines run under python, torchrun and srun (see 01-ddp-basics/ddp_training.py)


def init_distributed(device_arg: str, timeout_s: float):
    """Return (rank, world_size, device) and start the process group (gloo on CPU, NCCL on CUDA)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:  # the first host of the step's allocation
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

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:  # plain `python script.py`: a group of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


# --------------------------------------------------------------------------------------------------
# Model and data


class Block(nn.Module):
    """x + W2 GELU(W1 LayerNorm(x)): one FSDP unit."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """32 features -> hidden -> `depth` residual blocks -> 10 classes."""

    def __init__(self, hidden: int = 90, depth: int = 3, features: int = 32, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """Step `step`'s global batch, a pure function of (seed, step); labels from a fixed random
    teacher. Rank r keeps rows r*B..(r+1)*B-1, so any world size sees the same samples."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def lr_at(step: int, peak_lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then constant: a function of the step alone, so a
    resumed run needs no scheduler state."""
    return peak_lr * min(1.0, (step + 1) / warmup) if warmup else peak_lr


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints


def newest_checkpoint(ckpt_dir: Path, rank: int):
    """Rank 0 removes interrupted writes (.tmp_*) and picks the newest complete step_* directory;
    every rank gets its answer, so all of them load the same one."""
    choice = [None]
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for tmp in ckpt_dir.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
        choice = [str(done[-1]) if done else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, world: int, rank: int) -> Path:
    """Every rank writes its own shards (no gather to rank 0), into a temporary directory that
    rank 0 renames once all ranks are done."""
    # get_state_dict: keys are the plain model's names ("blocks.0.fc1.weight"); values are
    # DTensors, so DCP records each shard's offset in the global tensor. Optimizer state is keyed
    # by parameter name too (not by index), which is what lets another world size load it.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd,
             "step": torch.tensor(step), "world_size": torch.tensor(world)}
    tmp, final = ckpt_dir / f".tmp_step_{step:06d}", ckpt_dir / f"step_{step:06d}"
    dcp.save(state, checkpoint_id=str(tmp))  # collective: rank 0 writes .metadata last
    dist.barrier()
    if rank == 0:
        if final.exists():  # an earlier run wrote this step already (a restart): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: the name step_* appears only for a whole checkpoint
    dist.barrier()
    return final


def load_checkpoint(path: Path, model, optimizer):
    """Load in place into this rank's shards; returns (step, world size that saved it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the shapes and shards we hold now
    state = {"model": model_sd, "optim": optim_sd,
             "step": torch.tensor(0), "world_size": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))  # reads only the chunks overlapping our shards
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return int(state["step"]), int(state["world_size"])


def local_bytes(t) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        train(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def train(args, rank, world, device):
    if args.fail_at_step and args.fail_rank >= world:
        fail(f"--fail-rank {args.fail_rank} does not exist at world size {world}")
    global_bs = world * args.batch_size

    torch.manual_seed(args.seed)  # the same full model on every rank; fully_shard keeps our rows
    model = ResidualMLP(args.hidden, args.depth).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start_step, resumed = 0, None
    if args.ckpt_dir:
        path = newest_checkpoint(args.ckpt_dir, rank)
        if path is not None:
            start_step, saved_world = load_checkpoint(path, model, optimizer)
            resumed = {"path": str(path), "step": start_step, "saved_world_size": saved_world}
            if rank == 0:
                print(f"resumed from {path} (step {start_step}, saved by {saved_world} ranks, "
                      f"loaded on {world})", flush=True)

    # Preemption (SLURM, or torchrun shutting down) sends SIGTERM: only set a flag; the loop
    # agrees on it across ranks, checkpoints and exits at the same step on every rank.
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    if rank == 0:
        print(f"world {world} | device {device} | global batch {global_bs} | steps "
              f"{start_step}..{args.steps}", flush=True)

    losses, saved, t_start, timed = [], [], time.perf_counter(), 0
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    for step in range(start_step, args.steps):
        if args.fail_at_step and step + 1 == args.fail_at_step and rank == args.fail_rank:
            marker = args.ckpt_dir / f"failed_once_at_step_{args.fail_at_step}"
            if not marker.exists():
                marker.touch()  # remembered, so the restarted run does not fail again
                raise RuntimeError(f"injected failure on rank {rank} at step {step + 1}")
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup_steps)
        x_all, y_all = global_batch(args.seed, step, global_bs)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x_all[rows].to(device)), y_all[rows].to(device))
        loss.backward()  # reduce-scatter: each rank ends with the averaged grads of its shards
        optimizer.step()
        timed += global_bs

        # One small all-reduce: [sum of the ranks' losses, ranks that received SIGTERM].
        report = torch.stack([loss.detach(), torch.tensor(float(stop["requested"]),
                                                          device=device)])
        dist.all_reduce(report)
        losses.append(report[0].item() / world)
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done in (start_step + 1, args.steps)):
            print(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}", flush=True)
        preempted = report[1].item() > 0
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            saved.append(str(save_checkpoint(args.ckpt_dir, done, model, optimizer, world, rank)))
            if rank == 0:
                print(f"saved sharded checkpoint {saved[-1]}", flush=True)
        if preempted:
            if rank == 0:
                print(f"SIGTERM: checkpointed step {done}; exiting", flush=True)
            return
    samples_per_s = timed / (time.perf_counter() - t_start)
    report_results(args, rank, world, device, model, optimizer, losses, global_bs, samples_per_s,
                   start_step, resumed, saved)


def report_results(args, rank, world, device, model, optimizer, losses, global_bs, samples_per_s,
                   start_step, resumed, saved):
    per_rank_local = {
        "param_bytes": sum(local_bytes(p) for p in model.parameters()),
        "grad_bytes": sum(local_bytes(p.grad) for p in model.parameters()),
        "optim_bytes": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                           if torch.is_tensor(v)),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, per_rank_local)
    full_sd = None
    if args.export:  # every rank takes part: the shards are all-gathered, rank 0 keeps them
        full_sd = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        print(f"done: steps {start_step}..{args.steps}, {samples_per_s:.0f} samples/s", flush=True)
        if args.export:
            args.export.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.export.with_suffix(".tmp")
            torch.save(full_sd, tmp)
            os.replace(tmp, args.export)
            print(f"exported the full state dict ({len(full_sd)} tensors) to {args.export}",
                  flush=True)
        if args.metrics_out:
            import json
            metrics = {
                "script": "02-fsdp/fsdp_checkpoint.py", "strategy": "full",
                "world_size": world, "steps": args.steps, "start_step": start_step,
                "resumed": resumed, "checkpoints": saved, "global_batch": global_bs,
                "losses": losses, "samples_per_s": samples_per_s, "device": str(device),
                "torch_version": torch.__version__, "per_rank": per_rank,
            }
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps(metrics, indent=1))
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()
