"""Data parallelism by hand, from naive to overlapped and bucketed, beside torch DDP.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/communication_overlap.py
    torchrun --nproc_per_node=2 05-advanced/communication_overlap.py --steps 30 \\
        --json-out runs/dp_overlap.json --plot runs/dp_overlap.png
    torchrun --nproc_per_node=8 05-advanced/communication_overlap.py --device cuda --dim 1024

Expected output (the first command, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo;
milliseconds move from run to run on a shared CPU, see 05-advanced/README.md, part 05c):
    world 2 | 27 gradient tensors, 4.71 MB | 4x16 tokens per rank | 6 steps (1 warm-up) per variant
    compute only (no communication): 68.6 ms/step (median)
    variant   bucket MB  step ms  exposed comm ms collectives  first launch vs backward end ms
    naive             -    200.6            132.0          27                             +0.0
    flat              -     79.7             11.1           1                             +0.5
    overlap           -    188.0            119.4          27                            -15.0
    bucketed          1    105.9             37.3           8                            -45.8
    ...
    ddp               4     97.1             28.5           2                            -43.8

Five ways to average gradients, each training its own copy of the same model on the same data:

    naive     backward ............|ar ar ar ar ar ar|      one blocking all-reduce per tensor
    flat      backward ............|ar(all)|                one all-reduce of one flat buffer
    overlap   backward ..ar.ar.ar.ar.ar|wait|               async all-reduce per tensor, launched
                                                            from the tensor's grad hook
    bucketed  backward ....ar(b0)....ar(b1)|wait|           async all-reduce per bucket of ~cap MB,
                                                            launched when the bucket is full
    ddp       torch DDP: buckets (bucket_cap_mb) + overlap, in C++

Communication hidden behind the rest of backward costs nothing; what is left after backward
(`exposed` time) is what overlap tries to remove. Buckets trade the latency of many small
collectives against overlap: one huge bucket cannot start before backward ends.
"""

import argparse
import gc
import json
import os
import statistics
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


VARIANTS = ("naive", "flat", "overlap", "bucketed", "ddp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[0.25, 1.0, 4.0, 16.0],
                   help="bucket sizes for `bucketed` and `ddp` (a sweep when several)")
    p.add_argument("--steps", type=int, default=6, help="training steps of every variant")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--dim", type=int, default=192, help="model width")
    p.add_argument("--depth", type=int, default=4, help="residual MLP blocks")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes one row per variant here")
    p.add_argument("--plot", type=Path, help="rank 0 draws step time and the bucket sweep here")
    p.add_argument("--export-dir", type=Path,
                   help="rank 0 saves each variant's final state_dict here as <variant>.pt")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq", "dim", "depth", "vocab"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        fail(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if min(args.bucket_cap_mb) <= 0 or args.lr <= 0 or args.timeout_s <= 0:
        fail("--bucket-cap-mb, --lr and --timeout-s must be positive")
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


