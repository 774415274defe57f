"""Every command in the course's documents runs as written.

Convention (see conftest.readme_commands): each line of a ```bash block in any Markdown file of the
repository is run verbatim through bash from the repository root; only a free port is injected
(PET_MASTER_PORT for torchrun, --master_port for the deepspeed launcher, MASTER_PORT otherwise).
A command that is meant to fail says so with a trailing comment `# exits N`, and must exit N.
The two quick-start commands of the top-level README are checked against .ci/run; the test command
itself is not re-run from inside the suite.
"""

import pytest

from conftest import REPO, readme_commands, run_readme_command

TEST_COMMAND = "pip install -r requirements.txt && python -m pytest tests"

DOCS = sorted(p for p in REPO.rglob("*.md")
              if not any(part.startswith(".") for part in p.relative_to(REPO).parts))
COMMANDS = [(doc.relative_to(REPO).as_posix(), cmd) for doc in DOCS for cmd in readme_commands(doc)
            if cmd != TEST_COMMAND]


def test_quick_start_commands_are_in_the_readme_and_ci():
    readme = (REPO / "README.md").read_text()
    assert TEST_COMMAND in readme, "the README must show the test command"
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text(), ".ci/run must run the README's " \
                                                               "test command"
    assert "pip install -r requirements.txt && torchrun --nproc_per_node=2 " \
           "01-ddp-basics/ddp_mnist.py" in readme


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}::{c[:60]}" for d, c in COMMANDS])
def test_documented_command_runs(doc, command):
    run_readme_command(command, timeout=240)  # asserts the exit status (0, or N for `# exits N`)
