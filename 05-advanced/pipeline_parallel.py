"""Pipeline parallelism: one model cut into p stages (one per rank), a batch cut into m
micro-batches, and the schedules that decide who computes what when: GPipe and 1F1B written by
hand with send/recv, and the same (plus interleaved 1F1B) with torch.distributed.pipelining.

Launch (from the repository root):
    python 05-advanced/pipeline_parallel.py                       # p = 1: the unsplit model
    torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py  # 1F1B by hand, p = 4, m = 8
    torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py --schedule gpipe \\
        --layer-ms 25 --timeline runs/pp_gpipe.png                # fixed-cost stages, picture
    torchrun --nproc_per_node=2 05-advanced/pipeline_parallel.py --impl torch --schedule interleaved
    torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py --sweep 1-16 --sweep-p 2,4 \\
        --layer-ms 25 --metrics-out runs/pp_sweep.json --plot runs/pp_bubble.png  # vs formula

Output of `torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py` (2-core AMD EPYC CPU,
shared; torch 2.14.1, gloo); `python` gives the same losses with p = 1:
    pipeline: p = 4 rank(s) x v = 1 stage(s) | 8 layers | schedule 1f1b (manual) | batch 48 = ...
    step    1/20 | loss 2.3241
    ...
    step   20/20 | loss 1.1809
    last step: bubble 0.713 measured (mean over ranks) vs 0.273 = (p-1)/(m+p-1) | micro-batches
        held per rank [4, 3, 2, 1] | peak activations per rank (KiB) [75.4, 54.3, 36.2, 19.6]
(the bubble exceeds the formula when transfers outweigh this toy model's compute; with
--layer-ms 25 it measures 0.285; see the README section pipeline_experts_ring.md).

The mechanism, for p = 4 stages and m = 4 micro-batches (F = forward, B = backward, . = idle):

    GPipe (all forwards, then all backwards)       1F1B (after a warm-up, one forward, one backward)
    rank 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3      F0 F1 F2 F3 .  .  B0 .  B1 .  B2 .  B3
    rank 1  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .        .  F0 F1 F2 .  B0 F3 B1 .  B2 .  B3 .
    rank 2  .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .        .  .  F0 F1 B0 F2 B1 F3 B2 .  B3 .  .
    rank 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .        .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
    (drawn with B as long as F; the real B costs about 2 F)

Both have the same bubble, (p - 1) / (m + p - 1) of the step: the fill and the drain of the pipe.
They differ in memory: GPipe keeps the activations of all m micro-batches until the backward pass
starts; 1F1B starts the backward of micro-batch 0 as soon as it can, so rank r holds at most p - r.
Interleaved 1F1B gives each rank v smaller stages (rank r holds stages r, r + p, ...): the fill and
drain are made of stages v times shorter, so the bubble shrinks to (p - 1) / (v m + p - 1), at the
price of v times more point-to-point transfers.

Communication: the only traffic is point to point between neighbours: stage s sends its output
activation (rows, hidden) to stage s + 1, and receives d(loss)/d(output) of the same shape back.
"""

