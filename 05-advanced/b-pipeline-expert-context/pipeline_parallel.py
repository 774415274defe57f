"""Pipeline parallelism: one model cut into p stages (one per rank), a batch cut into m
micro-batches, and the schedules that decide who computes what when: GPipe and 1F1B written by
hand with send/recv, and the same (plus interleaved 1F1B and two zero-bubble schedules) with
torch.distributed.pipelining.

Launch (from the repository root, with D=05-advanced/b-pipeline-expert-context):
    python $D/pipeline_parallel.py --layer-ms 0                   # p = 1: the unsplit model
    torchrun --nproc_per_node=4 $D/pipeline_parallel.py           # 1F1B by hand, p = 4, m = 8
    torchrun --nproc_per_node=4 $D/pipeline_parallel.py --schedule gpipe --layer-ms 25 \\
        --metrics-out runs/pp_gpipe.json                          # longer boxes
    python $D/figures/pp_figures.py runs/pp_gpipe.json runs/pp_gpipe.png   # draw its timeline
    torchrun --nproc_per_node=2 $D/pipeline_parallel.py --impl torch --schedule interleaved
    torchrun --nproc_per_node=4 $D/pipeline_parallel.py --impl torch --schedule zbv
    torchrun --nproc_per_node=4 $D/pipeline_sweep.py ...          # bubble and memory for many m

The stages compute almost nothing (a toy model on a CPU), so every layer sleeps a simulated compute
time, --layer-ms per micro-batch forward (10 ms by default; a backward twice as long): then
compute, not the transfers, sets the step, as on GPUs running a real model, where the flag is 0.
The boxes of the timeline are read on the host clock. On CUDA the host only queues kernels, and an
NCCL receive makes the stream wait, not the host, so each box boundary first waits for the stream
(device_done below): a box then starts when its input has arrived and ends when its work is done,
and the host's sleep, after that wait, adds to the compute as a kernel of that length would.

After its last step the script prints the schedule it ran: each rank's forwards (F) and
backwards (B) of the m micro-batches, in the order the rank ran them, one slot per F or B and each
as early as its input allows (the README shows GPipe and 1F1B for p = 4, m = 4). GPipe runs all
forwards, then all backwards; 1F1B, after a warm-up of p - r - 1 forwards on rank r, alternates one
forward and one backward.

Both have the same bubble, (p - 1) / (m + p - 1) of the step: the fill and the drain of the pipe.
They differ in memory: GPipe keeps the activations of all m micro-batches until the backward pass
starts; 1F1B starts the backward of micro-batch 0 as soon as it can, so rank r holds at most p - r.
Interleaved 1F1B gives each rank v smaller stages (rank r holds stages r, r + p, ...): the fill and
drain are made of stages v times shorter, so the bubble shrinks to (p - 1) / (v m + p - 1) (for
whole rounds of p micro-batches: p divides m), at the price of v times more point-to-point
transfers.

Zero bubble (Qi et al. 2023, arXiv 2401.10241) splits each backward in two: B, the gradient of the
stage's input, which the previous stage waits for, and W, the gradient of its weights, which nobody
waits for and which fills the idle slots. With F, B and W of equal cost (one matmul per linear
layer each), zb1p idles (p - 1)(t_F + t_B - t_W), a share (p - 1) / (3 m + p - 1) for m >= p, a
third of 1F1B's idle time. It is torch's ScheduleInterleavedZeroBubble with one stage per rank.
Its docstring names the paper's ZB1P, what the paper's automatic scheduler finds (section 3); with
one stage per rank and equal costs it runs the pattern of the paper's handcrafted ZB-H1 (section
2.1): rank r runs each W r micro-batches after its B. zbv (ScheduleZBVZeroBubble, the paper's
ZB-V) gives each rank two stages of half the layers in a V, rank r holding stages r and
2p - 1 - r, and leaves only the start-up skew of its first forwards: (p - 1) / (6 m + p - 1) for
m >= 2p - 1, zero in the paper's count, which measures each rank from its first box to its last.
Outside those ranges a schedule can run longer than its formula says, and the script marks the
formula with a *.

Communication: the only traffic is point to point between neighbours: stage s sends its output
activation (rows, hidden) to stage s + 1, and receives d(loss)/d(output) of the same shape back.
"""

