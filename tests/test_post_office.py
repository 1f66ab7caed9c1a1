"""The object-store path between nodes without Ray: a round's messages packed into the
arguments of one ``deliver`` task and unpacked by the post office, and the ``ray`` transport
over real post offices (``transport.post_office.PostOffice``), each a thread of this process
standing in for the actor, with the ranks split between two pretend nodes: every collective
against numpy, small rounds (payloads cut into parts of the task's message) and large ones
(whole arrays, as Ray's object store carries them).
"""

import os
import pickle
import queue
import threading

import numpy as np
import pytest

from support.contract import check_every_collective, every_collective
from test_tcp import KEY, StreamFactory, pretend_nodes, two_node_transports
from ray_collective.transport.post_office import (INLINE_ARGUMENT_BYTES, INLINE_ROUND_BYTES,
                                                 PostOffice, pack_round, unpack_round)
from ray_collective.testing import run_ranks
from ray_collective.transport import uds
from ray_collective.transport.post_office_carrier import PostOffices
from ray_collective.transport.wire import CallHeader, HeaderTemplate


def _message(destination, payload):
    return (0, destination, 7, 0, len(payload), b"header", payload)


def _carried(messages, parts):
    """What the post office receives: Ray pickles a task's arguments (arrays out of band)."""
    return pickle.loads(pickle.dumps((messages, parts), protocol=5))