# --------------------------------------------------------------------------------------------------
# The model: tied weights, a frozen parameter and a buffer, the three cases a DP wrapper must get
# right


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):  # h: (B, T, dim) -> (B, T, dim)
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TiedLM(nn.Module):
    """Token embedding tied to the output head, a frozen positional table, residual MLP blocks."""

    def __init__(self, vocab: int, dim: int, depth: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # Frozen: gets no gradient, so no data-parallel wrapper may wait for (or reduce) one.
        self.pos = nn.Parameter(0.02 * torch.randn(seq, dim), requires_grad=False)
        # A buffer (the role BatchNorm's running statistics play): state that is not a parameter
        # but must be equal on every rank.
        self.register_buffer("feature_scale", 1 + 0.1 * torch.randn(dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, used twice, one gradient

    def forward(self, tokens):  # tokens: (B, T) -> logits (B, T, vocab)
        h = (self.embed(tokens) + self.pos[: tokens.shape[1]]) * self.feature_scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def global_batch(seed: int, step: int, size: int, seq: int, vocab: int):
    """Step `step`'s global batch of token sequences; the target of each token is a fixed
    permutation of it, so the task is learnable without attention."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 12345))
    tokens = torch.randint(vocab, (size, seq),
                           generator=torch.Generator().manual_seed(seed * 100003 + step))
    return tokens, perm[tokens]


# --------------------------------------------------------------------------------------------------
# Hand-written data parallelism


def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every replica start from rank 0's parameters and buffers (frozen ones included)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=0)


def trainable_params(module: nn.Module) -> list:
    """Parameters that receive gradients, each once: module.parameters() already yields a tied
    tensor once; frozen ones are skipped (they never get a .grad to reduce)."""
    return [p for p in module.parameters() if p.requires_grad]


def sync_naive(params, world: int, log: list) -> None:
    """(a) After backward: one blocking all-reduce per gradient tensor, one after the other."""
    for p in params:
        log.append(time.perf_counter())
        dist.all_reduce(p.grad)  # sum over ranks, in place
        p.grad.div_(world)


def sync_flat(params, world: int, log: list) -> None:
    """(b) After backward: copy every gradient into one flat buffer and all-reduce it once.
    One collective instead of len(params): latency paid once, but nothing overlaps backward."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (sum of numels,)
    log.append(time.perf_counter())
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


class DDPIndividualParameters(nn.Module):
    """(c) Overlap: each gradient's all-reduce starts, asynchronously, the moment autograd has
    finished accumulating it, while backward keeps computing the gradients of earlier layers.

    Usage: out = model(x); loss.backward(); model.finish_gradient_synchronization(); opt.step()
    Every trainable parameter must receive a gradient each step (DDP's default contract too).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        broadcast_from_rank0(module)
        self.world = dist.get_world_size()
        self.pending = []  # (param, async work) of this step, in launch order
        self.launch_times = []  # perf_counter() at each launch: proves they start during backward
        for p in trainable_params(module):
            p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p) -> None:
        # Runs inside backward, once per tensor per backward (a tied tensor's two uses are summed
        # by autograd before this hook fires). async_op: returns at once, gloo/NCCL works behind.
        self.launch_times.append(time.perf_counter())
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every outstanding all-reduce and turn the sums into averages in .grad."""
        for p, work in self.pending:
            work.wait()
            p.grad.div_(self.world)
        self.pending.clear()


class DDPBucketed(nn.Module):
    """(d) Buckets: gradients grouped into ~bucket_size_mb flat buffers in reverse parameter order
    (roughly the order backward produces them); a bucket's single async all-reduce starts as soon
    as its last gradient is ready. Fewer, larger collectives than (c), still overlapped.

    Usage as DDPIndividualParameters; every trainable parameter must get a gradient each step.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        broadcast_from_rank0(module)
        self.world = dist.get_world_size()
        cap = bucket_size_mb * 2**20
        self.buckets, filled = [[]], 0  # lists of parameters; a tensor over the cap gets its own
        for p in reversed(trainable_params(module)):
            size = p.numel() * p.element_size()
            if self.buckets[-1] and filled + size > cap:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(p)
            filled += size
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients ready so far this step, per bucket
        self.pending = {}  # bucket index -> (flat buffer, async work)
        self.launch_times = []
        for p in trainable_params(module):
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p) -> None:
        # Collectives pair up by launch order, so every rank must fill its buckets in the same
        # order: true for the same graph on the same kind of device (DDP goes further and, after
        # step 1, rebuilds its buckets in the order rank 0 observed).
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket is full: send it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self.launch_times.append(time.perf_counter())
            self.pending[i] = (flat, dist.all_reduce(flat, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for each bucket, average, and copy the slices back into the parameters' .grad."""
        for i, (flat, work) in sorted(self.pending.items()):
            work.wait()
            flat.div_(self.world)
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)


def wrap_ddp(module: nn.Module, cap_mb: float, device, log: list) -> DDP:
    """(e) torch DDP with the given bucket size, and a comm hook that only records launch times
    (and does what DDP's default hook does: average, then all-reduce the bucket asynchronously)."""
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cap_mb)
    world = dist.get_world_size()

    def timed_allreduce(state, bucket):
        log.append(time.perf_counter())
        buffer = bucket.buffer().div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, timed_allreduce)
    return ddp


