"""Runs pytest with Ray made unimportable, as on a machine that has only the library's own
dependencies: ``python tests/support/without_ray.py -m unit`` (``make test-without-ray``), any
pytest arguments after the script's name.

``None`` in ``sys.modules['ray']`` makes every ``import ray`` of this process raise
ImportError. The unit tests need no Ray: they collect and pass so, and a module that needs Ray
imports it inside its tests or skips saying so. Ray's test extras are missing by design here,
so the required-extras check (``RAY_COLLECTIVE_REQUIRE_EXTRAS``) is not this run's to make.
Processes a test starts import what they find, Ray included.
"""

import os
import sys

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(arguments) -> int:
    """Run pytest on the suite with ``arguments``, Ray unimportable.

    Args:
        arguments: pytest's command line, without the tests' directory (which is added).

    Returns:
        pytest's exit status.
    """
    sys.modules["ray"] = None
    os.environ.pop("RAY_COLLECTIVE_REQUIRE_EXTRAS", None)
    sys.path.insert(0, REPO_DIR)
    import pytest
    return int(pytest.main([*arguments, "-p", "no:cacheprovider",
                            os.path.join(REPO_DIR, "tests")]))


if __name__ == "__main__":  # a process the tests spawn imports this module as __mp_main__
    sys.exit(main(sys.argv[1:]))
