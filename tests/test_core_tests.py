"""The core of the suite (tests/core_tests.txt), which .ci/run also runs under a second torch.

The list names tests by their pytest ids, so a renamed test would silently leave it: here every id
must still collect, and every lesson must keep at least one test in it. The core runs in its own
environment, and the tests start launchers (`torchrun`, `deepspeed`) by name: one found first on
PATH from another environment would run the ranks under the other torch while pytest reports this
one, so the launchers on PATH must run this interpreter.
"""

import re
import sys

import torch

from conftest import PYTHON, REPO, launch, run_deepspeed, torchrun_cmd

CORE = REPO / "tests" / "core_tests.txt"

# What the core must cover: an equivalence test of every lesson and sub-lesson, the launchers and
# the device check (file name prefixes under tests/)
MUST_COVER = ["test_01_", "test_02_", "test_03_", "test_04_", "test_05a_", "test_05b_",
              "test_05c_", "test_05d_", "test_launchers.py", "test_device_agnostic.py"]


def core_ids() -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in CORE.read_text().splitlines()]
    return [line for line in lines if line]


def test_every_core_id_names_a_test():
    ids = core_ids()
    result = launch([PYTHON, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                     "-p", "no:cacheprovider", *ids], timeout=240, check=False)
    # pytest refuses the whole list if one id is unknown ("ERROR: not found: ID"), else lists
    # what each id collected
    missing = re.findall(r"not found: (\S+)", result.stdout + result.stderr)
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    missing += [i for i in ids if result.returncode == 0 and not any(
        c == i or c.startswith(i + ("[" if "::" in i else "::")) for c in collected)]
    assert result.returncode == 0 and not missing, \
        f"ids in {CORE.name} that name no test: {missing}\n{result.describe()}"


def test_every_lesson_keeps_a_test_in_the_core():
    files = {i.split("::")[0].removeprefix("tests/") for i in core_ids()}
    uncovered = [p for p in MUST_COVER if not any(f.startswith(p) for f in files)]
    assert uncovered == [], f"no test of {uncovered} in {CORE.name}"


def test_the_launchers_on_path_run_this_interpreter(tmp_path):
    """torchrun and the deepspeed launcher start a rank that reports its environment and torch."""
    script = tmp_path / "which_python.py"
    script.write_text("import sys, torch\nprint('env', sys.prefix, 'torch', torch.__version__)\n")
    here = f"env {sys.prefix} torch {torch.__version__}"
    for name, result in [
            ("torchrun", launch(torchrun_cmd(script, nproc=1), timeout=120)),
            ("deepspeed", run_deepspeed(script, num_gpus=1, timeout=120))]:
        seen = re.findall(r"^env .* torch \S+$", result.stdout, re.M)
        assert seen == [here], f"{name} on PATH ran {seen}, pytest runs {here}"
