"""The stream carrier: a rank's peers on other nodes, over authenticated TCP streams.

A stream between two ranks (``transport.tcp``) is opened at the join for the peers the backend
names (:func:`open_at_join`: the lower rank connects, one stream per pair, known from
the start as the one both send on), else on a rank's first send to, or receive from, a peer
on another node, by whichever end needs it first; all are read in the same poll loop as the
node's sockets. Both ends prove the group's key before any frame is read
(``transport.handshake``). Messages to a peer all take one stream, the first opened between the
two, to keep their order; when both connected at once, the second only brings the other's
messages. A stream ending means the peer died (a rank closes its streams only when it dies or
leaves the group) once every stream with it has ended; an ABORT frame on it publishes the
sender's failure on this node (``transport.failures``).
"""

from __future__ import annotations

import functools
import select
import struct
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveTimeoutError, PeerDiedError
from . import tcp, wire
from .base import Request, SendRequest
from .progress import POLL_INTERVAL_S, ProgressLoop
from .failures import FailureWatch
from .handshake import HandshakeError
from .link import Carrier


JOIN_ALL_PAIRS_MAX = 8
"""A group of at most this many ranks opens a stream between every two of its ranks on different
nodes at the join (:func:`peers_at_join`); a larger one only between the ranks of the same
index on their nodes (the lowest rank of each node among them), which keeps a rank's streams
to one per other node, and opens the others on first use."""


def peers_at_join(nodes: Sequence[str], rank: int) -> List[int]:
    """The ranks on other nodes that ``rank`` opens a stream with at the join: all of them in
    a group of at most ``JOIN_ALL_PAIRS_MAX`` ranks, else those whose index among their node's
    ranks (in rank order) is this rank's on its own. Every rank of the list names ``rank`` in
    its own.

    Args:
        nodes: every rank's node, by rank.
        rank: this rank.

    Returns:
        Ranks, ascending.
    """
    here = nodes[rank]
    if len(nodes) <= JOIN_ALL_PAIRS_MAX:
        return [peer for peer, node in enumerate(nodes) if node != here]
    index: Dict[int, int] = {}
    seen: Dict[str, int] = {}
    for peer, node in enumerate(nodes):
        index[peer] = seen.get(node, 0)
        seen[node] = index[peer] + 1
    return [peer for peer, node in enumerate(nodes)
            if node != here and index[peer] == index[rank]]


class Streams:
    """A rank's way to the ranks of other nodes over TCP (made by the backend).

    Args:
        listener: this rank's listening socket on its node's address.
        address: where rank ``peer`` listens: ``(host, port)``; it may wait for the peer to
            publish it, and raises ``OSError`` when it never does.
    """

    def __init__(self, listener, address: Callable[[int], Tuple[str, int]]):
        self.listener = listener
        self.address = address