import inspect
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.pipelining import PipelineStage

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch
from dtcourse.models import ResidualMLP

SCRIPT = "05-advanced/b-pipeline-expert-context/pipeline_parallel.py"
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_BUBBLE = ("zb1p", "zbv")  # torch only: the backward split into B (input) and W (weights)


# --------------------------------------------------------------------------------------------------
# A stage: a contiguous slice of the model's layers (ResidualMLP, below)


class Stage(nn.Module):
    """Pipeline stage `index` of `num_stages`: a contiguous slice of ResidualMLP's blocks, plus the
    embedding on the first stage and the head on the last. (rows, in) -> (rows, out)."""

    def __init__(self, model: ResidualMLP, index: int, num_stages: int):
        super().__init__()
        layers = len(model.blocks)
        lo, hi = index * layers // num_stages, (index + 1) * layers // num_stages
        self.index = index
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.head = model.head if index == num_stages - 1 else None
        self.block_ids = list(range(lo, hi))

    def full_name(self, name: str) -> str:
        """This stage's parameter name -> the unsplit ResidualMLP's (blocks.0 -> blocks.<lo>)."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{self.block_ids[int(i)]}.{rest}"
        return name

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


# --------------------------------------------------------------------------------------------------
# The point-to-point link. Stage s talks to stage s - 1 (prev) and s + 1 (next) only; activations
# and gradients have the shape (rows of a micro-batch, hidden).


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


# --------------------------------------------------------------------------------------------------
# The schedules by hand. Each transfer is one line.


def micro_loss(logits, target, m: int):
    """Loss of one micro-batch, scaled so that the m of them add up to the full batch's mean loss
    (micro-batches are equal in size), hence gradients equal to the unsplit model's."""
    return F.cross_entropy(logits, target) / m


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
# The schedule a step ran, drawn: every rank's forwards and backwards in the order it ran them (the
# Recorder below notes them, for either implementation), one slot each, as early as data allows.


def unit_slots(orders, n_stages: int):
    """orders[r]: the (kind, stage, micro-batch) that rank r ran, in its order. Returns, per rank,
    {slot: op}: every op takes one slot (a backward drawn as long as a forward) and starts as soon
    as its rank is free and its input is there: F_i on stage s one slot after F_i on stage s - 1
    has sent the activation, B_i on stage s after B_i on stage s + 1 has sent the gradient (B_i on
    the last stage follows F_i, earlier on the same rank), W_i after B_i on its own stage. The step
    of a pipe whose transfers are free and whose stages cost the same (exactly so for zero bubble,
    whose F, B and W each cost one forward)."""
    done = {}  # op -> the slot it ran in
    free = [0] * len(orders)  # rank -> its first free slot
    todo = [list(order) for order in orders]
    slots = [{} for _ in orders]
    while any(todo):
        placed = 0
        for r, queue in enumerate(todo):
            while queue:
                kind, s, i = queue[0]
                # who gives this op its input: the previous stage (F), the next one (B), or this
                # stage's B (W, on the same rank)
                src = {"F": ("F", s - 1, i), "B": ("B", s + 1, i), "W": ("B", s, i)}[kind]
                if 0 <= src[1] < n_stages and src not in done:
                    break  # not sent yet: another rank must move first
                t = max(free[r], done.get(src, -1) + 1)
                slots[r][t] = queue.pop(0)
                done[(kind, s, i)], free[r] = t, t + 1
                placed += 1
        if not placed:
            raise RuntimeError(f"these orders wait on each other forever: {todo}")
    return slots


def draw_schedule(orders, n_stages: int) -> str:
    """One line per rank: F3 = forward of micro-batch 3, B3 its backward (with zero bubble: the
    input gradient, W3 the weight gradient), . idle; with several stages per rank (interleaved,
    zbv) F3s5 names the stage too."""
    several = n_stages > len(orders)

    def name(op):
        kind, s, i = op
        return f"{kind}{i}" + (f"s{s}" if several else "")
    slots = unit_slots(orders, n_stages)
    width = max(len(name(op)) for row in slots for op in row.values())
    length = 1 + max(t for row in slots for t in row)
    return "\n".join((f"rank {r}  " + " ".join((name(row[t]) if t in row else ".").ljust(width)
                                               for t in range(length))).rstrip()
                     for r, row in enumerate(slots))


