r"""The course's benchmark suite: collective bandwidth, training throughput and scaling, and
per-rank memory beside memory_estimator.py. It launches the lesson scripts as subprocesses
(torchrun), never imports them, and writes one JSON and one PNG per subcommand.

Launch (from the repository root):
    python benchmarks/distributed_benchmarks.py comm --quick --out runs/bench-quick
    python benchmarks/distributed_benchmarks.py train --quick --out runs/bench-quick
    python benchmarks/distributed_benchmarks.py memory --quick --out runs/bench-quick \
        --from runs/bench-quick/train.json          # the train runs' bytes: no new launch
    python benchmarks/distributed_benchmarks.py comm --out benchmarks/results   # the sample run
    python benchmarks/distributed_benchmarks.py train --layers 4 --dim 128 --heads 8 \
        --out benchmarks/results
    python benchmarks/distributed_benchmarks.py memory --out benchmarks/results
    python benchmarks/distributed_benchmarks.py train --device cuda --worlds 1 --precision bf16 \
        --layers 12 --dim 768 --heads 12 --batch-size 16 --steps 30

What each subcommand launches (torchrun --nproc_per_node=W for every world size W):
    comm    04-nccl-operations/bandwidth_test.py: algbw and busbw per op and message size
    train   02-fsdp/fsdp_transformer.py (ddp and fsdp-* strategies, in one launch) and
            03-deepspeed/deepspeed_train.py (one launch per zero* config), which train the same
            GPT (dtcourse.models.GPT) from the same flags, with the same batch per rank: tokens/s
            and scaling efficiency
            tokens/s(W) / (W x tokens/s(1)), per-rank bytes
    memory  the same scripts at one world size: each rank's measured `per_rank` bytes beside
            memory_estimator.py's prediction (exact, from the parameter shapes of the GPT
            itself, built on the meta device) and the paper's formula
"""

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from dtcourse.cli import add_gpt_args, check_gpt_args, fail
from dtcourse.models import GPT
from dtcourse.report import write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_estimator as me  # noqa: E402 - the estimator beside this file

REPO = Path(__file__).resolve().parents[1]
FSDP_SCRIPT = "02-fsdp/fsdp_transformer.py"
DS_SCRIPT = "03-deepspeed/deepspeed_train.py"
BW_SCRIPT = "04-nccl-operations/bandwidth_test.py"

# Estimator strategy -> (lesson script, what selects it there)
LESSON = {
    "ddp": (FSDP_SCRIPT, "ddp"), "fsdp-full": (FSDP_SCRIPT, "full"),
    "fsdp-grad-op": (FSDP_SCRIPT, "grad-op"), "fsdp-hybrid": (FSDP_SCRIPT, "hybrid"),
    "zero1": (DS_SCRIPT, "zero1_config.json"), "zero2": (DS_SCRIPT, "zero2_config.json"),
    "zero3": (DS_SCRIPT, "zero3_config.json"),
    "zero2-offload": (DS_SCRIPT, "zero2_offload_config.json"),
    "zero3-offload": (DS_SCRIPT, "zero3_offload_config.json"),
}
GPT_FLAGS = ("layers", "dim", "heads", "seq_len", "vocab")  # the shared GPT's shape
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")


# --------------------------------------------------------------------------------------------------
# Arguments


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 1,2,4")
    if not values or min(values) < 1:
        fail(f"{flag} {text!r}: world sizes must be at least 1")
    return values