class StreamCarrier(Carrier):
    """Streams to the ranks of other nodes.

    Args:
        rank: this rank.
        group_key: the incarnation's key (the handshake proves it).
        peers: where every rank lives (``node``), by rank.
        streams: this rank's listener and the way to the others'.
        progress: the rank's progress loop (its sockets are registered there).
        failures: the rank's failure watch (dead peers and aborts are reported there).
        connect_timeout: seconds a connection may take.

    Attributes:
        refused: streams closed because their other end did not prove the key in time.
    """

    def __init__(self, rank: int, group_key: bytes, peers: Sequence, streams: Streams,
                 progress: ProgressLoop, failures: FailureWatch, connect_timeout: float = 30.0):
        self.rank = rank
        self.group_key = group_key
        self.peers = tuple(peers)
        self.world_size = len(self.peers)
        self.node = self.peers[rank].node
        self.streams = streams
        self.progress = progress
        self.failures = failures
        self.connect_timeout = connect_timeout
        self.refused = 0
        self._by_fd: Dict[int, tcp.Stream] = {}
        self._to: Dict[int, tcp.Stream] = {}
        self._from: Dict[int, tcp.Stream] = {}  # the stream each peer's messages came on
        failures.streamed = self._to
        progress.register(streams.listener.fileno(), self._on_listener)

    # ------------------------------------------------------------------ sending

    def send(self, peer: int, tag: int, step: int, header: bytes,
             data: np.ndarray) -> Request:
        request = SendRequest(peer)
        stream = self.stream_to(peer, "send")
        frames = tcp.frame_pieces(step, tag, len(data), header, data)
        for frame in frames[:-1]:
            stream.send(frame)
        stream.send(frames[-1], request)
        self._watch(stream)
        return request

    def expect(self, peer: int) -> None:
        """Open a stream to ``peer``, whose message a receive now waits for, unless there is
        one: a stream to the sender, whoever opened it, is how its death is seen at once.
        Failing to open one raises nothing here: what the sender sent before it went may be in
        the inbox already, and the wait raises if the receive misses it."""
        if peer not in self._to and peer not in self.failures.dead:
            try:
                self.stream_to(peer, "recv")
            except PeerDiedError:
                pass

    def stream_to(self, peer: int, what: str) -> tcp.Stream:
        """The stream this rank sends to ``peer`` on: the first one opened between the two, by
        either end (messages to a peer must all take one stream to keep their order)."""
        stream = self._to.get(peer)
        if stream is None:
            failures = self.failures
            if peer in failures.dead:
                raise failures.peer_died([peer], what)
            try:
                host, port = self.streams.address(peer)
                stream = tcp.connect(host, port, self.rank, peer, self.group_key,
                                     self.connect_timeout)
            except OSError as err:
                failures.mark_dead(peer, f"its stream on node {self.peers[peer].node[:8]} "
                                         f"refused a connection: {err}")
                raise failures.peer_died([peer], what) from err
            self._to[peer] = stream
            self._add(stream)
        return stream

    def sends_on_its_stream(self, peer: int) -> None:
        """Take the one stream with ``peer`` as the one it sends on, before any message came
        (``open_at_join``: the pair has no other)."""
        self._from.setdefault(peer, self._to[peer])

    def send_abort(self, frame: bytes) -> None:
        """Tell every peer this rank has a stream with that the group broke (they publish it
        on their node and, breaking in turn, tell the nodes they have streams with)."""
        for stream in list(self._by_fd.values()):
            if stream.open and not (stream.closed or stream.unwritable):
                stream.send(tcp.control_frame(frame))

    # ---------------------------------------------------------------- receiving

    def _add(self, stream: tcp.Stream) -> None:
        stream.placer = functools.partial(self._destination, stream)
        self._by_fd[stream.fd] = stream
        self.progress.register(stream.fd, functools.partial(self._on_event, stream))

    def _destination(self, stream: tcp.Stream, head: memoryview) -> Optional[memoryview]:
        """Where the payload of the frame ``head`` starts belongs, when a receive waits for it
        (``Stream.placer``)."""
        if stream.peer < 0:
            return None
        try:
            tag, part = wire.parse_data_head(head, stream)
        except ValueError:
            return None  # the whole frame arrives, and is refused, as usual
        return self.progress.inbox.destination((stream.peer, tag), part)

    def _watch(self, stream: tcp.Stream) -> None:
        if stream.closed or stream.unwritable:
            self.read(stream)
            self.drop(stream)
        elif self._by_fd.get(stream.fd) is stream:
            self.progress.watch(stream.fd, stream.backlogged)

    def tick(self, now: float) -> None:
        """Close the accepted streams whose other end has not proved the key in time (a
        stranger that connected and said nothing holds no socket for long). Streams this
        rank opened wait: their peer answers when it next waits, however busy it is now."""
        for stream in list(self._by_fd.values()):
            if stream.peer < 0 and now - stream.opened_at > tcp.HANDSHAKE_TIMEOUT_S:
                self.refused += 1
                self.drop(stream, ended=False)

    def _on_event(self, stream: tcp.Stream, events: int) -> None:
        if events & select.POLLOUT:
            stream.flush()
        if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
            self.read(stream, tcp.READ_BUDGET_BYTES)
        self._watch(stream)

    def _on_listener(self, events: int) -> None:
        while True:
            try:
                sock, _ = self.streams.listener.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # the connection went before it was accepted
            self._add(tcp.accepted(sock, self.rank, self.group_key))

    def read(self, stream: tcp.Stream, budget: Optional[int] = None) -> None:
        """Handle what ``stream`` has received: its handshake, then its frames; once it has
        kept ``budget`` bytes of parts that no receive waits for yet, only the frames already
        whole in its buffer (the socket stays readable, and the next poll comes back to it).
        Likewise once a read drained the kernel: reading on would only fail with ``EAGAIN``
        (3 to 4 µs here, with its exception), for every small message."""
        read = True
        try:
            while True:
                was_open = stream.open
                frame = stream.receive(read and (budget is None or budget > 0))
                if stream.open and not was_open:
                    self._on_open(stream)
                if frame is None:
                    return
                kept = self._on_frame(stream, frame)
                if budget is not None:
                    budget -= kept
                read = not stream.drained
        except HandshakeError:
            self.refused += 1
            if stream.peer >= 0 and self._to.get(stream.peer) is stream:
                self.failures.mark_dead(stream.peer, "its stream did not prove the group's key")
            self.drop(stream)
        except ValueError as err:
            self.refuse(stream, err)

    def _on_open(self, stream: tcp.Stream) -> None:
        if not 0 <= stream.peer < self.world_size or self.peers[stream.peer].node == self.node:
            self.refused += 1
            stream.peer = -1
            self.drop(stream)
            return
        # The first stream between two ranks carries both ways; a second one (both connected
        # at once) only brings the other's messages.
        self._to.setdefault(stream.peer, stream)
        if stream.backlogged:
            self.progress.watch(stream.fd, writable=True)

    def _on_frame(self, stream: tcp.Stream, frame: memoryview,
                  own: Optional[Callable[[memoryview], object]] = None) -> int:
        """Handle one frame; returns the bytes of the part kept for a later receive (0 when
        a receive took it, or it was no part). ``own`` keeps a part's payload (the stream's
        own by default)."""
        if stream.peer < 0:
            return 0  # refused on opening: nothing it sent is read
        try:
            if frame[0] == wire.ABORT:
                self.failures.publish_other_node_abort(wire.parse_abort(frame),
                                                       "an ABORT frame")
                return 0
            if frame[0] != wire.DATA:
                raise ValueError(f"frame kind {frame[0]} on a stream")
            tag, part = wire.parse_data(frame, stream, stream.placed)
            if part.segment != wire.INLINE:
                raise ValueError("a shared-memory part on a stream")
            self._from[stream.peer] = stream
            if not self.progress.inbox.arrive((stream.peer, tag), part, own or stream.own):
                return part.part_bytes
        except (ValueError, struct.error) as err:
            self.refuse(stream, err)
        return 0

    def refuse(self, stream: tcp.Stream, err: Exception) -> None:
        """Close ``stream``, whose peer sent a frame the protocol forbids (every later wait
        of the rank raises)."""
        self.failures.protocol_failed(stream.peer, err, "its stream")
        self.drop(stream, ended=False)

    def drop(self, stream: tcp.Stream, ended: bool = True) -> None:
        """Forget a stream that closed. Once every stream with a peer has ended, the peer is
        dead (a rank closes its streams only when it dies or leaves the group): two ranks that
        connected to each other at once have two, and each delivers what was sent on it before
        its end, so a message is never lost to the other one's end arriving first."""
        if self._by_fd.get(stream.fd) is not stream:
            return
        del self._by_fd[stream.fd]
        self.progress.unregister(stream.fd)
        peer = stream.peer
        if self._from.get(peer) is stream:
            del self._from[peer]
        ours = peer >= 0 and self._to.get(peer) is stream
        others = [other for other in self._by_fd.values() if other.peer == peer]
        if ours:
            # The other stream with the peer, if any, carries on: a new connection would be
            # refused by a peer that left after sending on it, and call it dead unread.
            del self._to[peer]
            for other in others:
                if other.open:
                    self._to[peer] = other
                    break
        if ended and peer >= 0 and stream.unreachable():
            # No acknowledgment for tcp.LINK_TIMEOUT_S: the node's link, not one process, is
            # gone, and every rank there is as far out of reach.
            node = self.peers[peer].node
            reason = (f"node {node[:8]} is unreachable: its stream with rank {peer} timed out "
                      f"(nothing acknowledged within {tcp.LINK_TIMEOUT_S} s: a cut link, or the "
                      f"node cut off from the network)")
            self.failures.mark_unreachable(node, reason)
        elif ended and peer >= 0 and (stream.open or ours) and not others:
            self.failures.mark_dead(peer, f"its stream from node {self.peers[peer].node[:8]} "
                                          f"ended (its process exited or left the group)")
        stream.close()

    # ------------------------------------------------------------ the native core

    def quiet_streams(self, peer: int, tag: int, sends: bool, receives: bool
                      ) -> Optional[Tuple[tcp.Stream, tcp.Stream]]:
        """(the stream this rank sends to ``peer`` on, the one ``peer`` sends on) if the
        native core may write the first (``sends``) and read the second (``receives``) from
        their next frames on (``engine.stream_rounds``); one of the two stands for the other where
        it is not needed. Quiet: open and whole, nothing queued to send, nothing read ahead,
        no receive posted or part waiting on (``peer``, ``tag``), and which of two streams
        the peer sends on known (from the join, or its first message). None otherwise."""
        sending = self._to.get(peer) if sends else None
        receiving = self._from.get(peer) if receives else None
        if sends and (sending is None or not sending.quiet):
            return None
        if receives and (receiving is None or not receiving.quiet
                         or not self.progress.inbox.quiet((peer, tag))):
            return None
        return sending or receiving, receiving or sending

    def deliver(self, stream: tcp.Stream, frame: bytes) -> None:
        """Handle a whole frame the native core read from ``stream`` and did not want (another
        channel's part, an ABORT), as if the stream had read it."""
        stream.placed = None
        self._on_frame(stream, memoryview(frame), _as_is)

    def ended(self, stream: tcp.Stream) -> None:
        """Forget ``stream``, which the native core found ended or broken: its peer is dead.
        Nothing more is read from it (the core may have read part of a frame)."""
        peer = stream.peer
        self.drop(stream)
        if peer >= 0:
            self.failures.mark_dead(peer, f"its stream from node {self.peers[peer].node[:8]} "
                                          f"ended or failed (its process exited or left the "
                                          f"group)")

    def open_streams(self) -> List[tcp.Stream]:
        """Every stream this rank holds (with a peer known or not yet)."""
        return list(self._by_fd.values())

    def sending_stream(self, peer: int) -> Optional[tcp.Stream]:
        """The stream this rank sends to ``peer`` on, if there is one yet."""
        return self._to.get(peer)

    def close(self) -> None:
        for stream in list(self._by_fd.values()):
            stream.close()
        self._by_fd.clear()
        self._to.clear()
        self._from.clear()
        self.streams.listener.close()


