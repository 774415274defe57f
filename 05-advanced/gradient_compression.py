"""Gradient compression as DDP communication hooks: fp16 / bf16 casts, PowerSGD (low rank), and a
hand-written top-k sparsification with error feedback; bytes sent against the loss they cost.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/gradient_compression.py
    torchrun --nproc_per_node=2 05-advanced/gradient_compression.py --powersgd-rank 4 \\
        --topk-ratio 0.05 --json-out runs/compression.json --plot runs/dp_compression.png
    torchrun --nproc_per_node=8 05-advanced/gradient_compression.py --device cuda

Expected output (the first command, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo;
milliseconds move from run to run on a shared CPU, see 05-advanced/README.md, part 05c):
    method    bytes/step   ratio loss, last 5 steps  vs none
    none          307240    1.0x             1.9239  +0.0000
    fp16          153620    2.0x             1.9239  +0.0000
    bf16          153620    2.0x             1.9238  +0.0000
    powersgd       10616   28.9x             1.9787  +0.0549
    topk            6152   49.9x             2.0799  +0.1561

A DDP comm hook replaces the all-reduce of each gradient bucket (a flat buffer holding this rank's
gradients of a group of parameters) by any function that returns a future of the averaged bucket:

    none      all_reduce(bucket / W)                               4 bytes per value
    fp16      all_reduce(fp16(bucket / W)), cast back              2 bytes per value
    bf16      all_reduce(bf16(bucket / W)), cast back              2 bytes per value (fp32 range)
    powersgd  G (n x m) ~ P Q^T: all_reduce P (n x r), then Q (m x r)   (n + m) r values
    topk      acc = grad + residual; send the k largest |acc| (values + int32 indices)
              with all_gather; residual = acc - sent stays on this rank for the next step

Error feedback is what makes the lossy ones converge: nothing is thrown away, only delayed. Each
step, sent + new residual = grad + old residual exactly, so over a run sum(sent) + residual =
sum(grads).
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


METHODS = ("none", "fp16", "bf16", "powersgd", "topk")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per method")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--powersgd-rank", type=int, default=2, help="rank r of P (n x r), Q (m x r)")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="plain all-reduce for the first steps (PowerSGD's warm-up; >= 2)")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="fraction of values sent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json-out", type=Path, help="rank 0 writes one row per method here")
    p.add_argument("--plot", type=Path, help="rank 0 draws the loss curves and ratios here")
    p.add_argument("--ef-check", type=Path,
                   help="rank 0 saves its top-k bookkeeping (sum of grads, sum sent, residual)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "hidden", "powersgd_rank", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.powersgd_start < 2:
        fail(f"--powersgd-start must be >= 2 with error feedback, got {args.powersgd_start}")
    if not 0 < args.topk_ratio <= 1:
        fail(f"--topk-ratio must be in (0, 1], got {args.topk_ratio}")
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
    """32 features -> 10 classes; the hidden x hidden matrix is what PowerSGD compresses best."""

    def __init__(self, hidden: int, features: int = 32, classes: int = 10):
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


# --------------------------------------------------------------------------------------------------
# Measuring what is sent


class CollectiveBytes:
    """Counts the bytes this rank hands to all_reduce / all_gather while `counting` is True.

    Every hook here, ours and torch's, calls `dist.all_reduce` / `dist.all_gather` through the
    module attribute, so wrapping those two functions for the duration of training sees every
    payload, including the Q all-reduce PowerSGD launches from a future's callback. The count is
    the payload per rank; a ring all-reduce moves 2(W-1)/W of it over each link.
    """

    def __init__(self):
        self.counting, self.bytes = False, 0

    def __enter__(self):
        self.originals = dist.all_reduce, dist.all_gather

        def all_reduce(tensor, *args, **kwargs):
            if self.counting:
                self.bytes += tensor.numel() * tensor.element_size()
            return self.originals[0](tensor, *args, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            if self.counting:
                self.bytes += tensor.numel() * tensor.element_size()
            return self.originals[1](tensor_list, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_gather = self.originals


# --------------------------------------------------------------------------------------------------
# Top-k sparsification with error feedback, written as a DDP comm hook


class TopKState:
    """Per-parameter residuals (what was not sent yet) and, for the conservation check, running
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


