"""A new user's mistakes at the join are caught before the ranks wait for each other: a world
size that differs between ranks, a rank claimed twice, another backend or forced algorithm
raise on every rank that came, naming both ranks and both values; a join that times out names
only the ranks that never called, and no internal sequence number.

The terms are compared on an in-memory store standing in for Ray's (``backends.arrivals``), and
in Ray actors, where the two ranks must both raise well before the deadline they passed."""

import os
import threading

import pytest

import ray_collective as col
from ray_collective.backends.arrivals import Arrivals, Terms
from ray_collective.backends.ray import rendezvous
from ray_collective.errors import CollectiveTimeoutError, JoinMismatchError
from support.helpers import run_in
from test_rendezvous import MemoryKeyValue

# Far beyond what a refused join takes: a test that waited it out would fail on ray.get's
# own deadline below.
JOIN_TIMEOUT_S = 300.0
ANSWER_S = 60


def _arrival(kv, rank, terms, pid=None, node="node", timeout=JOIN_TIMEOUT_S):
    return Arrivals(kv, "job", "g", rank, terms, node, pid or os.getpid(), timeout)


@pytest.mark.parametrize("mine, theirs, named", [
    (Terms(2, "ray"), Terms(3, "ray"), "world_size=3"),
    (Terms(2, "ray"), Terms(2, "nccl"), "backend='nccl'"),
    (Terms(2, "ray", "allreduce=ring"), Terms(2, "ray"), "RAY_COLLECTIVE_ALGORITHM=''"),
])
def test_terms_that_disagree_raise_on_the_later_rank_and_are_told_to_the_earlier(
        mine, theirs, named):
    kv = MemoryKeyValue()
    first = _arrival(kv, 0, mine)
    first.announce()
    first.look()    # alone: nothing to say
    with pytest.raises(JoinMismatchError, match=f"rank 0 joins with .* rank 1 with {named}"):
        _arrival(kv, 1, theirs).announce()
    with pytest.raises(JoinMismatchError, match="rank 0 joins with") as told:
        first.look()
    assert f"rank 1 with {named}" in str(told.value)
    assert not [key for key in kv.data if "#arrivals" in key or "#conflicts" in key]


def test_a_rank_claimed_by_a_second_process_is_refused_on_both():
    kv = MemoryKeyValue()
    first = _arrival(kv, 0, Terms(2, "ray"))
    first.announce()
    with pytest.raises(JoinMismatchError, match="rank 0 was claimed by two processes"):
        _arrival(kv, 0, Terms(2, "ray"), pid=os.getppid()).announce()
    with pytest.raises(JoinMismatchError, match="claimed by two processes"):
        first.look()


def test_an_arrival_left_by_a_dead_process_of_this_node_is_no_conflict():
    kv = MemoryKeyValue()
    _arrival(kv, 0, Terms(5, "ray"), pid=2 ** 22 + 12345).announce()   # no such process
    _arrival(kv, 0, Terms(2, "ray")).announce()


def test_an_arrival_of_another_node_whose_deadline_passed_long_ago_is_no_conflict():
    """A rank that died joining on another node (its process cannot be looked at) stops
    counting once its own deadline has passed, clocks a minute apart allowed for."""
    kv = MemoryKeyValue()
    _arrival(kv, 0, Terms(5, "ray"), node="other", timeout=-120).announce()
    _arrival(kv, 1, Terms(2, "ray")).announce()
    with pytest.raises(JoinMismatchError, match="rank 1 joins with world_size=2, rank 0 with "
                                                "world_size=3"):
        # 10 s past its deadline: within the clocks' skew, still counted
        _arrival(kv, 0, Terms(3, "ray"), node="other", timeout=-10).announce()


def test_a_join_timeout_names_only_ranks_that_never_called_and_no_sequence_number():
    """Rank 1 of 3 waits; rank 0 came (its announcement is there) but is not registered in
    this incarnation: only rank 2 never called."""
    kv = MemoryKeyValue()
    _arrival(kv, 0, Terms(3, "ray"), pid=os.getppid()).announce()
    mine = _arrival(kv, 1, Terms(3, "ray"))
    mine.announce()
    with pytest.raises(CollectiveTimeoutError) as caught:
        rendezvous.join(kv, "p/", "g", 3, rendezvous.Member(1, "node", os.getpid()),
                        timeout=0.05, on_token=lambda token: None, token="t", arrivals=mine)
    assert caught.value.missing_ranks == (2,)
    assert "#" not in str(caught.value) and "never called it" in str(caught.value)


