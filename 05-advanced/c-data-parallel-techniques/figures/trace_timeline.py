"""Draw the Chrome traces that profiling.py writes (one per rank) as the timeline Perfetto shows:

    python 05-advanced/c-data-parallel-techniques/figures/trace_timeline.py runs/traces \\
        05-advanced/c-data-parallel-techniques/figures/profiling_timeline.png

https://ui.perfetto.dev opens one trace_rank<r>.json at a time and draws a track per thread, each
range a box, nested ranges below their parent. This script reads every trace_rank<r>.json of the
folder and draws those tracks for all ranks in one picture, with nothing added that the files do
not hold:

    rank r, main thread     depth 0: ProfilerStep#k, the steps torch.profiler recorded
                            depth 1: the labelled ranges of the step (record_function, opened by
                                     dtcourse.profiling.nvtx_range): data, forward, backward,
                                     barrier, allreduce, optimizer
                            depth 2: c10d::allreduce_, the collective's call, which hands the
                                     gradients to the backend
    rank r, gloo thread k   gloo:all_reduce, the all-reduce itself, run by one of the backend's
                            worker threads (a CPU run, gloo), and gloo:barrier, the barrier's
    rank r, GPU d stream s  NCCL's kernels (names containing "nccl", e.g. ncclDevKernel_AllReduce_
                            Sum_f32_RING_LL), the all-reduce itself, on the CUDA stream of the
                            process group (a CUDA run, NCCL: the trace's events of category
                            "kernel", whose pid is the GPU and tid the stream); compute kernels
                            are left out

The profiler's clock is the machine's (Kineto's timestamps): the ranks of one machine line up.
Time runs from the start of the first recorded step of any rank.
"""

import json
import re
from pathlib import Path

import matplotlib

from dtcourse import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

LABELS = ("data", "forward", "backward", "barrier", "allreduce", "optimizer")
COLORS = {"data": "tab:olive", "forward": "tab:blue", "backward": "tab:orange",
          "barrier": "tab:gray", "allreduce": "tab:red", "optimizer": "tab:green",
          "c10d::allreduce_": "tab:pink", "collective": "tab:red"}


def is_nccl_kernel(e: dict) -> bool:
    """A GPU kernel of NCCL: Kineto writes kernels with category "kernel" (pid: the GPU, tid: the
    stream), and NCCL's kernel names contain "nccl" (ncclKernel_... or ncclDevKernel_...)."""
    return e.get("cat") == "kernel" and "nccl" in e["name"].lower()