def ran(events):
    """A rank's recorded boxes (kind, stage, micro-batch, start, end) -> its ops in order."""
    return [tuple(e[:3]) for e in sorted(events, key=lambda e: e[3])]


# --------------------------------------------------------------------------------------------------
# The same schedules with torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B), and the
# zero-bubble ones, which split each backward into B (input gradient) and W (weight gradient)


def stage_indices(schedule: str, p: int, v: int, rank: int) -> list[int]:
    """The stages rank r holds, of p v. One per rank: r. Interleaved (a loop): r, r + p, r + 2p,
    ... ScheduleZBVZeroBubble (a V): r and 2p - 1 - r, so the forward runs down the ranks and back
    up (rank p - 1 holds stages p - 1 and p: the turn costs no transfer) and rank 0 holds both the
    first and the last stage."""
    if schedule == "zbv":
        return [rank, 2 * p - 1 - rank]
    return [rank + c * p for c in range(v)]


def torch_schedule(stages, schedule: str, p: int, m: int, rows: int, hidden: int, device,
                   group=None):
    """Wrap our Stage modules in PipelineStage and pick the library's schedule. The example
    input/output tensors give the P2P buffer shapes up front (no shape-inference pass); their
    requires_grad tells the library which gradients travel back (all but the data's)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
    n = p * len(stages)
    pipe_stages = []
    for st in stages:
        width_in = st.embed.in_features if st.embed is not None else hidden
        width_out = st.head.out_features if st.head is not None else hidden
        pipe_stages.append(MeasuredPipelineStage(
            st, st.index, n, device,
            input_args=(torch.empty(rows, width_in, device=device,
                                    requires_grad=st.embed is None),),
            output_args=(torch.empty(rows, width_out, device=device, requires_grad=True),),
            group=group))
    # ScheduleInterleavedZeroBubble: "ZB1P" in its docstring, the paper's automatically scheduled
    # ZB-1p; with one stage per rank and F = B = W it runs the handcrafted ZB-H1's pattern.
    # ScheduleZBVZeroBubble maps stages to ranks in a V itself (it needs exactly 2).
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[schedule]
    # torch >= 2.7 divides gradients by m unless scale_grads=False; older versions never do.
    # micro_loss already divides by m, so we switch the library's scaling off where it exists.
    extra = {"scale_grads": False} if "scale_grads" in inspect.signature(cls).parameters else {}

    def loss_fn(logits, target):
        return micro_loss(logits, target, m)

    if schedule in ("gpipe", "1f1b"):  # the single-stage schedules take the stage itself
        return cls(pipe_stages[0], n_microbatches=m, loss_fn=loss_fn, **extra)
    return cls(pipe_stages, n_microbatches=m, loss_fn=loss_fn, **extra)


def bubble_formula(schedule: str, p: int, v: int, m: int) -> tuple[float, str]:
    """The idle share of a step between two barriers, for stages of equal cost, a forward t_F,
    a backward t_B + t_W = 2 t_F (zero bubble: B and W one t_F each), free transfers. (Value,
    how it is written.) GPipe and 1F1B: (p - 1)(t_F + t_B + t_W) idle of (m + p - 1)(...).
    Interleaved: stages v times shorter fill the pipe (p dividing m). zb1p: (p - 1)(t_F + t_B -
    t_W) idle (Qi et al., table 2, ZB-H1) of 3 m t_F busy, for m >= p. zbv: two stages of t_F / 2
    per rank and no idle slot from a rank's first box to its last; only the skew of the first
    forwards, r t_F / 2 before rank r starts and p - 1 - r after it ends, for m >= 2p - 1.
    Where these ranges end: formula_holds."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if schedule == "zb1p":
        return (p - 1) / (3 * m + p - 1), "(p-1)/(3m+p-1)"
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1), "(p-1)/(6m+p-1)"
    return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"


# Where bubble_formula is the schedule's step; outside, the schedule can run longer (the drawing
# counts its slots). GPipe and 1F1B: every m. Interleaved: whole rounds of p micro-batches. Zero
# bubble: the drawn schedules of torch's ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble
# last 3m + p - 1 and 6m + p - 1 slots from these m on, and longer below (zb1p at p = 4, m = 3:
# 13 slots, not 12; zbv at p = 4, m = 4: 30, not 27).
FORMULA_RANGE = {"interleaved": "p divides m", "zb1p": "m >= p", "zbv": "m >= 2p - 1"}


