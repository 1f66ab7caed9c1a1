"""Every Python snippet of the README runs as it is and prints what its last line says.

The README's quickstart is what a new user copies first, so each ``python`` block is run as a
whole script in a subprocess that starts a Ray of its own (marked ``ray``), and the last line it
prints must be the comment of its ``print`` line (``print(...)  # [[3.0, ...]]``). A block
without such a line (the one-line import) only has to run.
"""

import pathlib
import re

import pytest

from support.helpers import run_python
from support.paths import REPO_DIR

README = pathlib.Path(REPO_DIR) / "README.md"
TIMEOUT_S = 240
EXPECTED = re.compile(r"^print\(.*\)\s+#\s+(?P<expected>.+)$")


def python_blocks(text):
    """The README's ``python`` code blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def expected_output(block):
    """What the block's last ``print`` line says it prints, or None."""
    found = [EXPECTED.match(line) for line in block.splitlines()]
    found = [match.group("expected") for match in found if match]
    return found[-1] if found else None


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_a_quickstart_for_each_pattern():
    assert len(BLOCKS) >= 5, "the import line and four quickstart snippets"
    patterns = {"init_collective_group", "declare_collective_group", "allreduce_refs",
                "ray_util_collective_runtime_env", "declare_weight_sync"}
    assert all(any(pattern in block for block in BLOCKS) for pattern in patterns)
    assert sum(expected_output(block) is not None for block in BLOCKS) >= 4


def test_expected_output_is_read_from_the_print_line():
    assert expected_output("x = 1\nprint(x)  # 1\n") == "1"
    assert expected_output("import ray_collective as col   # instead of: ...\n") is None


@pytest.mark.ray
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_snippet_runs_and_prints_what_it_says(index):
    block = BLOCKS[index]
    finished = run_python(["-c", block], TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    expected = expected_output(block)
    if expected is not None:
        assert finished.stdout.strip().splitlines()[-1] == expected, finished.stdout[-2000:]
