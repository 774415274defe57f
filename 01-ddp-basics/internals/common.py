"""What the DDP internals demos share: two tiny models, the batches, one process as the reference,
the differences, and the launch (flags, process group, verdict, --json-out, --export).

Not run on its own: each demo file of this folder imports it (a script launched by path has its
own folder on sys.path), and so does ../ddp_internals.py, which runs every demo in one launch.

Each demo compares with one process where one process is the claim: every rank trains the plain
model on the whole global batch beside DDP, from the same seed, and the difference is printed.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, comm, launch, report, timing
from dtcourse.data import classification_batch, rank_rows

MiB = 1024 * 1024
# What "equal to one process" means in the printed verdicts: a few float32 roundings of weights of
# size ~0.1-1 after a few steps are ~1e-7; every bug these demos could show moves weights by more
# than 1e-3 (the Join divisor, plain BatchNorm, a missing average).
EQUAL_TOL = 1e-5


# --------------------------------------------------------------------------------------------------
# Tiny models that two demos each use


class TwoHeads(nn.Module):
    """(B, 32) -> (B, 10) through a shared trunk and head_a. head_b (an auxiliary task switched
    off, say) exists but forward never uses it, so its parameters get no gradient."""

    def __init__(self, hidden: int = 32, features: int = 32, classes: int = 10):
        super().__init__()
        self.trunk = nn.Linear(features, hidden)
        self.head_a = nn.Linear(hidden, classes)
        self.head_b = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head_a(F.gelu(self.trunk(x)))


class LayerStack(nn.Module):
    """(B, 32) -> width -> `layers` x (width -> width) -> (B, 10), ReLU between, Linear layers
    without bias: each layer is one gradient tensor, so the bucket boundaries are easy to follow.
    Sizes (fp32): 32 x 384 = 48 KiB, 384 x 384 = 576 KiB each, 384 x 10 = 15 KiB."""

    def __init__(self, width: int = 384, layers: int = 5, features: int = 32, classes: int = 10):
        super().__init__()
        dims = [features] + [width] * (layers + 1) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = F.relu(x) if i < len(self.layers) - 1 else x
        return x


# --------------------------------------------------------------------------------------------------
# Data, building, one process as the reference, differences, timing


def global_batch(args, d, step: int):
    """Step `step`'s global batch (world x batch rows), the same on every rank."""
    x, y = classification_batch(args.seed, step, d.world_size * args.batch_size)
    return x.to(d.device), y.to(d.device)


def local_batch(args, d, step: int, rank: int | None = None):
    """This rank's rows r*B..(r+1)*B-1 of step `step`'s global batch."""
    x, y = global_batch(args, d, step)
    rows = rank_rows(d.rank if rank is None else rank, args.batch_size)
    return x[rows], y[rows]


def build(make, args, d):
    """The plain model, its weights drawn from --seed: every rank and the reference start equal."""
    torch.manual_seed(args.seed)
    return make().to(d.device)


def wrap(make, args, d, **ddp_kwargs) -> DDP:
    return DDP(build(make, args, d), device_ids=[d.device.index] if d.device.type == "cuda"
               else None, **ddp_kwargs)


def one_process(make, args, d, steps: int) -> nn.Module:
    """What DDP must equal: one process, the plain model, SGD on the whole global batch."""
    model = build(make, args, d)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(steps):
        x, y = global_batch(args, d, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def sgd_step(ddp: DDP, opt, x, y) -> None:
    F.cross_entropy(ddp(x), y).backward()  # DDP all-reduces (averages) the gradients here
    opt.step()
    opt.zero_grad(set_to_none=True)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest |a - b| over the floating-point entries of two state dicts (weights and buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa
               if sa[k].is_floating_point())


def worst(d, *values: float) -> list[float]:
    """The largest of each value over the ranks (one small all-reduce): a claim must hold on all."""
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def verdict(diff: float, tol: float = EQUAL_TOL) -> str:
    return f"equal (max |diff| < {tol:.0e})" if diff < tol else f"DIFFERENT (max |diff| {diff:.2e})"


def timed(fn, device: torch.device) -> float:
    t0 = timing.clock(device)
    fn()
    return timing.clock(device) - t0


def allreduces(counter: comm.CollectiveCounter) -> list[dict]:
    return [r for r in counter.records if r["kind"] == "all_reduce"]


# --------------------------------------------------------------------------------------------------
# Flags and launch, for one demo (a file of this folder) or several (../ddp_internals.py)


@dataclass
class Demo:
    """One internal, shown by running it. run(args, d, checks, exports) prints its lines, records
    each claim in checks (name -> held), the models it trained in exports (tag -> module), and
    returns its numbers for --json-out."""
    name: str
    run: Callable
    timed: bool = False                # it times steps: --timing-steps
    add_args: Callable | None = None   # its own flags
    check_args: Callable | None = None  # refuses bad values (cli.fail), converts them


def parse_args(doc: str, demos: list[Demo], argv=None):
    """The flags every demo shares, each demo's own, and --demo when there are several. Returns
    (args, the demos to run)."""
    p = cli.parser(doc)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=4, batch_size=8, lr=0.1, grad_accum=False)
    cli.add_output_args(p, metrics=False, json_out=True)
    if len(demos) > 1:
        p.add_argument("--demo", choices=["all"] + [x.name for x in demos], default="all",
                       help="which internal to show")
    for demo in demos:
        if demo.add_args:
            demo.add_args(p)
    if any(x.timed for x in demos):
        p.add_argument("--timing-steps", type=int, default=20,
                       help="steps timed per variant (the medians of the step times)")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s",
                       *(["timing_steps"] if any(x.timed for x in demos) else []))
    chosen = [x for x in demos if getattr(args, "demo", "all") in ("all", x.name)]
    for demo in chosen:
        if demo.check_args:
            demo.check_args(args)
    return args, chosen


def main(doc: str, script: str, demos: list[Demo], argv=None) -> None:
    """Start the process group, run the chosen demos, print whether every check held (exit 1 if
    not); rank 0 writes --json-out and one plain state dict per trained model (--export)."""
    args, chosen = parse_args(doc, demos, argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        report.print0(f"world {d.world_size} | device {d.device} | {args.batch_size} rows per "
                      f"rank, {d.world_size * args.batch_size} global | SGD lr {args.lr:g}, "
                      f"{args.steps} steps per demo")
        checks: dict[str, bool] = {}
        exports: dict[str, nn.Module] = {}
        results = {demo.name: demo.run(args, d, checks, exports) for demo in chosen}
        failed = [name for name, ok in checks.items() if not ok]
        report.print0(f"\nFAIL: {'; '.join(failed)}" if failed else
                      f"\nall {len(checks)} checks hold")
        if args.json_out and d.rank == 0:
            report.write_json(args.json_out, {
                "script": script, "world_size": d.world_size, "device": str(d.device),
                "torch_version": torch.__version__, "batch_size": args.batch_size,
                "global_batch": d.world_size * args.batch_size, "steps": args.steps,
                "lr": args.lr, "seed": args.seed, "demos": results, "checks": checks,
                "exports": {tag: str(report.variant_path(args.export, tag, True))
                            for tag in exports} if args.export else {}})
        if args.export and d.rank == 0:
            # one plain state dict per trained model: runs/x.pt -> runs/x.join.pt, ...
            for tag, model in exports.items():
                report.save_state_dict(report.variant_path(args.export, tag, True),
                                       model.state_dict())
        dist.barrier()  # the file is complete before any rank exits
    if failed:
        sys.exit(1)
