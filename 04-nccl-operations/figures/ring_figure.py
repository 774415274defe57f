"""Draw the ring all-reduce, step by step, from the trace that ring_allreduce.py writes:

    torchrun --nproc_per_node=4 04-nccl-operations/ring_allreduce.py --trace-out runs/ring.json
    python 04-nccl-operations/figures/ring_figure.py runs/ring.json runs/ring.png

A grid: one row per step (the start, then the n-1 reduce-scatter and n-1 all-gather steps), one
column per rank. A cell shows the rank's n chunks; each chunk is a stack of n stripes, one per rank,
coloured where that rank's input is summed into the chunk (so a chunk fills up as the
reduce-scatter goes round, and a full chunk is copied whole in the all-gather), with the letters of
those inputs on it. The chunk the rank sends at that step has a thick black frame and the one it
receives a dashed one; the line under the cell names both peers.
"""

import json
from pathlib import Path

import matplotlib

from dtcourse import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.patches import Rectangle  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def draw(trace: dict, path: Path) -> None:
    n, rows = trace["world_size"], trace["steps"]
    colors = [plt.get_cmap("tab10")(k % 10) for k in range(n)]
    cell_w, cell_h = n + 1.2, 2.3  # a cell: n chunks of width 1 and a gap; chunks 1.2 high
    inch = 0.55  # per unit of the grid: a chunk is 1 wide
    fig, ax = plt.subplots(figsize=(inch * (n * cell_w + 2.6), inch * (len(rows) * cell_h + 2.6)))
    for i, row in enumerate(rows):
        y = -i * cell_h
        label = "start" if row["step"] is None else f"{row['phase']}\nstep s = {row['step']}"
        ax.text(-0.6, y + 0.6, label, ha="right", va="center", fontsize=9)
        for rank, cell in enumerate(row["ranks"]):
            x0 = rank * cell_w
            sent = cell["send"]["chunk"] if cell["send"] else None
            got = cell["recv"]["chunk"] if cell["recv"] else None
            for c, ranks in enumerate(cell["chunks"]):
                draw_chunk(ax, x0 + c, y, ranks or [], colors, n, c == sent, c == got)
                ax.text(x0 + c + 0.5, y + 1.32, f"c{c}", ha="center", va="bottom", fontsize=6,
                        color="dimgray")
            if cell["send"]:
                ax.text(x0 + n / 2, y - 0.12,
                        f"c{sent} -> rank {cell['send']['to']}   "
                        f"c{got} <- rank {cell['recv']['from']}",
                        ha="center", va="top", fontsize=7)
    for rank in range(n):
        ax.text(rank * cell_w + n / 2, 1.95, f"rank {rank}", ha="center", va="bottom",
                fontsize=10, weight="bold")
    handles = [Rectangle((0, 0), 1, 1, color=colors[k]) for k in range(n)]
    ax.legend(handles, [f"{LETTERS[k]}: input of rank {k}" for k in range(n)], ncol=n,
              loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8, frameon=False)
    ax.set_xlim(-2.6, n * cell_w - 1.0)
    ax.set_ylim(-(len(rows) - 1) * cell_h - 0.7, 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"ring all-reduce of {trace['numel']} elements on {n} ranks "
                 f"(chunks of {', '.join(map(str, trace['chunk_sizes']))}), as ring_allreduce.py "
                 f"ran it: {trace['backend']}, torch {trace['torch_version']}\n"
                 "a chunk's stripes: whose inputs it sums; thick frame: sent this step; "
                 "dashed: received (added in the reduce-scatter, copied in the all-gather)",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_chunk(ax, x, y, ranks, colors, n, sent: bool, received: bool) -> None:
    """One chunk at (x, y): n stripes, stripe k coloured if rank k's input is in it."""
    stripe = 1.2 / n
    for k in range(n):
        ax.add_patch(Rectangle((x + 0.06, y + k * stripe), 0.88, stripe, linewidth=0,
                               facecolor=colors[k] if k in ranks else "white"))
    frame = {"linewidth": 2.6, "edgecolor": "black"} if sent else \
        {"linewidth": 1.6, "edgecolor": "black", "linestyle": (0, (2, 1.5))} if received else \
        {"linewidth": 0.5, "edgecolor": "gray"}
    ax.add_patch(Rectangle((x + 0.06, y), 0.88, 1.2, facecolor="none", **frame))
    text = "".join(LETTERS[k] for k in ranks) or "-"  # a rank added twice would show twice
    ax.text(x + 0.5, y + 0.6, text, ha="center", va="center", fontsize=7 if n <= 4 else 5,
            bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.8,
                  "linewidth": 0})


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("json_in", type=Path, help="ring_allreduce.py --trace-out")
    p.add_argument("png_out", type=Path)
    args = p.parse_args(argv)
    try:
        trace = json.loads(args.json_in.read_text())
        trace["steps"], trace["world_size"]
    except (OSError, ValueError, KeyError) as exc:
        cli.fail(f"{args.json_in}: not a trace written by ring_allreduce.py --trace-out ({exc})")
    draw(trace, args.png_out)
    print(f"wrote {args.png_out}")


if __name__ == "__main__":
    main()
