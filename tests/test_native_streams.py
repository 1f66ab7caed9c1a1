"""Rounds between nodes on the native core (``native/streams.c``, ``engine.stream_rounds``).

First the core's ``stream_round`` alone, over socket pairs: its frames byte for byte those of
``transport.tcp``, frames made by ``transport.tcp`` read, checked, copied or reduced as numpy
would, other channels' frames and ABORTs handed back whole and in order, a stream that ends, a
frame the protocol forbids, a part unlike the receive's, a deadline, a malformed table. Then
groups on the native core across two pretend nodes over real TCP on loopback (every rank a
thread): every collective against numpy with the rounds between nodes in the core, the same
bits as the Python engine's rounds, a point-to-point message met by a collective round, ranks
that disagree about a call, and a rank whose streams close in the middle of a call.
"""

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import ray_collective as col
from support.contract import check_every_collective, every_collective
from support.helpers import numpy_reduce
from ray_collective import native
from ray_collective.backends.base import BackendFactory
from ray_collective.engine.cpu import TransportMembership
from ray_collective.errors import CollectiveError, CollectiveMismatchError, PeerDiedError
from ray_collective.testing import run_ranks
from ray_collective.transport import tcp, wire
from ray_collective.transport.wire import CallHeader, HeaderTemplate
from ray_collective.types import ReduceOp
from test_tcp import pretend_nodes, two_node_transports

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"the native core is not built: {native.import_error()}")

if native.available():
    from ray_collective.native import codes
    from ray_collective.engine.native_runner import (CORE_SPIN_S, SLICE_S, NativeRunner,
                                                     native_node)
    from ray_collective.engine.stream_rounds import StreamRounds
    CORE = native.core()

PART = tcp.STREAM_PART_BYTES
SEND = 1  # codes.MESSAGE_SEND, codes.MESSAGE_REDUCE (the module imports only with the core)
REDUCE = 2


def _stamp(collective="allreduce", dtype="float32", count=10, seq=3):
    return HeaderTemplate(CallHeader("g", 0, 0, collective, "ring", dtype, count,
                                     (count,))).stamp(seq)


def _frames(step, tag, array, stamp, part_bytes=PART):
    """The bytes ``transport.tcp`` writes for one message."""
    return b"".join(bytes(piece) for frame in tcp.frame_pieces(step, tag, len(array),
                                                               stamp.packed, array, part_bytes)
                    for piece in frame)


@pytest.fixture
def pair():
    ends = socket.socketpair()
    for end in ends:
        end.setblocking(False)
    yield ends
    for end in ends:
        end.close()


def _round(fds, rows, slots, stamp, dtype="float32", op=None, tag=-1, timeout=5.0,
           on_event=None, part_bytes=PART, watched=(), spin_s=0.0):
    events = []

    def record(kind, stream, detail):
        events.append((kind, stream, detail))
        if on_event is not None:
            on_event(kind, stream, detail)

    op_code = codes.NO_OP if op is None else codes.op_code(op, dtype)
    # The first arguments by position, the others by name, as the core takes either.
    pending = CORE.stream_round(fds, np.array(rows, np.int64).reshape(-1, 6), slots,
                                stamp.packed, codes.dtype_code(dtype), op_code, tag,
                                part_bytes=part_bytes, max_frame_bytes=tcp.MAX_FRAME_BYTES,
                                timeout_s=timeout, slice_s=0.02, on_event=record,
                                watched=watched, spin_s=spin_s)
    return pending, events


def _read_all(sock, nbytes):
    data = b""
    while len(data) < nbytes:
        try:
            data += sock.recv(nbytes - len(data))
        except BlockingIOError:
            threading.Event().wait(0.001)
    return data


