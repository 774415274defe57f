"""Data parallelism by hand, from naive to overlapped and bucketed, beside torch DDP.

Launch (from the repository root):
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/communication_overlap.py
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/communication_overlap.py \\
        --steps 30 --metrics-out runs/dp_overlap.json --export runs/dp_overlap.pt
    torchrun --nproc_per_node=8 05-advanced/c-data-parallel-techniques/communication_overlap.py \\
        --device cuda --dim 1024

Five ways to average gradients, each training its own copy of the same model on the same data:

    naive     backward ............|ar ar ar ar ar ar|      one blocking all-reduce per tensor
    flat      backward ............|ar(all)|                one all-reduce of one flat buffer
    overlap   backward ..ar.ar.ar.ar.ar|wait|               async all-reduce per tensor, launched
                                                            from the tensor's grad hook
    bucketed  backward ....ar(b0)....ar(b1)|wait|           async all-reduce per bucket of ~cap MB,
                                                            launched when the bucket is full
    ddp       torch DDP: buckets (bucket_cap_mb) + overlap; its reducer is C++, the all-reduce
              here goes through a Python comm hook that records each launch

Communication hidden behind the rest of backward costs nothing; what is left after backward
(`exposed` time) is what overlap tries to remove. Buckets trade the latency of many small
collectives against overlap: one huge bucket cannot start before backward ends.

The variants train interleaved, step by step, so that a noisy neighbour on a shared machine slows
all of them alike; the table compares each with a replica that trains without communicating.
Times come from dtcourse.timing: the step between two clock(device) reads (on CUDA each waits for
the GPU to finish), each launch as a stamp(device) (on CUDA an event on the compute stream),
measured from the moment the step's last gradient was accumulated, the same point for every
variant. figures/dp_figures.py draws the --metrics-out JSON.
"""

import inspect
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, launch, report, timing
from dtcourse.data import rank_rows

SCRIPT = "05-advanced/c-data-parallel-techniques/communication_overlap.py"
VARIANTS = ("naive", "flat", "overlap", "bucketed", "ddp")


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
        # GPT-2's N(0, 0.02): the table also produces the logits, and torch's N(0, 1) default
        # would start the loss far above ln(vocab).
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):  # tokens: (B, T) -> logits (B, T, vocab)
        h = (self.embed(tokens) + self.pos[: tokens.shape[1]]) * self.feature_scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def lm_batch(seed: int, step: int, size: int, seq: int, vocab: int):
    """Step `step`'s global batch of token sequences; the target of each token is a fixed
    permutation of it, so the task is learnable without attention."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 12345))
    tokens = torch.randint(vocab, (size, seq),
                           generator=torch.Generator().manual_seed(seed * 100003 + step))
    return tokens, perm[tokens]


# --------------------------------------------------------------------------------------------------
# Hand-written data parallelism


def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every replica start from rank 0's parameters and buffers (frozen ones included).

    The hand-written wrappers call this once, when built. torch DDP does that too, and then (with
    its default broadcast_buffers=True) broadcasts rank 0's buffers again before every forward,
    for buffers that forward changes (BatchNorm's running statistics). TiedLM's buffer is a
    constant, so once is enough here; a model with running statistics would need the wrappers to
    broadcast (or all-reduce) its buffers every step as DDP does."""
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
        log.append(timing.stamp(p.grad.device))
        dist.all_reduce(p.grad)  # sum over ranks, in place
        p.grad.div_(world)


