"""Draw the figures of the data-parallel techniques lesson from the --metrics-out JSON its scripts
write (the plots are not part of the lessons, so they live here):

    python 05-advanced/c-data-parallel-techniques/figures/dp_figures.py runs/dp_overlap.json
    python 05-advanced/c-data-parallel-techniques/figures/dp_figures.py runs/dp_compression.json \\
        --out 05-advanced/c-data-parallel-techniques/figures/dp_compression.png

communication_overlap.py   step time of every row beside the no-communication step, bucket sweep
gradient_compression.py    loss curves per method, compression ratio per method
data_loading.py            fraction of the step spent waiting for data, per loader setting

The script that wrote the JSON (its "script" field) decides the figure; --out defaults to the JSON's
path with .png.
"""

import json
from pathlib import Path

from dtcourse import cli

VARIANTS = ("naive", "flat", "overlap", "bucketed", "ddp")


def plot_overlap(m: dict, plt):
    rows, world = m["variants"], m["world_size"]
    compute = rows[0]["compute_step_time_s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    # Every row as measured: a step faster than the no-communication step (negative exposed
    # time) is drawn below the dashed line, not clipped to it; it is noise of the medians.
    names = [r["variant"] if r["bucket_cap_mb"] is None
             else f"{r['variant']} {r['bucket_cap_mb']:g}" for r in rows]
    times = [r["step_time_s"] * 1e3 for r in rows]
    colors = ["tab:red" if r["exposed_comm_s"] > 0 else "tab:blue" for r in rows]
    ax1.bar(range(len(rows)), times, color=colors)
    ax1.set_xticks(range(len(rows)), names, fontsize=7, rotation=40, ha="right")
    for i, r in enumerate(rows):
        ax1.annotate(f"{r['exposed_comm_s'] * 1e3:+.0f}", (i, times[i]), ha="center",
                     va="bottom", fontsize=7)
    ax1.axhline(compute * 1e3, color="tab:gray", linestyle="--",
                label="compute only (no communication)")
    ax1.set_ylabel("step time, ms (median)")
    ax1.set_xlabel("variant, bucket MB (labels: exposed communication, ms; blue: below compute)",
                   fontsize=8)
    ax1.set_title(f"gradient synchronisation at world {world}, one run")
    ax1.legend(fontsize=8)
    for variant, marker in (("bucketed", "o"), ("ddp", "s")):
        sweep = sorted((r for r in rows if r["variant"] == variant),
                       key=lambda r: r["bucket_cap_mb"])
        if sweep:
            ax2.plot([r["bucket_cap_mb"] for r in sweep],
                     [r["step_time_s"] * 1e3 for r in sweep], marker=marker, label=variant)
            for r in sweep:
                ax2.annotate(f"{r['collectives']:g}", (r["bucket_cap_mb"], r["step_time_s"] * 1e3),
                             textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax2.axhline(compute * 1e3, color="tab:gray", linestyle="--", label="compute only")
    ax2.set_xscale("log")
    ax2.set_xlabel("bucket size, MB (labels: collectives per step)")
    ax2.set_ylabel("step time, ms (median)")
    ax2.set_title("bucket-size sweep")
    ax2.legend(fontsize=8)
    return fig


def plot_compression(m: dict, plt):
    rows, world = m["methods"], m["world_size"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        ax1.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["method"])
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (global batch)")
    ax1.set_title(f"loss with compressed gradients, world {world}")
    ax1.legend(fontsize=8)
    ax2.bar([r["method"] for r in rows], [r["compression_ratio"] for r in rows], color="tab:blue")
    ax2.set_yscale("log")
    ax2.set_ylabel("compression ratio (dense bytes / bytes sent)")
    for i, r in enumerate(rows):
        ax2.annotate(f"{r['compression_ratio']:.0f}x\nloss {r['final_loss']:.3f}",
                     (i, r["compression_ratio"]), ha="center", va="bottom", fontsize=7)
    ax2.set_title("bytes sent per step; loss over the last 5 steps")
    return fig


def plot_data_loading(m: dict, plt):
    rows, world = m["settings"], m["world_size"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["setting"] for r in rows], [r["data_wait_fraction"] for r in rows],
            color="tab:orange")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['data_wait_fraction']:.0%}", (r["data_wait_fraction"], i),
                    xytext=(3, -3), textcoords="offset points", fontsize=8)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of step time waiting for the next batch")
    ax.set_title(f"data loading at world {world} (first batch excluded)")
    return fig


PLOTS = {"communication_overlap.py": plot_overlap, "gradient_compression.py": plot_compression,
         "data_loading.py": plot_data_loading}


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("metrics", type=Path, help="--metrics-out JSON of one of the scripts above")
    p.add_argument("--out", type=Path, help="the PNG (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    m = json.loads(args.metrics.read_text())
    name = Path(m.get("script", "")).name
    if name not in PLOTS:
        cli.fail(f"{args.metrics} was written by {m.get('script')!r}, not one of "
                f"{', '.join(PLOTS)}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = PLOTS[name](m, plt)
    fig.tight_layout()
    out = args.out or args.metrics.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
