"""The rendezvous's bookkeeping (who left, where members listen for streams) on an in-memory
store standing in for Ray's."""

import threading
import time

import pytest

from ray_collective.backends.ray import rendezvous


class MemoryKeyValue(rendezvous.KeyValue):
    """Ray's internal key-value store as a dict; ``before_listing`` runs ahead of each listing
    (another rank acting between this rank's put and its read)."""

    def __init__(self):
        self.data = {}
        self.before_listing = []

    def put(self, key, value="", overwrite=True):
        existed = key in self.data
        if overwrite or not existed:
            self.data[key] = value
        return existed

    def get(self, key):
        return self.data.get(key)

    def keys(self, prefix):
        while self.before_listing:
            self.before_listing.pop(0)()
        return [k for k in self.data if k.startswith(prefix)]

    def delete_prefix(self, prefix):
        for key in [k for k in self.data if k.startswith(prefix)]:
            del self.data[key]


def test_each_leaving_rank_sees_those_gone_before_it_and_the_last_closes():
    kv = MemoryKeyValue()
    assert rendezvous.leave(kv, "p/", "t", 1, 3) == {1}
    assert rendezvous.leave(kv, "p/", "t", 0, 3) == {0, 1}
    assert rendezvous.leave(kv, "p/", "t", 2, 3) == {0, 1, 2}
    assert kv.data == {}


def test_a_rank_whose_listing_comes_after_the_last_one_closed_knows_that_all_left():
    kv = MemoryKeyValue()
    rendezvous.leave(kv, "p/", "t", 0, 3)
    # rank 2 puts its key; before it lists, rank 1 leaves last and deletes every key
    kv.before_listing.append(lambda: rendezvous.leave(kv, "p/", "t", 1, 3))
    assert rendezvous.leave(kv, "p/", "t", 2, 3) == {0, 1, 2}
    assert kv.data == {}


def test_a_stream_endpoint_published_late_is_waited_for_and_all_known_ones_come_with_it():
    kv = MemoryKeyValue()
    rendezvous.publish_stream_endpoint(kv, "p/", "t", 0, "10.0.0.1", 4000)
    listings = []

    def publish_on_the_third_look():
        listings.append(1)
        if len(listings) == 3:
            rendezvous.publish_stream_endpoint(kv, "p/", "t", 2, "10.0.0.2", 4002)

    original = kv.keys
    kv.keys = lambda prefix: (publish_on_the_third_look(), original(prefix))[1]
    found = rendezvous.wait_for_stream_endpoint(kv, "p/", "t", 2, timeout=5)
    assert found == {0: ("10.0.0.1", 4000), 2: ("10.0.0.2", 4002)}
    assert len(listings) == 3


def test_a_stream_endpoint_never_published_is_a_connection_error_naming_the_rank():
    kv = MemoryKeyValue()
    with pytest.raises(ConnectionError, match="rank 1 published no stream endpoint"):
        rendezvous.wait_for_stream_endpoint(kv, "p/", "t", 1, timeout=0.05)


def test_a_survivor_leaves_for_its_dead_peers_so_the_last_survivor_removes_every_key():
    kv = MemoryKeyValue()
    assert rendezvous.leave(kv, "p/", "t", 0, 3, dead=[2]) == {0, 2}
    assert rendezvous.leave(kv, "p/", "t", 1, 3, dead=[2]) == {0, 1, 2}
    assert kv.data == {}


def _member(rank):
    return rendezvous.Member(rank, "node", 1000 + rank, 2, "streams", f"10.0.0.{rank % 3}")


def _join_in_threads(kv, world_size, looks_between):
    """Every rank joins in a thread of its own, rank r once the ranks already waiting have
    looked up ``r * looks_between`` keys: each waits through many looks at the store, however
    fast or slow this machine runs them."""
    results, errors = {}, []
    looks = [0]
    looked = threading.Condition()
    get = kv.get

    def counted_get(key):
        with looked:
            looks[0] += 1
            looked.notify_all()
        return get(key)

    kv.get = counted_get

    def join(rank):
        with looked:
            assert looked.wait_for(lambda: looks[0] >= rank * looks_between, 60)
        try:
            results[rank] = rendezvous.join(
                kv, "p/", "g", world_size, _member(rank),
                timeout=20, on_token=lambda token: None, token="t")
        except Exception as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    return results


