"""The rendezvous's bookkeeping (who left, where members listen for streams) on an in-memory
store standing in for Ray's."""

import pytest

from ray_collective.backends import rendezvous


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
