"""The ``ray`` backend's node transport over real Unix sockets and shared memory, without Ray.

Every rank is a thread of this process with its own transport, listener and shared memory, so
these tests exercise the real links, frames, parts and waits in seconds: every collective
against numpy across the inline and shared-memory sizes, messages in many parts, parts that
arrive before their receive, the spinning wait, and the failure paths (a stranger without the
group's key, a malformed frame, a peer that dies).
"""

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ray_collective as col
from support.helpers import act_while_waiting, numpy_reduce, rank_data
from ray_collective.backends.base import BackendFactory
from ray_collective.engine.cpu import TransportMembership
from ray_collective.errors import CollectiveError, PeerDiedError
from ray_collective.group import current_registry
from ray_collective.testing import run_ranks
from ray_collective.transport import uds, wire
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.node_state import NodeState
from ray_collective.transport.link_transport import LinkTransport, Peer
from ray_collective.transport.wire import CallHeader, HeaderTemplate

PART = uds.PART_BYTES
KEY = b"0123456789abcdef"


def _transports(directory, world_size, spin_s=0.0, pids=None):
    directory = str(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = [os.path.join(directory, f"{rank}.sock") for rank in range(world_size)]
    pids = pids or [os.getpid()] * world_size
    peers = [Peer("node", pids[rank], paths[rank]) for rank in range(world_size)]
    return [LinkTransport(rank, "g", KEY, peers, uds.listen(paths[rank], 16),
                         NodeState(directory, "g", world_size), connect_timeout=5,
                         spin_s=spin_s)
            for rank in range(world_size)]


class NodeFactory(BackendFactory):
    """Joins thread ranks to transports made in advance (what the rendezvous does in Ray)."""

    name = "node-test"

    def __init__(self, transports, forced):
        self.transports = transports
        self.forced = forced

    def available(self):
        return True

    def create(self, group_name, world_size, rank, timeout):
        return TransportMembership(group_name, self.transports[rank], forced=self.forced)


def _run(tmp_path, world_size, body, spin_s=0.0, timeout=60.0, forced=None):
    factory = NodeFactory(_transports(tmp_path / "group", world_size, spin_s), forced or {})
    return run_ranks(world_size, body, factory_of=lambda rank: factory, timeout=timeout)


SIZES = [0, 1, 1000, uds.INLINE_LIMIT // 8 + 1, 2 * PART // 8 + 3]


@pytest.mark.parametrize("spin_s", [0.0, 50e-6])
@pytest.mark.parametrize("count", SIZES)
def test_every_collective_matches_numpy_across_inline_and_shared_sizes(tmp_path, count,
                                                                       spin_s):
    p, root = 3, 2

    def body(rank):
        mine = rank_data(rank, count, np.float64)
        blocks = [rank_data(rank * 10 + j, count, np.float64) for j in range(p)]
        out = {}
        x = mine.copy()
        col.allreduce(x)
        out["allreduce"] = x
        x = mine.copy()
        col.reduce(x, root, op=col.ReduceOp.MAX)
        out["reduce"] = x
        x = mine.copy()
        col.broadcast(x, root)
        out["broadcast"] = x
        gathered = [np.zeros(count) for _ in range(p)]
        col.allgather(gathered, mine.copy())
        out["allgather"] = gathered
        x = np.zeros(count)
        col.reducescatter(x, [b.copy() for b in blocks])
        out["reducescatter"] = x
        recvd = [np.zeros(count) for _ in range(p)]
        col.alltoall(recvd, [b.copy() for b in blocks])
        out["alltoall"] = recvd
        col.barrier()
        return out

    results = _run(tmp_path, p, body, spin_s)
    inputs = [rank_data(rank, count, np.float64) for rank in range(p)]
    blocks = [[rank_data(rank * 10 + j, count, np.float64) for j in range(p)]
              for rank in range(p)]
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce"], numpy_reduce(inputs, col.ReduceOp.SUM))
        np.testing.assert_array_equal(
            out["reduce"], numpy_reduce(inputs, col.ReduceOp.MAX) if rank == root
            else inputs[rank])
        np.testing.assert_array_equal(out["broadcast"], inputs[root])
        for j in range(p):
            np.testing.assert_array_equal(out["allgather"][j], inputs[j])
            np.testing.assert_array_equal(out["alltoall"][j], blocks[j][rank])
        np.testing.assert_array_equal(
            out["reducescatter"], numpy_reduce([blocks[r][rank] for r in range(p)],
                                               col.ReduceOp.SUM))


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "recursive_doubling"])
def test_large_allreduce_in_many_parts_is_exact(tmp_path, algorithm):
    count = 3 * PART // 4 + 5                 # 3 parts and a few bytes of float32
    p = 4

    def body(rank):
        y = rank_data(rank, count, np.float32)
        col.allreduce(y)
        return y

    expected = numpy_reduce([rank_data(r, count, np.float32) for r in range(p)],
                            col.ReduceOp.SUM)
    for y in _run(tmp_path, p, body, forced={"allreduce": algorithm}):
        np.testing.assert_array_equal(y, expected)


