"""The streams between nodes (``transport.tcp``) without Ray: the handshake, the framing, and
the ``ray`` transport over real TCP on the loopback address, every rank a thread of this
process and the ranks split between two pretend nodes (so that every message between them
takes a stream): every collective against numpy, a key that is wrong, a stream that ends.
"""

import os
import select
import socket
import time

import numpy as np
import pytest

import ray_collective as col
from support.helpers import act_while_waiting, numpy_reduce, rank_data
from support.contract import check_every_collective, every_collective
from ray_collective.backends.base import BackendFactory
from ray_collective.engine.cpu import TransportMembership
from ray_collective.errors import CollectiveError, PeerDiedError, error_record
from ray_collective.testing import run_ranks
from ray_collective.transport import handshake, tcp, uds, wire
from ray_collective.transport.handshake import Handshake
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.node_state import NodeState
from ray_collective.transport.link_transport import LinkTransport, Peer
from ray_collective.transport.post_office_carrier import PostOffices
from ray_collective.transport.stream_carrier import Streams
from ray_collective.transport.wire import CallHeader, HeaderTemplate

DEADLINE_S = 30.0
"""The deadline of the waits that must end early, told of a failure."""
KEY = b"0123456789abcdef"
WRONG_KEY = b"fedcba9876543210"
HOST = "127.0.0.1"
PART = tcp.STREAM_PART_BYTES


def _stamp(collective="send/recv", count=1, seq=0):
    return HeaderTemplate(CallHeader("g", 0, 0, collective, "direct", "float64", count,
                                     (count,))).stamp(seq)


def _pair(connect_key=KEY, accept_key=KEY):
    """A connected (connecting link of rank 1, accepting link of rank 0) over loopback TCP."""
    server = tcp.listen(HOST, 4)
    try:
        connector = tcp.connect(HOST, server.getsockname()[1], 1, 0, connect_key, 5)
        deadline = time.monotonic() + 5
        while True:
            try:
                sock, _ = server.accept()
                break
            except BlockingIOError:
                assert time.monotonic() < deadline
                time.sleep(0.001)
    finally:
        server.close()
    return connector, tcp.accepted(sock, 0, accept_key)