import argparse
import gc
import inspect
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

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SWEEP_ROWS_PER_MICROBATCH = 4  # --sweep: every m uses micro-batches of 4 rows (batch 4 m)


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_int_list(text: str) -> list[int]:
    """'1-16' or '1,4,6' -> a list of ints."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            fail(f"--sweep expects a list like 1-16 or 1,4,6, got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail  # argparse's own errors too: one line, exit 2
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--impl", choices=["manual", "torch"], default="manual",
                   help="manual: send/recv written out here; torch: torch.distributed.pipelining")
    p.add_argument("--microbatches", type=int, default=8, help="m: micro-batches per step")
    p.add_argument("--virtual-stages", type=int, default=0,
                   help="v: stages per rank (interleaved only; 0 = 2 for interleaved, else 1)")
    p.add_argument("--layers", type=int, default=8, help="residual blocks, cut evenly into stages")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layer-ms", type=float, default=0.0,
                   help="fixed cost: each block sleeps this long in forward, twice in backward")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=48,
                   help="rows per step, shared by the whole pipeline; split into m micro-batches")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--timeline", type=Path, help="rank 0 draws the last step's schedule (PNG)")
    p.add_argument("--sweep", type=parse_int_list, metavar="LIST",
                   help="measure instead of train: one step of every implementation and schedule "
                        f"for each m in LIST (micro-batches of {SWEEP_ROWS_PER_MICROBATCH} rows)")
    p.add_argument("--sweep-p", type=parse_int_list, metavar="LIST",
                   help="with --sweep: pipeline sizes to measure, each on ranks 0..p-1 "
                        "(default: the world size)")
    p.add_argument("--plot", type=Path, help="with --sweep: rank 0 draws bubble and memory vs m")
    p.add_argument("--check-out", type=Path,
                   help="rank 0 saves the first step's loss and consolidated gradients (tests)")
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain model state_dict here")
    args = p.parse_args(argv)
    for name in ("microbatches", "layers", "hidden", "steps", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.layer_ms < 0 or args.lr <= 0 or args.timeout_s <= 0:
        fail("--layer-ms must be >= 0, --lr and --timeout-s positive")
    if args.sweep is not None and min(args.sweep) < 1:
        fail(f"--sweep micro-batch counts must be at least 1, got {min(args.sweep)}")
    if (args.plot or args.sweep_p) and args.sweep is None:
        fail("--plot and --sweep-p go with --sweep; use --timeline for one run")
    return args


def virtual_stages(schedule: str, v_arg: int) -> int:
    return (v_arg or 2) if schedule == "interleaved" else (v_arg or 1)


def too_few_layers(p: int, v: int, layers: int):
    return (f"{p} pipeline ranks x {v} stage(s) per rank = {p * v} stages, but --layers {layers}"
            " gives fewer layers than stages (each stage needs at least one)")


def unsupported(impl: str, schedule: str, p: int, v: int, m: int, layers: int, batch: int):
    """Why this combination cannot run (a message naming every number), or None."""
    if p * v > layers:
        return too_few_layers(p, v, layers)
    if batch % m:
        return (f"--batch-size {batch} is not divisible by --microbatches {m} (the receiving "
                "stage preallocates one buffer shape for every micro-batch)")
    if schedule == "interleaved" and impl == "manual":
        return "the interleaved schedule is shown with --impl torch (manual: gpipe or 1f1b)"
    if schedule == "interleaved" and v < 2:
        return f"interleaved needs --virtual-stages >= 2, got {v}"
    if schedule != "interleaved" and v != 1:
        return f"--virtual-stages {v} needs --schedule interleaved ({schedule} has 1 per rank)"
    if impl == "torch" and schedule == "1f1b" and m < p:
        return (f"torch's Schedule1F1B needs --microbatches >= stages: m = {m} < p = {p} "
                "(use --impl manual or --schedule gpipe)")
    if impl == "torch" and schedule == "interleaved" and m % max(1, m // p):
        return (f"torch's ScheduleInterleaved1F1B splits the m = {m} micro-batches into "
                f"max(1, m // p) = {m // p} rounds of equal size (p = {p}): m must be a multiple")
    return None


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
# Model and data: the unsplit model that every pipeline must reproduce


class Block(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 norm(x)); (rows, hidden) -> (rows, hidden)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class PipeModel(nn.Module):
    """embed (32 -> hidden) -> `layers` blocks -> head (hidden -> 10 classes)."""

    def __init__(self, layers: int = 8, hidden: int = 64, features: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """The batch of optimizer step `step`, a pure function of (seed, step) (as in lesson 01).
    Every stage of a pipeline works on the same rows: the first stage reads x, the last y."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def micro_loss(logits, target, m: int):
    """Loss of one micro-batch, scaled so that the m of them add up to the full batch's mean loss
    (micro-batches are equal in size), hence gradients equal to the unsplit model's."""
    return F.cross_entropy(logits, target) / m


# --------------------------------------------------------------------------------------------------
# Instruments: compute intervals (the timeline) and the activations a rank holds


