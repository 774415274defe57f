"""Every command in the course's documents runs as written.

Convention (see conftest.readme_commands): each line of a ```bash block in any Markdown file of the
repository is run verbatim through bash from the repository root; only a free port is injected
(PET_MASTER_PORT for torchrun, --master_port for the deepspeed launcher, MASTER_PORT otherwise).
A command that is meant to fail says so with a trailing comment `# exits N`, and must exit N.

A lesson test may run a documented command itself, to check the numbers it writes (its
--metrics-out, --export or --json-out files): such a test holds the command as a string literal,
calls `run_readme_command` on it and asserts `readme_mentions` of it. Those commands are not run a
second time here. Identical commands in two documents run once. The test command of the quick
start is checked against .ci/run and not re-run from inside the suite.
"""

import ast

import pytest

from conftest import REPO, readme_commands, run_readme_command

TEST_COMMAND = "pip install -r requirements.txt && python -m pytest tests"

DOCS = sorted(p for p in REPO.rglob("*.md")
              if not any(part.startswith(".") for part in p.relative_to(REPO).parts))


def string_literals(path) -> set[str]:
    """Every string constant of a test module (implicit concatenation is one constant)."""
    tree = ast.parse(path.read_text())
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


CLAIMED = set().union(*(string_literals(p) for p in (REPO / "tests").glob("test_*.py")
                        if p.name != "test_readmes.py"))


def claimed_by_a_lesson_test(command: str) -> bool:
    return command in CLAIMED


def documented_commands():
    seen, out = set(), []
    for doc in DOCS:
        for cmd in readme_commands(doc):
            if cmd == TEST_COMMAND or cmd in seen or claimed_by_a_lesson_test(cmd):
                continue
            seen.add(cmd)
            out.append((doc.relative_to(REPO).as_posix(), cmd))
    return out


COMMANDS = documented_commands()


def test_quick_start_commands_are_in_the_readme_and_ci():
    readme = (REPO / "README.md").read_text()
    assert TEST_COMMAND in readme, "the README must show the test command"
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text(), \
        ".ci/run must run the README's test command"
    assert "pip install -r requirements.txt && torchrun --nproc_per_node=2 " \
           "01-ddp-basics/ddp_mnist.py" in readme


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}::{c[:70]}" for d, c in COMMANDS])
def test_documented_command_runs(doc, command):
    run_readme_command(command, timeout=240)  # asserts the exit status (0, or N for `# exits N`)