def test_parts_that_arrive_before_their_receive_wait_for_it(tmp_path):
    """Rank 0 sends two large messages on two tags; rank 1 receives them in the other order,
    so the first message's parts (in shared memory) wait, unexpected, while later packets reuse
    the receive buffer."""
    count = 2 * PART // 8 + 11
    first, second = np.arange(count, dtype=np.float64), -np.arange(count, dtype=np.float64)
    sent = threading.Event()

    def body(rank):
        if rank == 0:
            col.send(first, 1, tag=1)
            col.send(second, 1, tag=2)
            sent.set()  # both messages are on their way before rank 1 asks for either
            return None
        assert sent.wait(60)
        b, a = np.zeros(count), np.zeros(count)
        col.recv(b, 0, tag=2)
        col.recv(a, 0, tag=1)
        return a, b

    a, b = _run(tmp_path, 2, body)[1]
    np.testing.assert_array_equal(a, first)
    np.testing.assert_array_equal(b, second)


def test_shared_memory_is_released_back_to_the_sender(tmp_path):
    count = 4 * PART // 8

    def body(rank):
        x = np.ones(count)
        for _ in range(3):
            col.allreduce(x)
        col.barrier()
        transport = current_registry().get("default").membership.transport
        transport.node_carrier.collect_releases()
        return x, transport.node_carrier.live_payloads()

    for x, live in _run(tmp_path, 2, body):
        np.testing.assert_array_equal(x, np.full(count, 8.0))
        assert live == 0


def _wait_refused(transport, before, deadline_s=5.0):
    deadline = time.monotonic() + deadline_s
    while transport.refused_connections == before and time.monotonic() < deadline:
        transport.progress.progress(0.05)
    return transport.refused_connections - before


def test_a_connection_without_the_group_key_is_refused_and_never_read(tmp_path):
    transports = _transports(tmp_path / "group", 2)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stranger.connect(transports[0].peers[0].socket_path)
    stranger.send(wire.hello(1, b"x" * 16))
    stamp = HeaderTemplate(CallHeader("g", 0, 0, "send/recv", "direct", "float64", 1, (1,))
                           ).stamp(0)
    frame = wire.data_frame(0, 0, 1, 8, 0, 8, wire.INLINE, 0, len(stamp.packed))
    stranger.send(frame + stamp.packed + np.float64(42).tobytes())
    out = np.zeros(1)
    receive = transports[0].irecv(1, 0, stamp, 0, out)
    assert _wait_refused(transports[0], 0) == 1
    assert not receive.done and out[0] == 0
    assert transports[0].wait([receive], time.monotonic() + 0.2) == [receive]
    stranger.close()
    for transport in transports:
        transport.close()


def test_a_malformed_frame_breaks_the_call_with_a_clear_error(tmp_path):
    transports = _transports(tmp_path / "group", 2)
    rogue = uds.connect(transports[0].peers[0].socket_path, 1, KEY, 5)
    rogue.send((b"\x02garbage",))
    stamp = HeaderTemplate(CallHeader("g", 0, 0, "send/recv", "direct", "float64", 1, (1,))
                           ).stamp(0)
    receive = transports[0].irecv(1, 0, stamp, 0, np.zeros(1))
    with pytest.raises(CollectiveError, match="malformed frame"):
        transports[0].wait([receive], time.monotonic() + 5)
    rogue.close()
    for transport in transports:
        transport.close()


