"""Draw one FSDP2 training step as lanes of time, from the JSON that fsdp_timeline.py writes:

    python 02-fsdp/figures/fsdp_timeline_figure.py runs/fsdp_timeline.json runs/fsdp_timeline.png

For each rank, three lanes. The main thread: forward and backward compute of each unit (root,
blocks.0, ...), coloured by unit, with the time FSDP spends inside its own all-gather and
reduce-scatter calls hatched over it, and a triangle where backward prefetches the next unit's
all-gather. Then where the collectives ran (gloo's worker threads; CPU runs only): the
all-gathers on one lane, the reduce-scatters and the gradient norm's all-reduce on the other, each
box in its unit's colour, joined by a grey line to the moment the main thread issued it.
"""

import json
from pathlib import Path

import matplotlib

from dtcourse import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def draw(t: dict, path: Path) -> None:
    units = t["units"]
    colors = {u: plt.get_cmap("Set2")(i % 8) for i, u in enumerate(units)}
    colors["clip_grad_norm_"] = "lightgray"
    lanes = []
    for r in t["ranks"]:
        lanes += [f"rank {r['rank']}\nmain thread", f"rank {r['rank']}\nall-gathers",
                  f"rank {r['rank']}\nreduce-scatters"]
    fig, ax = plt.subplots(figsize=(13, 0.72 * len(lanes) + 2.0))
    end = max([r["optimizer_step"]["end_ms"] for r in t["ranks"]] +
              [c["ran"]["end_ms"] for r in t["ranks"] for c in r["collectives"] if c["ran"]])

    def box(y, s, color, label="", **kw):
        ax.barh(y, s["end_ms"] - s["start_ms"], left=s["start_ms"], height=0.62, color=color,
                edgecolor="black", linewidth=0.5, **kw)
        if label and s["end_ms"] - s["start_ms"] > 0.03 * end:  # room for the text
            ax.text((s["start_ms"] + s["end_ms"]) / 2, y, label, ha="center", va="center",
                    fontsize=6.5)

    for k, r in enumerate(t["ranks"]):
        y0 = 3 * k
        for c in r["compute"]:
            name = "root" if c["unit"] == "root" else c["unit"].replace("blocks.", "b")
            box(y0, c, colors[c["unit"]], f"{'F' if c['pass'] == 'forward' else 'B'} {name}")
        for w in r["waits"]:
            box(y0, w, "none", hatch="////", alpha=0.9)
        box(y0, r["optimizer_step"], "white", "opt")
        for p in r["prefetches"]:
            ax.plot([p["start_ms"]], [y0 - 0.38], marker="v", color=colors[p["unit"]],
                    markersize=8, markeredgecolor="black", markeredgewidth=0.5)
        for c in r["collectives"]:
            if not c["ran"]:
                continue
            y = y0 + (1 if c["kind"] == "all_gather" else 2)
            unit = "norm" if c["unit"] == "clip_grad_norm_" else \
                c["unit"].replace("blocks.", "b")
            box(y, c["ran"], colors[c["unit"]], f"{SHORT[c['kind']]} {unit}")
            ax.plot([c["issued"]["start_ms"], c["ran"]["start_ms"]], [y0 + 0.31, y - 0.31],
                    color="gray", linewidth=0.6)
        ax.plot([r["backward_start_ms"]] * 2, [y0 - 0.45, y0 + 2.45], color="black",
                linestyle=":", linewidth=0.9)
        if k:
            ax.axhline(y0 - 0.5, color="black", linewidth=0.8)
    ax.text(t["ranks"][0]["backward_start_ms"], -0.5, " backward starts", fontsize=7,
            va="bottom")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colors[u], edgecolor="black",
                             linewidth=0.5) for u in units]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black",
                                 hatch="////", linewidth=0.5))
    labels = units + ["main thread inside FSDP's all-gather, copy-out or reduce-scatter"]
    ax.legend(handles, labels, ncol=len(handles),
              loc="upper center", bbox_to_anchor=(0.5, -0.09), fontsize=7.5, frameon=False)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7.5)
    ax.set_ylim(len(lanes) - 0.5, -0.8)
    ax.set_xlabel("ms since the profiled step started (one clock for both ranks)")
    ax.set_title(f"FSDP2, one training step (step {t['profiled_step']}) at world "
                 f"{t['world_size']}: fsdp_transformer.py's GPT ({t['layers']} blocks, dim "
                 f"{t['dim']}), fully_shard per block (reshard_after_forward=True) + root; "
                 f"{t['backend']}\nfrom "
                 "torch.profiler. "
                 "F/B = forward/backward compute of a unit; hatched: the main thread inside FSDP's "
                 "all-gather or reduce-scatter (issue, wait, copy-out);\ntriangle: backward "
                 "prefetch of the next unit's all-gather; dotted: backward starts; AG/RS/AR "
                 "boxes: where the collective ran, a grey line from where it was issued",
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("json_in", type=Path, help="fsdp_timeline.py --json-out")
    p.add_argument("png_out", type=Path)
    args = p.parse_args(argv)
    try:
        t = json.loads(args.json_in.read_text())
        t["units"], t["ranks"][0]["collectives"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        cli.fail(f"{args.json_in}: not a timeline written by fsdp_timeline.py --json-out ({exc})")
    draw(t, args.png_out)
    print(f"wrote {args.png_out}")


if __name__ == "__main__":
    main()
