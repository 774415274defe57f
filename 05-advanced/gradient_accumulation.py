"""Gradient accumulation under DDP: a large effective batch from small micro-batches, and the bug
that silently multiplies the learning rate.

Launch (from the repository root):
    python 05-advanced/gradient_accumulation.py                                # 1 process
    torchrun --nproc_per_node=2 05-advanced/gradient_accumulation.py           # 2 ranks
    torchrun --nproc_per_node=2 05-advanced/gradient_accumulation.py --buggy   # loss not / accum
    torchrun --nproc_per_node=8 05-advanced/gradient_accumulation.py --device cuda

Expected output (torchrun --nproc_per_node=2, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    world 2 | effective batch 64 = micro-batch 8 x accumulation 4 x world 2 | SGD lr 0.1
    step 1 gradient norm 0.2284 (loss not divided by 4, the --buggy way: 0.9135 = 4.00x)
    step  1/20 | loss 2.3087 | grad norm 0.2284
    ...
    step 20/20 | loss 2.2799 | grad norm 0.2325
    done: 20 steps, all-reduces per optimizer step: 1 (no_sync on 3 of 4 micro-steps)

    with --buggy:
    step 1 gradient norm 0.9135 = 4.00 x the correct 0.2284 (loss not divided by --grad-accum 4)
    ...
    step 20/20 | loss 2.1778 | grad norm 1.0261

One optimizer step with accumulation A on W ranks:

    micro-step 1 .. A-1   forward, backward inside ddp.no_sync(): grads add up in .grad, no comm
    micro-step A          forward, backward: DDP all-reduces (averages) the summed grads
    optimizer.step()      every rank applies the same averaged gradient

Each micro-step's loss is a mean over its B samples. Dividing it by A makes the accumulated
gradient the gradient of the mean over all A*B samples, so the step equals one step on the whole
batch. Forgetting the division (--buggy) gives A times that gradient: for SGD this is the learning
rate multiplied by A; Adam hides it almost completely (it divides by the gradient's own scale), so
the bug only surfaces when you switch optimizer, clip gradients or change A.
"""

import argparse
import contextlib
import gc
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP


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
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (no momentum)")
    p.add_argument("--buggy", action="store_true",
                   help="the classic bug: do not divide the micro-step loss by --grad-accum")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    p.add_argument("--grads-out", type=Path,
                   help="rank 0 saves step 1's averaged gradients computed both ways (same "
                        "weights and samples) here: {'correct': state_dict, 'buggy': state_dict}")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "grad_accum", "hidden", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """(rank, world, device); the process group works under python, torchrun and srun.
    (Explained in 01-ddp-basics/ddp_training.py.)"""
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
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in env:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, world, device


class MLP(nn.Module):
    """32 features -> 10 classes."""

    def __init__(self, hidden: int = 64, features: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """The global batch of optimizer step `step`, a pure function of (seed, step); labels from a
    fixed random teacher so the task is learnable."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


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


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        train(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def train(args, rank, world, device):
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # Count DDP's all-reduces (one per gradient bucket) to watch no_sync() skip them.
    allreduces = [0]

    def counting_allreduce(state, bucket):
        allreduces[0] += 1
        grad = bucket.buffer().div_(world)  # average = sum / world, as DDP's default hook does
        return dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    micro, accum = args.batch_size, args.grad_accum
    effective = micro * accum * world
    if rank == 0:
        print(f"world {world} | effective batch {effective} = micro-batch {micro} x accumulation "
              f"{accum} x world {world} | SGD lr {args.lr:g}", flush=True)

    losses, norms, t0 = [], [], time.perf_counter()
    for step in range(args.steps):
        x_all, y_all = global_batch(args.seed, step, effective)
        # This rank's rows r*B*A .. (r+1)*B*A - 1, cut into A micro-batches of B inside accumulate.
        mine = slice(rank * micro * accum, (rank + 1) * micro * accum)
        x_local, y_local = x_all[mine].to(device), y_all[mine].to(device)

        if step == 0:
            # Step 1 is computed both ways on the same weights and samples, the one we do not
            # train with first, so the two gradients can be printed side by side.
            accumulate(ddp, x_local, y_local, micro, accum, divide=args.buggy)
            other = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
            other_norm = grad_norm(model)
            optimizer.zero_grad(set_to_none=True)
            allreduces[0] = 0  # that extra all-reduce is not part of training
        step_loss = accumulate(ddp, x_local, y_local, micro, accum, divide=not args.buggy)
        norms.append(grad_norm(model))  # after the all-reduce: the same on every rank
        if step == 0 and rank == 0:
            if args.buggy:
                print(f"step 1 gradient norm {norms[0]:.4f} = {norms[0] / other_norm:.2f} x the "
                      f"correct {other_norm:.4f} (loss not divided by --grad-accum {accum})",
                      flush=True)
            else:
                print(f"step 1 gradient norm {norms[0]:.4f} (loss not divided by {accum}, the "
                      f"--buggy way: {other_norm:.4f} = {other_norm / norms[0]:.2f}x)", flush=True)
            if args.grads_out:
                grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
                save({"correct": other, "buggy": grads} if args.buggy else
                     {"correct": grads, "buggy": other}, args.grads_out)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        dist.all_reduce(step_loss)  # report the mean loss over the global batch
        losses.append(step_loss.item() / world)
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            print(f"step {done:2d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                  f"{norms[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    per_step = allreduces[0] / args.steps
    if rank == 0:
        print(f"done: {args.steps} steps, all-reduces per optimizer step: {per_step:g} "
              f"(no_sync on {accum - 1} of {accum} micro-steps)", flush=True)
    report(args, rank, world, device, model, optimizer, losses, norms, effective,
           effective * args.steps / elapsed, per_step)


def save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def report(args, rank, world, device, model, optimizer, losses, norms, effective, samples_per_s,
           allreduces_per_step):
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    mine = {"param_bytes": nbytes(model.parameters()),
            "grad_bytes": nbytes(p.grad for p in model.parameters()),
            "optim_bytes": nbytes(v for s in optimizer.state.values() for v in s.values()
                                  if torch.is_tensor(v)),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else None}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        if args.export:
            save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.export)
        if args.metrics_out:
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps({
                "script": "05-advanced/gradient_accumulation.py", "strategy": "ddp",
                "world_size": world, "steps": args.steps, "global_batch": effective,
                "grad_accum": args.grad_accum, "buggy": args.buggy, "losses": losses,
                "grad_norms": norms, "allreduces_per_step": allreduces_per_step,
                "samples_per_s": samples_per_s, "device": str(device),
                "torch_version": torch.__version__, "per_rank": per_rank}, indent=1))
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()