def _pump(links, seconds):
    """Flush and read every link for ``seconds`` (handshake errors propagate)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _read_once(links)
        time.sleep(0.0005)


def _read_once(links):
    """Flush and read every link once; the frames each received, as bytes."""
    frames = [[] for _ in links]
    for i, link in enumerate(links):
        link.flush()
        while not link.closed:
            frame = link.receive()
            if frame is None:
                break
            frames[i].append(bytes(frame))
    return frames


def test_both_ends_prove_the_key_then_frames_flow_whole_and_in_order():
    connector, acceptor = _pair()
    payload = np.arange(3 * PART // 8 + 5, dtype=np.float64)   # 4 parts, the last one short
    stamp = _stamp(count=len(payload))

    class Done:
        done = False

    request = Done()
    frames = tcp.frame_pieces(3, 7, len(payload), stamp.packed, payload)
    for frame in frames[:-1]:
        connector.send(frame)
    connector.send(frames[-1], request)
    assert not request.done  # nothing leaves before the accepting end's proof
    received = []
    deadline = time.monotonic() + 5
    while not (request.done and len(received) == len(frames)):
        assert time.monotonic() < deadline, "the frames did not arrive"
        received += _read_once([connector, acceptor])[1]
    assert connector.open and acceptor.open and acceptor.peer == 1
    rebuilt = np.zeros_like(payload)
    offsets = []
    for frame in received:
        tag, part = wire.parse_data(memoryview(frame), None)
        assert (tag, part.step, part.count, bytes(part.header)) == (7, 3, len(payload),
                                                                   stamp.packed)
        offsets.append(part.part_offset)
        rebuilt.view(np.uint8)[part.part_offset:part.part_offset + part.part_bytes] = \
            np.frombuffer(part.payload, np.uint8)
    assert offsets == [i * PART for i in range(len(frames))]
    assert len(acceptor._buffer) > PART    # grown for the first large part
    np.testing.assert_array_equal(rebuilt, payload)
    connector.close()
    acceptor.close()


def test_a_connector_without_the_key_is_refused_and_nothing_it_sent_after_is_read():
    connector, acceptor = _pair(connect_key=WRONG_KEY)
    connector.send(tcp.frame_pieces(0, 0, 1, _stamp().packed, np.ones(1))[0])
    with pytest.raises(handshake.HandshakeError):
        _pump([connector, acceptor], 2)
    assert acceptor.refused and acceptor.closed and acceptor.peer == -1
    connector.close()


def test_a_listener_that_cannot_prove_the_key_gets_nothing():
    """An impostor on a peer's port: it challenges, reads the response, and answers with a
    proof it cannot make; the connecting end closes without sending what it had queued."""
    server = socket.create_server((HOST, 0))
    connector = tcp.connect(HOST, server.getsockname()[1], 1, 0, KEY, 5)
    impostor, _ = server.accept()
    server.close()
    impostor.sendall(handshake.CHALLENGE.pack(handshake.MAGIC,
                                              os.urandom(handshake.NONCE_BYTES)))

    class Done:
        done = False

    request = Done()
    connector.send(tcp.frame_pieces(0, 0, 1, _stamp().packed, np.ones(1))[0], request)
    assert connector.receive() is None   # reads the challenge and answers it
    impostor.settimeout(5)
    response = b""
    while len(response) < handshake.RESPONSE.size:
        response += impostor.recv(handshake.RESPONSE.size - len(response))
    assert KEY not in response
    impostor.sendall(os.urandom(handshake.PROOF.size))
    with pytest.raises(handshake.HandshakeError):
        _pump([connector], 2)
    assert connector.refused and connector.closed and not request.done
    impostor.settimeout(2)
    assert impostor.recv(1 << 16) == b""   # the stream ended with nothing after the response
    impostor.close()


def test_the_handshake_is_not_the_key_and_differs_per_connection():
    macs = {handshake.handshake_mac(KEY, b"connect", os.urandom(16), os.urandom(16), 1, 0)
            for _ in range(3)}
    assert len(macs) == 3 and all(KEY not in mac for mac in macs)
    assert handshake.handshake_mac(KEY, b"connect", b"a" * 16, b"b" * 16, 1, 0) != \
        handshake.handshake_mac(KEY, b"accept", b"a" * 16, b"b" * 16, 1, 0)


def test_a_frame_longer_than_the_protocol_allows_is_an_error():
    connector, acceptor = _pair()
    deadline = time.monotonic() + 5
    while not (connector.open and acceptor.open):
        assert time.monotonic() < deadline
        _read_once([connector, acceptor])
    connector.send([tcp.LENGTH.pack(tcp.MAX_FRAME_BYTES + 1)])
    with pytest.raises(ValueError, match="stream frame"):
        _pump([acceptor], 2)
    connector.close()
    acceptor.close()


def test_frames_cut_anywhere_by_the_stream_are_put_back_together():
    """A byte stream keeps no boundaries: frames fed one byte at a time come out whole."""
    writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = tcp.Stream(reader, Handshake(0, KEY, peer=1))
    link.open = True  # the handshake is tested above; this is about the framing
    reader.setblocking(False)
    stamp = _stamp(count=3)
    message = b"".join(bytes(piece) for frame in tcp.frame_pieces(
        0, 5, 3, stamp.packed, np.array([1.0, 2.0, 3.0])) for piece in frame) * 2
    frames = []
    for byte in message:
        writer.send(bytes([byte]))
        frame = link.receive()
        if frame is not None:
            frames.append(bytes(frame))
    assert len(frames) == 2 and frames[0] == frames[1]
    assert len(link._buffer) == tcp.SMALL_BUFFER_BYTES   # small messages, small buffer
    tag, part = wire.parse_data(memoryview(frames[0]), None)
    assert tag == 5 and np.frombuffer(part.payload).tolist() == [1.0, 2.0, 3.0]
    writer.close()
    link.close()


def _open_reader():
    """(writer socket, reading link past its handshake) over a socket pair."""
    writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.enlarge_buffers(writer, 4 * PART)
    uds.enlarge_buffers(reader, 4 * PART)
    reader.setblocking(False)
    link = tcp.Stream(reader, Handshake(0, KEY, peer=1))
    link.open = True
    return writer, link


def _receive_all(link, count, seconds=5):
    """The next ``count`` frames, each as (frame bytes, placed payload bytes or None)."""
    frames, deadline = [], time.monotonic() + seconds
    while len(frames) < count:
        assert time.monotonic() < deadline, "the frames did not arrive"
        frame = link.receive()
        if frame is not None:
            frames.append((bytes(frame), None if link.placed is None else bytes(link.placed)))
    return frames


def test_a_large_payload_whose_receive_waits_is_read_straight_into_its_buffer():
    writer, link = _open_reader()
    payload = np.arange(2 * PART // 8, dtype=np.float64)              # two full parts
    small = np.arange(5, dtype=np.float64)
    stamp = _stamp(count=len(payload))
    target = np.zeros(len(payload), np.float64)
    asked = []

    def placer(head):
        tag, part = wire.parse_data_head(head, None)
        asked.append((tag, part.part_offset))
        if part.part_offset:
            return None     # the second part: no receive waits, it arrives whole
        return memoryview(target.view(np.uint8))[:part.part_bytes]

    link.placer = placer
    for frame in tcp.frame_pieces(0, 4, len(payload), stamp.packed, payload) + \
            tcp.frame_pieces(1, 4, len(small), stamp.packed, small):
        writer.sendall(b"".join(bytes(piece) for piece in frame))
    (first, placed), (second, not_placed), (third, _) = _receive_all(link, 3)
    assert asked == [(4, 0), (4, PART)]              # never asked for the small message
    # the placed frame ends with its call header, its payload is already in place
    assert len(first) == wire.DATA_FRAME.size + len(stamp.packed)
    assert placed == payload.view(np.uint8)[:PART].tobytes()
    np.testing.assert_array_equal(target[:PART // 8], payload[:PART // 8])
    assert not_placed is None
    tag, part = wire.parse_data(memoryview(second), None)
    assert bytes(part.payload) == payload.view(np.uint8)[PART:].tobytes()
    tag, part = wire.parse_data(memoryview(first), None,
                                memoryview(target.view(np.uint8))[:PART])
    assert part.placed and part.part_bytes == PART
    tag, part = wire.parse_data(memoryview(third), None)
    np.testing.assert_array_equal(np.frombuffer(part.payload), small)
    writer.close()
    link.close()


def test_a_kept_large_payload_takes_the_streams_buffer_and_later_frames_stay_whole():
    writer, link = _open_reader()
    payload = np.arange(3 * PART // 8, dtype=np.float64)
    stamp = _stamp(count=len(payload))
    writer.sendall(b"".join(bytes(piece) for frame in tcp.frame_pieces(
        0, 4, len(payload), stamp.packed, payload) for piece in frame))
    kept = []
    deadline = time.monotonic() + 5
    while len(kept) < 3:
        assert time.monotonic() < deadline, "the frames did not arrive"
        frame = link.receive()
        if frame is None:
            continue
        buffer = link._buffer
        tag, part = wire.parse_data(frame, None)
        kept.append(link.own(part.payload))
        assert link._buffer is not buffer                       # given up, not copied
    assert link.own(memoryview(b"x" * 100)) == b"x" * 100      # a small one is copied
    assert b"".join(bytes(view) for view in kept) == payload.tobytes()
    writer.close()
    link.close()


# ---------------------------------------------------------- the transport over streams

def pretend_nodes(world_size):
    """The node of every rank: the first half on "a", the others on "b"."""
    return ["a" if rank < (world_size + 1) // 2 else "b" for rank in range(world_size)]


def two_node_transports(tmp_path, world_size, key_of=lambda rank: KEY, post_offices=None,
                        over_streams=True):
    """Ranks on two pretend nodes (``pretend_nodes``), with streams between them on loopback
    unless ``over_streams`` is False (and ``post_offices``, if given, for every rank)."""
    nodes = pretend_nodes(world_size)
    paths = []
    for rank, node in enumerate(nodes):
        directory = str(tmp_path / node)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        paths.append(os.path.join(directory, f"{rank}.sock"))
    peers = [Peer(nodes[r], os.getpid(), paths[r]) for r in range(world_size)]
    streams = [None] * world_size
    if over_streams:
        listeners = [tcp.listen(HOST, 16) for _ in range(world_size)]
        addresses = {r: (HOST, listener.getsockname()[1]) for r, listener in enumerate(listeners)}
        streams = [Streams(listener, addresses.__getitem__) for listener in listeners]
    return [LinkTransport(rank, "g", key_of(rank), peers, uds.listen(paths[rank], 16),
                         NodeState(os.path.dirname(paths[rank]), "g", world_size), post_offices,
                         connect_timeout=5, streams=streams[rank])
            for rank in range(world_size)]


class StreamFactory(BackendFactory):
    name = "stream-test"

    def __init__(self, transports, forced=None):
        self.transports = transports
        self.forced = forced or {}

    def available(self):
        return True

    def create(self, group_name, world_size, rank, timeout):
        return TransportMembership(group_name, self.transports[rank], forced=self.forced,
                                node_of=[t.node for t in self.transports])


@pytest.mark.parametrize("dtype,op_name,count", [
    ("float64", "SUM", 0), ("int64", "SUM", 1), ("float32", "MAX", 1000),
    ("float64", "SUM", 2 * PART // 8 + 3), ("int32", "PRODUCT", 7), ("float64", "AVG", 1003),
    ("float32", "PRODUCT", 9)])
def test_every_collective_across_two_nodes_over_streams_matches_numpy(tmp_path, dtype,
                                                                      op_name, count):
    p = 4
    factory = StreamFactory(two_node_transports(tmp_path, p))
    results = run_ranks(p, lambda rank: every_collective(rank, "default", p, dtype, op_name,
                                                         count, "numpy"),
                        factory_of=lambda rank: factory, timeout=60)
    check_every_collective(results, p, dtype, op_name, count)


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "hierarchical",
                                       "hierarchical_sharded"])
def test_a_large_allreduce_in_many_stream_parts_is_exact(tmp_path, algorithm):
    count, p = 5 * PART // 4 + 5, 4       # several stream parts per message, float32

    def body(rank):
        y = rank_data(rank, count, np.float32)
        col.allreduce(y)
        return y

    factory = StreamFactory(two_node_transports(tmp_path, p), {"allreduce": algorithm})
    expected = numpy_reduce([rank_data(r, count, np.float32) for r in range(p)],
                            col.ReduceOp.SUM)
    for y in run_ranks(p, body, factory_of=lambda rank: factory, timeout=60):
        np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("root", [1, 2])
def test_a_large_broadcast_down_the_node_chain_over_streams_is_exact(tmp_path, root):
    count, p = 300_000, 4    # 2.4 MB of float64: two chunks of several stream parts each

    def body(rank):
        y = rank_data(rank, count, np.float64)
        col.broadcast(y, root)
        return y

    factory = StreamFactory(two_node_transports(tmp_path, p),
                            {"broadcast": "hierarchical_pipeline"})
    for y in run_ranks(p, body, factory_of=lambda rank: factory, timeout=60):
        np.testing.assert_array_equal(y, rank_data(root, count, np.float64))


def test_a_live_transport_refuses_a_stream_without_the_key_and_reads_nothing(tmp_path):
    transports = two_node_transports(tmp_path, 2)
    host, port = transports[0].stream_carrier.streams.address(0)
    stranger = tcp.connect(host, port, 1, 0, WRONG_KEY, 5)
    stamp = _stamp()
    stranger.send(tcp.frame_pieces(0, 0, 1, stamp.packed, np.float64([42.0]))[0])
    out = np.zeros(1)
    receive = transports[0].irecv(1, 0, stamp, 0, out)
    deadline = time.monotonic() + 5
    while transports[0].refused_connections == 0 and time.monotonic() < deadline:
        transports[0].progress.progress(0.05)
        try:
            stranger.receive()
        except handshake.HandshakeError:
            pass
    assert transports[0].refused_connections == 1
    assert not receive.done and out[0] == 0
    stranger.close()
    for transport in transports:
        transport.close()


def test_a_stream_that_ends_names_its_rank_at_once(tmp_path):
    transports = two_node_transports(tmp_path, 2)
    stamp = _stamp("allreduce", seq=4)
    receive = transports[0].irecv(1, COLLECTIVE_TAG, stamp, 0, np.zeros(1))
    # Rank 1 takes the stream rank 0 opened, then leaves without sending.
    deadline = time.monotonic() + 5
    while not transports[1].failures.streamed and time.monotonic() < deadline:
        transports[1].progress.progress(0.01)
        transports[0].progress.progress(0.01)
    assert transports[1].failures.streamed
    killer = act_while_waiting(transports[0], transports[1].close)
    started = time.monotonic()
    with pytest.raises(PeerDiedError) as caught:
        transports[0].wait([receive], time.monotonic() + DEADLINE_S)
    killer.join()
    assert caught.value.dead_ranks == (1,) and caught.value.seq == 4
    assert "stream" in str(caught.value)
    assert time.monotonic() - started < DEADLINE_S / 10  # told, not waited out
    transports[0].close()


def test_close_leaves_no_listener_and_no_stream(tmp_path):
    transports = two_node_transports(tmp_path, 2)
    address = transports[0].stream_carrier.streams.address(0)
    stamp = _stamp()
    send = transports[1].isend(0, 0, stamp, 0, np.ones(1))
    receive = transports[0].irecv(1, 0, stamp, 0, np.zeros(1))
    deadline = time.monotonic() + 5
    while not (send.done and receive.done):
        assert time.monotonic() < deadline
        transports[1].wait([send], time.monotonic() + 0.01)
        transports[0].wait([receive], time.monotonic() + 0.01)
    streams = (transports[0].stream_carrier.open_streams()
               + transports[1].stream_carrier.open_streams())
    assert streams
    for transport in transports:
        transport.close()
    assert all(s.closed and s.sock.fileno() == -1 for s in streams)
    assert all(t.stream_carrier.streams.listener.fileno() == -1 for t in transports)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=2).close()


def test_a_stranger_that_never_answers_the_challenge_is_closed_in_time(tmp_path, monkeypatch):
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT_S", 0.2)
    transports = two_node_transports(tmp_path, 2)
    silent = socket.create_connection(transports[0].stream_carrier.streams.address(0), timeout=5)
    receive = transports[0].irecv(1, 0, _stamp(), 0, np.zeros(1))
    assert transports[0].wait([receive], time.monotonic() + 1.0) == [receive]
    assert transports[0].refused_connections == 1
    challenge = silent.recv(handshake.CHALLENGE.size)
    assert challenge.startswith(handshake.MAGIC) and silent.recv(1) == b""   # closed
    silent.close()
    for transport in transports:
        transport.close()


def _exchange_once(transports, sender, receiver):
    stamp = _stamp()
    send = transports[sender].isend(receiver, 0, stamp, 0, np.ones(1))
    receive = transports[receiver].irecv(sender, 0, stamp, 0, np.zeros(1))
    deadline = time.monotonic() + 5
    while not (send.done and receive.done):
        assert time.monotonic() < deadline
        transports[sender].wait([send], time.monotonic() + 0.01)
        transports[receiver].wait([receive], time.monotonic() + 0.01)


def test_an_abort_crosses_to_the_other_node_on_the_stream_at_once(tmp_path):
    transports = two_node_transports(tmp_path, 2)
    _exchange_once(transports, 0, 1)
    receive = transports[1].irecv(0, COLLECTIVE_TAG, _stamp("allreduce", seq=3), 0,
                                  np.zeros(1))
    aborter = act_while_waiting(transports[1], lambda: transports[0].abort(
        PeerDiedError("g", 0, "allreduce", 3, [5], "its process exited")))
    started = time.monotonic()
    with pytest.raises(PeerDiedError) as caught:
        transports[1].wait([receive], time.monotonic() + DEADLINE_S)
    aborter.join()
    assert caught.value.dead_ranks == (5,) and "reported by rank 0" in str(caught.value)
    # no post office here: the stream told it, long before the deadline
    assert time.monotonic() - started < DEADLINE_S / 10
    for transport in transports:
        transport.close()


class QuietPostOffices(PostOffices):
    """Post offices that know of no death and carry nothing; the abort published for the whole
    group is ``published`` once ``after_s`` have passed."""

    def __init__(self, published, after_s):
        self.published, self.at = published, time.monotonic() + after_s

    def deliver(self, node, messages):
        raise AssertionError("streams carry every message here")

    def dead_ranks(self, node, ranks):
        return []

    def local_post_office_alive(self):
        return True

    def responsive(self, node, ranks, seq):
        return ranks

    def abort(self, record):
        pass

    def published_abort(self):
        return self.published if time.monotonic() >= self.at else None


@pytest.mark.parametrize("group", ["g", "another group"])
def test_a_rank_waiting_on_another_node_learns_the_abort_published_for_the_group(tmp_path,
                                                                                 group):
    """The drill across 8 nodes: the rank that saw the death left its call before answering
    a stream's handshake, and the other nodes' post offices were still starting; the waiting
    ranks learned of it 8-15 s later. Now they read the published abort every second."""
    published = error_record(group, 0, PeerDiedError(group, 0, "allreduce", 3, [5],
                                                     "its process exited"))
    transports = two_node_transports(tmp_path, 2, post_offices=QuietPostOffices(published, 0.3))
    receive = transports[1].irecv(0, COLLECTIVE_TAG, _stamp("allreduce", seq=3), 0,
                                  np.zeros(1))
    started = time.monotonic()
    if group == "g":
        with pytest.raises(PeerDiedError) as caught:
            transports[1].wait([receive], time.monotonic() + DEADLINE_S)
        assert caught.value.dead_ranks == (5,)
        assert time.monotonic() - started < DEADLINE_S / 10  # read, not waited out
        assert transports[0].state.aborted() is None    # another node: not told by rank 1
        assert transports[1].state.aborted()["rank"] == 0   # its node's page now holds it
    else:   # another group's record is none of this one's business
        assert transports[1].wait([receive], time.monotonic() + 1.5) == [receive]
        assert transports[1].state.aborted() is None
    for transport in transports:
        transport.close()


def test_when_one_of_two_streams_with_a_peer_ends_the_other_carries_its_messages(tmp_path):
    """Two ranks that connected to each other at once hold two streams; a peer that leaves
    closes both, and the end of the one this rank sent on may be read before the messages
    that came on the other: the other then carries on (and tells the peer's death at its own
    end), instead of a new connection, refused, calling the peer dead with its last message
    unread."""
    transports = two_node_transports(tmp_path, 2)
    stamp = _stamp()
    sends = [transports[0].isend(1, 0, stamp, 0, np.ones(1)),
             transports[1].isend(0, 0, stamp, 0, np.ones(1))]  # both connect
    receives = [transports[1].irecv(0, 0, stamp, 0, np.zeros(1)),
                transports[0].irecv(1, 0, stamp, 0, np.zeros(1))]
    deadline = time.monotonic() + 5
    while not all(r.done for r in sends + receives):
        assert time.monotonic() < deadline
        for transport in transports:
            transport.wait(sends + receives, time.monotonic() + 0.01)
    rank0 = transports[0]
    streams = [link for link in rank0.stream_carrier.open_streams() if link.peer == 1]
    assert len(streams) == 2 and all(link.open for link in streams)
    carrier = rank0.stream_carrier
    first = carrier.sending_stream(1)
    carrier.drop(first)                          # its end was read first
    assert carrier.sending_stream(1) in streams and carrier.sending_stream(1) is not first
    assert 1 not in rank0.failures.dead
    payload = np.arange(1000, dtype=np.float64)
    big = _stamp(count=len(payload))
    send = transports[1].isend(0, 0, big, 1, payload)
    out = np.zeros_like(payload)
    receive = rank0.irecv(1, 0, big, 1, out)
    while not (send.done and receive.done):
        assert time.monotonic() < deadline
        transports[1].wait([send], time.monotonic() + 0.01)
        rank0.wait([receive], time.monotonic() + 0.01)
    np.testing.assert_array_equal(out, payload)
    for transport in transports:
        transport.close()


def test_a_rank_reads_ahead_of_its_receives_only_a_budget_per_turn(tmp_path):
    """A peer that sends faster than a rank reads must not keep it reading: past the budget of
    parts no receive waits for, it handles what its buffer holds and turns to its other
    sockets; the rest waits in the kernel, and nothing is lost."""
    transports = two_node_transports(tmp_path, 2)
    _exchange_once(transports, 0, 1)
    payload = np.arange(3 * (1 << 20) // 8, dtype=np.float64)     # 3 MiB, 12 stream parts
    stamp = _stamp(count=len(payload))
    send = transports[0].isend(1, 0, stamp, 0, payload)
    deadline = time.monotonic() + 5
    while not send.done:   # the kernels hold it all (4 MiB buffers)
        assert time.monotonic() < deadline
        transports[0].wait([send], time.monotonic() + 0.01)
    receiver = transports[1]
    for link in receiver.stream_carrier.open_streams():   # one or two streams with rank 0
        receiver.stream_carrier.read(link, tcp.READ_BUDGET_BYTES)
    kept = receiver.progress.inbox.unexpected_parts() * PART
    assert tcp.READ_BUDGET_BYTES <= kept < tcp.READ_BUDGET_BYTES + 2 * PART
    out = np.zeros_like(payload)
    receive = receiver.irecv(0, 0, stamp, 0, out)
    assert receiver.wait([receive], time.monotonic() + 5) == ()
    np.testing.assert_array_equal(out, payload)
    for transport in transports:
        transport.close()


def test_a_frame_already_in_the_buffer_is_returned_without_reading_the_socket():
    writer, link = _open_reader()
    stamp = _stamp(count=1)
    small = b"".join(bytes(piece) for piece in tcp.frame_pieces(0, 4, 1, stamp.packed,
                                                                 np.ones(1))[0])
    large = b"".join(bytes(piece) for piece in tcp.frame_pieces(
        1, 4, PART // 8, stamp.packed, np.ones(PART // 8))[0])
    writer.sendall(small * 2 + large[:1000])
    deadline = time.monotonic() + 5
    while link.receive() is None:
        assert time.monotonic() < deadline
    assert bytes(link.receive(read=False)) == small[4:]   # whole in the buffer already
    writer.sendall(large[1000:])
    assert select.select([link.sock], [], [], 5)[0]        # the rest has reached the kernel
    assert link.receive(read=False) is None                # and is left there
    assert len(_receive_all(link, 1)[0][0]) == len(large) - 4
    writer.close()
    link.close()


@pytest.mark.parametrize("frame", [
    b"\x02garbage", bytes([wire.ABORT]) + b"not json", bytes([wire.ABORT]) + b"[1, 2]",
    bytes([wire.ABORT]) + b'{"group": "g"}',
    bytes([wire.ABORT]) + b'{"group": "other", "rank": 0, "kind": "X", "message": ""}'])
def test_a_malformed_frame_on_a_stream_breaks_the_call_and_publishes_nothing(tmp_path, frame):
    transports = two_node_transports(tmp_path, 2)
    host, port = transports[0].stream_carrier.streams.address(0)
    rogue = tcp.connect(host, port, 1, 0, KEY, 5)
    rogue.send(tcp.control_frame(frame))
    receive = transports[0].irecv(1, 0, _stamp(), 0, np.zeros(1))
    deadline = time.monotonic() + 5
    with pytest.raises(CollectiveError, match="malformed frame"):
        while time.monotonic() < deadline:
            rogue.receive()
            rogue.flush()
            transports[0].wait([receive], time.monotonic() + 0.05)
    assert transports[0].state.aborted() is None
    rogue.close()
    for transport in transports:
        transport.close()


class _CountingSocket:
    """A socket that counts the reads made of it (and is otherwise the socket)."""

    def __init__(self, sock):
        self._sock = sock
        self.reads = 0

    def recv_into(self, *args):
        self.reads += 1
        return self._sock.recv_into(*args)

    def recvmsg_into(self, *args):
        self.reads += 1
        return self._sock.recvmsg_into(*args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("sender", [1, 2], ids=["same node", "other node"])
def test_a_small_message_costs_its_receiver_one_read_of_its_socket(tmp_path, sender):
    """Reading on until the kernel says it holds no more costs every small message a second,
    failed read; the receiver reads once and lets poll tell it of anything more."""
    transports = two_node_transports(tmp_path, 4)
    receiver = transports[0]
    _exchange_once(transports, sender, 0)
    links = [link for link in (*receiver.node_carrier.connections(),
                               *receiver.stream_carrier.open_streams()) if link.peer == sender]
    counters = []
    for link in links:
        link.sock = _CountingSocket(link.sock)
        counters.append(link.sock)
    messages = 5
    for seq in range(1, messages + 1):
        stamp = _stamp(seq=seq)
        out = np.zeros(1)
        receive = receiver.irecv(sender, 0, stamp, 0, out)
        send = transports[sender].isend(0, 0, stamp, 0, np.full(1, float(seq)))
        assert transports[sender].wait([send], time.monotonic() + 5) == ()
        assert receiver.wait([receive], time.monotonic() + 5) == ()
        assert out[0] == seq
    assert sum(counter.reads for counter in counters) == messages
    for transport in transports:
        transport.close()
