"""Where the tests and the repository are, and the ``PYTHONPATH`` of the processes tests start
(Ray workers, subprocesses), so that they import ``support``, the test modules and this
checkout of ``ray_collective`` rather than an installed one."""

import os

SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(SUPPORT_DIR)
REPO_DIR = os.path.dirname(TESTS_DIR)


def python_path() -> str:
    """``tests/``, the repository and whatever ``PYTHONPATH`` this process had, joined.

    Returns:
        The value for a started process's ``PYTHONPATH``.
    """
    return os.pathsep.join([TESTS_DIR, REPO_DIR, os.environ.get("PYTHONPATH", "")])