def test_a_peer_process_that_dies_is_named_long_before_the_deadline(tmp_path):
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        transports = _transports(tmp_path / "group", 2, pids=[os.getpid(), peer.pid])
        stamp = HeaderTemplate(CallHeader("g", 0, 0, "allreduce", "ring", "float64", 1, (1,))
                               ).stamp(7)
        receive = transports[0].irecv(1, COLLECTIVE_TAG, stamp, 0, np.zeros(1))
        killer = act_while_waiting(transports[0], peer.kill)
        started = time.monotonic()
        deadline_s = 30.0
        with pytest.raises(PeerDiedError) as caught:
            transports[0].wait([receive], time.monotonic() + deadline_s)
        killer.join()
        assert caught.value.dead_ranks == (1,) and caught.value.seq == 7
        assert time.monotonic() - started < deadline_s / 10  # found, not waited out
    finally:
        peer.kill()
        peer.wait()


def test_the_state_page_tells_stalled_ranks_from_waiting_and_finished_ones(tmp_path, monkeypatch):
    from ray_collective.transport import node_state
    monkeypatch.setattr(node_state, "STALL_S", 0.05)
    state = node_state.NodeState(str(tmp_path), "g", 5)
    try:
        for rank in range(4):
            state.arrive(rank, 7)        # rank 4 never starts call 7
        state.complete(1)                # rank 1 finished it and computes elsewhere
        state.arrive(3, 8)               # rank 3 is already in the next call
        time.sleep(2 * node_state.STALL_S)
        state.beat(0)                    # rank 0 waits in call 7 and keeps beating
        # rank 2 started call 7 and has given no sign of life since: stalled
        assert state.responsive(list(range(5)), 7) == [0, 1, 3]
        assert state.responsive([2, 3], 8) == [] and state.responsive([3], 6) == [3]
        # rank 0, alive in call 7, holds up nobody's call 9: it waits for someone else
        assert state.responsive([0, 1], 9) == [0]
    finally:
        state.close()


def test_an_abort_after_the_page_is_closed_publishes_nothing(tmp_path):
    state = NodeState(str(tmp_path), "g", 2)
    state.close()
    assert state.abort({"rank": 1, "group": "g"}) is False
    assert not os.path.exists(os.path.join(str(tmp_path), "abort.json"))


def test_only_the_first_abort_is_published_and_only_its_caller_is_told_to_wake_the_others(
        tmp_path):
    state = NodeState(str(tmp_path), "g", 3)
    try:
        assert state.abort({"rank": 2, "group": "g", "kind": "first"}) is True
        assert state.abort({"rank": 0, "group": "g", "kind": "second"}) is False
        assert state.aborted()["kind"] == "first"
    finally:
        state.close()


def test_ranks_raising_an_abort_they_read_do_not_knock_again(tmp_path, monkeypatch):
    """One abort wakes a node's n-1 other ranks once: were every rank that raises it to
    knock too, n ranks would make n² connections (160 000 at 400 ranks)."""
    transports = _transports(tmp_path / "group", 5)
    knocked = []
    monkeypatch.setattr(uds, "knock", knocked.append)
    try:
        transports[3].abort(PeerDiedError("g", 3, "allreduce", 1, [4]))
        for transport in transports[:3]:
            transport.abort(PeerDiedError("g", transport.rank, "allreduce", 1, [4]))
        assert sorted(knocked) == sorted(os.path.join(str(tmp_path / "group"), f"{rank}.sock")
                                         for rank in (0, 1, 2, 4))
        assert transports[0].state.aborted()["rank"] == 3
    finally:
        for transport in transports:
            transport.close()


def test_a_nap_on_the_listener_says_whether_a_knock_ended_it(tmp_path):
    path = str(tmp_path / "0.sock")
    listener = uds.listen(path, 4)
    try:
        started = time.monotonic()
        assert uds.wait_for_knock(listener, 0.05) is False
        assert time.monotonic() - started >= 0.04
        uds.knock(path)
        # Woken at once, and the knock stays for the transport to accept (and find empty).
        assert uds.wait_for_knock(listener, 10) is True
        assert uds.wait_for_knock(listener, 10) is True
        connection, _ = listener.accept()
        connection.close()
        assert uds.wait_for_knock(listener, 0.01) is False
    finally:
        listener.close()
