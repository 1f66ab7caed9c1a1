"""How the members of a ``ray`` group agree on its next incarnation (``backends/ray/elastic``),
on an in-memory store standing in for Ray's, every member a thread: who a shrink keeps, when it
decides, what a failed round leaves to the next, what a grow opens; and which ranks the errors
the survivors saw name."""

import threading
import time

import pytest

from ray_collective import errors
from ray_collective.backends.ray import elastic, rendezvous
from test_rendezvous import MemoryKeyValue

PREFIX, TOKEN = "p/", "0" * 32


class LockedKeyValue(MemoryKeyValue):
    """The in-memory store with Ray's atomic put-if-absent, for members in threads."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def put(self, key, value="", overwrite=True):
        with self.lock:
            return super().put(key, value, overwrite)

    def keys(self, prefix):
        with self.lock:
            return super().keys(prefix)

    def delete_prefix(self, prefix):
        with self.lock:
            super().delete_prefix(prefix)


def _members(nodes):
    """One member per entry of ``nodes`` (its node), pids 1000 + rank."""
    return [rendezvous.Member(rank, node, 1000 + rank) for rank, node in enumerate(nodes)]


def _agreement(kv, members, rank, dead_pids=(), dead_nodes=()):
    return elastic.Agreement(kv, PREFIX, TOKEN, "g", members, rank,
                             alive=lambda pid: pid not in dead_pids,
                             nodes_gone=lambda: set(dead_nodes))


@pytest.fixture
def kv(monkeypatch):
    monkeypatch.setattr(rendezvous, "RECHECK_S", 0.02)
    monkeypatch.setattr(elastic, "SUSPECT_GRACE_S", 0.2)
    store = LockedKeyValue()
    store.put(f"{PREFIX}{TOKEN}/size", "6")
    store.put(PREFIX + "token", TOKEN)
    return store


def _shrink_in_threads(kv, members, ranks, named=(), doubtful=(), timeout=10.0,
                       dead_pids=(), dead_nodes=()):
    """Every rank of ``ranks`` comes to the shrink in a thread, the first one before the
    others start; their decisions, by rank."""
    decisions, failures = {}, []

    def come(rank):
        try:
            decisions[rank] = _agreement(kv, members, rank, dead_pids, dead_nodes).decide_shrink(
                set(named), set(doubtful), time.monotonic() + timeout)
        except Exception as err:  # noqa: BLE001 - reported by the test
            failures.append(err)

    threads = [threading.Thread(target=come, args=(rank,)) for rank in ranks]
    threads[0].start()
    here = f"{PREFIX}{TOKEN}/reform/"
    deadline = time.monotonic() + 10
    while not any(k.startswith(here) and f"/here/{ranks[0]}/" in k for k in kv.keys(here)):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not failures, failures
    return decisions


def test_the_survivors_keep_themselves_in_the_old_order_once_all_came(kv):
    members = _members(["a"] * 6)
    started = time.monotonic()
    decisions = _shrink_in_threads(kv, members, [5, 0, 4, 1, 2], named={3}, timeout=30)
    assert time.monotonic() - started < 5  # not at the deadline
    decision = decisions[0]
    assert set(decisions.values()) == {decision}
    assert (decision.kind, decision.ranks, decision.world_size) == ("shrink", (0, 1, 2, 4, 5), 5)
    # the new incarnation is open for the ranks that follow the group's token
    assert kv.get(PREFIX + "token") == decision.token
    assert kv.get(f"{PREFIX}{decision.token}/size") == "5"


def test_a_rank_found_dead_on_the_node_is_left_out_and_counted_gone(kv):
    members = _members(["a"] * 4)
    decisions = _shrink_in_threads(kv, members, [0, 1, 3], dead_pids={1002})
    decision = decisions[0]
    assert decision.ranks == (0, 1, 3) and decision.gone == (2,)
    assert f"{PREFIX}{TOKEN}/reform/0/dead/2" in kv.data


def test_a_rank_that_left_is_counted_gone(kv):
    members = _members(["a"] * 3)
    kv.put(f"{PREFIX}{TOKEN}/left/2")
    decision = _shrink_in_threads(kv, members, [0, 1])[0]
    assert decision.ranks == (0, 1) and decision.gone == (2,)


def test_a_named_rank_that_comes_anyway_is_kept(kv):
    members = _members(["a"] * 3)
    decision = _shrink_in_threads(kv, members, [2, 0, 1], named={2})[0]
    assert decision.ranks == (0, 1, 2) and decision.gone == ()


def test_a_live_rank_nobody_names_is_waited_for_until_the_deadline(kv):
    members = _members(["a"] * 3)
    started = time.monotonic()
    decision = _shrink_in_threads(kv, members, [0, 1], timeout=0.5)[0]
    assert time.monotonic() - started >= 0.5
    # left out, but not counted gone: it may be alive, and must learn that it is out
    assert decision.ranks == (0, 1) and decision.gone == ()


def test_the_ranks_of_a_lost_node_are_left_out_after_the_grace_or_as_soon_as_ray_knows(kv):
    members = _members(["a", "a", "b", "b", "c", "c"])
    started = time.monotonic()
    # rank 4 was named; 5 shares its node, where nobody came: gone with it after the grace
    decision = _shrink_in_threads(kv, members, [0, 1, 2, 3], named={4}, timeout=10)[0]
    assert elastic.SUSPECT_GRACE_S <= time.monotonic() - started < 5
    assert decision.ranks == (0, 1, 2, 3)
    kv = LockedKeyValue()
    kv.put(f"{PREFIX}{TOKEN}/size", "6")
    started = time.monotonic()
    decision = _shrink_in_threads(kv, members, [0, 1, 2, 3], named={4}, dead_nodes={"c"},
                                  timeout=10)[0]
    assert time.monotonic() - started < elastic.SUSPECT_GRACE_S
    assert decision.ranks == (0, 1, 2, 3) and decision.gone == (4, 5)


def test_a_rank_on_a_node_where_another_rank_came_is_waited_for(kv):
    members = _members(["a", "a", "b", "b"])
    started = time.monotonic()
    decisions = _shrink_in_threads(kv, members, [0, 1, 2], named={3}, doubtful={2, 3},
                                   timeout=0.6)
    # 3 is named; had it not been, its node-mate 2 coming would have made the others wait
    assert decisions[0].ranks == (0, 1, 2)
    assert time.monotonic() - started < 0.6
    kv2 = LockedKeyValue()
    kv2.put(f"{PREFIX}{TOKEN}/size", "4")
    started = time.monotonic()
    decision = _shrink_in_threads(kv2, members, [0, 1, 2], doubtful={2, 3}, timeout=0.6)[0]
    assert time.monotonic() - started >= 0.6 and decision.ranks == (0, 1, 2)


def test_a_late_rank_reads_the_decision_it_was_left_out_of(kv):
    members = _members(["a"] * 3)
    decision = _shrink_in_threads(kv, members, [0, 1], named={2})[0]
    late = _agreement(kv, members, 2).decide_shrink(set(), set(), time.monotonic() + 5)
    assert late == decision and 2 not in late.ranks


def test_a_failed_round_hands_its_blame_to_the_next_and_its_incarnation_is_dropped(kv):
    members = _members(["a"] * 4)
    first = _shrink_in_threads(kv, members, [0, 1, 2, 3])[0]
    _agreement(kv, members, 0).fail(first, [3], "died", "rank 3 died")
    assert rendezvous.broken_by(kv, PREFIX, first.token)["message"] == "rank 3 died"
    round_, decision, blamed = _agreement(kv, members, 1).current_round()
    assert (round_, decision, blamed) == (1, None, {3})
    second = _shrink_in_threads(kv, members, [0, 1, 2])[0]
    assert second.round == 1 and second.ranks == (0, 1, 2)
    assert not [k for k in kv.data if k.startswith(f"{PREFIX}{first.token}/")]


def test_the_first_grow_decision_wins_and_opens_the_grown_incarnation(kv):
    members = _members(["a"] * 3)
    first = _agreement(kv, members, 1).decide_grow(5)
    second = _agreement(kv, members, 0).decide_grow(7)
    assert second == first and (first.kind, first.ranks, first.world_size) == (
        "grow", (0, 1, 2), 5)
    assert kv.get(PREFIX + "token") == first.token
    assert kv.get(f"{PREFIX}{first.token}/size") == "5"


def test_an_incarnation_whose_keys_are_gone_is_closed(kv):
    agreement = _agreement(kv, _members(["a"] * 2), 0)
    assert not agreement.closed()
    kv.delete_prefix(f"{PREFIX}{TOKEN}/")
    assert agreement.closed()


def test_the_errors_a_survivor_saw_name_the_failed_and_the_cut_off_ranks():
    died = errors.PeerDiedError("g", 0, "allreduce", 3, [2, 5])
    stalled = errors.CollectiveTimeoutError("g", 0, "allreduce", 3, [4], 1.0)
    lost = errors.PostOfficeDiedError("g", 0, "allreduce", 3, "node", [6, 7])
    broken = errors.GroupBrokenError("g", 0, errors.GroupBrokenError("g", 0, stalled))
    mismatch = errors.CollectiveMismatchError("g", 0, 1, "allreduce", 3, {"count": (1, 2)})
    assert elastic.failures_named([died, None, broken, lost, mismatch]) == ({2, 4, 5}, {6, 7})


def _joined(kv, decision, new_ranks):
    for new in new_ranks:
        kv.put(rendezvous._member_key(PREFIX, decision.token,
                                      rendezvous.Member(new, "a", 2000 + new)))


def test_joining_the_new_incarnation_ends_when_a_rank_it_waits_for_is_found_dead(kv):
    members = _members(["a"] * 4)
    decision = _shrink_in_threads(kv, members, [0, 1, 3], named={2})[0]
    _joined(kv, decision, [0, 1])  # old ranks 0 and 1; old rank 3 (pid 1003) never comes
    agreement = _agreement(kv, members, 0, dead_pids={1003})
    watch = elastic._JoinWatch(agreement, decision, time.monotonic() + 60, "shrink", 0, 60.0)
    with pytest.raises(errors.PeerDiedError) as died:
        watch()
    assert died.value.dead_ranks == (3,) and "call shrink again" in str(died.value)
    assert agreement.failure(0)["ranks"] == [3] and agreement.failure(0)["kind"] == "died"
    assert rendezvous.broken_by(kv, PREFIX, decision.token) is not None
    # the next round blames it
    assert agreement.current_round() == (1, None, {3})


def test_joining_ends_at_the_deadline_naming_the_old_ranks_it_waited_for(kv):
    members = _members(["a"] * 4)
    decision = _shrink_in_threads(kv, members, [0, 1, 3], named={2})[0]
    _joined(kv, decision, [0])
    agreement = _agreement(kv, members, 0)
    watch = elastic._JoinWatch(agreement, decision, time.monotonic(), "shrink", 0, 5.0)
    with pytest.raises(errors.CollectiveTimeoutError) as late:
        watch()
    assert late.value.missing_ranks == (1, 3)
    assert agreement.failure(0)["kind"] == "timeout"


def test_a_membership_whose_last_rank_died_before_saying_it_is_complete_is_completed(kv):
    members = _members(["a", "a", "b"])
    decision = _shrink_in_threads(kv, members, [0, 1, 2])[0]
    _joined(kv, decision, [0, 1, 2])
    watch = elastic._JoinWatch(_agreement(kv, members, 0), decision, time.monotonic() + 60,
                               "shrink", 0, 60.0)
    watch()
    assert kv.get(f"{PREFIX}{decision.token}/complete") is not None