def test_a_small_round_travels_in_parts_of_the_tasks_message_and_comes_back_whole():
    rng = np.random.default_rng(3)
    large = rng.random(INLINE_ARGUMENT_BYTES // 8 * 3 + 5)            # 4 parts, the last short
    exact = rng.integers(0, 255, INLINE_ARGUMENT_BYTES, dtype=np.uint8)  # exactly 1 part
    messages = [_message(1, b"small"), _message(2, large), _message(1, b""),
                _message(3, exact)]
    packed, parts = pack_round(messages)
    assert [m[6] for m in packed] == [b"small", 4, b"", 1]
    assert all(part.nbytes <= INLINE_ARGUMENT_BYTES for part in parts) and len(parts) == 5
    assert all(np.shares_memory(part, large) for part in parts[:4])    # cut, not copied
    unpacked = unpack_round(*_carried(packed, parts))
    assert [m[:6] for m in unpacked] == [m[:6] for m in messages]
    assert unpacked[0][6] == b"small" and unpacked[2][6] == b""
    assert unpacked[1][6].tobytes() == large.tobytes()
    assert unpacked[3][6].tobytes() == exact.tobytes()


def test_a_round_above_the_inline_limit_or_without_large_payloads_is_left_whole():
    big = np.ones(INLINE_ROUND_BYTES // 8 + 1)
    for messages in ([_message(1, big)], [_message(1, b"a"), _message(2, b"b")]):
        packed, parts = pack_round(messages)
        assert packed is messages and parts == []
        assert unpack_round(packed, parts) == messages


class ThreadPostOffices(PostOffices):
    """The group's post offices as threads of this process: one ``PostOffice`` per pretend
    node, serving its queue of rounds one at a time, as the actor serves its tasks; a round
    reaches it pickled, as Ray carries it."""

    def __init__(self, offices):
        self.offices = offices
        self.queues = {node: queue.Queue() for node in offices}
        self.rounds = []
        self.threads = [threading.Thread(target=self._serve, args=(node,), daemon=True)
                        for node in offices]
        for thread in self.threads:
            thread.start()

    def _serve(self, node):
        while True:
            carried = self.queues[node].get()
            if carried is None:
                return
            self.offices[node].deliver(carried[0], *carried[1])

    def deliver(self, node, messages):
        packed, parts = pack_round(messages)
        self.rounds.append(len(parts))
        self.queues[node].put(_carried(packed, parts))

    def dead_ranks(self, node, ranks):
        return self.offices[node].dead_ranks(ranks)

    def local_post_office_alive(self):
        return True

    def responsive(self, node, ranks, seq):
        return self.offices[node].responsive(ranks, seq)

    def abort(self, record):
        for office in self.offices.values():
            office.abort(record)

    def published_abort(self):
        return None

    def close(self):
        for node, office in self.offices.items():
            self.queues[node].put(None)
        for thread in self.threads:
            thread.join(10)
        for office in self.offices.values():
            office.shutdown()


def _transports(tmp_path, world_size, post_offices=None):
    """Ranks on two pretend nodes that reach each other through ``post_offices`` (by default,
    real ones on threads: ``ThreadPostOffices``); returns the transports and the post offices."""
    if post_offices is None:
        nodes = pretend_nodes(world_size)
        offices = {}
        for node in sorted(set(nodes)):
            os.makedirs(tmp_path / node, mode=0o700, exist_ok=True)
            offices[node] = PostOffice(str(tmp_path / node), "g", KEY, world_size,
                                       {r: os.getpid() for r in range(world_size)
                                        if nodes[r] == node}, 10)
        post_offices = ThreadPostOffices(offices)
    transports = two_node_transports(tmp_path, world_size, post_offices=post_offices,
                                     over_streams=False)
    return transports, post_offices


@pytest.mark.parametrize("dtype,op_name,count", [
    ("float64", "SUM", 0), ("int64", "SUM", 1), ("float32", "MAX", 1000),
    ("float64", "SUM", 3 * INLINE_ARGUMENT_BYTES // 8 + 3),      # rounds cut into parts
    ("float32", "SUM", INLINE_ROUND_BYTES // 4 + 7),             # rounds sent whole
    ("float64", "AVG", 1003), ("float32", "PRODUCT", 9)])
def test_every_collective_across_two_nodes_over_post_offices_matches_numpy(tmp_path, dtype,
                                                                           op_name, count):
    p = 4
    transports, post_offices = _transports(tmp_path, p)
    factory = StreamFactory(transports)
    try:
        results = run_ranks(p, lambda rank: every_collective(rank, "default", p, dtype,
                                                             op_name, count, "numpy"),
                            factory_of=lambda rank: factory, timeout=60)
        check_every_collective(results, p, dtype, op_name, count)
    finally:
        post_offices.close()
    if count * np.dtype(dtype).itemsize > uds.INLINE_LIMIT:
        assert any(post_offices.rounds)   # some round went in parts...
        assert 0 in post_offices.rounds   # ...and some whole (small ones, or above the limit)


class RecordingPostOffices(ThreadPostOffices):
    """Post offices that carry nothing and keep each round as it was handed over."""

    def __init__(self):
        super().__init__({})
        self.handed = []

    def deliver(self, node, messages):
        self.handed.append((node, messages))


def test_a_send_to_another_node_completes_when_its_round_leaves_without_a_copy(tmp_path):
    post_offices = RecordingPostOffices()
    transports, _ = _transports(tmp_path, 2, post_offices)
    data = np.arange(uds.INLINE_LIMIT // 8 + 1, dtype=np.float64)
    stamp = HeaderTemplate(CallHeader("g", 0, 0, "send/recv", "direct", "float64", len(data),
                                      (len(data),))).stamp(0)
    request = transports[0].isend(1, 1, stamp, 0, data)
    # Until the round leaves the caller must not touch its buffer: the message is that buffer.
    assert not request.done and post_offices.handed == []
    assert transports[0].test(request)
    [(node, [message])] = post_offices.handed
    assert node == "b" and message[1] == 1 and np.shares_memory(message[6], data)
    for transport in transports:
        transport.close()


class _RecordedOffice:
    """Stands in for ``PostOffice`` in a host: records what it was given."""

    def __init__(self, directory, group_name, group_key, world_size, local_pids, timeout):
        self.group_key, self.delivered, self.shut = group_key, [], False

    def deliver(self, messages, *parts):
        self.delivered.append((messages, parts))

    def dead_ranks(self, ranks):
        return [r for r in ranks if r == 3]

    def shutdown(self):
        self.shut = True


def _host(monkeypatch, first=b"a" * 16):
    from ray_collective.transport import post_office
    monkeypatch.setattr(post_office, "PostOffice", _RecordedOffice)
    return post_office.PostOfficeHost("/unused", "g", first, 4, {0: 1}, 1.0)


def test_a_host_keeps_an_incarnations_deliveries_until_it_opens(monkeypatch):
    host = _host(monkeypatch)
    later = b"b" * 16
    host.deliver(later, ["first"], b"part")
    host.deliver(later, ["second"])
    assert host.dead_ranks(later, [2, 3]) == []   # still starting: nothing known dead
    host.open("/unused", "g", later, 5, {0: 1}, 1.0)
    office = host.offices[later]
    assert office.delivered == [(["first"], (b"part",)), (["second"], ())]
    assert host.dead_ranks(later, [2, 3]) == [3]
    assert host.offices[b"a" * 16].delivered == []


def test_a_host_counts_the_incarnations_left_and_forgets_a_closed_one(monkeypatch):
    host = _host(monkeypatch)
    first, later = b"a" * 16, b"b" * 16
    host.open("/unused", "g", later, 5, {0: 1}, 1.0)
    office = host.offices[first]
    assert host.close(first) == 1 and office.shut
    assert host.dead_ranks(first, [3]) is None          # closed here: nothing known
    host.deliver(first, ["late"])                        # its ranks have left: dropped
    host.open("/unused", "g", first, 4, {0: 1}, 1.0)     # a closed one is not opened again
    assert first not in host.offices and host.early == {}
    assert host.close(later) == 0
    with pytest.raises(RuntimeError, match="stopping"):   # its caller stops it now
        host.open("/unused", "g", b"c" * 16, 4, {0: 1}, 1.0)