def formula_holds(schedule: str, p: int, m: int) -> bool:
    return {"interleaved": m % p == 0, "zb1p": m >= p, "zbv": m >= 2 * p - 1}.get(schedule, True)


# --------------------------------------------------------------------------------------------------
# One pipeline, either implementation


def build_stages(args, schedule: str, p: int, v: int, rank: int):
    """Build the unsplit model from the seed on every rank (identical initial weights), keep the
    stages of this rank (stage_indices) and drop the rest. (A large model would be built on the
    meta device and only this rank's stages materialised; the weights would then come from a
    checkpoint.)"""
    torch.manual_seed(args.seed)
    model = ResidualMLP(args.hidden, args.layers)
    recorder = Recorder()
    stages = [MeasuredStage(model, s, p * v, args.layer_ms, recorder)
              for s in stage_indices(schedule, p, v, rank)]
    recorder.meter.param_storages = {q.untyped_storage().data_ptr()
                                     for st in stages for q in st.parameters()}
    return stages, recorder


class Pipeline:
    """The pipeline of ranks 0..p-1 (`group`: their process group; None: all ranks): this rank's
    v stages of the model that `args` describes (--seed --layers --hidden --layer-ms), the link
    to its neighbours, and the schedule that drives them over m micro-batches of `batch` rows."""

    def __init__(self, args, impl: str, schedule: str, p: int, v: int, m: int, batch: int,
                 rank: int, device, group=None):
        self.impl, self.schedule, self.p, self.v, self.m = impl, schedule, p, v, m
        self.rank, self.device, self.group, self.rows = rank, device, group, batch // m
        self.stages, self.recorder = build_stages(args, schedule, p, v, rank)
        # who feeds the data in and who computes the loss: ranks 0 and p - 1, but rank 0 for zbv
        self.has_first = any(st.index == 0 for st in self.stages)
        self.has_last = any(st.index == p * v - 1 for st in self.stages)
        self.last_rank = 0 if schedule == "zbv" else p - 1
        for st in self.stages:
            st.to(device)
        self.link = Link(rank, p, (self.rows, args.hidden), device)
        if impl == "torch":
            self.torch_sched = torch_schedule(self.stages, schedule, p, m, self.rows, args.hidden,
                                              device, group)

    def parameters(self):
        return [q for st in self.stages for q in st.parameters()]

    def step(self, x, y, fixed_cost: bool = False):
        """Forward and backward of one batch: fills .grad. Returns the loss on the rank that
        holds the last stage (a 0-dim tensor), None on the others. fixed_cost: every box sleeps
        its simulated compute time (--layer-ms), as the training loop and the sweep's measured
        step ask; without it the step runs at the toy model's own speed."""
        first, last = self.has_first, self.has_last
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

    def full_state(self, grads: bool = False):
        """{unsplit ResidualMLP name: tensor on CPU} of this rank's stages (weights or grads)."""
        out = {}
        for st in self.stages:
            for name, prm in st.named_parameters():
                t = prm.grad if grads else prm
                out[st.full_name(name)] = (torch.zeros_like(prm) if t is None else t).detach().cpu()
        return out

    def measured(self):
        """This rank's compute time, bubble (idle share of the step) and memory, last step."""
        busy = sum(end - start for _, _, _, start, end in self.recorder.events)
        return {"window_s": self.window_s, "busy_s": busy, "bubble": 1 - busy / self.window_s,
                "peak_held_microbatches": self.recorder.peak_held,
                "peak_activation_bytes": self.recorder.meter.peak,
                "events": self.recorder.events}

    def formula(self) -> tuple[float, str]:
        return bubble_formula(self.schedule, self.p, self.v, self.m)


def merge(parts):
    """The ranks' {name: tensor} pieces -> one state_dict of the unsplit ResidualMLP."""
    return {k: t for part in parts for k, t in part.items()}


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


