"""Ranks that disagree about a call, on the ``ray`` backend with real Ray actors, at 8 B and
1 MiB: every rank fails well within the deadline with an error saying so, and the group's next
call fails at once. (Roots that disagree: tests/test_ray_backend.py.)"""

import time

import numpy as np
import pytest

import ray_collective as col
from support.helpers import run_in

WORLD = 3
ODD_RANK = 2
DEADLINE_S = 20.0
BOUND_S = DEADLINE_S / 4
"""A failed call must end this long after it started at most: well before its deadline, so it
was not waited out; and so must a call on a broken group, which fails before sending."""
SIZES = {"8 B": 2, "1 MiB": 1 << 18}


CALLS = {
    "op": lambda tensor, group: col.allreduce(tensor, group, col.ReduceOp.MAX,
                                              timeout=DEADLINE_S),
    "element count": lambda tensor, group: col.allreduce(
        np.ones(len(tensor) + 1, tensor.dtype), group, timeout=DEADLINE_S),
    "shape": lambda tensor, group: col.allreduce(tensor.reshape(2, -1), group,
                                                 timeout=DEADLINE_S),
    "dtype": lambda tensor, group: col.allreduce(tensor.astype(np.int32), group,
                                                 timeout=DEADLINE_S),
    "collective": lambda tensor, group: col.broadcast(tensor, 0, group, timeout=DEADLINE_S),
}
"""What the odd rank calls instead of ``allreduce(tensor, SUM)``, by what differs."""


def _outcome(call):
    """(``"ok"`` or the error's class name, its message, seconds ``call()`` took)."""
    started = time.monotonic()
    try:
        call()
        return "ok", "", time.monotonic() - started
    except col.CollectiveError as err:
        return type(err).__name__, str(err), time.monotonic() - started


def _disagree(rank, group, differs, length):
    """Inside a member: the call as this rank makes it, then one more call on the group."""
    tensor = np.ones(length, np.float32)
    if rank == ODD_RANK:
        first = _outcome(lambda: CALLS[differs](tensor, group))
    else:
        first = _outcome(lambda: col.allreduce(tensor, group, timeout=DEADLINE_S))
    return first, _outcome(lambda: col.allreduce(np.ones(2, np.float32), group,
                                                 timeout=DEADLINE_S))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("differs", list(CALLS))
def test_every_rank_of_a_mismatched_call_fails_fast_and_the_group_stays_broken(
        ray_session, members, differs, size):
    actors = members[:WORLD]
    group = f"mismatch-{differs}-{size}"
    col.declare_collective_group(actors, group_name=group)
    try:
        outcomes = run_in(ray_session, actors, _disagree, group, differs, SIZES[size])
    finally:
        col.destroy_collective_group(group)
    firsts = [first for first, _ in outcomes]
    assert any(kind == "CollectiveMismatchError" for kind, _, _ in firsts), firsts
    for rank, (first, second) in enumerate(outcomes):
        kind, message, elapsed = first
        assert kind in ("CollectiveMismatchError", "GroupBrokenError"), (rank, first)
        assert elapsed < BOUND_S, (rank, first)
        assert f"rank {ODD_RANK}" in message, (rank, first)
        kind, message, elapsed = second
        assert kind == "GroupBrokenError" and elapsed < BOUND_S, (rank, second)


def _on_group(rank, groups, timeout):
    """Inside a member: an allreduce on this rank's group of ``groups``, then one more."""
    mine = groups[rank == ODD_RANK]
    first = _outcome(lambda: col.allreduce(np.ones(2, np.float32), mine, timeout=timeout))
    again = _outcome(lambda: col.allreduce(np.ones(2, np.float32), mine, timeout=timeout))
    return first, again


def _on_other_group(rank, groups, timeout):
    """Inside a member: an allreduce on the group of ``groups`` this rank did not call on."""
    other = groups[rank != ODD_RANK]
    return _outcome(lambda: col.allreduce(np.ones(2, np.float32), other, timeout=timeout))


def test_ranks_calling_on_differently_named_groups_time_out_naming_the_absent_ranks(
        ray_session, members):
    """Two groups of the same actors are distinct: nothing on one tells a rank of the other
    what its peers do, so each group's call waits out its deadline and names the ranks that
    never came to it; both groups are broken afterwards."""
    actors = members[:WORLD]
    groups = ("named-a", "named-b")
    timeout = 2.0
    for name in groups:
        col.declare_collective_group(actors, group_name=name)
    try:
        outcomes = run_in(ray_session, actors, _on_group, groups, timeout)
        # only once every rank is done with its own group: before, a call on the other group
        # could still meet a rank waiting there, and be a call of its own
        elsewhere = run_in(ray_session, actors, _on_other_group, groups, timeout)
    finally:
        for name in groups:
            col.destroy_collective_group(name)
    for rank, (first, again) in enumerate(outcomes):
        kind, message, elapsed = first
        absent = [ODD_RANK] if rank != ODD_RANK else [r for r in range(WORLD) if r != ODD_RANK]
        assert kind == "CollectiveTimeoutError", (rank, first)
        assert f"waiting for ranks {absent}" in message, (rank, first)
        # a rank may learn of the timeout from a peer whose call started a little earlier
        assert timeout / 2 < elapsed < timeout + BOUND_S, (rank, first)
        for kind, message, elapsed in (again, elsewhere[rank]):
            assert kind == "GroupBrokenError" and elapsed < BOUND_S, (rank, again,
                                                                      elsewhere[rank])
