"""One call on a GPU machine: install what the course needs beyond torch, run the GPU tier, and
write every figure it measured to one JSON file and one Markdown table.

    python benchmarks/gpu_check.py --wheels benchmarks/wheels --out gpu_check_out

It is made for a machine that has its own torch (say 2.11 on Python 3.12) and no package registry,
and it finishes in under 8 minutes: each part has a time budget, and a part that runs past it is
stopped and reported as such, with what it measured so far.

  1. install     deepspeed and fairscale (and their pure-Python dependencies) from the wheels in
                 --wheels, with pip --no-index (budget 90 s). Nothing is fetched.
  2. GPU tier    `python -m pytest -m gpu tests -n 0` (budget: what is left, at most 330 s), in
                 two parts: first the tests that measure the figures below (at most 150 s),
                 then the rest (each training script and README command on CUDA). Its
                 tests record their figures in a JSON-lines file (DTCOURSE_GPU_FIGURES): the GPU's
                 name, tokens/s and MFU of 02-fsdp/fsdp_transformer.py in bf16, a DDP run's peak
                 memory beside the memory estimator's prediction, one strategy's peak alone and
                 after another, HBM copy bandwidth, and each training script's timings on CUDA.
  3. report      gpu_check.json (every figure, every part's status and seconds, the versions)
                 and gpu_check.md (the same as a table).

Without a CUDA GPU it installs and runs nothing, and writes both files saying that it skipped.

Fetching the wheels (on a machine with a registry, for the GPU machine's Python 3.12):

    mkdir -p benchmarks/wheels
    # deepspeed and fairscale publish source distributions: build pure-Python wheels of the
    # versions the course runs (DeepSpeed compiles its CUDA ops just in time, on the GPU machine);
    # --no-build-isolation builds against the torch installed here instead of fetching one
    pip wheel --no-deps --no-build-isolation -w benchmarks/wheels \
        deepspeed==0.19.8 fairscale==0.4.13
    # their dependencies, as wheels for CPython 3.12 on x86-64 Linux (torch is the machine's own)
    pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d benchmarks/wheels \
        einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm

Do not fetch deepspeed with `pip download --only-binary=:all: ... deepspeed`: the only wheel on
the index is an old pre-release (0.3.1.dev5), which it takes without a word; fairscale has no
wheel at all. Copy the folder to the GPU machine with the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 480  # 8 minutes, the whole call
INSTALL_BUDGET_S = 90
TIER_BUDGET_S = 330  # of which the figures' tests first
FIGURES_BUDGET_S = 150
PACKAGES = ["deepspeed", "fairscale"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Fetching the wheels: see the top of this file.")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check",
                   help="folder for gpu_check.json and gpu_check.md (created)")
    p.add_argument("--wheels", type=Path, default=REPO / "benchmarks" / "wheels",
                   help="folder of wheels for deepspeed, fairscale and their dependencies")
    p.add_argument("--no-install", action="store_true",
                   help="use the deepspeed and fairscale already installed")
    p.add_argument("--tier-budget-s", type=float, default=TIER_BUDGET_S,
                   help=f"seconds for the GPU tier (default {TIER_BUDGET_S})")
    return p.parse_args(argv)


def versions() -> dict:
    import torch
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda}
    for name in PACKAGES:
        try:
            found[name] = __import__(name).__version__
        except Exception:  # not installed, or fails to import on this machine
            found[name] = None
    return found


def run_part(cmd: list, budget_s: float, env: dict | None = None) -> dict:
    """Run one part with a timeout; its status, seconds and the tail of its output."""
    start = time.monotonic()  # host clock: a part's wall time against its budget
    # its own session, so that a timeout stops the launched ranks too, not only the launcher
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=max(budget_s, 1))
        status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        # Ctrl-C first: pytest stops, and the suite's launch helper kills the process group of
        # the ranks it started (each launch runs in a session of its own, which a kill of this
        # group does not reach); then whatever is left of this group
        os.killpg(proc.pid, signal.SIGINT)
        try:
            text, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        status = f"timed out after {budget_s:.0f} s"
    return {"status": status, "seconds": round(time.monotonic() - start, 1),  # host clock: as above
            "output_tail": text[-4000:]}


def install(wheels: Path, budget_s: float) -> dict:
    if not wheels.is_dir():
        return {"status": f"skipped: no wheel folder {wheels}", "seconds": 0.0}
    return run_part([sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                     str(wheels), *PACKAGES], budget_s)


# The tests that measure the figures the check exists for: they run first, as a part of their own,
# so that a slow sweep of the training scripts cannot take their time
FIGURE_TESTS = [f"tests/test_gpu.py::{name}" for name in (
    "test_fsdp_transformer_tokens_per_s_and_mfu", "test_hbm_copy_bandwidth",
    "test_ddp_peak_memory_beside_the_estimator",
    "test_a_strategys_peak_is_the_same_alone_and_after_another",
    "test_the_device_clock_waits_for_the_kernels_the_host_clock_does_not")]


def gpu_tier(figures_file: Path, budget_s: float, figures_only: bool | None = None) -> dict:
    """The GPU tier under pytest: figures_only True runs FIGURE_TESTS, False the rest of the
    tier, None all of it."""
    # the course's own package from this checkout: a machine without a registry cannot
    # `pip install -e .`, and every launched rank inherits the variable
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "DTCOURSE_GPU_FIGURES": str(figures_file.resolve()), "PYTHONPATH": path}
    if figures_only:
        selection = FIGURE_TESTS
    else:
        selection = ["tests"] + [a for t in FIGURE_TESTS for a in ("--deselect", t)
                                 if figures_only is False]
    part = run_part([sys.executable, "-m", "pytest", "-m", "gpu", *selection, "-n", "0", "-q",
                     "-s", "-p", "no:cacheprovider"], budget_s, env)
    summary = [line.strip(" =") for line in part["output_tail"].splitlines()
               if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", line)]
    part["summary"] = summary[-1] if summary else None  # "12 passed, 3 skipped in 250.1s"
    return part


def read_figures(figures_file: Path) -> list[dict]:
    if not figures_file.exists():
        return []
    return [json.loads(line) for line in figures_file.read_text().splitlines() if line.strip()]


def table(result: dict) -> str:
    lines = ["# GPU check", ""]
    if result.get("skipped"):
        lines += [f"Skipped: {result['skipped']}.", ""]
    lines += ["| what | value |", "|---|---|"]
    for key in ("gpu", "python", "torch", "cuda", "deepspeed", "fairscale"):
        lines.append(f"| {key} | {result.get(key) if result.get(key) is not None else '-'} |")
    for name, part in result.get("parts", {}).items():
        extra = f", {part['summary']}" if part.get("summary") else ""
        lines.append(f"| part: {name} | {part['status']}, {part['seconds']} s{extra} |")
    lines.append(f"| total | {result['seconds']} s |")
    if result.get("figures"):
        lines += ["", "| test | figure | value |", "|---|---|---|"]
        for f in result["figures"]:
            lines.append(f"| {f['test']} | {f['name']} | {f['value']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()  # host clock: the check's wall time against its budget
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    result: dict = {"skipped": None, "gpu": None, **versions(), "parts": {}, "figures": []}
    if not torch.cuda.is_available():
        result["skipped"] = (f"no CUDA GPU on this machine (torch {torch.__version__}, "
                             "torch.cuda.is_available() is False): nothing installed or measured")
        if Path("/dev/nvidia0").exists():  # a GPU this torch cannot use: say so, and fail
            result["skipped"] += (" - but /dev/nvidia0 exists: a CPU-only torch, a driver older "
                                  "than this torch's CUDA, or CUDA_VISIBLE_DEVICES empty?")
    else:
        result["gpu"] = torch.cuda.get_device_name()
        if not args.no_install:
            result["parts"]["install"] = install(args.wheels, INSTALL_BUDGET_S)
            result.update({k: v for k, v in versions().items() if k in PACKAGES})
        figures_file = args.out / "figures.jsonl"
        figures_file.unlink(missing_ok=True)
        for name, only in (("gpu figures", True), ("gpu tier", False)):
            spent = time.monotonic() - start  # host clock: the budget's wall time so far
            left = TOTAL_BUDGET_S - 20 - spent  # 20 s kept to write the report
            first = min(FIGURES_BUDGET_S, args.tier_budget_s)
            share = first if only else args.tier_budget_s - first
            result["parts"][name] = gpu_tier(figures_file, min(share, left), only)
        result["figures"] = read_figures(figures_file)
    result["seconds"] = round(time.monotonic() - start, 1)  # host clock: as above
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "gpu_check.md").write_text(table(result))
    print(table(result))
    print(f"written: {args.out / 'gpu_check.json'}, {args.out / 'gpu_check.md'}")
    failed = [n for n, p in result["parts"].items() if not p["status"].startswith(("passed",
                                                                                    "skipped"))]
    unusable_gpu = bool(result["skipped"]) and "/dev/nvidia0 exists" in result["skipped"]
    return 1 if failed or unusable_gpu else 0


if __name__ == "__main__":
    sys.exit(main())