def device_done(device):
    """Block the host until this thread's stream has run what was queued on it. On CUDA the host
    only queues kernels, and an NCCL receive's wait() makes the stream wait, not the host: a box
    timed on the host clock without this would measure the queueing. Only this stream: a device-
    wide synchronize would also wait for sends still posted to a peer that has not reached its
    receive, turning the library's asynchronous sends into blocking ones. On CPU (gloo) the work
    is done when the call returns: nothing to do."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Recorder:
    """This rank's view of one step: compute intervals (kind, stage, micro-batch, start, end) in
    seconds since the step started, the micro-batches whose activations are held, and the bytes."""

    def __init__(self):
        self.meter = ActivationMeter()
        self.reset()

    def reset(self):
        # The step's zero, read right after the start-of-step barrier; every later reading
        # follows device_done(), which drains this stream only (see there)
        self.t0 = time.perf_counter()  # host clock: see the comment above
        self.events, self.forwards = [], {}
        self.held = self.peak_held = 0
        self.meter.peak = self.meter.live

    def now(self):
        return time.perf_counter() - self.t0  # host clock: see reset()


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward it calls `hook` when the gradient passes through. The
    `anchor` (a scalar that requires grad) keeps the node in the graph on the first stage, whose
    input does not require grad."""

    @staticmethod
    def forward(ctx, x, anchor, hook):
        ctx.hook = hook
        # a copy, not a view: the zero-bubble schedules detach a stage's output in place after B
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return (grad if ctx.needs_input_grad[0] else None), None, None


class MeasuredStage(Stage):
    """A Stage whose forward and backward are recorded as boxes of the timeline and, with
    --layer-ms, made to cost a simulated compute time (a sleep: ranks that share a few CPU cores
    do not compete for them) so the bubble can be measured. A backward box opens when the
    gradient of the stage's output arrives and closes when the gradient of its input leaves: an
    _OnBackward marker at each end of the stage. A split backward (zero bubble) is two boxes: B,
    here, and W, recorded by MeasuredPipelineStage. Every box boundary first waits for the device
    (device_done): the box opens once its input has arrived and closes once its work is done."""

    def __init__(self, model: ResidualMLP, index: int, num_stages: int, layer_ms: float,
                 recorder: Recorder):
        super().__init__(model, index, num_stages)
        self.recorder = recorder
        self.cost_s = layer_ms * len(self.blocks) / 1000  # set to 0 for an untimed warm-up step
        self.layer_cost_s = self.cost_s
        # A buffer, so that .to(device) moves it with the stage; not persistent: it is no weight
        # and stays out of the exported state_dict. Not a parameter: see _OnBackward.
        self.register_buffer("anchor", torch.zeros((), requires_grad=True), persistent=False)
        self.bwd_start = {}
        self.split = False  # set by the library for each backward: input gradient only?

    def forward(self, x):
        rec = self.recorder
        mb = rec.forwards[self.index] = rec.forwards.get(self.index, -1) + 1  # in order 0..m-1
        device_done(self.anchor.device)  # on CUDA: the received activation is there
        start = rec.now()
        # bwd: the gradient leaves the stage here, last of all: that closes this backward box
        x = _OnBackward.apply(x, self.anchor, lambda: self._backward_done(mb))
        with torch.autograd.graph.saved_tensors_hooks(rec.meter.pack, rec.meter.unpack):
            h = super().forward(x)
        device_done(self.anchor.device)
        time.sleep(self.cost_s)
        rec.events.append(("F", self.index, mb, start, rec.now()))
        rec.held += 1
        rec.peak_held = max(rec.peak_held, rec.held)
        # bwd: the gradient of the output arrives here first: that opens the backward box
        return _OnBackward.apply(h, self.anchor, lambda: self._backward_arrived(mb))

    def _backward_arrived(self, mb):
        device_done(self.anchor.device)  # on CUDA: the received gradient is there
        self.bwd_start[mb] = self.recorder.now()

    def _backward_done(self, mb):
        device_done(self.anchor.device)
        # A backward costs about two forwards: per linear layer, a forward makes one matmul
        # (x W^T), a backward two (dx = dy W for B, dW = dy^T x for W). Split, B is one of them.
        time.sleep((1 if self.split else 2) * self.cost_s)
        rec = self.recorder
        rec.events.append(("B", self.index, mb, self.bwd_start.pop(mb), rec.now()))
        if not self.split:  # a split backward holds the activations until W
            rec.held -= 1


