"""Measure and plot the two figures of 05-advanced/a-tensor-sequence-hybrid/README.md.

    python 05-advanced/a-tensor-sequence-hybrid/figures/tp_figures.py   # ~15 min on a 2-core CPU
    python 05-advanced/a-tensor-sequence-hybrid/figures/tp_figures.py --from-json  # replot only

1. tp_step_time.png: median time per training step of tensor_parallel.py at world 2, hand-written
   layers vs DTensor, with and without sequence parallelism, at two model sizes. Each variant runs
   --repeats times, interleaved, so that a busy machine slows all of them alike; the README quotes
   the median over repeats of the per-repeat ratio DTensor / manual.
2. tp_bytes_tp_vs_dp.png: bytes one rank sends per step, measured by hybrid_parallelism.py's
   counter, for the same model and global batch split two ways at world 2: --tp 2 (activations,
   grows with batch x sequence) and --dp 2 (FSDP: parameters, independent of the batch). TP's
   bytes are proportional to the tokens of the step, so its line is drawn through many points
   (a straight segment between two measured points would bend it on the log axis) and the
   crossings printed are where that line meets FSDP's and DDP's.

Like the benchmarks, this launches the lesson scripts as subprocesses and reads their
--metrics-out JSON; the raw numbers go to tp_figures.json beside the plots.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LESSON = "05-advanced/a-tensor-sequence-hybrid"
SIZES = {"default": [], "wider": ["--dim", "256", "--heads", "8", "--seq-len", "64"]}
VARIANTS = {"manual": ["--impl", "manual"], "dtensor": ["--impl", "dtensor"],
            "manual + SP": ["--impl", "manual", "--sequence-parallel"],
            "dtensor + SP": ["--impl", "dtensor", "--sequence-parallel"]}


def run(script: str, nproc: int, args: list, metrics: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(REPO / script), *args,
           "--metrics-out", str(metrics)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, text=True)
    return json.loads(metrics.read_text())


def step_times(repeats: int, steps: int, tmp: Path) -> dict:
    out = {size: {v: [] for v in VARIANTS} for size in SIZES}
    for rep in range(repeats):
        for size, size_args in SIZES.items():
            for name, flags in VARIANTS.items():
                m = run(f"{LESSON}/tensor_parallel.py", 2,
                        ["--steps", str(steps), *flags, *size_args], tmp / "m.json")
                out[size][name].append(m["median_step_ms"])
                print(f"repeat {rep + 1}/{repeats} | {size:<7} | {name:<12} | "
                      f"{m['median_step_ms']:7.1f} ms/step", flush=True)
    return out


def traffic(batches: list, tmp: Path) -> dict:
    out = {"global_batch": batches, "tp": [], "dp": [], "param_count": None}
    for g in batches:
        tp = run(f"{LESSON}/hybrid_parallelism.py", 2,
                 ["--steps", "3", "--tp", "2", "--batch-size", str(g)], tmp / "m.json")
        dp = run(f"{LESSON}/hybrid_parallelism.py", 2,
                 ["--steps", "3", "--dp", "2", "--batch-size", str(g // 2)], tmp / "m.json")
        out["tp"].append(sum(tp["per_rank"][0]["comm_bytes"].values()))
        out["dp"].append(sum(dp["per_rank"][0]["comm_bytes"].values()))
        # Parameters of the whole model: the FSDP shards of both ranks together (fp32).
        out["param_count"] = sum(r["param_bytes"] for r in dp["per_rank"]) // 4
        out["torch_version"] = dp["torch_version"]
        print(f"global batch {g:3d} | tp 2: {out['tp'][-1]:>9} B | dp 2: {out['dp'][-1]:>9} B",
              flush=True)
    return out


def plot(times: dict, bytes_: dict, seq_len: int) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {size: statistics.median(d / m for d, m in zip(t["dtensor"], t["manual"]))
              for size, t in times.items()}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.2
    for k, name in enumerate(VARIANTS):
        med = [statistics.median(times[size][name]) for size in SIZES]
        xs = [i + (k - 1.5) * width for i in range(len(SIZES))]
        ax.bar(xs, med, width, label=name)
    ax.set_xticks(range(len(SIZES)),
                  [f"{size}\n(dtensor/manual = {ratios[size]:.2f}x)" for size in SIZES])
    ax.set_ylabel("median ms per step")
    ax.set_title("tensor_parallel.py, tp 2, 2-core CPU (shared), gloo")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "tp_step_time.png", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    tokens = [g * seq_len for g in bytes_["global_batch"]]
    per_token = {b / n for b, n in zip(bytes_["tp"], tokens)}
    assert len(per_token) == 1, f"TP bytes not proportional to tokens: {bytes_['tp']}"
    per_token = per_token.pop()
    fsdp = statistics.median(bytes_["dp"])
    ddp = 2 * (2 - 1) / 2 * 4 * bytes_["param_count"]
    # TP's bytes grow linearly with tokens: drawn through 200 points, so that on the log axis the
    # line is the curve it is, not straight segments between the three measured points.
    lo, hi = tokens[0] / 2, tokens[-1] * 2
    dense = [lo * (hi / lo) ** (k / 199) for k in range(200)]
    ax.plot(dense, [per_token * n / 1e6 for n in dense], "-", color="C0",
            label=f"tensor parallel, t = 2: {per_token:.0f} B per token")
    ax.plot(tokens, [b / 1e6 for b in bytes_["tp"]], "o", color="C0", label="measured")
    ax.axhline(fsdp / 1e6, color="C1", label="FSDP, d = 2 (3(d-1)/d x 4P)")
    ax.plot(tokens, [b / 1e6 for b in bytes_["dp"]], "s", color="C1", label="measured")
    ax.axhline(ddp / 1e6, color="grey", ls=":", label="DDP formula 2(d-1)/d x 4P")
    crossings = {"ddp": ddp / per_token, "fsdp": fsdp / per_token}
    for name, x in crossings.items():
        ax.axvline(x, color="grey", lw=0.6, ls="--")
        ax.annotate(f"{x:.0f}", (x, per_token * x / 1e6),
                    xytext=(4, -12), textcoords="offset points", fontsize=8)
        print(f"TP's line crosses {name.upper()}'s at {x:.1f} tokens ({x / seq_len:.2f} "
              f"sequences of {seq_len})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (global batch x sequence)")
    ax.set_ylabel("MB one rank sends per step")
    ax.set_title("Same model, same batch: TP moves activations, DP moves parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "tp_bytes_tp_vs_dp.png", dpi=120)
    return ratios, crossings


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--from-json", action="store_true",
                   help="measure nothing: redraw both plots from the numbers in tp_figures.json")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads((HERE / "tp_figures.json").read_text())
        plot(saved["step_ms"], saved["traffic"], seq_len=16)
        return
    with tempfile.TemporaryDirectory() as tmp:
        times = step_times(args.repeats, args.steps, Path(tmp))
        bytes_ = traffic(args.batches, Path(tmp))
    ratios, crossings = plot(times, bytes_, seq_len=16)
    result = {"step_ms": times, "dtensor_over_manual": ratios, "traffic": bytes_,
              "tp_crossing_tokens": crossings,
              "machine": "2-core AMD EPYC CPU (shared), gloo", "python": sys.version.split()[0]}
    (HERE / "tp_figures.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"dtensor_over_manual": ratios}, indent=1))


if __name__ == "__main__":
    main()
