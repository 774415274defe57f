"""Exercise 5 of lesson 03: ShardedOptimizer stage 2 with bucketed reductions.

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex5_bucketed_stage2.py
    torchrun --nproc_per_node=3 03-deepspeed/solutions/ex5_bucketed_stage2.py --bucket-bytes 64K
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex5_bucketed_stage2.py --device cuda

zero_from_scratch.py's stage 2 reduces every gradient to its owner the moment backward has
accumulated it: one `dist.reduce` per parameter per micro-step, most of them small. Each call
pays a fixed cost (a Python call, a kernel launch or a gloo round trip, a latency on the wire),
which is why DDP and DeepSpeed gather gradients into buckets (`bucket_cap_mb`,
`reduce_bucket_size`) and send a few large messages instead.

BucketedShardedOptimizer keeps a bucket per owner rank: the post-accumulate-grad hook puts the
gradient into its owner's bucket, and when the bucket holds at least --bucket-bytes the bucket is
flattened into one buffer, reduced to that owner in one call, and dropped on the other ranks. At
the end of every backward the buckets that did not fill go out too. Every rank fills the buckets
in the same order (the same graph runs everywhere), so every rank issues the same reduces.

The script trains zero_from_scratch.py's TiedNet (a tied weight, a frozen layer, two param groups,
the second added with add_param_group) from the same weights, on the same global batches with
--grad-accum micro-steps per step: with plain AdamW on the whole global batch in every rank (what
one process computes), with the lesson's ShardedOptimizer stage 2, and with the bucketed one for
each size of --bucket-bytes. It counts every reduce with dtcourse.comm.CollectiveCounter, and
--export PATH writes every result (PATH with .plain, .unbucketed and .bucketed<bytes> before the
suffix).
"""

import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Variable

from dtcourse import cli, launch, lessons, report
from dtcourse.comm import CollectiveCounter
from dtcourse.data import classification_batch, rank_rows

SCRIPT = "03-deepspeed/solutions/ex5_bucketed_stage2.py"
LESSON = Path(__file__).resolve().parents[1]



zfs = lessons.load(LESSON / "zero_from_scratch.py")


class BucketedShardedOptimizer(zfs.ShardedOptimizer):
    """ShardedOptimizer(stage=2) whose reductions go out in buckets of at least `bucket_bytes`,
    one bucket per owner rank (a reduce has one destination, so a bucket holds one owner's
    parameters)."""

    def __init__(self, params, optimizer_cls, *, bucket_bytes: int, group=None, **kwargs):
        self.bucket_bytes = bucket_bytes
        self._buckets: dict[int, list] = {}  # owner -> parameters whose .grad waits in its bucket
        self._bucket_fill: dict[int, int] = {}  # owner -> bytes waiting
        self._flush_queued = False
        super().__init__(params, optimizer_cls, stage=2, group=group, **kwargs)

    @torch.no_grad()
    def _reduce_to_owner(self, p) -> None:
        # The hook the lesson registered: backward has just accumulated p.grad. Queue it in its
        # owner's bucket instead of reducing it alone.
        if not self._flush_queued:
            # At the end of this backward, reduce the buckets that did not fill, as DDP and
            # DeepSpeed do: no gradient outlives its micro-step, which is stage 2's point. The
            # autograd engine runs queued callbacks once the whole backward is done (FSDP2
            # finishes its reduce-scatters the same way, torch/distributed/fsdp/_fully_shard).
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._flush_queued = True
        owner = self.owner[p]
        self._buckets.setdefault(owner, []).append(p)
        self._bucket_fill[owner] = self._bucket_fill.get(owner, 0) + \
            p.grad.numel() * p.grad.element_size()
        if self._bucket_fill[owner] >= self.bucket_bytes:
            self._flush(owner)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self.flush()

    @torch.no_grad()
    def _flush(self, owner: int) -> None:
        """One reduce for the whole bucket: flatten, sum onto the owner, unflatten there."""
        bucket = self._buckets.pop(owner, [])
        self._bucket_fill.pop(owner, None)
        if not bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # (sum of numel,) on the device
        dist.reduce(flat, dst=self._src(bucket[0]), op=dist.ReduceOp.SUM, group=self.group)
        if owner == self.rank:
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                self._reduced[p] = self._reduced.get(p, 0) + g.view_as(p) / self.world
        for p in bucket:
            p.grad = None  # every rank: the owner keeps the reduced sum in _reduced only

    def flush(self) -> None:
        """Reduce what the buckets still hold, owner by owner (the same order on every rank)."""
        for owner in sorted(self._buckets):
            self._flush(owner)

    @torch.no_grad()
    def step(self, closure=None):
        self.flush()  # nothing left after a backward; kept for hooks fired outside one
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._buckets, self._bucket_fill = {}, {}


# --------------------------------------------------------------------------------------------------
# Train every way, count the reduces


def fresh_model(args, device):
    torch.manual_seed(args.seed)  # the same initial weights in every variant and on every rank
    return zfs.TiedNet().to(device)


def build(variant: str, model, args):
    """"plain", "unbucketed" (the lesson's class) or "bucketed <bytes>"."""
    groups = zfs.param_groups(model)
    if variant == "plain":
        return torch.optim.AdamW(groups, lr=args.lr)
    if variant == "unbucketed":
        opt = zfs.ShardedOptimizer(groups[:1], torch.optim.AdamW, stage=2, lr=args.lr)
    else:
        opt = BucketedShardedOptimizer(groups[:1], torch.optim.AdamW,
                                       bucket_bytes=int(variant.split()[1]), lr=args.lr)
    opt.add_param_group(groups[1])  # the second group arrives later, as the tests do it
    return opt