class MeasuredPipelineStage(PipelineStage):
    """torch's PipelineStage around a MeasuredStage, which records F and B. For the zero-bubble
    schedules, which run a backward as B (backward_one_chunk(full_backward=False)) and later W
    (backward_weight_one_chunk), it tells the stage that B is only half of it and records W: a
    box costing one forward. On the first stage the library skips B (no stage waits for the
    data's gradient) and runs the whole backward in W: the markers then record B inside W's
    call, and the W box starts where B ends."""

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.submod.split = not full_backward
        return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                          last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        st, rec = self.submod, self.submod.recorder
        device_done(st.anchor.device)
        start, recorded = rec.now(), len(rec.events)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if len(rec.events) > recorded:  # the first stage: its B box was recorded just now
            start = rec.events[-1][4]
        device_done(st.anchor.device)
        time.sleep(st.cost_s)
        rec.events.append(("W", st.index, bwd_chunk_id, start, rec.now()))
        rec.held -= 1

    def _get_init_p2p_neighbors_ops(self):
        """The first messages to the neighbouring stages, less those to a stage on this rank.
        ScheduleZBVZeroBubble puts stages p - 1 and p on rank p - 1, and torch 2.11's schedules
        open every link with these messages, so that rank would send to itself, which gloo
        refuses ("Pair is not connected"). torch 2.14 opens the links its own way (it skips a
        stage on the same rank) and no longer asks for these."""
        return [op for op in super()._get_init_p2p_neighbors_ops()
                if op.group_peer != self.group_rank]


# --------------------------------------------------------------------------------------------------
# Training and the report