def test_joining_ranks_list_the_whole_membership_once_however_long_they_wait():
    kv = MemoryKeyValue()
    full_listings = []
    original = kv.keys
    kv.keys = lambda prefix: (full_listings.append(prefix) if prefix.endswith("/member/")
                              else None, original(prefix))[1]
    world_size = 12
    results = _join_in_threads(kv, world_size, looks_between=4)
    expected = [_member(rank) for rank in range(world_size)]
    assert all(result == ("t", expected) for result in results.values())
    assert kv.get("p/t/complete") is not None
    # Once each, after its own key went in: the others read the membership from the key
    # that says it is complete.
    assert len(full_listings) == world_size


def test_a_large_group_looks_at_the_store_less_often_than_a_small_one():
    assert rendezvous._longest_pause(8) == 0.05
    assert rendezvous._longest_pause(400) == pytest.approx(400 / rendezvous.LOOKS_PER_SECOND)
    # Registered ranks are woken when the group completes: their looks are a fallback.
    assert next(rendezvous.pauses(8, registered=True)) == 0.05
    assert next(rendezvous.pauses(400, registered=True)) == pytest.approx(
        400 / rendezvous.REGISTERED_LOOKS_PER_SECOND)
    assert rendezvous.recheck_interval(8) == rendezvous.RECHECK_S
    assert rendezvous.recheck_interval(400) == pytest.approx(
        400 / rendezvous.RECHECKS_PER_SECOND)


