"""Draw the pipeline figures of 05-advanced/b-pipeline-expert-context/README.md from the JSON
the scripts write:

    python 05-advanced/b-pipeline-expert-context/figures/pp_figures.py IN.json OUT.png

- IN written by pipeline_parallel.py --metrics-out: the last step's timeline, ranks as rows, a box
  per forward and backward (pp_timeline_*.png);
- IN written by pipeline_sweep.py --json-out: measured bubble vs the formulas and the activation
  memory of rank 0, against m, one row of panels per pipeline size p (pp_bubble.png).
"""

import json
from pathlib import Path

import matplotlib

from dtcourse import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)


def draw_timeline(metrics: dict, path: Path):
    """Ranks as rows, time to the right; a box per forward (light) or backward (dark, hatched),
    coloured by micro-batch and labelled with it (and with the stage when a rank has several)."""
    per_rank = metrics["per_rank"]
    title = (f"{metrics['schedule']} ({metrics['impl']}), p={metrics['world_size']}, "
             f"v={metrics['virtual_stages']}, m={metrics['microbatches']}, "
             f"{metrics['layer_ms']:g} ms per layer forward: bubble {metrics['bubble']:.3f} "
             f"measured, {metrics['bubble_formula']:.3f} formula (F = forward, B = backward "
             f"hatched, number = micro-batch, s = stage)")
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
    save(fig, path, dpi=120)


def draw_sweep(sweep: dict, path: Path):
    """One row of panels per pipeline size p. Left: measured bubble per schedule vs the formulas.
    Right: activation memory held by rank 0."""
    rows = [r for r in sweep["runs"] if "skipped" not in r]
    title = (f"{sweep['layers']} layers, {sweep['layer_ms']:g} ms per layer forward (x2 "
             f"backward); torch {sweep['torch_version']}, {sweep['device']}, {sweep['backend']}")
    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(len(ps), 2, figsize=(12, 4.2 * len(ps)), squeeze=False)
    markers = {"gpipe": "o", "1f1b": "s", "interleaved": "^", "zb1p": "D", "zbv": "v"}
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
                title=f"activation memory, p = {p}, {sweep['rows_per_microbatch']} rows per "
                      "micro-batch")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save(fig, path, dpi=110)


def save(fig, path: Path, dpi: int):
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("json_in", type=Path, help="pipeline_parallel.py --metrics-out or "
                                              "pipeline_sweep.py --json-out")
    p.add_argument("png_out", type=Path)
    args = p.parse_args(argv)
    try:
        data = json.loads(args.json_in.read_text())
    except (OSError, ValueError) as exc:
        cli.fail(f"{args.json_in}: not a readable JSON file ({exc})")
    if "runs" in data:
        draw_sweep(data, args.png_out)
    else:
        draw_timeline(data, args.png_out)
    print(f"wrote {args.png_out}")


if __name__ == "__main__":
    main()