def _as_is(payload: memoryview) -> memoryview:
    """Keeps a payload that lies in a frame no one reuses (``StreamCarrier.deliver``)."""
    return payload


def open_at_join(carrier: StreamCarrier, peers: Sequence[int], deadline: float) -> None:
    """Open and authenticate ``carrier``'s streams with ``peers`` now, all at once (the join),
    so that no call pays a connection and its handshake: the rank connects to those of higher
    rank and accepts those of lower rank, one stream per pair, which then carries both ways;
    each peer's stream is known as the one it sends on before its first message, so the
    first round with it may already run in the native core.

    Args:
        carrier: the rank's stream carrier.
        peers: ranks on other nodes (every rank of ``peers`` names this rank in its own).
        deadline: when to give up (``time.monotonic()``).

    Raises:
        PeerDiedError: a peer refused the connection, ended its stream or failed the
            handshake.
        CollectiveTimeoutError: a stream was still not open at ``deadline``.
    """
    wanted = sorted(set(peers))
    for peer in wanted:
        if peer > carrier.rank:
            carrier.stream_to(peer, "init_collective_group")
    failures = carrier.failures
    while True:
        dead = [peer for peer in wanted if peer in failures.dead]
        if dead:
            raise failures.peer_died(dead, "init_collective_group")
        waiting = [peer for peer in wanted if not _is_open(carrier.sending_stream(peer))]
        if not waiting:
            break
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeoutError(failures.group_name, carrier.rank,
                                         "init_collective_group (opening streams)", -1,
                                         waiting, carrier.connect_timeout)
        carrier.progress.progress(min(deadline - now, POLL_INTERVAL_S))
        carrier.tick(time.monotonic())
    for peer in wanted:
        carrier.sends_on_its_stream(peer)


def _is_open(stream: Optional[tcp.Stream]) -> bool:
    return stream is not None and stream.open
