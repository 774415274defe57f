"""benchmarks/gpu_check.py on a machine without a GPU: it installs and launches nothing, says
that it skipped and why, and still writes its JSON and its Markdown table (what a GPU machine's
run writes, with no figures)."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_gpu_check_reports_the_skip_and_writes_both_files(tmp_path):
    out = tmp_path / "gpu"
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out),
                          "--wheels", str(tmp_path / "no-wheels")], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["skipped"].startswith("no CUDA GPU"), result["skipped"]
    assert result["gpu"] is None and result["parts"] == {} and result["figures"] == []
    assert result["python"] == ".".join(map(str, sys.version_info[:3]))
    import torch
    assert result["torch"] == torch.__version__
    assert 0 <= result["seconds"] < 60
    md = (out / "gpu_check.md").read_text()
    assert f"Skipped: {result['skipped']}." in md
    assert f"| torch | {torch.__version__} |" in md
    assert not (out / "figures.jsonl").exists()  # the GPU tier did not run


def test_gpu_check_help_says_how_to_fetch_the_wheels():
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert "--wheels" in run.stdout and "--out" in run.stdout
    source = (REPO / "benchmarks" / "gpu_check.py").read_text()
    assert "--python-version 3.12" in source and "pip wheel --no-deps" in source


def test_the_figures_part_names_gpu_tests_that_exist():
    """The check runs its figures' tests first, by pytest id: a renamed test would leave the part
    empty (pytest: 'not found') and the figures unmeasured."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-n", "0", "-p", "no:cacheprovider", *gpu_check.FIGURE_TESTS],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{len(gpu_check.FIGURE_TESTS)} tests collected" in run.stdout