def read_trace(path: Path) -> dict:
    """One rank's trace: its rank, what ran (the "course" entry profiling.py adds), and its
    complete events (ph "X": a start ts and a duration dur, in microseconds) by thread."""
    t = json.loads(path.read_text())
    events = [e for e in t["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep# event: not a trace of torch.profiler on a schedule")
    main = (steps[0]["pid"], steps[0]["tid"])
    # The lanes of the collective itself: gloo's worker threads on a CPU run, the GPU streams
    # that ran NCCL's kernels on a CUDA run.
    gloo = sorted({(e["pid"], e["tid"]) for e in events if e["name"].startswith("gloo:")}
                  - {main})
    streams = sorted({(e["pid"], e["tid"]) for e in events if is_nccl_kernel(e)})
    lanes = [(f"worker thread {k + 1}",
              [e for e in events if (e["pid"], e["tid"]) == w and e["name"].startswith("gloo:")])
             for k, w in enumerate(gloo)]
    lanes += [(f"GPU {gpu}, stream {stream}",
               [e for e in events if (e["pid"], e["tid"]) == (gpu, stream) and is_nccl_kernel(e)])
              for gpu, stream in streams]
    info = t.get("distributedInfo", {})  # what torch.distributed told the profiler
    on_main = [e for e in events if (e["pid"], e["tid"]) == main]
    return {"rank": info.get("rank", "?"), "backend": info.get("backend", "?"),
            "world_size": info.get("world_size", "?"),
            "course": t.get("course", {}), "steps": steps,
            "labels": [e for e in on_main if e["name"] in LABELS],
            "calls": [e for e in on_main if e["name"] == "c10d::allreduce_"],
            "collective": lanes}


def draw(traces: list, path: Path, sources: str) -> None:
    t0 = min(e["ts"] for tr in traces for e in tr["steps"])
    end = max(e["ts"] + e["dur"] for tr in traces for e in tr["steps"])
    span = (end - t0) / 1e3
    lanes = []  # (label, rank's first lane?)
    for tr in traces:
        lanes.append(f"rank {tr['rank']}\nmain thread")
        lanes += [f"rank {tr['rank']}, {tr['backend']}\n{name}" for name, _ in tr["collective"]]
    fig, ax = plt.subplots(figsize=(13, 0.8 * len(lanes) + 1.8))

    def box(y, e, color, label="", height=0.26, **kw):
        start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.barh(y, width, left=start, height=height, color=color, edgecolor="black",
                linewidth=0.4, **kw)
        if label and width > 0.0085 * span * len(label):
            ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=6.5)

    lane = 0
    for tr in traces:
        # depth 0, 1, 2 of the main thread: one above the other inside the lane, as in Perfetto
        for e in tr["steps"]:
            box(lane - 0.3, e, "whitesmoke", e["name"], height=0.24)
        for e in tr["labels"]:
            box(lane, e, COLORS[e["name"]], e["name"], alpha=0.8)
        for e in tr["calls"]:
            box(lane + 0.3, e, COLORS[e["name"]], height=0.22)
        for k, (_, worker) in enumerate(tr["collective"]):
            for e in worker:
                color = COLORS["barrier" if "barrier" in e["name"] else "collective"]
                box(lane + 1 + k, e, color, e["name"], alpha=0.8)
        if lane:
            ax.axhline(lane - 0.55, color="black", linewidth=0.8)
        lane += 1 + len(tr["collective"])
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[n], alpha=0.8) for n in
               (*LABELS, "c10d::allreduce_")]
    fig.legend(handles, [*LABELS, "c10d::allreduce_ (the collective's call, inside allreduce)",
                         ], fontsize=7.5, ncol=7, loc="lower center", frameon=False)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7.5)
    ax.set_ylim(len(lanes) - 0.5, -0.6)
    ax.set_xlim(0, span * 1.005)
    ax.set_xlabel("ms since the first recorded step began (one clock for every rank)")
    course = traces[0]["course"]
    steps = course.get("steps", {})
    ax.set_title(f"{course.get('script', 'torch.profiler')}: the {len(traces[0]['steps'])} "
                 f"recorded steps (after {steps.get('wait', '?')} skipped, "
                 f"{steps.get('warmup', '?')} warm-up) at world {traces[0]['world_size']}; "
                 f"{course.get('machine', '?')}, {traces[0]['backend']}, torch "
                 f"{course.get('torch_version', '?')}\ndrawn from {sources}: the tracks "
                 "https://ui.perfetto.dev shows for each file, every rank on one time axis",
                 fontsize=8.5)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("trace_dir", type=Path, help="profiling.py --trace-dir: trace_rank<r>.json")
    p.add_argument("png_out", type=Path)
    args = p.parse_args(argv)
    files = sorted(args.trace_dir.glob("trace_rank*.json"),
                   key=lambda f: int(re.findall(r"\d+", f.stem)[-1]))
    if not files:
        cli.fail(f"{args.trace_dir}: no trace_rank<r>.json (run profiling.py --trace-dir "
                 f"{args.trace_dir} first)")
    try:
        traces = [read_trace(f) for f in files]
    except (OSError, ValueError, KeyError) as exc:
        cli.fail(f"{args.trace_dir}: not traces written by profiling.py ({exc})")
    draw(traces, args.png_out, f"{args.trace_dir}/trace_rank<r>.json")
    print(f"wrote {args.png_out}")


if __name__ == "__main__":
    main()