def sync_flat(params, world: int, log: list) -> None:
    """(b) After backward: copy every gradient into one flat buffer and all-reduce it once.
    One collective instead of len(params): latency paid once, but nothing overlaps backward."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (sum of numels,)
    log.append(timing.stamp(flat.device))
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
        # timing.stamp() at each launch: when backward handed the collective over (on CUDA the
        # compute stream's point; NCCL's own stream may start it later)
        self.launch_times = []
        for p in trainable_params(module):
            p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p) -> None:
        # Runs inside backward, once per tensor per backward (a tied tensor's two uses are summed
        # by autograd before this hook fires). async_op: returns at once, gloo/NCCL works behind.
        self.launch_times.append(timing.stamp(p.grad.device))
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
    DDP's rule: a tensor joins the open bucket, and the bucket closes once it holds the cap or
    more (so a bucket can exceed the cap by one tensor, and a cap below every tensor gives one
    tensor per bucket).

    Usage as DDPIndividualParameters; every trainable parameter must get a gradient each step.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        broadcast_from_rank0(module)
        self.world = dist.get_world_size()
        cap = bucket_size_mb * 2**20
        self.buckets, filled = [[]], 0  # lists of parameters
        for p in reversed(trainable_params(module)):
            if filled >= cap:  # the open bucket reached the cap: close it
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(p)
            filled += p.numel() * p.element_size()
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
            self.launch_times.append(timing.stamp(flat.device))
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


# --------------------------------------------------------------------------------------------------
# The library call it all stands for


def wrap_ddp(module: nn.Module, cap_mb: float, device, log: list) -> DDP:
    """(e) torch DDP with the given bucket size, and a Python comm hook that records each launch
    (and does what DDP's default C++ hook does: average, then all-reduce the bucket asynchronously).

    By default DDP also broadcasts every buffer from rank 0 before every forward (for buffers
    that forward changes, like BatchNorm's running statistics): one more collective per step,
    which the hand-written wrappers do not make and the collectives column (the hook's calls)
    would not count. TiedLM's buffer is a constant, so the timed DDP broadcasts it once, as the
    wrappers do, and turns the per-forward broadcast off."""
    broadcast_from_rank0(module)
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        no_buffer_sync = {"forward_sync_buffers": False}  # torch 2.14: broadcast_buffers deprecated
    else:
        no_buffer_sync = {"broadcast_buffers": False}  # older torch (it also skips the one at init)
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cap_mb, **no_buffer_sync)
    world = dist.get_world_size()

    def timed_allreduce(state, bucket):
        log.append(timing.stamp(bucket.buffer().device))
        buffer = bucket.buffer().div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, timed_allreduce)
    return ddp


# --------------------------------------------------------------------------------------------------
# One variant's replica and its training step


class Variant:
    """One way of averaging gradients, with its own replica of the model and its optimizer.
    `compute-only` never communicates: the replicas drift apart, it only times the compute."""

    def __init__(self, name: str, cap_mb, args, d):
        self.name, self.cap_mb, self.world, self.device = name, cap_mb, d.world_size, d.device
        self.tag = name if cap_mb is None else f"{name}_{cap_mb:g}mb"
        # Each rank initialises differently on purpose: only the wrappers' broadcast from rank 0
        # makes the replicas equal (and equal to a one-process run with the same seed).
        torch.manual_seed(args.seed + d.rank)
        self.plain = TiedLM(args.vocab, args.dim, args.depth, args.seq).to(d.device)
        self.launches = []  # timing.stamp() at each collective launch of the current step
        # The reference point of the launch offsets: the moment the step's last gradient was
        # accumulated, the same for every variant (DDP's backward() returns only after it has
        # waited for its all-reduces, so the end of backward() would not be). Registered before
        # any wrapper's hook, so on each tensor it runs before that tensor's launch.
        self.last_grad = None
        for p in trainable_params(self.plain):
            p.register_post_accumulate_grad_hook(self._grad_accumulated)
        if name in ("naive", "flat"):
            broadcast_from_rank0(self.plain)
            self.model = self.plain
        elif name == "overlap":
            self.model = DDPIndividualParameters(self.plain)
            self.launches = self.model.launch_times
        elif name == "bucketed":
            self.model = DDPBucketed(self.plain, cap_mb)
            self.launches = self.model.launch_times
        elif name == "ddp":
            self.model = wrap_ddp(self.plain, cap_mb, d.device, self.launches)
        else:
            self.model = self.plain
        self.params = trainable_params(self.plain)
        self.opt = torch.optim.SGD(self.params, lr=args.lr)

    def _grad_accumulated(self, p) -> None:
        self.last_grad = timing.stamp(self.device)  # the last call of a backward wins

    def step(self, tokens, targets):
        """Forward, backward, average the gradients this variant's way, SGD step. Returns this
        rank's loss and a stamp of the step's start."""
        self.launches.clear()
        start = timing.stamp(self.device)
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        if self.name == "naive":
            sync_naive(self.params, self.world, self.launches)
        elif self.name == "flat":
            sync_flat(self.params, self.world, self.launches)
        elif self.name in ("overlap", "bucketed"):
            self.model.finish_gradient_synchronization()
        # ddp: its all-reduces were launched and waited for inside backward
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), start


# --------------------------------------------------------------------------------------------------
# Measuring: every variant (and every bucket size) trained interleaved, step by step


def build_variants(args, d) -> list:
    variants = [Variant("compute-only", None, args, d)]
    for name in args.variants:
        caps = args.bucket_cap_mb if name in ("bucketed", "ddp") else [None]
        variants += [Variant(name, cap, args, d) for cap in caps]
    return variants


def measure(args, d, variants) -> dict:
    """Per variant tag: step times, collectives and launch offsets per step, and losses."""
    records = {v.tag: {"times": [], "collectives": [], "offsets": [], "losses": []}
               for v in variants}
    for step in range(args.steps):
        tokens, targets = lm_batch(args.seed, step, d.world_size * args.batch_size, args.seq,
                                   args.vocab)
        rows = rank_rows(d.rank, args.batch_size)
        x, y = tokens[rows].to(d.device), targets[rows].to(d.device)
        for v in variants:
            rec = records[v.tag]
            t0 = timing.clock(d.device)  # on CUDA: after the GPU finished the previous step
            loss, start = v.step(x, y)
            rec["times"].append(timing.clock(d.device) - t0)  # on CUDA: once this step finished
            rec["collectives"].append(len(v.launches))
            # Each launch relative to the step's last gradient, both measured from the step's
            # start: negative = launched while backward was still computing gradients.
            last_grad = timing.seconds(start, v.last_grad)
            rec["offsets"].append([timing.seconds(start, t) - last_grad for t in v.launches])
            rec["losses"].append(loss)
    return records


def rows_of(args, d, variants, records) -> tuple[list, float]:
    """One row per variant (medians after --warmup), and the compute-only median step time."""
    def median_time(tag):
        return statistics.median(records[tag]["times"][args.warmup:])

    compute = median_time("compute-only")
    rows = []
    for v in variants[1:]:
        rec = records[v.tag]
        losses = torch.stack(rec["losses"])
        dist.all_reduce(losses)  # mean over the global batch, once for all steps
        rows.append({
            "variant": v.name, "bucket_cap_mb": v.cap_mb, "tag": v.tag,
            "step_time_s": median_time(v.tag),
            # What communication adds to a step that computes only (medians, same run).
            "exposed_comm_s": median_time(v.tag) - compute,
            "collectives": statistics.median(rec["collectives"][args.warmup:]),
            "compute_step_time_s": compute,
            "launch_offsets_s": rec["offsets"][-1],  # last step, this rank's (rank 0's in JSON)
            # the first launch of each step after --warmup, median (None without collectives)
            "first_launch_s": statistics.median(o[0] for o in rec["offsets"][args.warmup:])
            if rec["offsets"][-1] else None,
            "losses": (losses / d.world_size).tolist(),
            "samples_per_s": d.world_size * args.batch_size / median_time(v.tag),
        })
    return rows, compute


def print_table(rows, compute, world) -> None:
    report.print0(f"compute only (no communication): {compute * 1e3:.1f} ms/step (median); "
                  "~: depends on the machine's speed")
    report.print0(f"{'variant':<9} {'bucket MB':>9} {'step ms':>8} {'exposed comm ms':>16} "
                  f"{'collectives':>11} {'first launch vs last gradient ms':>33}")

    def timed(x: float) -> str:  # a time in ms: varies from run to run, marked `~`
        return f"~{x:.1f}"

    for row in rows:
        cap = "-" if row["bucket_cap_mb"] is None else f"{row['bucket_cap_mb']:g}"
        first = float("nan") if row["first_launch_s"] is None else row["first_launch_s"] * 1e3
        report.print0(f"{row['variant']:<9} {cap:>9} {timed(row['step_time_s'] * 1e3):>8} "
                      f"{timed(row['exposed_comm_s'] * 1e3):>16} {row['collectives']:11g} "
                      f"{timed(first):>33}")
    # Ratios of this run's medians, every row of a variant (no best-of: the minimum of noisy
    # medians is the luckiest row, not a property of the method).
    naive = [r for r in rows if r["variant"] == "naive"]
    if naive and len(rows) > 1:
        ratios = []
        for variant in VARIANTS[1:]:
            group = [naive[0]["step_time_s"] / r["step_time_s"] for r in rows
                     if r["variant"] == variant]
            if group:
                ratios.append(f"{variant} ~{min(group):.1f}x" if len(group) == 1 else
                              f"{variant} ~{min(group):.1f}x to ~{max(group):.1f}x")
        report.print0(f"naive's step time over the others' at world {world}, this run: "
                      + ", ".join(ratios))


def run(args, d):
    variants = build_variants(args, d)
    grad_mb = sum(p.numel() * p.element_size() for p in variants[0].params) / 2**20
    report.print0(f"world {d.world_size} | {len(variants[0].params)} gradient tensors, "
                  f"{grad_mb:.2f} MB | {args.batch_size}x{args.seq} tokens per rank | "
                  f"{args.steps} steps ({args.warmup} warm-up) per variant")
    rows, compute = rows_of(args, d, variants, measure(args, d, variants))
    print_table(rows, compute, d.world_size)
    write_outputs(args, d, variants[1:], rows)


# --------------------------------------------------------------------------------------------------
# Outputs, arguments and launch


def write_outputs(args, d, variants, rows) -> None:
    """--export: one plain state dict per variant (PATH itself when there is one variant, else
    PATH with the variant's tag before the suffix); --metrics-out: the rows, with the contract's
    top-level fields taken from the first variant."""
    several = len(variants) > 1
    for v, row in zip(variants, rows):
        row["export"] = None if args.export is None else \
            str(report.variant_path(args.export, v.tag, several))
        if d.rank == 0 and args.export:
            report.save_state_dict(row["export"], v.plain.state_dict())
    first = variants[0]
    per_rank = report.gather(report.held_bytes(params=first.plain.parameters(),
                                               optimizer=first.opt, device=d.device))
    metrics = report.metrics(d, script=SCRIPT, strategy="ddp", steps=args.steps,
                             global_batch=d.world_size * args.batch_size,
                             losses=rows[0]["losses"], samples_per_s=rows[0]["samples_per_s"],
                             per_rank=per_rank, variants=rows)
    report.finish(args, metrics)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=6, batch_size=4, lr=0.05, grad_accum=False,
                       batch_help="sequences per rank per step")
    cli.add_output_args(p)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[0.25, 1.0, 4.0, 16.0],
                   help="bucket sizes for `bucketed` and `ddp` (a sweep when several)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--dim", type=int, default=192, help="model width")
    p.add_argument("--depth", type=int, default=4, help="residual MLP blocks")
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "seq", "dim", "depth", "vocab", "lr",
                       "timeout_s")
    if not 0 <= args.warmup < args.steps:
        cli.fail(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if min(args.bucket_cap_mb) <= 0:
        cli.fail(f"--bucket-cap-mb must be positive, got {min(args.bucket_cap_mb)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