def train(args, d):
    p, m = d.world_size, args.microbatches
    v = virtual_stages(args.schedule, args.virtual_stages)
    pipe = Pipeline(args, args.impl, args.schedule, p, v, m, args.batch_size, d.rank, d.device)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    report.print0(f"pipeline: p = {p} rank(s) x v = {v} stage(s) | {args.layers} layers | "
                  f"schedule {args.schedule} ({args.impl}) | batch {args.batch_size} = {m} "
                  f"micro-batches of {pipe.rows} | device {d.device}")
    losses, t_start = [], None
    bar = report.progress(args.steps, "train")
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        x, y = classification_batch(args.seed, step, args.batch_size)  # every stage: same rows
        loss = pipe.step(x, y, fixed_cost=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The loss lives on the last stage: one broadcast brings it to rank 0 for the log.
        held = loss.reshape(1) if loss is not None else torch.zeros(1, device=d.device)
        dist.broadcast(held, src=pipe.last_rank)
        losses.append(held.item())
        bar.update(1)
        if d.rank == 0 and ((step + 1) % 5 == 0 or step in (0, args.steps - 1)):
            bar.write(f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f}")
    bar.close()
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * args.batch_size / elapsed if t_start else float("nan")
    report_run(args, d, pipe, optimizer, losses, samples_per_s)


def report_run(args, d, pipe, optimizer, losses, samples_per_s):
    """Print the last step's bubble and memory; write the metrics (with every rank's timeline
    of the last step: figures/pp_figures.py draws it) and the unsplit model's state_dict."""
    per_rank = report.gather(dict(pipe.measured(), **report.held_bytes(
        params=pipe.parameters(), optimizer=optimizer, device=d.device)))
    weights = merge(report.gather(pipe.full_state()))
    bubble = sum(r["bubble"] for r in per_rank) / d.world_size
    formula, written = pipe.formula()
    holds = formula_holds(args.schedule, d.world_size, pipe.m)
    # the measured bubble is a timing (marked `~`); the formula's value is exact (where it holds)
    report.print0(f"last step: bubble ~{bubble:.3f} measured (mean over ranks) vs "
                  f"{formula:.3f} = {written}{'' if holds else '*'} | "
                  f"micro-batches held per rank {[r['peak_held_microbatches'] for r in per_rank]}"
                  f" | peak activations per rank (KiB) "
                  f"{[round(r['peak_activation_bytes'] / 1024, 1) for r in per_rank]}")
    if not holds:
        report.print0(f"* the formula holds for {FORMULA_RANGE[args.schedule]}, not at p = "
                      f"{d.world_size}, m = {pipe.m}: this schedule can take longer (the drawing "
                      "below counts its slots)")
    if args.schedule in ZERO_BUBBLE:
        report.print0("last step's schedule: one slot per forward F, input gradient B and weight "
                      "gradient W (each costs a forward), each as early as its input allows")
    else:
        report.print0("last step's schedule: one slot per forward F or backward B (drawn as long "
                      "as F), each as early as its input allows")
    report.print0(draw_schedule([ran(r["events"]) for r in per_rank], d.world_size * pipe.v))
    report.print0(f"done: {args.steps} steps, {samples_per_s:.0f} samples/s")
    metrics = report.metrics(
        d, script=SCRIPT, strategy="pipeline", steps=args.steps, global_batch=args.batch_size,
        losses=losses, samples_per_s=samples_per_s, per_rank=per_rank, schedule=args.schedule,
        impl=args.impl, pipeline_stages=d.world_size * pipe.v, virtual_stages=pipe.v,
        microbatches=pipe.m, layers=args.layers, layer_ms=args.layer_ms, bubble=bubble,
        bubble_formula=formula, bubble_formula_holds=holds)
    report.finish(args, metrics, weights)


# --------------------------------------------------------------------------------------------------
# Checks, arguments and launch


def virtual_stages(schedule: str, v_arg: int) -> int:
    return (v_arg or 2) if schedule in ("interleaved", "zbv") else (v_arg or 1)


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
    if schedule in ("interleaved",) + ZERO_BUBBLE and impl == "manual":
        return f"the {schedule} schedule is shown with --impl torch (manual: gpipe or 1f1b)"
    if schedule == "interleaved" and v < 2:
        return f"interleaved needs --virtual-stages >= 2, got {v}"
    if schedule == "zbv" and v != 2:
        return f"zbv holds exactly 2 stages per rank (a V), got --virtual-stages {v}"
    if schedule not in ("interleaved", "zbv") and v != 1:
        return f"--virtual-stages {v} needs --schedule interleaved ({schedule} has 1 per rank)"
    if impl == "torch" and schedule == "1f1b" and m < p:
        return (f"torch's Schedule1F1B needs --microbatches >= stages: m = {m} < p = {p} "
                "(use --impl manual or --schedule gpipe)")
    if impl == "torch" and schedule in ("interleaved", "zb1p") and m % max(1, m // p):
        name = {"interleaved": "Interleaved1F1B", "zb1p": "InterleavedZeroBubble"}[schedule]
        return (f"torch's Schedule{name} splits the m = {m} micro-batches into "
                f"max(1, m // p) = {m // p} rounds of equal size (p = {p}): m must be a multiple")
    return None


def add_model_args(p):
    """The model and its simulated compute time (shared with pipeline_sweep.py)."""
    p.add_argument("--layers", type=int, default=8, help="residual blocks, cut evenly into stages")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layer-ms", type=float, default=10.0,
                   help="simulated compute: each block sleeps this long per micro-batch in "
                        "forward, twice in backward, so that compute, not this toy model's "
                        "transfers, sets the bubble; 0 on a GPU running a real model")


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=10, batch_size=48, lr=3e-3, grad_accum=False,
                       batch_help="rows per step, shared by the whole pipeline; split into m "
                                  "micro-batches")
    cli.add_output_args(p)
    p.add_argument("--schedule", choices=SCHEDULES + ZERO_BUBBLE, default="1f1b",
                   help="zb1p and zbv (zero bubble): --impl torch")
    p.add_argument("--impl", choices=["manual", "torch"], default="manual",
                   help="manual: send/recv written out here; torch: torch.distributed.pipelining")
    p.add_argument("--microbatches", type=int, default=8, help="m: micro-batches per step")
    p.add_argument("--virtual-stages", type=int, default=0,
                   help="v: stages per rank (interleaved: 0 = 2, or more; zbv: 2; others: 1)")
    add_model_args(p)
    args = p.parse_args(argv)
    cli.check_positive(args, "microbatches", "layers", "hidden", "steps", "batch_size", "lr",
                       "timeout_s")
    if args.layer_ms < 0 or args.virtual_stages < 0:
        cli.fail(f"--layer-ms and --virtual-stages must be >= 0, got {args.layer_ms:g} and "
                 f"{args.virtual_stages}")
    # Before any process group: every rank reaches the same verdict and exits alike.
    why = unsupported(args.impl, args.schedule, launch.launched().world_size,
                      virtual_stages(args.schedule, args.virtual_stages), args.microbatches,
                      args.layers, args.batch_size)
    if why:
        cli.fail(why)
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()
