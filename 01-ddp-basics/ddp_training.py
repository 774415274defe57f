"""DDP production template: mixed precision, gradient accumulation, LR scaling with warmup,
checkpoints with automatic resume, preemption (SIGTERM) handling, export and metrics.

Launch (from the repository root):
    python 01-ddp-basics/ddp_training.py                                  # 1 process
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py             # 2 ranks, one node
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --grad-accum 2 --ckpt-dir runs/ddp
    python 01-ddp-basics/ddp_training.py --spawn 2                        # mp.spawn, no torchrun
    srun -n 2 python 01-ddp-basics/ddp_training.py                        # SLURM, one task per GPU
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_training.py --device cuda --precision bf16

Expected output (torchrun --nproc_per_node=2, 2-core x86-64 CPU, gloo; see the README):
    world 2 | device cpu | global batch 64 (2 ranks x 32 x accum 1) | lr 0.002 (base 0.001 x 64/32)
    step    1/40 | loss 2.3302 | lr 0.00040
    ...
    step   40/40 | loss 0.6203 | lr 0.00200
    done: 40 steps, ... samples/s, all-reduce calls 40

What DDP does each optimizer step (and where this file does it):
    forward on the local batch -> loss / grad_accum -> backward: as each bucket of gradients is
    ready, DDP all-reduces (averages) it across the ranks while backward continues; on the
    accumulation micro-steps before the last, `no_sync()` skips that all-reduce and gradients just
    add up locally -> optimizer.step() on identical averaged gradients keeps every replica equal.
"""

import argparse
import contextlib
import gc
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


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
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (total, resume included)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=1e-2, help="base LR for --base-batch samples")
    p.add_argument("--base-batch", type=int, default=32, help="global batch the base LR is for")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup to the scaled LR")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="autocast dtype; fp16 adds a GradScaler and needs CUDA")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint here and resume from the newest")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: end)")
    p.add_argument("--keep-ckpts", type=int, default=3, help="keep the newest K checkpoints")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="fault injection: --fail-rank raises once at this step (needs --ckpt-dir)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N local ranks with torch.multiprocessing.spawn instead of torchrun")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "grad_accum", "base_batch", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    if args.warmup_steps < 0 or args.ckpt_every < 0 or args.keep_ckpts < 1:
        fail("--warmup-steps and --ckpt-every must be >= 0, --keep-ckpts >= 1")
    if args.spawn and ("RANK" in os.environ or args.spawn < 1):
        fail("--spawn N starts N ranks itself: use it with plain python, N >= 1")
    if args.fail_at_step and not args.ckpt_dir:
        fail("--fail-at-step needs --ckpt-dir (the restart resumes from it)")
    if args.ckpt_dir and args.ckpt_dir.exists() and not args.ckpt_dir.is_dir():
        fail(f"--ckpt-dir {args.ckpt_dir} is a file, not a directory of checkpoints")
    return args


# --------------------------------------------------------------------------------------------------
# Set-up: the same lines run under python, torchrun and srun


def init_distributed(device_arg: str, timeout_s: float):
    """Return (rank, world_size, device) and start the process group (gloo on CPU, NCCL on CUDA).

    torchrun sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Under `srun python`
    we translate SLURM's variables; with plain `python` we are rank 0 of 1 and still build a
    (one-process) group, so DDP and every collective run through the very same code.
    """
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


