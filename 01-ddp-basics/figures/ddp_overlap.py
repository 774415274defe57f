"""DDP's bucket all-reduces overlapping backward, as torch.profiler records one training step.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/figures/ddp_overlap.py \\
        --json-out runs/ddp_overlap.json --trace-out runs/ddp_overlap_trace.json
    python 01-ddp-basics/figures/ddp_overlap_figure.py runs/ddp_overlap.json runs/ddp_overlap.png

The model is a stack of --layers Linear layers of width x width, without bias, so that each layer
has one gradient tensor and the bucket boundaries are easy to follow. With --bucket-cap-mb 0.5 and
width 256 (256 KiB per layer) every bucket holds two layers. The first --steps - 1 steps run
unprofiled: DDP's first step uses a single bucket and rebuilds its buckets at the start of the
second, in the order the gradients arrived; its logger reports the rebuilt layout from the third
forward on, hence --steps >= 3. The last step runs under torch.profiler (CPU activities, input
shapes recorded). Every rank reads its own Chrome trace (rank 0 keeps its file: --trace-out, open
it in https://ui.perfetto.dev), and rank 0 writes to --json-out, per rank:

    grad ready: layers.i  a mark made when layer i's gradient has been accumulated (a
                          post-accumulate-grad hook opens and closes a record_function);
    c10d::allreduce_      DDP launching a bucket's all-reduce from inside backward, on the main
                          thread (asynchronous: it queues the work for a gloo worker thread);
    gloo:all_reduce       the all-reduce itself, run by one of gloo's worker threads; its input
                          shape is the bucket's length.

Inside each mark the hook also reads two clocks of the main thread: the CPU time it has run
(time.thread_time_ns) and, on Linux, the time it has waited runnable for a core (the run-queue
delay, second field of /proc/thread-self/schedstat). Between two marks, wall time minus CPU time
is time the main thread did not run; the run-queue delay says how much of that it was ready to
run but had no core (on a machine with fewer cores than busy threads), rather than blocked.

CPU runs only (--device cuda is refused): on a GPU the main thread's boxes would be the times at
which the CPU queued each layer's kernels, not when the GPU ran them, so the picture would not
show what the GPU overlaps; read a GPU run in the profiler's own trace instead.
"""

import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from dtcourse import cli, launch, report

SCRIPT = "01-ddp-basics/figures/ddp_overlap.py"


class Stack(nn.Module):
    """(B, width) -> `layers` x Linear(width, width, bias=False), ReLU between -> (B, width)."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x


class MainThreadClocks:
    """Two clocks of the thread that creates it (the main thread, which runs backward on a CPU):
    the CPU time it has run (time.thread_time_ns) and the time it has waited runnable for a core,
    the kernel's run-queue delay (Linux: /proc/thread-self/schedstat, second field; None where the
    kernel does not report it). `read()` appends one (cpu_ns, wait_ns) sample."""

    def __init__(self):
        self.samples: list[tuple[int, int | None]] = []
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's
        except OSError:
            self._fd = None

    def read(self) -> None:
        # The wait first, computed inside one read system call: a preemption on the way back from
        # it falls after both the profiler's mark and this sample, in the next box for both.
        wait = None
        if self._fd is not None:
            wait = int(os.pread(self._fd, 128, 0).split()[1])
        self.samples.append((time.thread_time_ns(), wait))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def mark_gradients(model: Stack, clocks: MainThreadClocks) -> None:
    """After autograd has accumulated layer i's gradient, leave a mark named after the layer in
    the profiler's trace (a record_function that opens at that moment) and read the main
    thread's clocks inside it."""
    for i, layer in enumerate(model.layers):
        def hook(_param, name=f"grad ready: layers.{i}"):
            with record_function(name):
                clocks.read()
        layer.weight.register_post_accumulate_grad_hook(hook)


def train_step(ddp: DDP, opt, x, clocks: MainThreadClocks) -> None:
    opt.zero_grad(set_to_none=True)
    loss = ddp(x).pow(2).mean()
    clocks.samples.clear()
    with record_function("backward"):  # returns once DDP has waited for every bucket
        clocks.read()  # the first layer's box begins with this range
        loss.backward()
    opt.step()


