"""bucket_cap_mb: how DDP groups gradients into buckets, one all-reduce each. The layout is
predicted from the parameter sizes (expected_buckets, below) and the all-reduces of a step are
counted; they agree, for each cap given with --bucket-caps.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/internals/bucket_cap.py
    torchrun --nproc_per_node=4 01-ddp-basics/internals/bucket_cap.py --bucket-caps none,0.5,4
    python 01-ddp-basics/internals/bucket_cap.py                  # one process: the same layout
"""

import statistics

import torch
import torch.distributed as dist
from common import Demo, LayerStack, MiB, allreduces, local_batch, main, sgd_step, timed, worst, \
    wrap

from dtcourse import cli, comm, report

SCRIPT = "01-ddp-basics/internals/bucket_cap.py"
DEFAULT_BUCKET_CAP_MB = 25  # DDP's documented default (torch/nn/parallel/distributed.py)


def expected_buckets(sizes: list[int], cap_mb: float | None) -> list[int]:
    """Bucket sizes DDP forms from gradients of `sizes` bytes, in the order they become ready.

    From step 2 on (DDP rebuilds its buckets at the start of it) the order is the order in which
    step 1's gradients arrived: for a stack of layers, the reverse of the parameter order. A bucket
    closes when it reaches its cap, the tensor that crosses it included. The first bucket's cap is
    dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), so that the first all-reduce starts early, but only
    when bucket_cap_mb is left at its default; given explicitly, every bucket has the same cap."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else int(cap_mb * MiB)
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MiB)
    buckets, current, limit = [], 0, first
    for size in sizes:
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + ([current] if current else [])


def demo(args, d, checks, exports) -> dict:
    sizes = [p.numel() * p.element_size() for p in reversed(list(LayerStack().parameters()))]
    report.print0(f"\n[bucket_cap_mb] LayerStack's gradients in the order backward produces them: "
                  f"{', '.join(f'{s:,}' for s in sizes)} B")
    report.print0("  bucket_cap_mb  first cap  expected buckets (B)                  all-reduces "
                  "counted   step time")
    ddps = [wrap(LayerStack, args, d, bucket_cap_mb=cap) for cap in args.bucket_caps]
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in ddps]
    counted, times = {}, {i: [] for i in range(len(ddps))}
    for step in range(3 + args.timing_steps):
        x, y = local_batch(args, d, step)
        for i, (ddp, opt) in enumerate(zip(ddps, opts)):  # in turn: the same load for every cap
            if step == 2:  # after the rebuild at the start of step 2
                with comm.CollectiveCounter() as counter:
                    sgd_step(ddp, opt, x, y)
                counted[i] = [r["tensor_bytes"] for r in allreduces(counter)]
            else:
                seconds = timed(lambda: sgd_step(ddp, opt, x, y), d.device)
                if step >= 3:
                    times[i].append(seconds)
    step_s = worst(d, *(statistics.median(times[i]) for i in range(len(ddps))))
    rows = []
    for i, cap in enumerate(args.bucket_caps):
        expected = expected_buckets(sizes, cap)
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap is None else int(cap * MiB)
        buckets = " + ".join(f"{b:,}" for b in expected)
        agree = "as expected" if counted[i] == expected else "NOT as expected"
        report.print0(f"  {cap_label(cap):13}  {first / MiB:5g} MiB  {buckets:36}  "
                      f"{len(counted[i]):>2} ({agree})      {step_s[i] * 1e3:.1f} ms")
        checks[f"bucket_cap_mb {cap_label(cap)}: counted = expected"] = counted[i] == expected
        rows.append({"bucket_cap_mb": cap, "first_bucket_bytes": first, "expected": expected,
                     "counted": counted[i], "step_s": step_s[i]})
    return {"gradient_sizes": sizes, "rows": rows}


def cap_label(cap: float | None) -> str:
    return f"none ({DEFAULT_BUCKET_CAP_MB})" if cap is None else f"{cap:g}"


def parse_caps(text: str) -> list[float | None]:
    caps = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            cap = None if item == "none" else float(item)
        except ValueError:
            cli.fail(f"--bucket-caps: {item!r} is neither a size in MiB nor 'none'")
        if cap is not None and cap <= 0:
            cli.fail(f"--bucket-caps: {item} MiB is not a positive size")
        caps.append(cap)
    return caps


def add_args(p) -> None:
    p.add_argument("--bucket-caps", default="none,1,2,25",
                   help="bucket_cap_mb values to compare, in MiB ('none': DDP's default)")


def check_args(args) -> None:
    args.bucket_caps = parse_caps(args.bucket_caps)


DEMO = Demo("bucket_cap_mb", demo, timed=True, add_args=add_args, check_args=check_args)

if __name__ == "__main__":
    main(__doc__, SCRIPT, [DEMO])