@pytest.mark.parametrize("count,part_bytes", [(0, PART), (1, PART), (10, PART),
                                              (PART // 4 + 3, PART), (1000, 1024)])
def test_the_cores_frames_are_the_bytes_tcp_writes(pair, count, part_bytes):
    stamp = _stamp(count=count)
    data = np.arange(count, dtype=np.float32) * 1.5
    want = _frames(7, -1, data, stamp, part_bytes)
    read = []
    reader = threading.Thread(target=lambda: read.append(_read_all(pair[1], len(want))))
    reader.start()
    pending, events = _round([pair[0].fileno()], [[0, SEND, 7, 0, 0, count]], [data], stamp,
                             part_bytes=part_bytes)
    reader.join()
    assert pending == [] and all(kind == CORE.STREAM_SLICE for kind, _, _ in events)
    assert read == [want]


@pytest.mark.parametrize("dtype,op", [("float32", None), ("float64", ReduceOp.SUM),
                                      ("int32", ReduceOp.PRODUCT), ("int64", ReduceOp.MAX),
                                      ("float16", ReduceOp.MIN)])
@pytest.mark.parametrize("count", [1, 100, 3 * PART // 8 + 5])
def test_frames_tcp_wrote_are_copied_or_reduced_as_numpy_would(pair, dtype, op, count):
    rng = np.random.default_rng(count)
    incoming = (rng.random(count) * 10).astype(dtype)
    mine = (rng.random(count) * 10).astype(dtype)
    out = mine.copy()
    stamp = _stamp(dtype=dtype, count=count)
    pair[1].setblocking(True)
    writer = threading.Thread(target=pair[1].sendall, args=(_frames(2, -1, incoming, stamp),))
    writer.start()
    pending, events = _round([pair[0].fileno()], [[0, REDUCE if op else 0, 2, 0, 0, count]],
                             [out], stamp, dtype, op)
    writer.join()
    assert pending == [] and all(kind == CORE.STREAM_SLICE for kind, _, _ in events)
    want = incoming if op is None else numpy_reduce([mine, incoming], op)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("spin_s", [0.0, 500e-6])
def test_both_ends_in_the_core_exchange_large_messages_at_once(pair, spin_s):
    """Each end sends 24 MiB while it receives as much: neither waits for the other to read
    first (the kernel's buffers hold a fraction of it), whether a round that cannot move
    sleeps at once or polls first."""
    n = 3 * 2 ** 20
    stamp = _stamp(dtype="float64", count=n)
    sent = [np.random.default_rng(r).random(n) for r in range(2)]
    got = [np.zeros(n), np.zeros(n)]
    results = [None, None]

    def side(end):
        results[end] = _round([pair[end].fileno()], [[0, SEND, 1, 0, 0, n], [0, 0, 1, 1, 0, n]],
                              [sent[end], got[end]], stamp, "float64", timeout=30,
                              spin_s=spin_s)

    other = threading.Thread(target=side, args=(1,))
    other.start()
    side(0)
    other.join()
    assert results[0][0] == results[1][0] == []
    np.testing.assert_array_equal(got[0], sent[1])
    np.testing.assert_array_equal(got[1], sent[0])


def test_other_channels_frames_and_aborts_are_handed_over_whole_and_in_order(pair):
    stamp = _stamp(count=4)
    p2p = HeaderTemplate(CallHeader("g", 0, 0, "send/recv", "direct", "float32", 3,
                                    (3,))).stamp(0)
    abort = wire.abort_frame({"error": "x"})
    point = np.arange(3, dtype=np.float32)
    mine = np.arange(4, dtype=np.float32)
    pair[1].sendall(_frames(0, 5, point, p2p) + tcp.control_frame(abort)[0]
                    + _frames(1, -1, mine, stamp))
    out = np.zeros(4, np.float32)
    pending, events = _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [out], stamp)
    assert pending == []
    np.testing.assert_array_equal(out, mine)
    foreign = [(stream, detail) for kind, stream, detail in events
               if kind == CORE.STREAM_FOREIGN]
    assert foreign == [(0, _frames(0, 5, point, p2p)[4:]), (0, abort)]


def test_a_stream_that_ends_must_raise_and_ends_the_round(pair):
    pair[1].close()

    def ended(kind, stream, detail):
        if kind == CORE.STREAM_CLOSED:
            raise ConnectionError(f"stream {stream} ended")

    with pytest.raises(ConnectionError, match="stream 0 ended"):
        _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [np.zeros(4, np.float32)], _stamp(),
               on_event=ended)
    with pytest.raises(RuntimeError, match="must raise"):
        _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [np.zeros(4, np.float32)], _stamp())


@pytest.mark.parametrize("frame,reason", [
    (struct.pack("<I", tcp.MAX_FRAME_BYTES + 1), "stream frame of"),
    (struct.pack("<I", 0), "stream frame of 0 bytes"),
    (tcp.frame_pieces(1, -1, 4, _stamp().packed, np.zeros(4, np.float32))[0][0][:4 + 45]
     + struct.pack("<i", 3) + bytes(10), "shared-memory part")])
def test_a_frame_the_protocol_forbids_is_named(pair, frame, reason):
    pair[1].sendall(frame + bytes(64))
    seen = []

    def refuse(kind, stream, detail):
        if kind == CORE.STREAM_PROTOCOL:
            seen.append(detail)
            raise ValueError(detail)

    with pytest.raises(ValueError):
        _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [np.zeros(4, np.float32)], _stamp(),
               on_event=refuse)
    assert reason in seen[0]


@pytest.mark.parametrize("change", ["header", "step", "count"])
def test_a_part_unlike_the_receives_is_described_and_nothing_is_written(pair, change):
    stamp = _stamp(count=4)
    theirs = {"header": _stamp(count=4, seq=9), "step": stamp, "count": _stamp(count=5)}[change]
    data = np.arange(5 if change == "count" else 4, dtype=np.float32) + 1
    pair[1].sendall(_frames(8 if change == "step" else 1, -1, data, theirs))
    out = np.zeros(4, np.float32)
    details = []

    def mismatch(kind, stream, detail):
        if kind == CORE.STREAM_MISMATCH:
            details.append(detail)
            raise CollectiveMismatchError("g", 0, 1, "allreduce", 3, {})

    with pytest.raises(CollectiveMismatchError):
        _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [out], stamp, on_event=mismatch)
    index, received, header, step, count, nbytes, offset, part_bytes = details[0]
    assert (index, received, header, offset) == (0, 0, theirs.packed, 0)
    assert (step, count, nbytes) == (8 if change == "step" else 1, len(data), data.nbytes)
    assert not out.any()
    error = wire.part_difference(0, 1, stamp, 1, out, received, header, step, count, nbytes,
                                 offset, part_bytes)
    assert isinstance(error, CollectiveMismatchError)