def run(args, d) -> dict | None:
    """Train --steps steps, the last under the profiler; rank 0 returns that step's timeline on
    every rank."""
    torch.manual_seed(args.seed)
    model = Stack(args.width, args.layers)
    clocks = MainThreadClocks()  # read at backward's start and at each gradient's mark
    mark_gradients(model, clocks)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(args.seed * 1000 + d.rank)  # this rank's rows
    x = torch.randn(args.batch_size, args.width, generator=g)
    for _ in range(args.steps - 1):
        train_step(ddp, opt, x, clocks)
    dist.barrier()  # both ranks start the profiled step together
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(ddp, opt, x, clocks)
    with trace_file(args.trace_out if d.rank == 0 else None) as path:
        prof.export_chrome_trace(str(path))
        mine = rank_events(read_trace(path), d)
    mine["clocks"] = list(clocks.samples)
    clocks.close()
    # The traces of all ranks share one clock (the profiler's, in microseconds): put them side by
    # side on rank 0.
    every = report.gather(mine)
    if d.rank != 0:
        return None
    t0 = min(r["t0_us"] for r in every)
    layout = bucket_layout(ddp)
    ranks = [rank_timeline(r, layout, t0, rank) for rank, r in enumerate(every)]
    return {"script": SCRIPT, "world_size": d.world_size, "device": d.device.type,
            "backend": d.backend, "torch_version": torch.__version__, "machine": machine(),
            "layers": args.layers, "width": args.width, "batch_size": args.batch_size,
            "bucket_cap_mb": args.bucket_cap_mb, "profiled_step": args.steps,
            "buckets": layout, "ranks": ranks}


def bucket_layout(ddp: DDP) -> list[dict]:
    """DDP's buckets as it rebuilt them at the start of step 2, from its own logging data: the
    bytes of each and the parameters in it (layers.i is the i-th parameter). The logger records
    them at the start of a forward, before that forward's rebuild: from step 3 on."""
    logged = ddp._get_ddp_logging_data()
    names = [name.removeprefix("module.").removesuffix(".weight")
             for name, _ in ddp.named_parameters()]
    sizes = [int(b) for b in logged["rebuilt_bucket_sizes"].split(",")]
    members = [[names[int(i)] for i in group.split()]
               for group in logged["rebuilt_per_bucket_param_indices"].split(",")]
    return [{"index": i, "bytes": b, "layers": m} for i, (b, m) in enumerate(zip(sizes, members))]


@contextlib.contextmanager
def trace_file(path: Path | None):
    """--trace-out, or a temporary file that is gone afterwards."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "trace.json"


def read_trace(path: Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace, in order of start."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    return sorted(events, key=lambda e: e["ts"])


def rank_events(events: list[dict], d) -> dict:
    """What the figure needs from this rank's trace, as [start, end] pairs in microseconds."""
    main = next(e["tid"] for e in events if e["name"] == "backward")

    def on_main(name):
        return [e for e in events if e["tid"] == main and e["name"].startswith(name)]

    def span(e):
        return [e["ts"], e["ts"] + e["dur"]]

    runs = [e for e in events if e["name"] == f"{d.backend}:all_reduce"]  # gloo's worker threads
    return {"t0_us": min(e["ts"] for e in events if e["tid"] == main),
            "forward": span(on_main("DistributedDataParallel.forward")[0]),
            "backward": span(on_main("backward")[0]),
            "optimizer_step": span(on_main("Optimizer.step")[0]),
            "ready": [(e["name"].removeprefix("grad ready: "), e["ts"])
                      for e in on_main("grad ready: ")],
            "launches": [(span(e), input_elements(e)) for e in on_main("c10d::allreduce_")],
            "runs": [(span(e), e["tid"], input_elements(e)) for e in runs]}


def rank_timeline(r: dict, layout: list[dict], t0: float, rank: int) -> dict:
    """One rank's step in milliseconds from `t0` (the first rank's start of the step)."""
    def ms(pair):
        return {"start_ms": (pair[0] - t0) / 1e3, "end_ms": (pair[1] - t0) / 1e3}

    # Layer i's gradient is computed between the previous mark (or the start of backward) and its
    # own: backward visits the layers from the last to the first. Over the same boxes, the main
    # thread's clocks: the CPU time it ran, and the time it waited runnable for a core (None where
    # the kernel does not say). A wait that begins right at a mark, between the profiler's
    # timestamp and the clocks' read, is counted in the box that ends there: per box, wall - CPU
    # time (when the thread did not run) is exact, the wait almost always; over all boxes both are.
    def waited(a, b):
        return None if a[1] is None else (b[1] - a[1]) / 1e6

    gradients, prev, clocks = [], r["backward"][0], r["clocks"]
    for (name, ts), c0, c1 in zip(r["ready"], clocks, clocks[1:]):
        gradients.append({"name": name, **ms((prev, ts)), "ready_ms": (ts - t0) / 1e3,
                          "cpu_ms": (c1[0] - c0[0]) / 1e6, "waited_ms": waited(c0, c1)})
        prev = ts
    main_thread = {"wall_ms": (prev - r["backward"][0]) / 1e3,  # backward's start to last mark
                   "cpu_ms": (clocks[-1][0] - clocks[0][0]) / 1e6,
                   "waited_ms": waited(clocks[0], clocks[-1])}
    threads = sorted({tid for _, tid, _ in r["runs"]})
    buckets = []
    for b in layout:  # DDP launches bucket 0 first, then 1, ...; the runs start in that order
        i = b["index"]
        launch_ = r["launches"][i] if i < len(r["launches"]) else None
        run_ = r["runs"][i] if i < len(r["runs"]) else None
        buckets.append({"index": i,
                        "launch": dict(ms(launch_[0]), elements=launch_[1]) if launch_ else None,
                        "all_reduce": dict(ms(run_[0]), thread=threads.index(run_[1]),
                                           elements=run_[2]) if run_ else None})
    return {"rank": rank, "forward": ms(r["forward"]), "backward": ms(r["backward"]),
            "optimizer_step": ms(r["optimizer_step"]), "gradients": gradients,
            "main_thread_until_last_gradient": main_thread,
            "buckets": buckets, "all_reduce_launches": len(r["launches"]),
            "all_reduce_runs": len(r["runs"]), "worker_threads": len(threads)}