class MLP(nn.Module):
    """A small classifier: 32 features -> 10 classes."""

    def __init__(self, hidden: int = 128, features: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """The whole global batch of optimizer step `step`: a pure function of (seed, step).

    Labels come from a fixed random 'teacher' (the same for every step), so the task is learnable.
    Every rank builds the same tensor and keeps only its own rows: a run with D ranks and batch B
    sees exactly the samples of a one-process run with batch D*B.
    """
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    y = (x @ teacher).argmax(dim=1)
    return x, y


def lr_at(step: int, peak_lr: float, warmup: int) -> float:
    """Linear warmup to the scaled LR over `warmup` steps, then constant."""
    return peak_lr * min(1.0, (step + 1) / warmup) if warmup else peak_lr


# --------------------------------------------------------------------------------------------------
# Checkpoints: rank 0 writes to a temporary name and renames, so a kill never leaves half a file


def latest_checkpoint(ckpt_dir: Path):
    """Newest checkpoint that loads (a corrupt newest one is skipped), or None."""
    for path in sorted(ckpt_dir.glob("step_*.pt"), reverse=True):
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: fall back to an older one
            print(f"warning: skipping unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, scheduler, scaler, rank: int,
                    keep: int):
    if rank == 0:
        state = {
            "step": step,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        tmp = ckpt_dir / f".step_{step:06d}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, ckpt_dir / f"step_{step:06d}.pt")  # atomic on POSIX
        for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:  # only after the new one exists
            old.unlink()
    dist.barrier()  # nobody reads or moves on before the file is complete


def spawn_worker(local_rank: int, nprocs: int, port: int, argv: list):
    """mp.spawn calls this in each child with its index: set what torchrun would have set."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.spawn:  # the alternative to torchrun: this process starts the ranks itself
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(os.environ.get("MASTER_PORT", s.getsockname()[1]))
        i = argv.index("--spawn") if "--spawn" in argv else None
        child_argv = argv[:i] + argv[i + 2:] if i is not None else \
            [a for a in argv if not a.startswith("--spawn=")]
        mp.spawn(spawn_worker, args=(args.spawn, port, child_argv), nprocs=args.spawn)
        return
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        train(args, rank, world, device)
    finally:
        # Free DDP (its reducer sits in reference cycles) while Python is fully alive: left to
        # interpreter shutdown, gloo's threads can abort the process after a finished run.
        gc.collect()
        dist.destroy_process_group()


def train(args, rank, world, device):
    if args.precision == "fp16" and device.type != "cuda":
        fail("--precision fp16 needs CUDA (GradScaler); use bf16 on CPU")
    if args.fail_at_step and args.fail_rank >= world:
        fail(f"--fail-rank {args.fail_rank} does not exist at world size {world}")
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # Linear scaling rule (Goyal et al. 2017): LR grows with the global batch; warmup avoids the
    # early instability that a large LR causes on random weights.
    global_bs = world * args.batch_size * args.grad_accum
    peak_lr = args.lr * global_bs / args.base_batch

    model = MLP(args.hidden).to(device)
    # DDP broadcasts rank 0's weights at construction, so all replicas start equal.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # Count the all-reduces DDP launches (one per gradient bucket) to see no_sync() at work.
    allreduce_calls = [0]

    def counting_allreduce(state, bucket):
        allreduce_calls[0] += 1
        grad = bucket.buffer().div_(world)  # average = sum / world, as DDP's default does
        return dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)

    optimizer = torch.optim.AdamW(ddp.parameters(), lr=peak_lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, 1.0, args.warmup_steps))
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    # fp16 gradients can underflow: scale the loss up, unscale before the step (bf16 needs none).
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")

    start_step = 0
    if args.ckpt_dir:
        if rank == 0:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        ckpt = latest_checkpoint(args.ckpt_dir)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            scaler.load_state_dict(ckpt["scaler"])
            torch.set_rng_state(ckpt["rng"]["torch"])
            random.setstate(ckpt["rng"]["python"])
            if ckpt["rng"]["cuda"] is not None and device.type == "cuda":
                torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
            start_step = ckpt["step"]
            if rank == 0:
                print(f"resumed from step {start_step} in {args.ckpt_dir}", flush=True)

    # Preemption: SLURM (or torchrun on shutdown) sends SIGTERM. We only set a flag here; the
    # training loop agrees on it across ranks (all-reduce MAX), checkpoints and exits cleanly.
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))

    if rank == 0:
        print(f"world {world} | device {device} | global batch {global_bs} ({world} ranks x "
              f"{args.batch_size} x accum {args.grad_accum}) | lr {peak_lr:g} "
              f"(base {args.lr:g} x {global_bs}/{args.base_batch})", flush=True)

    losses, t_start, timed_samples = [], None, 0
    bar = tqdm(total=args.steps, initial=start_step, disable=(rank != 0) or None,
               desc="train") if tqdm else None
    for step in range(start_step, args.steps):
        if step == start_step + 1:
            t_start = time.perf_counter()  # the first step pays for warm-up; time the rest
        if args.fail_at_step and step + 1 == args.fail_at_step and rank == args.fail_rank:
            marker = args.ckpt_dir / f"failed_once_at_step_{args.fail_at_step}"
            if not marker.exists():
                marker.touch()  # remembered, so the restarted run does not fail again
                raise RuntimeError(f"injected failure on rank {rank} at step {step + 1}")

        x_all, y_all = global_batch(args.seed, step, global_bs)
        # This rank's rows: r*B*A .. (r+1)*B*A - 1, cut into grad_accum micro-batches of B.
        rows = slice(rank * args.batch_size * args.grad_accum,
                     (rank + 1) * args.batch_size * args.grad_accum)
        x_local, y_local = x_all[rows].to(device), y_all[rows].to(device)

        step_loss = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            x = x_local[micro * args.batch_size:(micro + 1) * args.batch_size]
            y = y_local[micro * args.batch_size:(micro + 1) * args.batch_size]
            last = micro == args.grad_accum - 1
            # no_sync(): no all-reduce on this backward; gradients accumulate locally in .grad
            # and are averaged once, with the last micro-step's all-reduce.
            sync_ctx = contextlib.nullcontext() if last else ddp.no_sync()
            with sync_ctx, torch.autocast(device.type, dtype=autocast_dtype,
                                          enabled=autocast_dtype is not None):
                loss = F.cross_entropy(ddp(x), y)
                # Divide by the micro-steps: the accumulated gradient is then the gradient of the
                # mean loss over all of this rank's samples, not grad_accum times it.
                scaler.scale(loss / args.grad_accum).backward()
            step_loss += loss.detach().float() / args.grad_accum

        scaler.step(optimizer)  # unscales first when fp16; a plain optimizer.step() otherwise
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        # Report the mean loss over the global batch, and agree on a pending SIGTERM.
        # One small all-reduce: [sum of rank losses, number of ranks that received SIGTERM].
        report = torch.stack([step_loss, torch.tensor(float(stop["requested"]), device=device)])
        dist.all_reduce(report, op=dist.ReduceOp.SUM)
        losses.append(report[0].item() / world)
        if step >= start_step + 1:
            timed_samples += global_bs
        done = step + 1
        if bar is not None:
            bar.update(1)
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            msg = f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | lr " \
                  f"{optimizer.param_groups[0]['lr']:.5f}"
            (bar.write(msg) if bar is not None else print(msg, flush=True))

        preempted = report[1].item() > 0  # every rank stops at the same step
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            save_checkpoint(args.ckpt_dir, done, ddp, optimizer, scheduler, scaler, rank,
                            args.keep_ckpts)
        if preempted:
            if rank == 0:
                print(f"SIGTERM: checkpointed step {done} to {args.ckpt_dir}; exiting", flush=True)
            if bar is not None:
                bar.close()
            return
    if bar is not None:
        bar.close()

    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    samples_per_s = timed_samples / elapsed if timed_samples else float("nan")
    report_results(args, rank, world, device, model, optimizer, losses, global_bs, samples_per_s,
                   allreduce_calls[0], start_step)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def report_results(args, rank, world, device, model, optimizer, losses, global_bs, samples_per_s,
                   allreduce_calls, start_step):
    per_rank_local = {
        "param_bytes": tensor_bytes(model.parameters()),
        "grad_bytes": tensor_bytes(p.grad for p in model.parameters()),
        "optim_bytes": tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                                    if torch.is_tensor(v)),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, per_rank_local)
    if rank == 0:
        print(f"done: {args.steps - start_step} steps, {samples_per_s:.0f} samples/s, "
              f"all-reduce calls {allreduce_calls}", flush=True)
        if args.export:
            args.export.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.export.with_suffix(".tmp")
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
            os.replace(tmp, args.export)
        if args.metrics_out:
            import json
            metrics = {
                "script": "01-ddp-basics/ddp_training.py", "strategy": "ddp",
                "world_size": world, "steps": args.steps, "start_step": start_step,
                "global_batch": global_bs, "grad_accum": args.grad_accum,
                "precision": args.precision, "losses": losses,
                "samples_per_s": samples_per_s, "allreduce_calls": allreduce_calls,
                "device": str(device), "torch_version": torch.__version__, "per_rank": per_rank,
            }
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps(metrics, indent=1))
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()
