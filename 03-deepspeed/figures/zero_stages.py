"""Measure what the ZeRO stages cost: every config of 03-deepspeed/configs at world 2, for the
bytes-per-rank and throughput tables of 03-deepspeed/README.md.

    python 03-deepspeed/figures/zero_stages.py        # about 10 minutes on a shared 2-core CPU

Each config trains deepspeed_train.py for --steps steps (--grad-accum 2, so stage 1's and stage
2's gradient footprints between micro-steps show), --repeats times, interleaved: repeat 1 of every
config, then repeat 2, ..., so that a busy spell of a shared machine slows all configs alike. The
script reads each run's --metrics-out and writes the raw numbers to zero_stages_world2_cpu.json
beside it, then prints the tables: medians over repeats, and ratios to zero0 within each repeat.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIGS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
COMMAND = ("deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py --deepspeed_config "
           "03-deepspeed/configs/{config}_config.json --steps {steps} --grad-accum 2 "
           "--metrics-out {metrics}")


def run(config: str, steps: int, metrics: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = COMMAND.format(config=config, steps=steps, metrics=metrics).split()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, text=True)
    return json.loads(metrics.read_text())


def machine() -> str:
    model = platform.processor() or "CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import deepspeed
    import torch
    return (f"{os.cpu_count()}-core {model} CPU (shared with other jobs), torch "
            f"{torch.__version__.split('+')[0]}, deepspeed {deepspeed.__version__}, gloo, fp32")


def sweep(args) -> dict:
    out = {"what": f"deepspeed_train.py at world 2, every config, {args.repeats} interleaved "
                   "repeats (rep 1 of all configs, then rep 2, ...)",
           "command": COMMAND.format(config="<config>", steps=args.steps,
                                     metrics="<config>_rep<r>.json"),
           "machine": machine(), "configs": {c: {"samples_per_s": [],
                                                 "cpu_s_per_step_mean_over_ranks": [],
                                                 "final_loss": []} for c in CONFIGS}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for config in CONFIGS:
                m = run(config, args.steps, Path(tmp) / "m.json")
                row = out["configs"][config]
                row["samples_per_s"].append(round(m["samples_per_s"], 1))
                row["cpu_s_per_step_mean_over_ranks"].append(
                    round(statistics.mean(r["cpu_s_per_step"] for r in m["per_rank"]), 5))
                row["final_loss"].append(m["losses"][-1])
                row["per_rank"] = m["per_rank"]
                out.update(n_params=m["n_params"], global_batch=m["global_batch"])
                print(f"repeat {rep + 1}/{args.repeats} | {config:<14} | "
                      f"{m['samples_per_s']:7.1f} samples/s", flush=True)
    return out


def tables(data: dict) -> None:
    """The README's two tables, from the JSON."""
    P = data["n_params"]
    print(f"\nbytes per rank (P = {P:,}, world 2, fp32, --grad-accum 2), rank 0 / rank 1:")
    print(f"{'config':<15}{'weights':>10}{'grads per micro-step':>26}{'master':>10}"
          f"{'moments':>10}{'host':>10}{'total':>12}")
    for config, row in data["configs"].items():
        for rank, r in enumerate(row["per_rank"]):
            moments = r["optim_bytes"] - r["master_bytes"]
            total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            grads = " -> ".join(f"{g:,}" for g in r["grad_bytes_per_micro_step"])
            print(f"{config if rank == 0 else '':<15}{r['param_bytes']:>10,}{grads:>26}"
                  f"{r['master_bytes']:>10,}{moments:>10,}{r['host_bytes']:>10,}{total:>12,}")
    base = data["configs"]["zero0"]
    med = {c: statistics.median(r["samples_per_s"]) for c, r in data["configs"].items()}
    cpu = {c: statistics.median(r["cpu_s_per_step_mean_over_ranks"]) * 1e3
           for c, r in data["configs"].items()}
    print(f"\n{'config':<15}{'samples/s (median)':>20}{'vs zero0 (per-repeat range)':>30}"
          f"{'CPU ms/step/rank':>18}{'vs zero0':>10}")
    for config, row in data["configs"].items():
        ratios = [a / b for a, b in zip(row["samples_per_s"], base["samples_per_s"])]
        print(f"{config:<15}{med[config]:>20.0f}"
              f"{med[config] / med['zero0']:>18.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
              f"{cpu[config]:>18.1f}{cpu[config] / cpu['zero0']:>10.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", type=Path, default=HERE / "zero_stages_world2_cpu.json")
    p.add_argument("--tables-only", action="store_true",
                   help="print the tables of an existing --json-out without running anything")
    args = p.parse_args(argv)
    if args.tables_only:
        data = json.loads(args.json_out.read_text())
    else:
        data = sweep(args)
        args.json_out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json_out.relative_to(REPO)}", file=sys.stderr)
    tables(data)


if __name__ == "__main__":
    main()