@pytest.mark.parametrize("spin_s", [0.0, 500e-6])
def test_a_round_still_waiting_at_its_deadline_names_its_pending_messages(pair, spin_s):
    out = np.zeros(4, np.float32)
    data = np.ones(2, np.float32)
    pending, events = _round([pair[0].fileno()], [[0, SEND, 1, 1, 0, 2], [0, 0, 1, 0, 0, 4]],
                             [out, data], _stamp(), timeout=0.1, spin_s=spin_s)
    assert pending == [1]
    assert events and all(kind == CORE.STREAM_SLICE for kind, _, _ in events)


def test_a_watched_socket_that_becomes_ready_is_reported_once_while_the_round_waits(pair):
    other = socket.socketpair()
    try:
        other[1].sendall(b"x")
        out = np.zeros(4, np.float32)
        stamp = _stamp(count=4)

        def on_event(kind, stream, detail):
            if kind == CORE.STREAM_WATCHED:  # served: now the round's message comes
                pair[1].sendall(_frames(1, -1, np.ones(4, np.float32), stamp))

        pending, events = _round([pair[0].fileno()], [[0, 0, 1, 0, 0, 4]], [out], stamp,
                                 on_event=on_event, watched=[other[0].fileno()])
        assert pending == [] and out.tolist() == [1.0] * 4
        assert [(kind, stream) for kind, stream, _ in events
                if kind != CORE.STREAM_SLICE] == [(CORE.STREAM_WATCHED, 0)]
    finally:
        for end in other:
            end.close()