def train(variant: str, args, d) -> dict:
    """args.steps optimizer steps of args.grad_accum micro-steps; returns the final weights,
    the losses and the reduces counted in the last step."""
    model = fresh_model(args, d.device)
    opt = build(variant, model, args)
    global_bs = d.world_size * args.batch_size
    # plain: the whole global batch in every rank (one process's computation); sharded: my rows
    rows = slice(None) if variant == "plain" else rank_rows(d.rank, args.batch_size)
    losses, reduces = [], []
    for step in range(args.steps):
        x, y = classification_batch(args.seed, step, global_bs)
        x, y = x[rows].to(d.device), y[rows].to(d.device)
        counter = CollectiveCounter()
        micro = len(x) // args.grad_accum
        step_loss = torch.zeros((), device=d.device)
        with counter:
            for m in range(args.grad_accum):
                part = slice(m * micro, (m + 1) * micro)
                loss = F.cross_entropy(model(x[part]), y[part]) / args.grad_accum
                loss.backward()  # sharded: reduces leave from the hooks during this call
                step_loss += loss.detach()
            opt.step()
        opt.zero_grad()
        reduces = [r["tensor_bytes"] for r in counter.records if r["kind"] == "reduce"]
        if variant != "plain":
            dist.all_reduce(step_loss)  # the mean over the global batch
            step_loss /= d.world_size
        losses.append(step_loss.item())
    # optimizer state bytes each rank holds (the sharded variants; plain holds it all)
    state = report.gather(opt.state_bytes()) if variant != "plain" else None
    return {"state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "losses": losses, "reduces": reduces, "state_bytes_per_rank": state}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run(args, d) -> None:
    variants = ["plain", "unbucketed"] + [f"bucketed {b}" for b in args.bucket_list]
    results = {v: train(v, args, d) for v in variants}
    report.print0(f"ShardedOptimizer stage 2 over adamw | world {d.world_size} | global batch "
                  f"{d.world_size * args.batch_size} | {args.grad_accum} micro-steps per step")
    report.print0(f"{'':18}{'reduces per step':>17}{'bytes reduced':>15}{'largest':>9}"
                  f"{'final loss':>12}   weights vs unbucketed, vs plain AdamW")
    for variant in variants[1:]:
        r = results[variant]
        label = variant if variant == "unbucketed" else f"buckets of {human(variant)}"
        same = max_difference(r["state"], results["unbucketed"]["state"])
        # ~: a rounding-level difference, its digits depend on the CPU's kernels
        plain = max_difference(r["state"], results["plain"]["state"])
        report.print0(f"{label:18}{len(r['reduces']):>17}{sum(r['reduces']):>15,}"
                      f"{max(r['reduces']):>9,}{r['losses'][-1]:>12.4f}   "
                      + ("identical" if same == 0 else f"~{same:.1e}") + f", ~{plain:.1e}")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "steps": args.steps, "lr": args.lr,
            "grad_accum": args.grad_accum, "bucket_bytes": args.bucket_list,
            "variants": {v: {"losses": r["losses"], "reduce_bytes_last_step": r["reduces"],
                             "state_bytes_per_rank": r["state_bytes_per_rank"]}
                         for v, r in results.items()}})
    if d.rank == 0 and args.export:  # PATH.plain.pt, PATH.unbucketed.pt, PATH.bucketed16384.pt
        for variant, r in results.items():
            report.save_state_dict(report.variant_path(args.export, variant.replace(" ", ""),
                                                       True), r["state"])
    report.finish(args)


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def human(variant: str) -> str:
    """'bucketed 16384' -> '16K'."""
    nbytes = int(variant.split()[1])
    return f"{nbytes // 1024}K" if nbytes % 1024 == 0 else f"{nbytes} B"


def parse_size(text: str) -> int:
    """'16384', '16K', '1M' -> bytes (binary suffixes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KM]?)\s*", text, flags=re.IGNORECASE)
    if not m:
        cli.fail(f"--bucket-bytes {text!r}: give a byte count with an optional K or M suffix")
    return int(m.group(1)) * 1024 ** " KM".index(m.group(2).upper() or " ")


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=4, batch_size=16, lr=1e-2,
                       batch_help="samples per rank per optimizer step (all micro-steps)")
    cli.add_output_args(p, metrics=False, export=True, json_out=True)
    p.set_defaults(grad_accum=2)  # accumulation: buckets must also work across backwards
    p.add_argument("--bucket-bytes", default="16K,64K",
                   help="comma-separated bucket sizes to train with: an owner's bucket is "
                        "reduced once it holds this many bytes (K/M suffixes)")
    args = p.parse_args(argv)
    args.bucket_list = [parse_size(b) for b in args.bucket_bytes.split(",")]
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "lr", "timeout_s")
    if min(args.bucket_list) < 1:
        cli.fail(f"--bucket-bytes {args.bucket_bytes}: a bucket holds at least 1 byte")
    if args.batch_size % args.grad_accum:
        cli.fail(f"--batch-size {args.batch_size} must be divisible by --grad-accum "
                 f"{args.grad_accum}: each micro-step takes batch-size / grad-accum rows")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
