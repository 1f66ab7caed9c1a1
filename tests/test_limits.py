"""What ``init_collective_group`` accepts works, and what could not work is refused there, on
every rank, before anything is sent (issue 30): group names, deadlines, world sizes; and what
many groups in a row leave in their members (descriptors). Ray backend on real actors, with
the in-process backend where only the argument checks are concerned."""

import sys
import time

import numpy as np
import pytest

import ray_collective as col
from support.helpers import process_resources, run_in, start_members
from ray_collective.types import MAX_GROUP_NAME_BYTES, MAX_TIMEOUT_S, MAX_WORLD_SIZE

LARGE = 1 << 18
"""float32 elements of a message that travels through shared memory (1 MiB)."""


def _checked_allreduces(rank, group, **call):
    """An allreduce of 8 B (inline) and one of 1 MiB (shared memory), each against numpy."""
    world = col.get_collective_group_size(group)
    for length in (2, LARGE):
        tensor = np.full(length, rank + 1, np.float32)
        col.allreduce(tensor, group, **call)
        np.testing.assert_array_equal(tensor, np.full(length, world * (world + 1) / 2,
                                                      np.float32))
    return True


def _join_and_run(rank, group, init=None, call=None):
    """Inside a member: join ``group`` (2 ranks), run checked allreduces, leave; what came of
    it and the group's default deadline."""
    try:
        col.init_collective_group(2, rank, "ray", group, **(init or {}))
    except Exception as err:  # noqa: BLE001 - the outcome is what the test looks at
        return type(err).__name__, str(err), None
    try:
        timeout = col.get_group_handle(group).timeout
        _checked_allreduces(rank, group, **(call or {}))
        work = col.allreduce(np.ones(4, np.float32), group, async_op=True)
        work.wait(1e10)
        return "ok", "", timeout
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)[:300], None
    finally:
        col.destroy_collective_group(group)


# ------------------------------------------------------------------ group names