@pytest.mark.parametrize("row,slots,message", [
    ([1, 0, 1, 0, 0, 4], None, "stream the round does not have"),
    ([0, 0, 1, 1, 0, 4], None, "slot the call does not have"),
    ([0, 0, 1, 0, 2, 5], None, "outside its slot"),
    ([0, 7, 1, 0, 0, 4], None, "unknown flags"),
    ([0, REDUCE, 1, 0, 0, 4], None, "without a reduce op"),
    ([0, 0, 1, 0, 0, 4], "read-only", "read-only slot")])
def test_a_malformed_round_is_refused_before_anything_moves(pair, row, slots, message):
    array = np.zeros(4, np.float32)
    if slots == "read-only":
        array.flags.writeable = False
    with pytest.raises(ValueError, match=message):
        _round([pair[0].fileno()], [row], [array], _stamp())
    with pytest.raises(BlockingIOError):
        pair[1].recv(1)


# ------------------------------------------------------------------ groups across two nodes

class NativeStreamFactory(BackendFactory):
    """Ranks on two pretend nodes, each on its node's native core, the rounds between nodes in
    the core (``in_core``) or on the Python engine."""

    name = "native-stream-test"

    def __init__(self, tmp_path, world_size, in_core=True):
        self.transports = two_node_transports(tmp_path, world_size)
        self.in_core = in_core
        self.runners = [None] * world_size

    def available(self):
        return True

    def create(self, group_name, world_size, rank, timeout):
        transport = self.transports[rank]
        directory = os.path.dirname(transport.peers[rank].socket_path)
        streams = (StreamRounds(CORE, transport.stream_carrier, transport, SLICE_S,
                                CORE_SPIN_S) if self.in_core else None)
        runner = NativeRunner(native_node(directory, rank, world_size), transport, SLICE_S,
                              spans_nodes=True, streams=streams)
        self.runners[rank] = runner
        return TransportMembership(group_name, transport, node_of=pretend_nodes(world_size),
                                   native=runner)

    def rounds_in_core(self):
        return [runner.streams.rounds_run if runner.streams else 0 for runner in self.runners]