def test_a_waiting_rank_learns_of_a_later_disagreement_while_it_waits():
    kv = MemoryKeyValue()
    mine = _arrival(kv, 0, Terms(2, "ray"))
    mine.announce()
    errors = []

    def wait():
        try:
            rendezvous.join(kv, "p/", "g", 2, rendezvous.Member(0, "node", os.getpid()),
                            timeout=JOIN_TIMEOUT_S, on_token=lambda token: None, token="t",
                            arrivals=mine)
        except JoinMismatchError as err:
            errors.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not [key for key in kv.data if "/member/0/" in key]:
        waiter.join(0.001)
    with pytest.raises(JoinMismatchError):
        _arrival(kv, 1, Terms(3, "ray"), pid=os.getppid()).announce()
    waiter.join(ANSWER_S)
    assert not waiter.is_alive() and "world_size=3" in str(errors[0])
    assert not [key for key in kv.data if "/member/" in key]


def _join_expecting_refusal(rank, group, world_size):
    try:
        col.init_collective_group(world_size, rank, backend="ray", group_name=group,
                                  timeout=JOIN_TIMEOUT_S)
    except JoinMismatchError as err:
        return str(err)
    col.destroy_collective_group(group)
    return None


def test_world_sizes_that_differ_raise_on_both_ranks_in_ray(ray_session, members):
    actors = members[:2]
    refs = [actors[rank].__ray_call__.remote(
        lambda _self, r=rank: _join_expecting_refusal(r, "first-hour-size", 2 + r))
        for rank in range(2)]
    messages = ray_session.get(refs, timeout=ANSWER_S)
    for message in messages:
        assert message is not None
        assert "rank 0 joins with world_size=2" in message or \
            "rank 1 joins with world_size=3" in message
        assert "world_size=2" in message and "world_size=3" in message
    # the members are usable again right away, with sizes that agree
    assert run_in(ray_session, actors, _join_and_leave, "first-hour-size") == [0, 1]


def test_two_actors_claiming_rank_0_are_both_refused_in_ray(ray_session, members):
    actors = members[:2]
    refs = [actor.__ray_call__.remote(
        lambda _self: _join_expecting_refusal(0, "first-hour-twice", 2)) for actor in actors]
    messages = ray_session.get(refs, timeout=ANSWER_S)
    assert all(m is not None and "rank 0 was claimed by two processes" in m for m in messages)


def _join_and_leave(rank, group):
    col.init_collective_group(2, rank, backend="ray", group_name=group, timeout=ANSWER_S)
    joined = col.get_rank(group)
    col.destroy_collective_group(group)
    return joined


def test_the_driver_calling_a_collective_on_the_group_it_declared_is_pointed_to_the_refs_calls(
        ray_session, members):
    import numpy as np
    col.declare_collective_group(members[:2], group_name="first-hour-driver")
    try:
        with pytest.raises(col.GroupNotInitializedError, match="allreduce_refs") as caught:
            col.allreduce(np.ones(2), "first-hour-driver")
        assert "declare_collective_group" not in str(caught.value)
    finally:
        col.destroy_collective_group("first-hour-driver")


def test_gloo_timeout_and_timeout_that_disagree_are_refused_and_agreeing_ones_taken():
    from ray_collective.validation import group_timeout
    assert group_timeout(None, 8000) == 8.0
    assert group_timeout(8.0, 8000) == 8.0
    with pytest.raises(col.ArgumentValueError, match="gloo_timeout=8 .* timeout=8"):
        group_timeout(8, 8)     # 8 ms beside 8 s: one of them is in the wrong unit
    with pytest.raises(col.ArgumentValueError, match="pass only timeout="):
        col.init_collective_group(1, 0, group_name="first-hour-units", gloo_timeout=30000,
                                  timeout=60)