ACCEPTED_NAMES = ["n" * 240, "x" * MAX_GROUP_NAME_BYTES, "\U0001F642" * (MAX_GROUP_NAME_BYTES // 4),
                  "../../x/%00/..", "名前 with spaces", "-"]


def test_every_name_init_accepts_works_through_shared_memory(ray_session, members):
    """Names at the limit (in bytes of UTF-8), with slashes, escapes or unicode: each forms a
    group whose large messages go through shared memory (named after the group), with right
    results. Issue 30 saw 240 characters fail at the first call with EINVAL."""
    outcomes = {name[:12]: run_in(ray_session, members[:2], _join_and_run, name)
                for name in ACCEPTED_NAMES}
    assert all(outcome == [("ok", "", 1800.0)] * 2 for outcome in outcomes.values()), outcomes


REFUSED_NAMES = {
    "one byte too long": ("x" * (MAX_GROUP_NAME_BYTES + 1), "at most 256"),
    "a character too long": ("\U0001F642" * (MAX_GROUP_NAME_BYTES // 4) + "x", "at most 256"),
    "a thousand characters": ("y" * 1000, "1000 bytes long"),
    "a NUL": ("a\0b", "control character"),
    "a newline": ("a\nb", "control character"),
    "a lone surrogate": ("a\ud800", "surrogate"),
}


@pytest.mark.parametrize("case", list(REFUSED_NAMES))
def test_a_name_that_cannot_work_is_refused_at_init_on_every_rank(ray_session, members, case):
    name, message = REFUSED_NAMES[case]
    outcomes = run_in(ray_session, members[:2], _join_and_run, name)
    assert [kind for kind, _, _ in outcomes] == ["ArgumentValueError"] * 2, outcomes
    assert all(message in text for _, text, _ in outcomes), outcomes


def test_a_refused_name_is_never_echoed_at_length():
    with pytest.raises(col.ArgumentValueError) as refused:
        col.init_collective_group(2, 0, group_name="z" * 1_000_000)
    assert len(str(refused.value)) < 200


# ------------------------------------------------------------------ deadlines

HUGE_DEADLINES = {"timeout=1e10": dict(timeout=1e10), "timeout=1e12": dict(timeout=1e12),
                  "timeout=max float": dict(timeout=sys.float_info.max),
                  "gloo_timeout=1e13 ms": dict(gloo_timeout=10 ** 13)}


@pytest.mark.parametrize("case", list(HUGE_DEADLINES))
def test_a_deadline_past_a_year_is_a_year_and_every_call_works(ray_session, members, case):
    """Issue 30: such deadlines passed init, then every call raised OverflowError."""
    outcomes = run_in(ray_session, members[:2], _join_and_run, f"deadline-{case}",
                      HUGE_DEADLINES[case], dict(timeout=1e300))
    assert outcomes == [("ok", "", MAX_TIMEOUT_S)] * 2


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_a_deadline_that_is_not_a_positive_number_is_refused(value):
    for arguments in (dict(timeout=value), dict(gloo_timeout=value)):
        with pytest.raises(col.ArgumentValueError, match="positive number"):
            col.init_collective_group(2, 0, group_name="never", **arguments)


# ------------------------------------------------------------------ world sizes


def _refused_world_size(rank, world_size):
    """Inside a member: try to join a group of ``world_size``; (error kind, message, seconds)."""
    started = time.monotonic()
    try:
        col.init_collective_group(world_size, rank, "ray", "too-many", timeout=5)
    except Exception as err:  # noqa: BLE001 - the outcome is what the test looks at
        return type(err).__name__, str(err), time.monotonic() - started
    col.destroy_collective_group("too-many")
    return "joined", "", time.monotonic() - started


@pytest.mark.parametrize("world_size", [MAX_WORLD_SIZE + 1, 10_000_000, 10 ** 9, 2 ** 31])
def test_a_world_size_past_the_limit_is_refused_at_once_on_every_rank(ray_session, members,
                                                                       world_size):
    """Issue 30: 10,000,000 grew a joining rank to 1.4 GiB, 10^9 ended in MemoryError, 2^31 in
    OverflowError."""
    outcomes = run_in(ray_session, members[:2], _refused_world_size, world_size)
    assert [kind for kind, _, _ in outcomes] == ["ArgumentValueError"] * 2, outcomes
    for _, message, seconds in outcomes:
        assert f"world_size must be an int in 1..{MAX_WORLD_SIZE}" in message, message
        assert seconds < 1.0, seconds


def _join_alone(rank, world_size, timeout):
    """Inside a member: join a group of ``world_size`` whose other ranks never come; (the
    error, seconds to it, growth of resident memory in bytes)."""
    rss_before = process_resources(rank)[2]
    started = time.monotonic()
    try:
        col.init_collective_group(world_size, 1, "ray", f"alone-{time.monotonic_ns()}",
                                  timeout=timeout)
    except col.CollectiveTimeoutError as err:
        return err, time.monotonic() - started, process_resources(rank)[2] - rss_before
    raise AssertionError("the join completed alone")


def test_a_join_at_the_largest_world_size_times_out_on_time_and_small(ray_session, members):
    """Nothing grows with the world size while the peers are missing: the join ends at its
    deadline (not at the next of its ever longer pauses between looks), and its error lists
    a bounded number of the missing ranks, not 65,535 of them."""
    error, seconds, growth = run_in(ray_session, members[:1], _join_alone, MAX_WORLD_SIZE,
                                    2.0)[0]
    assert 2.0 <= seconds < 3.0, seconds
    assert len(error.missing_ranks) == MAX_WORLD_SIZE - 1 and 1 not in error.missing_ranks
    assert len(str(error)) < 1000 and f"({MAX_WORLD_SIZE - 1} ranks in all)" in str(error)
    assert growth < 32 << 20, growth


# ------------------------------------------------------------------ descriptors


def _cycle(rank, group):
    col.init_collective_group(4, rank, "ray", group)
    _checked_allreduces(rank, group)
    col.destroy_collective_group(group)
    return process_resources(rank)[0]


def test_create_destroy_cycles_leave_every_rank_its_descriptors(ray_session):
    """Issue 30 counted 3 more descriptors per rank after 200 cycles of a 4-rank group than
    after 50: the process that opens an incarnation (rank 0 of an imperative group) asked Ray
    for the finished jobs through a second connection to its control store, opened once and
    kept (an eventfd, an epoll and a timer descriptor). Rank 0 moves round the actors here, so
    every one of them opens incarnations; each ends with the descriptors it started with."""
    actors = start_members(ray_session, 4)
    try:
        before = [fds for fds, _, _ in run_in(ray_session, actors, process_resources)]
        for cycle in range(8):
            refs = [actor.__ray_call__.remote(
                lambda _self, rank=(k - cycle) % 4, group=f"cycle-{cycle}": _cycle(rank, group))
                for k, actor in enumerate(actors)]
            after = ray_session.get(refs, timeout=120)
        assert after == before
    finally:
        for actor in actors:
            ray_session.kill(actor)