def test_the_first_rank_of_another_node_to_see_the_group_complete_wakes_its_node_mates():
    kv = MemoryKeyValue()
    woke, results = {}, {}
    # Rank 1 (node b) and rank 2 (node a) look; rank 3 (node b) is woken by a knock.
    naps = {1: lambda s: time.sleep(min(s, 0.005)), 2: lambda s: time.sleep(min(s, 0.005)),
            3: lambda s: (time.sleep(min(s, 0.005)), True)[1], 0: time.sleep}
    nodes = {0: "a", 1: "b", 2: "a", 3: "b"}

    def join(rank):
        member = rendezvous.Member(rank, nodes[rank], 1000 + rank)
        results[rank] = rendezvous.join(
            kv, "p/", "g", 4, member, timeout=20, on_token=lambda token: None, token="t",
            waiting=rendezvous.Waiting(naps[rank], lambda members, r=rank: woke.setdefault(
                r, sorted(m.rank for m in members))))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (1, 2, 3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len([key for key in kv.data if "/member/" in key]) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    join(0)
    for thread in threads:
        thread.join()
    expected = [rendezvous.Member(r, nodes[r], 1000 + r) for r in range(4)]
    assert all(result == ("t", expected) for result in results.values())
    # The completer wakes its node's ranks; node b's rank that looked wakes node b's.
    assert woke == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


def test_a_completion_put_without_the_members_is_read_by_listing_them():
    kv = MemoryKeyValue()
    for rank in (0, 1):
        kv.put(rendezvous._member_key("p/", "t", rendezvous.Member(rank, "a", 1000 + rank)))
    kv.put("p/t/size", "3")
    # As a member of a shrink whose completer died says it for it (``elastic``).
    kv.put("p/t/complete")
    token, members = rendezvous.join(kv, "p/", "g", 3, rendezvous.Member(2, "a", 1002), 5,
                                     lambda token: None, token="t")
    assert [m.rank for m in members] == [0, 1, 2]


def test_a_join_that_times_out_names_the_missing_ranks_not_itself_and_withdraws():
    kv = MemoryKeyValue()
    with pytest.raises(rendezvous.CollectiveTimeoutError) as caught:
        rendezvous.join(kv, "p/", "g", 3, rendezvous.Member(1, "node", 1001), timeout=0.05,
                        on_token=lambda token: None, token="t")
    assert caught.value.missing_ranks == (0, 2)
    assert not [key for key in kv.data if "/member/" in key]


def test_a_rank_seen_waiting_is_not_named_missing_once_it_gave_up_first():
    """Two of three ranks wait together and neither sees the third: the one whose deadline
    passes second must still name only the third (the first withdrew its member key when it
    gave up, but it came). A rank that gave up before the other came is missing for it."""
    kv = MemoryKeyValue()
    errors = {}

    def wait(rank, timeout):
        try:
            rendezvous.join(kv, "p/", "g", 3, rendezvous.Member(rank, "node", 1000 + rank),
                            timeout=timeout, on_token=lambda token: None, token="t")
        except rendezvous.CollectiveTimeoutError as err:
            errors[rank] = err.missing_ranks

    first = threading.Thread(target=wait, args=(0, 0.3))
    first.start()
    while not [key for key in kv.data if "/member/0/" in key]:
        time.sleep(0.001)
    wait(1, 0.6)    # registers while rank 0 waits, gives up after rank 0 did
    first.join()
    assert errors == {0: (1, 2), 1: (2,)} or errors == {0: (2,), 1: (2,)}
    assert not [key for key in kv.data if "/member/" in key]
    wait(0, 0.05)   # alone now: rank 1 left before it came
    assert errors[0] == (1, 2)


def test_a_registered_rank_polls_the_complete_key_and_rechecks_its_incarnation_seldom(
        monkeypatch):
    monkeypatch.setattr(rendezvous, "RECHECK_S", 0.2)
    kv = MemoryKeyValue()
    kv.put("p/t/size", "2")
    kv.put("p/token", "t")
    looked_at = []
    original = kv.get
    kv.get = lambda key: (looked_at.append(key), original(key))[1]
    waiting = threading.Thread(target=rendezvous.join, args=(
        kv, "p/", "g", 2, rendezvous.Member(1, "node", 1001), 10, lambda token: None))
    started = time.monotonic()
    waiting.start()
    # Until it has looked at the token again at least once after registering, and polled the
    # complete key many times.
    deadline = started + 10
    while looked_at.count("p/token") < 2 or looked_at.count("p/t/complete") < 8:
        assert time.monotonic() < deadline, looked_at
        time.sleep(0.01)
    polled, elapsed = list(looked_at), time.monotonic() - started
    rendezvous.join(kv, "p/", "g", 2, rendezvous.Member(0, "node", 1000), 10,
                    lambda token: None)
    waiting.join()
    # One look at the token before registering, then at most one per RECHECK_S.
    assert polled.count("p/token") <= 2 + elapsed / rendezvous.RECHECK_S
    assert set(polled) <= {"p/token", "p/t/size", "p/t/complete", "p/t/broken", "p/t/left/1"}


def test_the_broken_mark_keeps_the_first_failure_recorded_for_other_nodes_to_read():
    kv = MemoryKeyValue()
    assert rendezvous.broken_by(kv, "p/", "t") is None
    rendezvous.mark_broken(kv, "p/", "t", {"group": "g", "rank": 3, "kind": "PeerDiedError"})
    rendezvous.mark_broken(kv, "p/", "t", {"group": "g", "rank": 4, "kind": "GroupBrokenError"})
    assert rendezvous.broken_by(kv, "p/", "t") == {"group": "g", "rank": 3,
                                                  "kind": "PeerDiedError"}
    # A mark without a failure (a joining rank found the incarnation dead) still breaks it.
    rendezvous.mark_broken(kv, "p/", "u")
    assert kv.get("p/u/broken") == "" and rendezvous.broken_by(kv, "p/", "u") is None
    kv.put("p/v/broken", "[1, 2]")
    with pytest.raises(ValueError, match="incarnation v"):
        rendezvous.broken_by(kv, "p/", "v")