# --------------------------------------------------------------------------------------------------
# Training: every variant trains its own replica, interleaved step by step so that a noisy
# neighbour on a shared machine slows all variants alike


class Runner:
    """One variant: its model, optimizer, synchronisation, and per-step records."""

    def __init__(self, name, cap_mb, args, rank, world, device):
        self.name, self.cap_mb, self.world = name, cap_mb, world
        # Each rank initialises differently on purpose: only the wrappers' broadcast from rank 0
        # makes the replicas equal (and equal to a one-process run with the same seed).
        torch.manual_seed(args.seed + rank)
        model = TiedLM(args.vocab, args.dim, args.depth, args.seq).to(device)
        self.log = []  # collective launch times of the current step
        if name in ("naive", "flat", "local"):
            if name != "local":
                broadcast_from_rank0(model)
            self.model, self.plain = model, model
        elif name == "overlap":
            self.model = DDPIndividualParameters(model)
            self.log = self.model.launch_times
            self.plain = model
        elif name == "bucketed":
            self.model = DDPBucketed(model, cap_mb)
            self.log = self.model.launch_times
            self.plain = model
        else:  # ddp
            self.model, self.plain = wrap_ddp(model, cap_mb, device, self.log), model
        self.params = trainable_params(self.plain)
        self.opt = torch.optim.SGD(self.params, lr=args.lr)
        self.step_times, self.collectives, self.offsets = [], [], []

    def step(self, tokens, targets):
        self.log.clear()
        t0 = time.perf_counter()
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        t_bwd = time.perf_counter()
        if self.name == "naive":
            sync_naive(self.params, self.world, self.log)
        elif self.name == "flat":
            sync_flat(self.params, self.world, self.log)
        elif self.name in ("overlap", "bucketed"):
            self.model.finish_gradient_synchronization()
        # ddp: the all-reduces were launched and waited for inside backward
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_times.append(time.perf_counter() - t0)
        self.collectives.append(len(self.log))
        # Launch times relative to the end of backward: negative = started during backward.
        self.offsets.append([t - t_bwd for t in self.log])
        return loss.detach()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        run(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world, device):
    runners = [Runner("local", None, args, rank, world, device)]  # compute only: no sync at all
    for name in args.variants:
        caps = args.bucket_cap_mb if name in ("bucketed", "ddp") else [None]
        runners += [Runner(name, cap, args, rank, world, device) for cap in caps]
    grad_mb = sum(p.numel() * p.element_size() for p in runners[0].params) / 2**20
    if rank == 0:
        print(f"world {world} | {len(runners[0].params)} gradient tensors, {grad_mb:.2f} MB | "
              f"{args.batch_size}x{args.seq} tokens per rank | {args.steps} steps "
              f"({args.warmup} warm-up) per variant", flush=True)

    losses = {id(r): [] for r in runners}
    for step in range(args.steps):
        tokens, targets = global_batch(args.seed, step, world * args.batch_size, args.seq,
                                       args.vocab)
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        x, y = tokens[mine].to(device), targets[mine].to(device)
        for r in runners:
            losses[id(r)].append(r.step(x, y))

    def median_time(r):
        return statistics.median(r.step_times[args.warmup:])

    compute = median_time(runners[0])
    rows = []
    for r in runners[1:]:
        bucketed = r.name in ("bucketed", "ddp")
        rows.append({
            "variant": r.name, "bucket_cap_mb": r.cap_mb if bucketed else None,
            "step_time_s": median_time(r),
            # What communication adds to a step that computes only (medians, same run).
            "exposed_comm_s": median_time(r) - compute,
            "collectives": statistics.median(r.collectives[args.warmup:]),
            "compute_step_time_s": compute,
            "launch_offsets_s": r.offsets[-1],  # last step, rank 0's clock
            "final_loss": losses[id(r)][-1].item(),
        })
    if rank == 0:
        report(args, world, rows, compute)
        if args.export_dir:
            args.export_dir.mkdir(parents=True, exist_ok=True)
            for r in runners[1:]:
                tag = r.name if r.cap_mb is None else f"{r.name}_{r.cap_mb:g}mb"
                torch.save({k: v.detach().cpu() for k, v in r.plain.state_dict().items()},
                           args.export_dir / f"{tag}.pt")
    dist.barrier()  # files are complete before any rank exits


