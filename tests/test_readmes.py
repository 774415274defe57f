"""Every command in the course's documents runs as written.

Convention (see conftest.readme_commands): each line of a ```bash block in any Markdown file of the
repository is run verbatim through bash from the repository root; only a free port is injected
(PET_MASTER_PORT for torchrun, --master_port for the deepspeed launcher, MASTER_PORT otherwise).
A command that is meant to fail says so with a trailing comment `# exits N`, and must exit N.
A ```text block right after a command's ```bash block is its output: every run of the command
re-checks it (conftest.run_readme_command, tests/quoted_output.py).

A lesson test may run a documented command itself, to check the numbers it writes (its
--metrics-out, --export or --json-out files): such a test holds the command as a string literal,
calls `run_readme_command` on it and asserts `readme_mentions` of it. Those commands are not run a
second time here. Identical commands in two documents run once. The test command of the quick
start is checked against .ci/run and not re-run from inside the suite.
"""

import ast

import pytest

import quoted_output
from conftest import (REPO, all_documented_commands, quoted_pairs, readme_commands,
                      run_readme_command)

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


def test_every_quoted_output_belongs_to_one_command():
    """A quoted output is checked against its command's run, so its ```bash block holds one
    command, and it quotes nothing a rerun cannot reproduce (timestamps, addresses)."""
    assert len(quoted_pairs()) >= 30
    for pair in quoted_pairs():
        where = f"{pair['doc'].relative_to(REPO)}:{pair['line']}"
        assert len(pair["commands"]) == 1, f"{where}: {len(pair['commands'])} commands"
        assert not quoted_output.FORBIDDEN.search(pair["quote"]), where


def test_the_quote_check_catches_a_changed_number():
    """The check compares integers exactly and decimals to their last quoted digit or 0.5%, skips
    timings and `~` marks, and lets no line go missing."""
    fresh = "step 10 | loss 2.3456 | 812 samples/s\nbytes 1,024 | bubble ~0.713\n"
    assert quoted_output.check("step 10 | loss 2.3456 | 900 samples/s\n...\nbytes 1,024 | "
                               "bubble ~0.500", fresh) == []
    assert quoted_output.check("step 10 | loss 2.3457 | 812 samples/s", fresh) == []  # last digit
    assert quoted_output.check("step 10 | loss 2.3500 | 812 samples/s", fresh) == []  # 0.2%
    assert quoted_output.check("step 10 | loss 2.3600 | 812 samples/s", fresh)  # 0.6%
    assert quoted_output.check("step 10 | loss 2.3600 | 812 samples/s", fresh, rel=0.02) == []
    assert quoted_output.check("bytes 1,025 | bubble ~0.713", fresh)
    assert quoted_output.check("step 11 | loss 2.3456 | 812 samples/s", fresh)
    assert quoted_output.check("a line it never printed", fresh)


def test_every_documented_elastic_restart_disables_the_shared_rendezvous_store():
    """torchrun --max-restarts reuses the agent's TCP store across restarts unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it a restart can hang or fail to reconnect (seen
    in one run of three). Every documented elastic command, run here or not, sets it."""
    elastic = [(doc, command) for doc, command in all_documented_commands()
               if "torchrun" in command and "--max-restarts" in command]
    assert len(elastic) >= 2
    for doc, command in elastic:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in command, (doc, command)
