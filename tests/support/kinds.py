"""The kind of each test, as a marker, so that ``pytest -m <kind>`` selects a part of the suite.

- ``gpu``: needs CuPy with NCCL and a GPU; marked by hand (``tests/test_nccl_gpu.py``).
- ``multinode``: starts a Ray cluster of several nodes on this machine (in a subprocess of its
  own); marked by hand.
- ``netbed``: needs root, ``ip`` and ``tc``: builds a network bed of namespaces and links
  (``benchmarks.netbed``); skipped with the reason where it cannot; marked by hand.
- ``ray``: needs Ray: given to every test that uses the ``ray_session`` fixture (directly or
  through ``members`` and the like), and marked by hand on a test that starts Ray itself (a
  benchmark or an example in a subprocess).
- ``slow``: minutes rather than seconds: the 4096-rank simulations and the multi-node cluster;
  marked by hand.
- ``unit``: given to every other test: no Ray, no GPU, quick. ``pytest -m unit`` runs these
  alone; never marked by hand, since it means "none of the others".

A test marked ``unit`` that starts Ray anyway is stopped (see ``conftest.py``): its ``ray.init``
raises, and :func:`refuse_ray_subprocess` makes the helpers that start Ray in a subprocess raise.
"""

import os
from typing import FrozenSet, Iterable

RAY_FIXTURE = "ray_session"
MARKED_BY_HAND = frozenset({"gpu", "multinode", "netbed", "ray", "slow"})
KINDS = MARKED_BY_HAND | {"unit"}
UNIT_TEST_VARIABLE = "RAY_COLLECTIVE_UNIT_TEST"
"""Set (to the test's id) while a ``unit`` test runs."""


class KindError(Exception):
    """A test's markers make no sense as kinds."""


def kinds_of(fixture_names: Iterable[str], marker_names: Iterable[str]) -> FrozenSet[str]:
    """The kinds of a test, from the fixtures it uses and the markers it carries.

    Args:
        fixture_names: every fixture the test uses, those its fixtures use included.
        marker_names: the names of its markers (its own, its class's and its module's).

    Returns:
        Its kinds: ``{"unit"}``, or the kinds of :data:`MARKED_BY_HAND` that apply.

    Raises:
        KindError: the test is marked ``unit`` by hand.
    """
    marked = set(marker_names) & KINDS
    if "unit" in marked:
        raise KindError("'unit' is given to the tests that are none of "
                        f"{sorted(MARKED_BY_HAND)}; do not mark a test with it")
    if RAY_FIXTURE in set(fixture_names):
        marked.add("ray")
    return frozenset(marked or {"unit"})


def refuse_ray_subprocess(what: str) -> None:
    """Raise if a ``unit`` test is running: ``what`` would start Ray in a subprocess.

    Args:
        what: the command about to start, for the message.

    Raises:
        KindError: a ``unit`` test is running (its id is in the message).
    """
    test = os.environ.get(UNIT_TEST_VARIABLE)
    if test:
        raise KindError(f"{test} is a unit test, but {what} starts Ray: mark it "
                        f"@pytest.mark.ray (or multinode)")