def report(args, world, rows, compute):
    print(f"compute only (no communication): {compute * 1e3:.1f} ms/step (median)")
    print(f"{'variant':<9} {'bucket MB':>9} {'step ms':>8} {'exposed comm ms':>16} "
          f"{'collectives':>11} {'first launch vs backward end ms':>32}")
    for row in rows:
        cap = "-" if row["bucket_cap_mb"] is None else f"{row['bucket_cap_mb']:g}"
        first = min(row["launch_offsets_s"]) * 1e3 if row["launch_offsets_s"] else float("nan")
        print(f"{row['variant']:<9} {cap:>9} {row['step_time_s'] * 1e3:8.1f} "
              f"{row['exposed_comm_s'] * 1e3:16.1f} {row['collectives']:11g} {first:+32.1f}")
    naive = [r for r in rows if r["variant"] == "naive"]
    best = min((r for r in rows if r["variant"] == "bucketed"), key=lambda r: r["step_time_s"],
               default=None)
    if naive and best:
        print(f"bucketed ({best['bucket_cap_mb']:g} MB) vs naive: "
              f"{naive[0]['step_time_s'] / best['step_time_s']:.2f}x faster per step "
              f"at world {world}", flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, compute, world, args.plot)


def plot(rows, compute, world, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names, comp, comm = [], [], []
    for variant in VARIANTS:
        group = [r for r in rows if r["variant"] == variant]
        if group:
            best = min(group, key=lambda r: r["step_time_s"])
            names.append(variant if best["bucket_cap_mb"] is None
                         else f"{variant}\n{best['bucket_cap_mb']:g} MB")
            comp.append(compute * 1e3)
            comm.append(max(best["exposed_comm_s"], 0) * 1e3)
    ax1.bar(names, comp, label="compute (no-communication step)", color="tab:gray")
    ax1.bar(names, comm, bottom=comp, label="exposed communication", color="tab:red")
    ax1.set_ylabel("step time, ms (median)")
    ax1.set_title(f"gradient synchronisation at world {world}")
    ax1.legend(fontsize=8)
    for variant, marker in (("bucketed", "o"), ("ddp", "s")):
        sweep = sorted((r for r in rows if r["variant"] == variant),
                       key=lambda r: r["bucket_cap_mb"])
        if sweep:
            ax2.plot([r["bucket_cap_mb"] for r in sweep],
                     [r["step_time_s"] * 1e3 for r in sweep], marker=marker, label=variant)
            for r in sweep:
                ax2.annotate(f"{r['collectives']:g}", (r["bucket_cap_mb"], r["step_time_s"] * 1e3),
                             textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax2.axhline(compute * 1e3, color="tab:gray", linestyle="--", label="compute only")
    ax2.set_xscale("log")
    ax2.set_xlabel("bucket size, MB (labels: collectives per step)")
    ax2.set_ylabel("step time, ms (median)")
    ax2.set_title("bucket-size sweep")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