def input_elements(event: dict) -> int | None:
    """The length of a collective's tensor, from the shapes the profiler recorded: [[131072]]
    for gloo:all_reduce, [[[131072]], ...] (a list of tensors) for c10d::allreduce_."""
    dims = (event.get("args", {}).get("Input Dims") or [None])[0]
    while dims and isinstance(dims[0], list):
        dims = dims[0]
    return math.prod(dims) if dims else None


def machine() -> str:
    """'2-core AMD EPYC ...', for the figure's title."""
    name = "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores}-core {name}"


def print_summary(t: dict) -> None:
    sizes = ", ".join(f"{b['bytes']:,}" for b in t["buckets"])
    report.print0(f"ddp_overlap | world {t['world_size']} | {t['device']} | {t['backend']} | "
                  f"{t['layers']} layers of {t['width']} x {t['width']} | bucket_cap_mb "
                  f"{t['bucket_cap_mb']:g}: {len(t['buckets'])} buckets of {sizes} B")
    for b in t["buckets"]:
        report.print0(f"  bucket {b['index']}: {', '.join(b['layers'])}")
    report.print0(f"step {t['profiled_step']}, ms from its start (~: depends on the machine's "
                  "speed and load)")
    for r in t["ranks"]:
        last = max(g["ready_ms"] for g in r["gradients"])
        report.print0(f"rank {r['rank']}: backward ~{r['backward']['start_ms']:.1f} to "
                      f"~{r['backward']['end_ms']:.1f}, last gradient ready at ~{last:.1f}")
        for b in r["buckets"]:
            run_ = b["all_reduce"] or {"start_ms": float("nan"), "end_ms": float("nan")}
            report.print0(f"  bucket {b['index']}: launch ~{b['launch']['start_ms']:.1f} to "
                          f"~{b['launch']['end_ms']:.1f}, all-reduce ~{run_['start_ms']:.1f} to "
                          f"~{run_['end_ms']:.1f}")
        m = r["main_thread_until_last_gradient"]
        waits = "" if m["waited_ms"] is None else \
            f", waited runnable for a core ~{m['waited_ms']:.1f}"
        report.print0(f"  main thread from backward's start to the last gradient: "
                      f"~{m['wall_ms']:.1f}, ran ~{m['cpu_ms']:.1f}{waits}")


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    p.set_defaults(device="cpu")  # a picture of gloo's threads: see the docstring
    p.add_argument("--steps", type=int, default=3,
                   help="training steps; the last one is profiled (at least 3: DDP rebuilds its "
                        "buckets at the start of step 2 and reports them from step 3)")
    p.add_argument("--batch-size", type=int, default=128, help="rows per rank")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=0.5,
                   help="DDP's bucket size cap in MiB (its default is 25)")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the step's timeline here")
    p.add_argument("--trace-out", type=Path,
                   help="rank 0 writes the profiler's Chrome trace of the step here")
    args = p.parse_args(argv)
    cli.check_positive(args, "batch_size", "layers", "width", "bucket_cap_mb", "timeout_s")
    if args.steps < 3:
        cli.fail(f"--steps must be at least 3 (DDP rebuilds its buckets at the start of step 2 "
                 f"and its logger reports the rebuilt layout from step 3; the last step is "
                 f"profiled), got {args.steps}")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        cli.fail("--device cuda: this picture is drawn from CPU runs only (gloo's worker "
                 "threads; on a GPU the main thread's boxes would be kernel launches, not GPU "
                 "compute): run it with --device cpu")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        t = run(args, d)
        if d.rank == 0:
            print_summary(t)
            if args.json_out:
                report.write_json(args.json_out, t)
        dist.barrier()  # the files are complete before any rank exits


if __name__ == "__main__":
    main()