def name_list(text: str, allowed, flag: str) -> list[str]:
    """'ddp,zero3' -> ['ddp', 'zero3'], every name one of `allowed`."""
    names = [part.strip() for part in text.split(",")]
    bad = [name for name in names if name not in allowed] if text.strip() else ["(nothing)"]
    if bad:
        fail(f"{flag} {text!r}: {', '.join(bad)} not among {', '.join(allowed)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.error = fail
    sub = p.add_subparsers(dest="command", metavar="{comm,train,memory}")
    sub.required = True

    def common(sp):
        sp.error = fail
        sp.add_argument("--quick", action="store_true", help="a small run that tests can afford")
        sp.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="passed to the lesson scripts (auto: CUDA when available)")
        sp.add_argument("--out", type=Path, default=Path("runs/benchmarks"),
                        help="folder for <command>.json and <command>.png")
        sp.add_argument("--timeout-s", type=float, default=900, help="limit for one launch")
        return sp

    c = common(sub.add_parser("comm", help="busbw vs message size per op and world size",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    c.add_argument("--worlds", default="2,4", help="world sizes (quick: 2)")
    c.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast",
                   help="subset of " + ",".join(OPS) + " (quick: all_reduce,all_gather)")
    c.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="message sizes (quick: 4K,256K)")
    c.add_argument("--iters", type=int, default=10, help="timed iterations per row (quick: 3)")
    c.add_argument("--warmup", type=int, default=2, help="untimed iterations (quick: 1)")

    def model(sp, steps, accum):
        add_gpt_args(sp, layers=2, dim=64, heads=4, seq_len=32, vocab=64)
        sp.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
        sp.add_argument("--steps", type=int, default=steps, help="optimizer steps per launch")
        sp.add_argument("--grad-accum", type=int, default=accum, help="micro-steps per step")
        sp.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: FSDP MixedPrecisionPolicy / DDP autocast / DeepSpeed bf16")
        sp.add_argument("--shard-size", type=int, default=2, help="fsdp-hybrid: ranks per group")

    t = common(sub.add_parser("train", help="tokens/s and scaling efficiency per strategy",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    t.add_argument("--worlds", default="1,2,4", help="world sizes; 1 is needed for efficiency "
                   "(quick: 1,2)")
    t.add_argument("--strategies", default="ddp,fsdp-full,zero2,zero3",
                   help="any of " + ",".join(LESSON))
    t.add_argument("--repeats", type=int, default=3, help="launches per point, interleaved; "
                   "medians are reported (quick: 1)")
    model(t, steps=30, accum=1)
    t.set_defaults(quick_steps=4)

    m = common(sub.add_parser("memory", help="measured per-rank bytes vs memory_estimator.py",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    m.add_argument("--world", type=int, default=2, help="world size")
    m.add_argument("--strategies", help="any of " + ",".join(LESSON) + " (default: all that "
                   "run at this world size; quick: ddp,fsdp-full,zero2,zero3)")
    m.add_argument("--from", dest="from_json", type=Path,
                   help="reuse the runs of a `train` JSON at --world instead of launching")
    model(m, steps=2, accum=2)  # accum 2: stage 1 holds full gradients between micro-steps
    m.set_defaults(quick_steps=2)

    args = p.parse_args(argv)
    return validate(args)


def validate(args):
    if args.timeout_s <= 0:
        fail(f"--timeout-s must be positive, got {args.timeout_s}")
    if args.command == "comm":
        if args.quick:
            args.worlds, args.ops, args.sizes = "2", "all_reduce,all_gather", "4K,256K"
            args.iters, args.warmup = 3, 1
        args.world_list = int_list(args.worlds, "--worlds")
        args.op_list = name_list(args.ops, OPS, "--ops")
        if args.iters < 1 or args.warmup < 0:
            fail(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
        return args
    for name in ("batch_size", "steps", "grad_accum", "shard_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    check_gpt_args(args)
    if args.command == "train":
        if args.quick:
            args.worlds, args.repeats, args.steps = "1,2", 1, args.quick_steps
        args.world_list = int_list(args.worlds, "--worlds")
        args.strategy_list = name_list(args.strategies, list(LESSON), "--strategies")
        if args.repeats < 1:
            fail(f"--repeats must be at least 1, got {args.repeats}")
        if args.steps < 3:
            # fsdp_transformer.py times steps 2 .. S-1: step 1 warms up, the last runs under the
            # collective counter.
            fail(f"--steps must be at least 3 (the first step warms up and the FSDP runs' last "
                 f"step is counted, so neither is timed), got {args.steps}")
        worlds = args.world_list
    else:
        if args.world < 1:
            fail(f"--world must be at least 1, got {args.world}")
        default = ("ddp,fsdp-full,zero2,zero3" if args.quick else
                   ",".join(s for s in LESSON if s != "fsdp-hybrid" or args.world >= 4))
        args.strategy_list = name_list(args.strategies or default, list(LESSON), "--strategies")
        if args.quick:
            args.steps = args.quick_steps
        if args.from_json is not None and not args.from_json.is_file():
            fail(f"--from {args.from_json}: no such file (run the `train` subcommand first)")
        worlds = [args.world]
    if "fsdp-hybrid" in args.strategy_list and any(w % args.shard_size for w in worlds):
        fail(f"fsdp-hybrid needs every world size ({worlds}) to be a multiple of --shard-size "
             f"{args.shard_size}")
    return args


# --------------------------------------------------------------------------------------------------
# Machine and launches


def machine_info() -> dict:
    """What the numbers were measured on: CPU, cores, GPUs, versions, load at the start."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), None)
    except OSError:
        pass
    gpus = []
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             check=False).stdout
        gpus = [line.strip() for line in out.splitlines() if line.strip()]

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "cpu": cpu or platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(),
            "gpus": gpus, "platform": platform.platform(), "python": platform.python_version(),
            "torch": version("torch"), "deepspeed": version("deepspeed"),
            "load_average_1m_at_start": round(os.getloadavg()[0], 2),
            "omp_num_threads_per_rank": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str, args: list, timeout_s: float, tag: str) -> dict:
    """Run `torchrun --nproc_per_node=nproc script args` from the repository root, with a fresh
    port and one OMP thread per rank; return {command, seconds}. Fails (exit 1) with the tail of
    its output when the launch fails or exceeds timeout_s (its whole process group is killed)."""
    launcher = ["torchrun"] if shutil.which("torchrun") else \
        [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", script, *map(str, args)]
    # An outer launcher's variables (or the README runner's PET_MASTER_PORT) must not leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")  # fixed resources per rank: scaling is comparable
    print(f"[{tag}] {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()  # host clock: a launch's wall time, start to exit
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        print(out[-3000:], file=sys.stderr)
        print(f"error: timed out after {timeout_s:.0f} s: {shlex.join(cmd)}", file=sys.stderr)
        sys.exit(1)
    if proc.returncode != 0:
        print(out[-3000:], file=sys.stderr)
        print(f"error: exit status {proc.returncode}: {shlex.join(cmd)}", file=sys.stderr)
        sys.exit(1)
    seconds = time.perf_counter() - t0  # host clock: as above
    print(f"[{tag}]   done in {seconds:.1f} s", flush=True)
    return {"command": shlex.join(cmd), "seconds": round(seconds, 2)}


def write_outputs(out_dir: Path, name: str, result: dict, fig) -> None:
    """<out>/<name>.json and <out>/<name>.png, each written to a temporary name and renamed."""
    path = out_dir / f"{name}.json"
    write_json(path, result)
    tmp_png = out_dir / f".{name}.png.tmp"
    fig.savefig(tmp_png, format="png", dpi=80, bbox_inches="tight")
    os.replace(tmp_png, out_dir / f"{name}.png")
    print(f"wrote {path} and {out_dir / f'{name}.png'}", flush=True)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def backend_of(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


# --------------------------------------------------------------------------------------------------
# comm: 04-nccl-operations/bandwidth_test.py at each world size


def run_comm(args) -> None:
    machine, rows, launches = machine_info(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_list:
            path = Path(tmp) / f"bw_{world}.json"
            launches.append(torchrun(
                world, BW_SCRIPT, ["--sizes", args.sizes, "--ops", ",".join(args.op_list),
                                   "--iters", args.iters, "--warmup", args.warmup,
                                   "--device", args.device, "--json-out", path],
                args.timeout_s, f"comm world {world}"))
            rows += json.loads(path.read_text())
    device = rows[0]["device"]
    print(f"\n{'op':15} {'world':>5} {'bytes':>10} {'time_us':>10} {'busbw_GBps':>11}")
    for r in rows:
        print(f"{r['op']:15} {r['world_size']:>5} {r['bytes']:>10} {r['time_us']:>10.1f} "
              f"{r['busbw_GBps']:>11.4f}")
    result = {"kind": "comm", "machine": machine, "device": device, "backend": rows[0]["backend"],
              "config": {k: getattr(args, k) for k in ("quick", "sizes", "iters", "warmup")}
              | {"worlds": args.world_list, "ops": args.op_list},
              "launches": launches, "rows": rows}

    plt = pyplot()
    cols = min(2, len(args.op_list))
    nrows = -(-len(args.op_list) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False,
                             layout="constrained")
    for ax, op in zip(axes.flat, args.op_list):
        for world in args.world_list:
            mine = [r for r in rows if r["op"] == op and r["world_size"] == world]
            ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o",
                    label=f"{world} ranks")
        ax.set_xscale("log", base=2)
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("message size (bytes)", fontsize=8)
        ax.set_ylabel("busbw (GB/s)", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(args.op_list):]:
        ax.axis("off")
    fig.suptitle(f"busbw, {device}, {result['backend']}: {machine['cpu']}", fontsize=9)
    write_outputs(args.out, "comm", result, fig)


# --------------------------------------------------------------------------------------------------
# The lessons' models: parameter shapes for the estimator, derived from the same flags


def gpt_shapes(args) -> list:
    """Parameter shapes of the GPT both lessons train at these flags, read off the model class
    itself (built on the meta device: shapes without memory), in parameter order."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    return [tuple(p.shape) for p in model.parameters()]


def lesson_args(strategy_names: list, world: int, args, metrics: Path) -> tuple[str, list]:
    """The script and flags that run these strategies (one fsdp launch, or one DeepSpeed config)
    on the shared model shape and per-rank batch."""
    script = LESSON[strategy_names[0]][0]
    shared = ["--layers", args.layers, "--dim", args.dim, "--heads", args.heads, "--seq-len",
              args.seq_len, "--vocab", args.vocab, "--batch-size", args.batch_size, "--steps",
              args.steps, "--grad-accum", args.grad_accum, "--device", args.device,
              "--metrics-out", metrics]
    if script == FSDP_SCRIPT:
        flags = ["--strategy", *[LESSON[s][1] for s in strategy_names],
                 "--mixed-precision", args.precision]
        if "fsdp-hybrid" in strategy_names:
            flags += ["--shard-size", args.shard_size]
    else:
        flags = ["--deepspeed_config", f"03-deepspeed/configs/{LESSON[strategy_names[0]][1]}",
                 "--precision", args.precision]
    return script, flags + shared


def launch_groups(strategies: list) -> list[list]:
    """FSDP strategies share one launch (fsdp_transformer.py trains them one after the other);
    every DeepSpeed config is a launch of its own."""
    fsdp = [s for s in strategies if LESSON[s][0] == FSDP_SCRIPT]
    return ([fsdp] if fsdp else []) + [[s] for s in strategies if LESSON[s][0] == DS_SCRIPT]


def run_lessons(strategies: list, world: int, args, tag: str, repeat: int = 0) -> list[dict]:
    """Launch the lesson scripts for these strategies at one world size; one record per
    strategy with its metrics (per_rank verbatim) and the command that produced them."""
    records = []
    groups = launch_groups(strategies)
    groups = groups[repeat % len(groups):] + groups[:repeat % len(groups)]  # rotate the order
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            path = Path(tmp) / "metrics.json"
            script, flags = lesson_args(group, world, args, path)
            launch = torchrun(world, script, flags, args.timeout_s,
                              f"{tag} world {world} | {' '.join(group)}")
            data = json.loads(path.read_text())
            for name in group:
                m = data["runs"][LESSON[name][1]] if "runs" in data else data
                records.append({
                    "strategy": name, "world_size": world, "repeat": repeat, "script": script,
                    "command": launch["command"], "launch_seconds": launch["seconds"],
                    "params": m.get("params", m.get("n_params")),
                    "param_tensors": m.get("param_tensors"), "device": m["device"],
                    "precision": m.get("precision", m.get("mixed_precision")),
                    "tokens_per_s": m["tokens_per_s"], "samples_per_s": m["samples_per_s"],
                    "final_loss": m["losses"][-1], "per_rank": m["per_rank"]})
    return records


# --------------------------------------------------------------------------------------------------
# train: throughput and scaling efficiency


def run_train(args) -> None:
    machine, records = machine_info(), []
    for repeat in range(args.repeats):
        # Interleave: every repeat visits every world size, in a rotated order, so slow spells
        # of a shared machine fall on different points each time.
        worlds = args.world_list[repeat % len(args.world_list):] + \
            args.world_list[:repeat % len(args.world_list)]
        for world in worlds:
            records += run_lessons(args.strategy_list, world, args,
                                   f"train repeat {repeat + 1}/{args.repeats}", repeat)
    summary = []
    for name in args.strategy_list:
        for world in args.world_list:
            mine = [r for r in records if r["strategy"] == name and r["world_size"] == world]
            tps = [r["tokens_per_s"] for r in mine]
            row = {"strategy": name, "world_size": world, "params": mine[0]["params"],
                   "tokens_per_s": tps, "tokens_per_s_median": statistics.median(tps),
                   "per_rank": mine[-1]["per_rank"], "scaling_efficiency": None,
                   "scaling_efficiency_per_repeat": None}
            if 1 in args.world_list and world > 1:
                # Ratio inside each repeat (the two launches ran close in time), then the median.
                base = {r["repeat"]: r["tokens_per_s"] for r in records
                        if r["strategy"] == name and r["world_size"] == 1}
                ratios = [r["tokens_per_s"] / (world * base[r["repeat"]]) for r in mine]
                row["scaling_efficiency_per_repeat"] = ratios
                row["scaling_efficiency"] = statistics.median(ratios)
            summary.append(row)
    device = records[0]["device"]
    result = {"kind": "train", "machine": machine, "device": device,
              "backend": backend_of(device),
              "config": {k: getattr(args, k) for k in GPT_FLAGS + ("quick", "batch_size", "steps",
                                                                   "grad_accum", "precision",
                                                                   "repeats", "shard_size")}
              | {"worlds": args.world_list, "strategies": args.strategy_list},
              "summary": summary, "runs": records}

    print(f"\n{'strategy':13} {'world':>5} {'tokens/s (median)':>18} {'scaling efficiency':>19} "
          f"{'rank-0 bytes held':>18}")
    for row in summary:
        held = sum(row["per_rank"][0][k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        eff = "-" if row["scaling_efficiency"] is None else f"{row['scaling_efficiency']:.2f}"
        print(f"{row['strategy']:13} {row['world_size']:>5} {row['tokens_per_s_median']:>18,.0f} "
              f"{eff:>19} {held:>18,}")

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name in args.strategy_list:
        rows = [r for r in summary if r["strategy"] == name]
        line, = ax1.plot([r["world_size"] for r in rows], [r["tokens_per_s_median"] for r in rows],
                         marker="o", label=name)
        one = next((r for r in rows if r["world_size"] == 1), None)
        if one:  # perfect scaling from this strategy's world-1 throughput
            ax1.plot([r["world_size"] for r in rows],
                     [r["world_size"] * one["tokens_per_s_median"] for r in rows],
                     linestyle=":", color=line.get_color())
    ax1.set_xlabel("world size (ranks)")
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput (dotted: perfect scaling)", fontsize=10)
    ax1.set_xticks(args.world_list)
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    scaled = [w for w in args.world_list if w > 1]
    width = 0.8 / max(1, len(args.strategy_list))
    for i, name in enumerate(args.strategy_list):
        effs = [next(r["scaling_efficiency"] or 0 for r in summary
                     if r["strategy"] == name and r["world_size"] == w) for w in scaled]
        ax2.bar([k + i * width for k in range(len(scaled))], effs, width, label=name)
    ax2.axhline(1.0, color="gray", linestyle=":")
    ax2.set_xticks([k + width * (len(args.strategy_list) - 1) / 2 for k in range(len(scaled))],
                   [f"world {w}" for w in scaled])
    ax2.set_ylabel("tokens/s(W) / (W x tokens/s(1))")
    ax2.set_title("scaling efficiency", fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(f"{args.layers} layers, dim {args.dim}, {args.batch_size} x {args.seq_len} "
                 f"tokens per rank, {args.precision}, {device}: {machine['cpu']}", fontsize=9)
    write_outputs(args.out, "train", result, fig)


# --------------------------------------------------------------------------------------------------
# memory: measured per-rank bytes beside the estimator


def measured_bytes(record: dict, held: dict) -> dict:
    """One rank's `per_rank` entry in the estimator's terms. DeepSpeed's grad_bytes is the most
    held during any micro-step; from stage 2 on the formula describes what it keeps after the
    last one (while accumulating, stage 2 keeps whole tensors that overlap its partition; with
    offload it keeps them in host buffers from step to step, which the estimator counts)."""
    grads = held["grad_bytes"]
    if record["script"] == DS_SCRIPT and record["strategy"] not in ("zero1",):
        grads = held["grad_bytes_per_micro_step"][-1]
    out = {"params_bytes": held["param_bytes"], "grads_bytes": grads,
           "optim_bytes": held["optim_bytes"], "host_bytes": held.get("host_bytes", 0)}
    out["held_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optim_bytes"]
    return out


def predicted_bytes(est: dict) -> dict:
    """An estimate in the same terms: each role's device + host bytes."""
    out = {k: est[k] + est["host"][k] for k in ("params_bytes", "grads_bytes", "optim_bytes")}
    out["host_bytes"] = est["host_bytes"]
    out["held_bytes"] = sum(out[k] for k in ("params_bytes", "grads_bytes", "optim_bytes"))
    return out


def compare_memory(record: dict, args) -> list[dict]:
    """Rows (one per rank): measured, the estimator's library accounting from the model's exact
    shapes, and the paper's formula from P alone."""
    shapes = gpt_shapes(args)
    P = sum(math.prod(s) for s in shapes)
    if P != record["params"] or record["param_tensors"] not in (None, len(shapes)):
        sys.exit(f"error: {record['script']} reports {record['params']:,} parameters in "
                 f"{record['param_tensors']} tensors, but dtcourse.models.GPT at these flags has "
                 f"{P:,} in {len(shapes)}: the lesson no longer trains the shared GPT")
    precision = "mixed" if record["precision"] == "bf16" else "fp32"
    rows = []
    for rank, held in enumerate(record["per_rank"]):
        kw = {"shard_size": args.shard_size if record["strategy"] == "fsdp-hybrid" else None,
              "rank": rank, "grad_accum": args.grad_accum}
        library = me.estimate(P, record["world_size"], record["strategy"], precision, "library",
                              shapes=shapes, **kw)
        paper = me.estimate(P, record["world_size"], record["strategy"], precision, "paper", **kw)
        measured = measured_bytes(record, held)
        rows.append({
            "strategy": record["strategy"], "world_size": record["world_size"], "rank": rank,
            "script": record["script"], "params": P, "param_tensors": len(shapes),
            "precision": precision, "measured": measured, "library": predicted_bytes(library),
            "paper": predicted_bytes(paper),
            "grads_bytes_max_over_micro_steps": held["grad_bytes"],
            "grads_bytes_per_micro_step": held.get("grad_bytes_per_micro_step")})
        row = rows[-1]
        row["library_minus_measured"] = row["library"]["held_bytes"] - measured["held_bytes"]
        row["paper_minus_measured"] = row["paper"]["held_bytes"] - measured["held_bytes"]
    return rows


def run_memory(args) -> None:
    machine = machine_info()
    if args.from_json:
        source = json.loads(args.from_json.read_text())
        if source.get("kind") != "train":
            fail(f"--from {args.from_json}: not a `train` result (kind {source.get('kind')!r})")
        # The model and batch of those runs: the estimator needs their shapes.
        for key in GPT_FLAGS + ("batch_size", "steps", "grad_accum", "precision", "shard_size"):
            setattr(args, key, source["config"][key])
        last = max(r["repeat"] for r in source["runs"])
        records = [r for r in source["runs"] if r["world_size"] == args.world
                   and r["repeat"] == last and r["strategy"] in args.strategy_list]
        missing = [s for s in args.strategy_list if s not in {r["strategy"] for r in records}]
        if missing:
            fail(f"--from {args.from_json} has no world-{args.world} run of {', '.join(missing)}"
                 " (pass --strategies to choose among its runs)")
    else:
        records = run_lessons(args.strategy_list, args.world, args, "memory")
    rows = [row for record in records for row in compare_memory(record, args)]
    device = records[0]["device"]
    result = {"kind": "memory", "machine": machine, "device": device,
              "backend": backend_of(device), "world_size": args.world,
              "source": str(args.from_json) if args.from_json else "launched",
              "config": {k: getattr(args, k) for k in GPT_FLAGS + ("quick", "batch_size", "steps",
                                                                   "grad_accum", "precision",
                                                                   "shard_size")}
              | {"strategies": args.strategy_list},
              "rows": rows, "runs": [{k: v for k, v in r.items() if k != "per_rank"}
                                     for r in records]}

    print(f"\nper-rank bytes at world {args.world} (params + grads + optimizer state, device and "
          f"host), measured by the lesson scripts vs memory_estimator.py:")
    print(f"{'strategy':14} {'rank':>4} {'P':>9} {'measured':>11} {'library':>11} "
          f"{'lib-meas':>9} {'paper':>11} {'paper-meas':>11} {'host (meas.)':>13}")
    for row in rows:
        print(f"{row['strategy']:14} {row['rank']:>4} {row['params']:>9,} "
              f"{row['measured']['held_bytes']:>11,} {row['library']['held_bytes']:>11,} "
              f"{row['library_minus_measured']:>9,} {row['paper']['held_bytes']:>11,} "
              f"{row['paper_minus_measured']:>11,} {row['measured']['host_bytes']:>13,}")

    plt = pyplot()
    rank0 = [r for r in rows if r["rank"] == 0]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rank0)), 3.4))
    for i, (key, label) in enumerate((("measured", "measured (lesson per_rank)"),
                                      ("library", "estimator, library accounting"),
                                      ("paper", "estimator, paper formula"))):
        ax.bar([k + (i - 1) * 0.27 for k in range(len(rank0))],
               [r[key]["held_bytes"] / 1e3 for r in rank0], 0.27, label=label)
    ax.set_xticks(range(len(rank0)), [r["strategy"] for r in rank0], rotation=20, fontsize=8)
    ax.set_ylabel("rank 0 holds (kB, device + host)")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"model states per rank at world {args.world}, {args.precision}, {device}",
                 fontsize=10)
    write_outputs(args.out, "memory", result, fig)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()  # host clock: the whole benchmark's wall time
    {"comm": run_comm, "train": run_train, "memory": run_memory}[args.command](args)
    print(f"{args.command}: {time.perf_counter() - t0:.0f} s", flush=True)  # host clock: as above


if __name__ == "__main__":
    main()
