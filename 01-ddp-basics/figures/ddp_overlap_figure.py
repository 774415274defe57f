"""Draw one DDP training step as lanes of time, from the JSON that ddp_overlap.py writes:

    python 01-ddp-basics/figures/ddp_overlap_figure.py runs/ddp_overlap.json runs/ddp_overlap.png

For each rank, a lane for its main thread: forward, then backward cut into one box per layer (the
time between two gradients becoming ready), coloured by the bucket the layer's gradient goes into,
then the optimizer step; a triangle where DDP's call that launches a bucket's all-reduce begins,
and a bar in its colour along the bottom of the lane for as long as that call lasts. A box is
hatched when the main thread did not run for more than half of it (the box's length minus the CPU
time that ddp_overlap.py reads from the thread's clock); its label then says for how long. Below,
a lane per worker thread of the backend: each bucket's all-reduce as it ran there, in the same
colour. The dotted line is the moment the rank's last gradient was ready: an all-reduce that
starts left of it overlapped backward. The profiler's clock is the same for every process of the
machine, so the ranks line up.
"""

import json
from pathlib import Path

import matplotlib

from dtcourse import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)


def draw(t: dict, path: Path) -> None:
    layout = t["buckets"]
    colors = {b["index"]: plt.get_cmap("tab10")(b["index"] % 10) for b in layout}
    bucket_of = {layer: b["index"] for b in layout for layer in b["layers"]}
    members = {b["index"]: ", ".join(n.removeprefix("layers.") for n in b["layers"])
               for b in layout}
    lanes, first_lane = [], {}
    for r in t["ranks"]:
        first_lane[r["rank"]] = len(lanes)
        lanes += [f"rank {r['rank']}\nmain thread"] + [
            f"rank {r['rank']}, {t['backend']}\nworker thread {k + 1}"
            for k in range(r["worker_threads"])]
    fig, ax = plt.subplots(figsize=(12, 0.75 * len(lanes) + 1.8))
    end = max(r["optimizer_step"]["end_ms"] for r in t["ranks"])

    def box(y, span, color, *labels, **kw):
        """A box from span's start to its end; inside it the first label that fits, if any."""
        ax.barh(y, span["end_ms"] - span["start_ms"], left=span["start_ms"], height=0.62,
                color=color, edgecolor="black", linewidth=0.5, **kw)
        fits = [x for x in labels if span["end_ms"] - span["start_ms"] > 0.0135 * end * len(x) / 4]
        if fits:  # on a hatched box, on a white patch so that it stays legible
            ax.text((span["start_ms"] + span["end_ms"]) / 2, y, fits[0], ha="center",
                    va="center", fontsize=6.5, bbox={"facecolor": "white", "edgecolor": "none",
                                                     "pad": 0.6} if "hatch" in kw else None)

    for r in t["ranks"]:
        y0 = first_lane[r["rank"]]
        box(y0, r["forward"], "lightgray", "forward")
        for g in r["gradients"]:
            layer, wall = g["name"].removeprefix("layers."), g["end_ms"] - g["start_ms"]
            idle = wall - g.get("cpu_ms", wall)  # no clocks in a JSON of an older ddp_overlap.py
            if idle > 0.5 * wall:
                box(y0, g, colors[bucket_of[g["name"]]], f"{layer}: {idle:.1f} ms not running",
                    f"{layer}: {idle:.1f} ms", layer, alpha=0.5, hatch="///")
            else:
                box(y0, g, colors[bucket_of[g["name"]]], layer, alpha=0.5)
        box(y0, r["optimizer_step"], "lightgray")
        last = max(g["ready_ms"] for g in r["gradients"])
        ax.plot([last, last], [y0 - 0.45, y0 + r["worker_threads"] + 0.45], color="black",
                linestyle=":", linewidth=1)
        ax.plot([r["backward"]["end_ms"]] * 2, [y0 - 0.45, y0 + 0.45], color="black",
                linewidth=1.5)
        for b in r["buckets"]:
            if b["launch"]:
                ax.plot([b["launch"]["start_ms"]], [y0 - 0.36], marker="v", markersize=7,
                        color=colors[b["index"]], markeredgecolor="black", markeredgewidth=0.5)
                # the launch call itself, on the main thread: from the triangle to its return
                ax.barh(y0 + 0.24, max(b["launch"]["end_ms"] - b["launch"]["start_ms"],
                                       0.002 * end), left=b["launch"]["start_ms"], height=0.14,
                        color=colors[b["index"]], edgecolor="black", linewidth=0.5)
            if b["all_reduce"]:
                y = y0 + 1 + b["all_reduce"]["thread"]
                box(y, b["all_reduce"], colors[b["index"]],
                    f"bucket {b['index']} ({members[b['index']]})")
                if b["launch"]:
                    ax.annotate("", xy=(b["all_reduce"]["start_ms"], y - 0.31),
                                xytext=(b["launch"]["start_ms"], y0 - 0.3),
                                arrowprops={"arrowstyle": "->", "color": "gray", "lw": 0.6})
        if r["rank"]:
            ax.axhline(y0 - 0.5, color="black", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7.5)
    ax.set_ylim(len(lanes) - 0.5, -0.6)
    ax.set_xlabel("ms since the profiled step started (one clock for both ranks)")
    ax.set_title(f"DDP, one training step (step {t['profiled_step']}) at world "
                 f"{t['world_size']}: {t['layers']} Linear layers {t['width']} x {t['width']}, "
                 f"batch {t['batch_size']} per rank, bucket_cap_mb {t['bucket_cap_mb']:g} -> "
                 f"{len(layout)} buckets; {t['backend']}\nfrom torch.profiler. "
                 "Main thread: backward, one box per "
                 "layer (number = layer, colour = its bucket); triangle + bar at its foot: DDP's "
                 "call launching a bucket's all-reduce;\nhatched: the main thread did not run for "
                 "over half of the box; dotted line: last gradient ready; thick line: backward() "
                 "returns, after waiting for every bucket", fontsize=8.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("json_in", type=Path, help="ddp_overlap.py --json-out")
    p.add_argument("png_out", type=Path)
    args = p.parse_args(argv)
    try:
        t = json.loads(args.json_in.read_text())
        t["buckets"], t["ranks"][0]["gradients"]
    except (OSError, ValueError, KeyError) as exc:
        cli.fail(f"{args.json_in}: not a timeline written by ddp_overlap.py --json-out ({exc})")
    draw(t, args.png_out)
    print(f"wrote {args.png_out}")


if __name__ == "__main__":
    main()