@pytest.mark.parametrize("dtype,op_name,count", [
    ("float64", "SUM", 1), ("float32", "MAX", 1000), ("float64", "SUM", 2 * PART // 8 + 3),
    ("int32", "PRODUCT", 7), ("float64", "AVG", 1003)])
def test_every_collective_across_nodes_with_rounds_in_the_core_matches_numpy(tmp_path, dtype,
                                                                            op_name, count):
    """Twice over: a round goes to the core once its peer's first message came (over the
    Python engine), which tells the stream that peer sends on."""
    p = 4
    factory = NativeStreamFactory(tmp_path, p)
    runs = run_ranks(p, lambda rank: [every_collective(rank, "default", p, dtype, op_name,
                                                       count, "numpy") for _ in range(2)],
                     factory_of=lambda rank: factory, timeout=60)
    for twice in zip(*runs):
        check_every_collective(list(twice), p, dtype, op_name, count)
    # Which rounds find their streams quiet depends on timing; some always do.
    assert sum(factory.rounds_in_core()) > 0


@pytest.mark.parametrize("count", [5, 3 * PART // 4 + 1])
def test_rounds_in_the_core_give_the_python_engines_bits(tmp_path, count):
    p = 4

    def body(rank):
        rng = np.random.default_rng(rank)
        tensors = [rng.standard_normal(count).astype(np.float32) for _ in range(3)]
        col.allreduce(tensors[0])
        col.allreduce(tensors[1], op=ReduceOp.PRODUCT)
        col.reduce(tensors[2], 3)
        return tensors

    outcomes = []
    for in_core in (True, False):
        factory = NativeStreamFactory(tmp_path / str(in_core), p, in_core)
        outcomes.append(run_ranks(p, body, factory_of=lambda rank: factory, timeout=60))
        assert (sum(factory.rounds_in_core()) > 0) == in_core
    for ours, theirs in zip(*outcomes):
        for a, b in zip(ours, theirs):
            assert a.tobytes() == b.tobytes()


def test_a_point_to_point_message_met_by_a_round_in_the_core_reaches_its_recv(tmp_path):
    """Rank 0 sends to rank 2 (another node), then both join an allreduce whose round in the
    core on rank 2 meets the message on the stream first: handed back, it waits in the inbox
    for rank 2's recv. (A first allreduce tells each leader the stream the other sends on; rank
    0 sends once rank 2 is out of it, so that no Python wait of rank 2's reads the message.)"""
    p = 4
    factory = NativeStreamFactory(tmp_path, p)
    carrier = factory.transports[2].stream_carrier
    handed_back = []
    deliver = carrier.deliver
    carrier.deliver = lambda stream, frame: (handed_back.append(frame), deliver(stream, frame))
    idle, sent = threading.Event(), threading.Event()

    def body(rank):
        total = np.full(3, rank + 1.0)
        got = np.zeros(5)
        col.allreduce(np.zeros(3))
        if rank == 2:
            idle.set()
            sent.wait(10)
        if rank == 0:
            idle.wait(10)
            col.send(np.arange(5.0), 2)
            sent.set()
        col.allreduce(total)
        if rank == 2:
            col.recv(got, 0)
        return total, got

    results = run_ranks(p, body, factory_of=lambda rank: factory, timeout=60)
    for total, _ in results:
        np.testing.assert_array_equal(total, np.full(3, 10.0))
    np.testing.assert_array_equal(results[2][1], np.arange(5.0))
    assert factory.rounds_in_core()[2] > 0
    assert len(handed_back) == 1 and handed_back[0].endswith(np.arange(5.0).tobytes())


def test_ranks_that_disagree_about_a_call_across_nodes_all_fail_and_none_hangs(tmp_path):
    p = 4
    factory = NativeStreamFactory(tmp_path, p)

    def body(rank):
        tensor = np.ones(8)
        col.allreduce(tensor)  # opens the streams: the next call's rounds can go to the core
        col.allreduce(tensor, op=ReduceOp.MAX if rank >= 2 else ReduceOp.SUM)

    results = run_ranks(p, body, factory_of=lambda rank: factory, timeout=20,
                        return_exceptions=True)
    assert all(isinstance(r, CollectiveError) for r in results), results
    assert any(isinstance(r, CollectiveMismatchError) for r in results), results


def test_a_rank_whose_streams_close_mid_call_is_named_dead_by_the_other_node(tmp_path):
    """Rank 2's streams shut while rank 0 waits in a round in the core for its message: rank
    0 names it dead at once (its node-mate, rank 3, whose peer still lives in this process,
    waits for its deadline)."""
    p = 4
    factory = NativeStreamFactory(tmp_path, p)
    closed = threading.Event()
    failed_after = []

    def body(rank):
        tensor = np.ones(8)
        col.allreduce(tensor)
        if rank == 2:
            threading.Event().wait(0.3)  # rank 0 is in its round by then
            for stream in factory.transports[2].stream_carrier.open_streams():
                stream.sock.shutdown(socket.SHUT_RDWR)
            closed.set()
            return None
        start = time.monotonic()
        try:
            col.allreduce(tensor)
        finally:
            if rank == 0:
                failed_after.append(time.monotonic() - start)

    results = run_ranks(p, body, factory_of=lambda rank: factory, timeout=5,
                        return_exceptions=True)
    assert isinstance(results[0], PeerDiedError) and results[0].dead_ranks == (2,), results
    assert failed_after[0] < 2.0, failed_after
    assert factory.rounds_in_core()[0] > 0