class ActivationMeter:
    """Bytes of activations saved for backward, live now and at peak, counted by autograd's
    saved-tensor hooks: a tensor is counted when a forward saves it and released when autograd
    frees the graph after that micro-batch's backward. Parameters (also saved by F.linear) are
    not activations and are skipped; a tensor saved twice (by two operations) counts once."""

    def __init__(self):
        self.param_storages = set()
        self.refs: dict[tuple, list[int]] = {}  # (address, shape) -> [times saved, bytes]
        self.live = self.peak = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.param_storages:
            return t
        key = (t.data_ptr(), tuple(t.shape))
        entry = self.refs.setdefault(key, [0, t.numel() * t.element_size()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(t, self, key)

    def release(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= self.refs.pop(key)[1]

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """What autograd keeps instead of the tensor; freed with the graph, it tells the meter."""
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter.release(self.key)


class Recorder:
    """This rank's view of one step: compute intervals (kind, stage, micro-batch, start, end) in
    seconds since the step started, the micro-batches whose activations are held, and the bytes."""

    def __init__(self):
        self.meter = ActivationMeter()
        self.reset()

    def reset(self):
        self.t0 = time.perf_counter()
        self.events, self.forwards = [], {}
        self.held = self.peak_held = 0
        self.meter.peak = self.meter.live

    def now(self):
        return time.perf_counter() - self.t0


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward it calls `hook` when the gradient passes through. The
    `anchor` (a scalar that requires grad) keeps the node in the graph on the first stage, whose
    input does not require grad."""

    @staticmethod
    def forward(ctx, x, anchor, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return (grad if ctx.needs_input_grad[0] else None), None, None


class Stage(nn.Module):
    """Pipeline stage `index` of `num_stages`: a contiguous slice of PipeModel's blocks (plus the
    embedding on the first stage and the head on the last). Forward and backward are timed and,
    with --layer-ms, made to cost a fixed time (sleep) so the bubble can be measured exactly."""

    def __init__(self, model: PipeModel, index: int, num_stages: int, layer_ms: float,
                 recorder: Recorder):
        super().__init__()
        layers = len(model.blocks)
        lo, hi = index * layers // num_stages, (index + 1) * layers // num_stages
        self.index, self.recorder = index, recorder
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.head = model.head if index == num_stages - 1 else None
        self.block_ids = list(range(lo, hi))
        self.cost_s = layer_ms * (hi - lo) / 1000  # set to 0 for an untimed warm-up step
        self.layer_cost_s = self.cost_s
        self.anchor = torch.zeros((), requires_grad=True)  # not a parameter: see _OnBackward
        self.bwd_start = {}

    def full_name(self, name: str) -> str:
        """This stage's parameter name -> the unsplit PipeModel's (blocks.0 -> blocks.<lo>)."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{self.block_ids[int(i)]}.{rest}"
        return name

    def forward(self, x):
        rec = self.recorder
        mb = rec.forwards[self.index] = rec.forwards.get(self.index, -1) + 1  # in order 0..m-1
        start = rec.now()
        # bwd: the gradient leaves the stage here, last of all: that closes this backward box
        x = _OnBackward.apply(x, self.anchor, lambda: self._backward_done(mb))
        with torch.autograd.graph.saved_tensors_hooks(rec.meter.pack, rec.meter.unpack):
            h = self.embed(x) if self.embed is not None else x
            for block in self.blocks:
                h = block(h)
            if self.head is not None:
                h = self.head(h)
        time.sleep(self.cost_s)
        rec.events.append(("F", self.index, mb, start, rec.now()))
        rec.held += 1
        rec.peak_held = max(rec.peak_held, rec.held)
        # bwd: the gradient of the output arrives here first: that opens the backward box
        return _OnBackward.apply(h, self.anchor, lambda: self.bwd_start.update({mb: rec.now()}))

    def _backward_done(self, mb):
        time.sleep(2 * self.cost_s)  # a backward costs about two forwards (two matmuls per one)
        rec = self.recorder
        rec.events.append(("B", self.index, mb, self.bwd_start.pop(mb), rec.now()))
        rec.held -= 1


def build_stages(args, p: int, v: int, rank: int):
    """Build the unsplit model from the seed on every rank (identical initial weights), keep the
    stages of this rank and drop the rest. (A large model would be built on the meta device and
    only this rank's stages materialised; the weights would then come from a checkpoint.)
    Interleaved: rank r holds stages r, r + p, r + 2p, ... (v of them)."""
    torch.manual_seed(args.seed)
    model = PipeModel(args.layers, args.hidden)
    recorder = Recorder()
    stages = [Stage(model, rank + c * p, p * v, args.layer_ms, recorder) for c in range(v)]
    recorder.meter.param_storages = {q.untyped_storage().data_ptr()
                                     for st in stages for q in st.parameters()}
    return stages, recorder


# --------------------------------------------------------------------------------------------------
# The schedules by hand. Each transfer is one line; stage s talks to stage s - 1 (prev) and s + 1
# (next) only. Activations and gradients have the shape (rows of a micro-batch, hidden).


class Link:
    """Point-to-point transfers of one stage (None at the ends of the pipe)."""

    def __init__(self, rank: int, p: int, shape, device):
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < p - 1 else None
        self.shape, self.device = shape, device

    def recv_forward(self):  # fwd: activation of stage s - 1
        x = torch.empty(self.shape, device=self.device)
        dist.recv(x, src=self.prev)
        return x.requires_grad_()  # a leaf: its .grad is what we send back

    def send_forward(self, y):
        dist.send(y.detach().contiguous(), dst=self.next)

    def recv_backward(self):  # bwd: d loss / d (our output), from stage s + 1
        g = torch.empty(self.shape, device=self.device)
        dist.recv(g, src=self.next)
        return g

    def send_backward(self, dx):
        dist.send(dx.contiguous(), dst=self.prev)

    def exchange(self, send, peer):
        """Send `send` to `peer` and receive a tensor of the same shape from it, both posted at
        once. In 1F1B neighbours send to each other at the same moment (activation one way,
        gradient the other); two blocking sends would wait for each other forever on NCCL."""
        got = torch.empty(self.shape, device=self.device)
        ops = [dist.P2POp(dist.isend, send.detach().contiguous(), peer),
               dist.P2POp(dist.irecv, got, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got


class ManualStage:
    """Forward and backward of one micro-batch on this rank's stage, ends of the pipe included."""

    def __init__(self, stage: Stage, link: Link, x_mbs, y_mbs, m: int):
        self.stage, self.link, self.m = stage, link, m
        self.x_mbs, self.y_mbs = x_mbs, y_mbs  # used on the first / last stage only
        self.saved = {}  # micro-batch -> (input, output): the activations held for backward
        self.losses = []

    def forward(self, i, x):
        """x: the received activation (None on the first stage, which reads the data)."""
        x = self.x_mbs[i] if x is None else x
        y = self.stage(x)
        if self.link.next is None:  # last stage: the output is the loss
            y = micro_loss(y, self.y_mbs[i], self.m)
            self.losses.append(y.detach())
        self.saved[i] = (x, y)
        return y

    def backward(self, i, grad):
        """grad: d loss / d output (None on the last stage); returns d loss / d input."""
        x, y = self.saved.pop(i)
        torch.autograd.backward(y, grad)  # accumulates into the stage's .grad (sum over i)
        return x.grad if self.link.prev is not None else None


def gpipe(run: ManualStage, link: Link, m: int):
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards (reverse order is not
    needed for correctness; we keep 0..m-1). Rank r holds all m micro-batches' activations."""
    for i in range(m):
        x = link.recv_forward() if link.prev is not None else None
        y = run.forward(i, x)
        if link.next is not None:
            link.send_forward(y)
    for i in range(m):
        g = link.recv_backward() if link.next is not None else None
        dx = run.backward(i, g)
        if link.prev is not None:
            link.send_backward(dx)


def one_f_one_b(run: ManualStage, link: Link, p: int, rank: int, m: int):
    """1F1B (PipeDream-flush, Narayanan et al. 2021): rank r runs p - r - 1 warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards. It holds at most
    p - r micro-batches of activations instead of m."""
    first, last = link.prev is None, link.next is None
    warmup = min(m, p - rank - 1)
    steady = m - warmup
    for i in range(warmup):
        y = run.forward(i, None if first else link.recv_forward())
        if not last:
            link.send_forward(y)
    x = None if first or steady == 0 else link.recv_forward()
    for j in range(steady):
        y = run.forward(warmup + j, x)
        # send activation j + warmup down, receive the gradient of micro-batch j up: one exchange
        g = None if last else link.exchange(y, link.next)
        dx = run.backward(j, g)
        if first:
            continue
        if j == steady - 1:
            link.send_backward(dx)
        else:  # send gradient j up, receive the next activation: the other exchange
            x = link.exchange(dx, link.prev).requires_grad_()
    for i in range(steady, m):  # cool-down: the backwards of the warm-up micro-batches
        dx = run.backward(i, None if last else link.recv_backward())
        if not first:
            link.send_backward(dx)


# --------------------------------------------------------------------------------------------------
# The same schedules with torch.distributed.pipelining


def torch_schedule(stages, schedule: str, p: int, m: int, rows: int, hidden: int, device,
                   group=None):
    """Wrap our Stage modules in PipelineStage and pick the library's schedule. The example
    input/output tensors give the P2P buffer shapes up front (no shape-inference pass); their
    requires_grad tells the library which gradients travel back (all but the data's)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    n = p * len(stages)
    pipe_stages = []
    for st in stages:
        width_in = st.embed.in_features if st.embed is not None else hidden
        width_out = st.head.out_features if st.head is not None else hidden
        pipe_stages.append(PipelineStage(
            st, st.index, n, device,
            input_args=(torch.empty(rows, width_in, device=device,
                                    requires_grad=st.embed is None),),
            output_args=(torch.empty(rows, width_out, device=device, requires_grad=True),),
            group=group))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
           "interleaved": ScheduleInterleaved1F1B}[schedule]
    # torch >= 2.7 divides gradients by m unless scale_grads=False; older versions never do.
    # micro_loss already divides by m, so we switch the library's scaling off where it exists.
    extra = {"scale_grads": False} if "scale_grads" in inspect.signature(cls).parameters else {}

    def loss_fn(logits, target):
        return micro_loss(logits, target, m)

    if schedule == "interleaved":
        return cls(pipe_stages, n_microbatches=m, loss_fn=loss_fn, **extra)
    return cls(pipe_stages[0], n_microbatches=m, loss_fn=loss_fn, **extra)


# --------------------------------------------------------------------------------------------------
# One pipeline, either implementation


class Pipeline:
    def __init__(self, args, impl: str, schedule: str, m: int, batch: int, rank: int, p: int,
                 device, group=None):
        """The pipeline of ranks 0..p-1; `group` is their process group (None: all ranks)."""
        self.impl, self.schedule, self.m, self.rank, self.p = impl, schedule, m, rank, p
        self.group = group
        self.v = virtual_stages(schedule, args.virtual_stages if args.sweep is None else 0)
        self.stages, self.recorder = build_stages(args, p, self.v, rank)
        for st in self.stages:
            st.to(device)
        self.device, self.rows = device, batch // m
        self.link = Link(rank, p, (self.rows, args.hidden), device)
        if impl == "torch":
            self.torch_sched = torch_schedule(self.stages, schedule, p, m, self.rows, args.hidden,
                                              device, group)

    def parameters(self):
        return [q for st in self.stages for q in st.parameters()]

    def step(self, x, y, fixed_cost: bool = True):
        """Forward and backward of one batch: fills .grad. Returns the loss on the rank that
        holds the last stage (a 0-dim tensor), None on the others."""
        first, last = self.rank == 0, self.rank == self.p - 1
        for st in self.stages:
            st.cost_s = st.layer_cost_s if fixed_cost else 0.0
        x, y = x.to(self.device), y.to(self.device)
        dist.barrier(group=self.group)  # every stage starts the clock together: the step's window
        self.recorder.reset()
        if self.impl == "manual":
            run = ManualStage(self.stages[0], self.link, x.chunk(self.m), y.chunk(self.m), self.m)
            if self.schedule == "gpipe":
                gpipe(run, self.link, self.m)
            else:
                one_f_one_b(run, self.link, self.p, self.rank, self.m)
            loss = torch.stack(run.losses).sum() if last else None
        else:
            losses = []
            # The first stage gets the whole batch, the last the targets; the library cuts them
            # into m micro-batches with tensor_split (the same rows as x.chunk(m) above).
            self.torch_sched.step(*([x] if first else []), target=y if last else None,
                                  losses=losses if last else None)
            loss = torch.stack(losses).sum().detach() if last else None
        dist.barrier(group=self.group)
        self.window_s = self.recorder.now()
        return loss

    def measured(self):
        """This rank's compute time, bubble (idle share of the step) and memory, last step."""
        busy = sum(end - start for _, _, _, start, end in self.recorder.events)
        return {"window_s": self.window_s, "busy_s": busy, "bubble": 1 - busy / self.window_s,
                "peak_held_microbatches": self.recorder.peak_held,
                "peak_activation_bytes": self.recorder.meter.peak,
                "events": self.recorder.events}

    def formula(self):
        return (self.p - 1) / (self.v * self.m + self.p - 1)

    def full_state(self, grads: bool = False):
        """{unsplit PipeModel name: tensor on CPU} of this rank's stages (weights or grads)."""
        out = {}
        for st in self.stages:
            for name, prm in st.named_parameters():
                t = prm.grad if grads else prm
                out[st.full_name(name)] = (torch.zeros_like(prm) if t is None else t).detach().cpu()
        return out


def gather_to_rank0(obj, rank, world):
    """gather_object: rank 0 receives every rank's object (pickled, so tensors go as CPU)."""
    got = [None] * world if rank == 0 else None
    dist.gather_object(obj, got, dst=0)
    return got


def merge(parts):
    """The ranks' {name: tensor} pieces -> one state_dict of the unsplit PipeModel."""
    return {k: t for part in parts for k, t in part.items()}


# --------------------------------------------------------------------------------------------------
# Pictures


def draw_timeline(path: Path, per_rank, title: str):
    """Ranks as rows, time to the right; a box per forward (light) or backward (dark, hatched),
    coloured by micro-batch and labelled with it (and with the stage when a rank has several)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cmap = plt.get_cmap("tab20")
    several = len({s for r in per_rank for _, s, _, _, _ in r["events"]}) > len(per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1.4))
    for rank, r in enumerate(per_rank):
        for kind, stage, mb, start, end in r["events"]:
            color = cmap((2 * mb) % 20 + (0 if kind == "F" else 1))
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8, color=color,
                    edgecolor="black", linewidth=0.4, hatch="//" if kind == "B" else None)
            label = f"{kind}{mb}" + (f"s{stage}" if several else "")
            if end - start > 0.02 * max(x["window_s"] for x in per_rank):  # room for text
                ax.text((start + end) / 2 * 1e3, rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step started (ms)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_sweep(path: Path, rows, title: str):
    """One row of panels per pipeline size p. Left: measured bubble per schedule vs the formulas.
    Right: activation memory held by rank 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(len(ps), 2, figsize=(12, 4.2 * len(ps)), squeeze=False)
    markers = {"gpipe": "o", "1f1b": "s", "interleaved": "^"}
    for (ax1, ax2), p in zip(axes, ps):
        mine = [r for r in rows if r["p"] == p]
        grid = [m / 4 for m in range(4, 4 * max(r["m"] for r in mine) + 1)]
        ax1.plot(grid, [(p - 1) / (m + p - 1) for m in grid], "k-", lw=1, label="(p-1)/(m+p-1)")
        for v in sorted({r["v"] for r in mine if r["v"] > 1}):
            ax1.plot(grid, [(p - 1) / (v * m + p - 1) for m in grid], "k--", lw=1,
                     label=f"(p-1)/({v}m+p-1)")
        for impl, sched in sorted({(r["impl"], r["schedule"]) for r in mine}):
            pts = [r for r in mine if r["impl"] == impl and r["schedule"] == sched]
            style = {"mfc": "none" if impl == "torch" else None, "label": f"{impl} {sched}"}
            ax1.plot([r["m"] for r in pts], [r["bubble"] for r in pts], markers[sched], ms=6,
                     **style)
            ax2.plot([r["m"] for r in pts],
                     [r["per_rank"][0]["peak_activation_bytes"] / 1024 for r in pts],
                     markers[sched] + "-", **style)
        ax1.set(xlabel="micro-batches m", ylabel="bubble: idle share of the step",
                title=f"measured bubble vs formula, p = {p}")
        ax2.set(xlabel="micro-batches m", ylabel="peak activations held by rank 0 (KiB)",
                title=f"activation memory, p = {p}, {SWEEP_ROWS_PER_MICROBATCH} rows per "
                      "micro-batch")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Main: train (the contract) or sweep (the measurements)


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    v = virtual_stages(args.schedule, args.virtual_stages)
    if args.sweep is None:
        why = unsupported(args.impl, args.schedule, world, v, args.microbatches, args.layers,
                          args.batch_size)
    else:  # every p must fit the model; schedules that refuse an m are skipped and listed
        args.sweep_p = args.sweep_p or [world]
        why = next((f"--sweep-p {p} must lie between 1 and the world size {world}"
                    for p in args.sweep_p if not 1 <= p <= world), None)
        p = max(args.sweep_p)
        why = why or (too_few_layers(p, 2, args.layers) if 2 * p > args.layers else None)
        if args.virtual_stages:
            why = why or "--sweep runs every schedule (v = 2 for interleaved): drop " \
                         "--virtual-stages"
    if why:
        fail(why)  # before any collective: every rank reaches the same verdict
    start_process_group(device, args.timeout_s)
    try:
        if args.sweep is None:
            train(args, rank, world, device)
        else:
            sweep(args, rank, world, device)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def train(args, rank, world, device):
    p, m = world, args.microbatches
    pipe = Pipeline(args, args.impl, args.schedule, m, args.batch_size, rank, p, device)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    if rank == 0:
        print(f"pipeline: p = {p} rank(s) x v = {pipe.v} stage(s) | {args.layers} layers | "
              f"schedule {args.schedule} ({args.impl}) | batch {args.batch_size} = {m} "
              f"micro-batches of {pipe.rows} | device {device}", flush=True)
    losses, t_start = [], None
    for step in range(args.steps):
        if step == 1:
            t_start = time.perf_counter()  # the first step pays for warm-up; time the rest
        x, y = global_batch(args.seed, step, args.batch_size)
        loss = pipe.step(x, y)
        if step == 0 and args.check_out:
            save_check(args.check_out, loss, pipe.full_state(grads=True), rank, world, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The loss lives on the last stage: one broadcast brings it to rank 0 for the log.
        report = loss.reshape(1) if loss is not None else torch.zeros(1, device=device)
        dist.broadcast(report, src=world - 1)
        losses.append(report.item())
        if rank == 0 and ((step + 1) % 5 == 0 or step in (0, args.steps - 1)):
            print(f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * args.batch_size / elapsed if t_start else float("nan")

    per_rank = gather_to_rank0(dict(pipe.measured(), **memory_bytes(pipe, optimizer, device)),
                               rank, world)
    weights = gather_to_rank0(pipe.full_state(), rank, world)
    if rank == 0:
        bubble = sum(r["bubble"] for r in per_rank) / world
        held = [r["peak_held_microbatches"] for r in per_rank]
        print(f"last step: bubble {bubble:.3f} measured (mean over ranks) vs {pipe.formula():.3f}"
              f" = (p-1)/({'v*' if pipe.v > 1 else ''}m+p-1) | micro-batches held per rank "
              f"{held} | peak activations per rank (KiB) "
              f"{[round(r['peak_activation_bytes'] / 1024, 1) for r in per_rank]}", flush=True)
        print(f"done: {args.steps} steps, {samples_per_s:.0f} samples/s", flush=True)
        title = (f"{args.schedule} ({args.impl}), p={p}, v={pipe.v}, m={m}, {args.layer_ms:g} ms "
                 f"per layer forward: bubble {bubble:.3f} measured, {pipe.formula():.3f} formula "
                 f"(F = forward, B = backward hatched, number = micro-batch, s = stage)")
        if args.timeline:
            draw_timeline(args.timeline, per_rank, title)
        if args.export:
            atomic_save(merge(weights), args.export)
        if args.metrics_out:
            write_json(args.metrics_out, {
                "script": "05-advanced/pipeline_parallel.py", "strategy": "pipeline",
                "schedule": args.schedule, "impl": args.impl, "world_size": world,
                "pipeline_stages": p * pipe.v, "virtual_stages": pipe.v, "microbatches": m,
                "steps": args.steps, "global_batch": args.batch_size, "losses": losses,
                "samples_per_s": samples_per_s, "bubble": bubble,
                "bubble_formula": pipe.formula(), "device": str(device),
                "torch_version": torch.__version__, "per_rank": per_rank})
    dist.barrier()  # files are complete before any rank exits


def memory_bytes(pipe, optimizer, device):
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
    return {"param_bytes": nbytes(pipe.parameters()),
            "grad_bytes": nbytes(q.grad for q in pipe.parameters()),
            "optim_bytes": nbytes(v for s in optimizer.state.values() for v in s.values()
                                  if torch.is_tensor(v)),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else None}


def sweep(args, rank, world, device):
    """One step of every implementation and schedule for each p and m: measured bubble,
    micro-batches held and activation bytes per rank, the loss and (with --check-out) the
    gradients. A pipeline of p < world ranks runs on ranks 0..p-1; the others wait for it in the
    gathers below (every rank joins those)."""
    rows, checks = [], {}
    for p in args.sweep_p:
        # collective over all ranks, even those that sit this p out
        group = dist.new_group(list(range(p))) if p < world else None
        for impl in ("manual", "torch"):
            for schedule in SCHEDULES:
                for m in args.sweep:
                    row, check = sweep_one(args, rank, world, device, p, group, impl, schedule, m)
                    rows.append(row)
                    if check:
                        checks[f"p{p}/{impl}/{schedule}/m{m}"] = check
    if rank == 0:
        for r in rows:
            if "skipped" in r:
                print(f"skipped {r['impl']} {r['schedule']} p={r['p']} m={r['m']}: {r['skipped']}")
        title = (f"{args.layers} layers, {args.layer_ms:g} ms per layer forward (x2 backward); "
                 f"torch {torch.__version__}, {device}, {dist.get_backend()}")
        if args.plot:
            draw_sweep(args.plot, [r for r in rows if "skipped" not in r], title)
        if args.check_out:
            atomic_save(checks, args.check_out)
        if args.metrics_out:
            write_json(args.metrics_out, {
                "script": "05-advanced/pipeline_parallel.py", "strategy": "pipeline-sweep",
                "world_size": world, "layers": args.layers, "layer_ms": args.layer_ms,
                "rows_per_microbatch": SWEEP_ROWS_PER_MICROBATCH, "device": str(device),
                "torch_version": torch.__version__, "runs": rows})
    dist.barrier()


def sweep_one(args, rank, world, device, p, group, impl, schedule, m):
    """Rank 0's row (and check tensors) for one configuration; None elsewhere."""
    batch = SWEEP_ROWS_PER_MICROBATCH * m
    why = unsupported(impl, schedule, p, virtual_stages(schedule, 0), m, args.layers, batch)
    if why:  # every rank reaches the same verdict
        return {"p": p, "impl": impl, "schedule": schedule, "m": m, "skipped": why}, None
    mine = grads = loss = None
    if rank < p:
        pipe = Pipeline(args, impl, schedule, m, batch, rank, p, device, group)
        x, y = global_batch(args.seed, 0, batch)
        pipe.step(x, y, fixed_cost=False)  # warm-up (first-call costs), untimed
        for q in pipe.parameters():
            q.grad = None
        loss = pipe.step(x, y)
        mine = pipe.measured()
        mine.pop("events")  # the sweep keeps the numbers; --timeline draws one run
        grads = pipe.full_state(grads=True) if args.check_out else None
    per_rank = [r for r in gather_to_rank0(mine, rank, world) or [] if r is not None]
    parts = gather_to_rank0(grads, rank, world) if args.check_out else None
    # the loss lives on the last stage (NCCL broadcasts device tensors: keep it on the device)
    report = loss.reshape(1) if loss is not None else torch.zeros(1, device=device)
    dist.broadcast(report, src=p - 1)
    if rank != 0:
        return None, None
    bubble = sum(r["bubble"] for r in per_rank) / p
    v = virtual_stages(schedule, 0)
    formula = (p - 1) / (v * m + p - 1)
    print(f"{impl:6s} {schedule:11s} p={p} v={v} m={m:2d} | bubble {bubble:.3f} measured, "
          f"{formula:.3f} formula | held {[r['peak_held_microbatches'] for r in per_rank]} | "
          f"rank 0 activations {per_rank[0]['peak_activation_bytes'] / 1024:.1f} KiB", flush=True)
    row = {"p": p, "impl": impl, "schedule": schedule, "m": m, "v": v, "bubble": bubble,
           "formula": formula, "per_rank": per_rank}
    check = {"loss": report.item(), "batch": batch,
             "grads": merge([g for g in parts if g is not None])} if args.check_out else None
    return row, check


def save_check(path, loss, grads, rank, world, device):
    """Rank 0 saves the loss (held by the last stage) and the consolidated gradients."""
    parts = gather_to_rank0(grads, rank, world)
    report = loss.reshape(1) if loss is not None else torch.zeros(1, device=device)
    dist.broadcast(report, src=world - 1)
    if rank == 0:
        atomic_save({"loss": report.item(), "grads": merge(parts)}, path)


def atomic_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


if __name__ == "__main__":
    main()