def make_model(method, args, world, device):
    torch.manual_seed(args.seed)  # the same start for every method
    model = MLP(args.hidden).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
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
        state = TopKState(args.topk_ratio, world)
        ddp.register_comm_hook(state, topk_hook)
    return model, ddp, state


def train(method, args, rank, world, device, counter):
    model, ddp, state = make_model(method, args, world, device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    losses, sent = [], []
    for step in range(args.steps):
        x_all, y_all = global_batch(args.seed, step, world * args.batch_size)
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        loss = F.cross_entropy(ddp(x_all[mine].to(device)), y_all[mine].to(device))
        counter.bytes, counter.counting = 0, True
        loss.backward()  # DDP runs the hook per bucket and waits for its future before returning
        counter.counting = False
        sent.append(counter.bytes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report = loss.detach().clone()
        dist.all_reduce(report)  # mean loss over the global batch (not counted: not a gradient)
        losses.append(report.item() / world)
    dense = sum(p.numel() * 4 for p in model.parameters())  # fp32 gradients, uncompressed
    return model, state, losses, sent, dense


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    rows = []
    with CollectiveBytes() as counter:
        for method in args.methods:
            model, state, losses, sent, dense = train(method, args, rank, world, device, counter)
            # Median bytes per step after PowerSGD's warm-up of plain all-reduces (the other
            # methods send the same amount every step).
            later = sorted(sent[args.powersgd_start:]) or sorted(sent)
            steady = later[len(later) // 2]
            tail = losses[-5:]
            rows.append({"method": method, "bytes_per_step": steady, "dense_bytes": dense,
                         "compression_ratio": dense / steady, "losses": losses,
                         "final_loss": sum(tail) / len(tail), "bytes_each_step": sent})
            if method == "topk" and args.ef_check and rank == 0:
                names = {id(p): n for n, p in model.named_parameters()}
                check = {kind: {names[i]: t.cpu() for i, t in store.items()}
                         for kind, store in (("sum_grads", state.sum_grads),
                                             ("sum_sent", state.sum_sent),
                                             ("residual", state.residual))}
                args.ef_check.parent.mkdir(parents=True, exist_ok=True)
                torch.save(check, args.ef_check)
    if rank == 0:
        report(args, world, rows)
    dist.barrier()  # files are complete before any rank exits


def report(args, world, rows):
    base = next((r for r in rows if r["method"] == "none"), None)
    print(f"world {world} | {args.steps} steps | dense gradients {rows[0]['dense_bytes']} B "
          f"per rank per step | powersgd rank {args.powersgd_rank} | top-k "
          f"{args.topk_ratio:g}")
    print("loss   " + " ".join(f"{r['method']:>9}" for r in rows))
    for step in sorted({0, args.steps - 1, *range(args.log_every - 1, args.steps,
                                                  args.log_every)}):
        print(f"{step + 1:5d}  " + " ".join(f"{r['losses'][step]:9.4f}" for r in rows))
    print(f"{'method':<9} {'bytes/step':>10} {'ratio':>7} {'loss, last 5 steps':>18} "
          f"{'vs none':>8}")
    for r in rows:
        # + 0.0 turns a rounded -0.0 into 0.0
        r["loss_cost"] = round(r["final_loss"] - base["final_loss"], 4) + 0.0 if base else None
        cost = f"{r['loss_cost']:+8.4f}" if base else "       -"
        print(f"{r['method']:<9} {r['bytes_per_step']:10d} {r['compression_ratio']:6.1f}x "
              f"{r['final_loss']:18.4f} {cost}", flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, world, args.plot)


def plot(rows, world, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        ax1.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["method"])
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (global batch)")
    ax1.set_title(f"loss with compressed gradients, world {world}")
    ax1.legend(fontsize=8)
    ax2.bar([r["method"] for r in rows], [r["compression_ratio"] for r in rows], color="tab:blue")
    ax2.set_yscale("log")
    ax2.set_ylabel("compression ratio (dense bytes / bytes sent)")
    for i, r in enumerate(rows):
        ax2.annotate(f"{r['compression_ratio']:.0f}x\nloss {r['final_loss']:.3f}",
                     (i, r["compression_ratio"]), ha="center", va="bottom", fontsize=7)
    ax2.set_title("bytes sent per step; loss over the last 5 steps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
