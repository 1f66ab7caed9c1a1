"""The transport of the ``ray`` backend: Unix sockets and shared memory on a node, Ray actor
tasks across nodes.

It drives the wire protocol (``transport.wire``) with real I/O. On one node, each message goes
to its peer over a Unix-socket link (``transport.uds``): small payloads inline in one packet,
large ones part by part through the sender's shared memory (``transport.shm``), read in place by
the receiver. Nothing runs in the background: the calling thread makes progress inside
:meth:`RayTransport.wait`, so an idle rank costs nothing and a busy one has no thread to contend
with. While it waits, a rank writes the next part of its own large sends between reading the
parts that arrive, so that its peers reduce one part while it writes the next.

Waiting: a rank first polls its sockets without sleeping for a short while (``spin_s``), which
answers a small message in microseconds instead of a process wake-up; it is given that while
only where its machine has a core for every rank of the group there (the rendezvous knows), and
none at all on an oversubscribed machine, where spinning would take the core a peer needs. Then it
blocks in ``poll``, waking at least every 0.1 s to look for failures.

Across nodes, messages travel on authenticated TCP streams between the two ranks
(``transport.tcp``, chosen by default; see :class:`Streams`), opened on a rank's first send to
or receive from a peer there, and read in the same poll loop as the Unix sockets. Or, where
the group chose the object store, sends go to the destination node's post office (an actor,
``backends.post_office``, reached through :class:`PostOffices`), batched: one actor task per
destination node per round, however many ranks of that node the round addresses. The post
office delivers them on its node as if it were the sender.

Failures: a peer's socket or streams closing, or its process gone from the process table
(checked every 0.1 s for the peers a rank waits for on its node, every second through the post
offices for the others that have no stream), means it died; an abort by any rank is published
in the node's shared state page (``transport.node_state``) and, through the streams and the
post offices, on every other node, and every waiting rank raises it within one poll interval.
A rank that waits on another node also reads, every second, the abort published for the whole
group (``PostOffices.published_abort``): the way it learns of a failure that no stream and no
post office has brought it (a post office still starting, a stream whose peer left the call
before answering its handshake).
"""

from __future__ import annotations

import functools
import hmac
import select
import struct
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import (CollectiveError, CollectiveTimeoutError, GroupBrokenError, PeerDiedError,
                      PostOfficeDiedError, error_from_record, error_record)
from . import tcp, uds, wire
from .base import COLLECTIVE_CHANNEL, Request, SendRequest, Transport
from .node_state import NodeState
from .shm import PeerSegments, SendArena

INLINE_LIMIT = uds.INLINE_LIMIT
_POLL_INTERVAL_S = 0.1
_LOCAL_LIVENESS_INTERVAL_S = 0.1
# A killed process closes its sockets a moment before it leaves the process table: a hang-up
# waits this long for the exit, so that the death is known at once rather than at the next
# liveness check. A peer that closed its links on purpose (it left the group) costs it once.
_HANG_UP_GRACE_S = 0.02
# The part size of large messages on a node with more ranks than cores (see RayTransport).
CROWDED_PART_BYTES = 64 << 20
_REMOTE_LIVENESS_INTERVAL_S = 1.0

SPIN_S = 50e-6
"""How long a rank with a core of its own polls without sleeping before it blocks."""

RemoteMessage = Tuple[int, int, int, int, int, bytes, object]
"""``(source, destination, tag, step, count, packed header, payload)``: one message for a rank
on another node. The payload is the bytes of a small message, or the array of a large one
(Ray carries arrays above its inline limit through the object store)."""


@dataclass(frozen=True)
class Peer:
    """Where a rank lives: its node, its process id and (on this node) its socket."""

    node: str
    pid: int
    socket_path: str


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


class PostOffices:
    """The group's post offices as one rank reaches them: its own node's, and through the
    others', the ranks on other nodes (implemented over Ray by the backend)."""

    def deliver(self, node: str, messages: List[RemoteMessage]) -> None:
        """Hand ``messages`` to ``node`` in one batch (asynchronously, order kept per node);
        their payloads are taken by the time it returns, and the caller may reuse them."""
        raise NotImplementedError

    def dead_ranks(self, node: str, ranks: List[int]) -> Optional[List[int]]:
        """Those of ``ranks`` (all on ``node``) known to be dead; None when ``node``'s post
        office is dead (nothing is known of its ranks then)."""
        raise NotImplementedError

    def local_post_office_alive(self) -> bool:
        """Whether this node's post office is alive (True until it is known to be dead)."""
        raise NotImplementedError

    def responsive(self, node: str, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` (all on ``node``) that have started collective ``seq`` and are
        not stalled in it (see ``NodeState.responsive``)."""
        raise NotImplementedError

    def abort(self, record: dict) -> None:
        """Publish a failure on every other node."""
        raise NotImplementedError

    def published_abort(self) -> Optional[dict]:
        """The failure a rank of the group published for every node to read (the record of
        ``abort``), or None: for a rank that waits on another node which neither a stream
        nor a post office has told yet (a post office still starting, a stream whose peer
        left the call before it answered)."""
        raise NotImplementedError


def channel_tag(channel: Hashable) -> int:
    """The wire number of a channel: -1 for collectives, the tag for point-to-point."""
    return wire.COLLECTIVE_TAG if channel == COLLECTIVE_CHANNEL else channel[1]


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone, or goes within ``seconds``."""
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
    return True


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on this node."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Deliveries:
    """Moves messages into the links of one node: a rank's own sends, or a post office's.

    Messages to one link leave in the order they were given, each whole before the next (the
    receiver matches a message's parts in order); a large message leaves one part per call of
    :meth:`advance`, so that its sender can read what arrives in between.

    Args:
        arena: the sender's shared memory for large parts.
        reclaim: collects releases before the arena grows.
        part_bytes: the size of a large message's parts.
    """

    def __init__(self, arena: SendArena, reclaim: Callable[[], None],
                 part_bytes: int = uds.PART_BYTES):
        self.arena = arena
        self.reclaim = reclaim
        self.part_bytes = part_bytes
        self._queues: Dict[uds.Link, Deque[uds.OutgoingMessage]] = {}

    @property
    def pending(self) -> bool:
        """Whether some message still has parts to send."""
        return bool(self._queues)

    def send(self, link: uds.Link, step: int, tag: int, count: int, header: bytes,
             payload: np.ndarray, request) -> None:
        """Start sending ``payload`` on ``link``: its first part leaves now unless the link
        is still sending an earlier message."""
        queue = self._queues.get(link)
        if queue is None and payload.nbytes <= INLINE_LIMIT:
            # A small message whose link is idle leaves whole at once: the common case of
            # small collectives, spared the bookkeeping of a message sent part by part.
            uds.send_inline(link, step, tag, count, header, payload, request)
            return
        message = uds.OutgoingMessage(link, self.arena, self.reclaim, step, tag, count, header,
                                      payload, request, self.part_bytes)
        if queue is not None:
            queue.append(message)
        elif not message.advance():
            self._queues[link] = deque([message])

    def advance(self) -> None:
        """Send one more part of the first unfinished message of every link."""
        for link, queue in list(self._queues.items()):
            if link.closed or link.unwritable:
                del self._queues[link]
                continue
            if queue[0].advance():
                queue.popleft()
                if not queue:
                    del self._queues[link]

    def drop(self, link: uds.Link) -> None:
        """Forget what was still to be sent on ``link`` (it closed)."""
        self._queues.pop(link, None)


class RayTransport(Transport):
    """One rank's endpoint.

    Args:
        rank: this rank.
        group_name: the group's name (errors).
        group_key: 16 bytes identifying this incarnation of the group (links check it).
        peers: where every rank lives, indexed by rank.
        listener: this rank's listening socket (bound before the rendezvous).
        state: this node's shared state page of the group.
        post_offices: reaches other nodes' post offices; None when the group has one node.
        streams: carries messages to other nodes when given (else the post offices do).
        connect_timeout: seconds to wait for a local peer's socket to accept.
        spin_s: seconds to poll without sleeping before blocking (0 on oversubscribed nodes).
    """

    def __init__(self, rank: int, group_name: str, group_key: bytes, peers: Sequence[Peer],
                 listener, state: NodeState, post_offices: Optional[PostOffices] = None,
                 connect_timeout: float = 30.0, spin_s: float = 0.0,
                 streams: Optional[Streams] = None):
        self.rank = rank
        self.world_size = len(peers)
        self.group_name = group_name
        self.group_key = group_key
        self.peers = tuple(peers)
        self.node = peers[rank].node
        self.state = state
        self.post_offices = post_offices
        self.connect_timeout = connect_timeout
        self.spin_s = spin_s
        self._listener = listener
        self._listener_fd = listener.fileno()
        self._poll = select.poll()
        self._poll.register(self._listener_fd, select.POLLIN)
        self._links_by_fd: Dict[int, uds.Link] = {}
        self._out_links: Dict[int, uds.Link] = {}
        self._arena = SendArena(f"ray_collective-{group_name}-{rank}")
        self._segments = PeerSegments()
        # Every part wakes its receiver: where ranks outnumber cores a wake-up is a context
        # switch, so parts are as large as the message allows (overlap needs a core anyway).
        self._deliveries = Deliveries(self._arena, self._collect_releases,
                                      uds.PART_BYTES if spin_s else CROWDED_PART_BYTES)
        self._inbox = wire.Inbox(rank, self._read_segment, self._release)
        self._buffer = bytearray(uds.RECEIVE_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._remote_batches: Dict[str, list] = {}
        self._remote_sends: List[SendRequest] = []
        self._streams = streams
        self._stream_listener_fd = -1
        if streams is not None:
            self._stream_listener_fd = streams.listener.fileno()
            self._poll.register(self._stream_listener_fd, select.POLLIN)
        self._streams_by_fd: Dict[int, tcp.StreamLink] = {}
        self._stream_to: Dict[int, tcp.StreamLink] = {}
        self._dead: Dict[int, str] = {}
        self._lost_post_offices: set = set()
        self._next_post_office_check = 0.0
        self._current: Optional[wire.CallStamp] = None
        self._protocol_error: Optional[CollectiveError] = None
        self.refused_connections = 0

    # ------------------------------------------------------------------ sending

    def isend(self, peer: int, channel: Hashable, stamp: wire.CallStamp, step: int,
              data: np.ndarray) -> Request:
        self._current = stamp
        tag = channel_tag(channel)
        if self.peers[peer].node != self.node:
            if self._streams is not None:
                return self._send_stream(peer, tag, stamp.packed, step, data)
            return self._send_remote(peer, tag, stamp.packed, step, data)
        request = SendRequest(peer)
        link = self._link_to(peer)
        self._deliveries.send(link, step, tag, len(data), stamp.packed, data, request)
        if link.unwritable:
            self._read_link(link)  # what the peer sent before it went is still to be read
        if link.closed:
            self._drop_link(link)
        elif link.backlogged:
            self._poll.modify(link.fd, select.POLLIN | select.POLLOUT)
        return request

    def _send_remote(self, peer: int, tag: int, packed: bytes, step: int,
                     data: np.ndarray) -> Request:
        # The round's batch leaves at the next wait or test, which completes the request: the
        # caller keeps its buffer untouched until then, so a large payload needs no copy.
        request = SendRequest(peer)
        payload = data if data.nbytes > INLINE_LIMIT else data.tobytes()
        batch = self._remote_batches.setdefault(self.peers[peer].node, [])
        batch.append((self.rank, peer, tag, step, len(data), packed, payload))
        self._remote_sends.append(request)
        return request

    def _send_stream(self, peer: int, tag: int, packed: bytes, step: int,
                     data: np.ndarray) -> Request:
        request = SendRequest(peer)
        link = self._stream_link(peer, "send")
        frames = tcp.frame_pieces(step, tag, len(data), packed, data)
        for frame in frames[:-1]:
            link.send(frame)
        link.send(frames[-1], request)
        self._watch_stream(link)
        return request

    def _stream_link(self, peer: int, what: str) -> tcp.StreamLink:
        """The stream this rank sends to ``peer`` on: the first one opened between the two, by
        either end (messages to a peer must all take one stream to keep their order)."""
        link = self._stream_to.get(peer)
        if link is None:
            if peer in self._dead:
                raise self._peer_died([peer], what)
            try:
                host, port = self._streams.address(peer)
                link = tcp.connect(host, port, self.rank, peer, self.group_key,
                                   self.connect_timeout)
            except OSError as err:
                self._dead[peer] = (f"its stream on node {self.peers[peer].node[:8]} refused a "
                                    f"connection: {err}")
                raise self._peer_died([peer], what) from err
            self._stream_to[peer] = link
            self._add_stream(link)
        return link

    def _add_stream(self, link: tcp.StreamLink) -> None:
        link.placer = functools.partial(self._destination, link)
        self._streams_by_fd[link.fd] = link
        self._poll.register(link.fd, select.POLLIN)

    def _destination(self, link: tcp.StreamLink, head: memoryview) -> Optional[memoryview]:
        """Where the payload of the frame ``head`` starts belongs, when a receive waits for it
        (``StreamLink.placer``)."""
        if link.peer < 0:
            return None
        try:
            tag, part = wire.parse_data_head(head, link)
        except ValueError:
            return None  # the whole frame arrives, and is refused, as usual
        return self._inbox.destination((link.peer, tag), part)

    def _watch_stream(self, link: tcp.StreamLink) -> None:
        if link.closed or link.unwritable:
            self._read_stream(link)
            self._drop_stream(link)
        elif self._streams_by_fd.get(link.fd) is link:
            self._poll.modify(link.fd, select.POLLIN | (select.POLLOUT if link.backlogged
                                                          else 0))

    def _flush_remote(self) -> None:
        if self._remote_batches:
            batches, self._remote_batches = self._remote_batches, {}
            sends, self._remote_sends = self._remote_sends, []
            for node, messages in batches.items():
                self.post_offices.deliver(node, messages)
            for request in sends:
                request.done = True

    def _link_to(self, peer: int) -> uds.Link:
        link = self._out_links.get(peer)
        if link is None:
            if peer in self._dead:
                raise self._peer_died([peer], "send")
            try:
                link = uds.connect(self.peers[peer].socket_path, self.rank, self.group_key,
                                   self.connect_timeout)
            except OSError as err:
                self._dead[peer] = f"its socket refused a connection: {err}"
                raise self._peer_died([peer], "send") from err
            link.peer = peer
            self._out_links[peer] = link
            self._links_by_fd[link.fd] = link
            self._poll.register(link.fd, select.POLLIN)
        return link

    # ---------------------------------------------------------------- receiving

    def irecv(self, peer: int, channel: Hashable, stamp: wire.CallStamp, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        self._current = stamp
        receive = wire.Receive(peer, stamp, step, out, combine)
        if (self._streams is not None and self.peers[peer].node != self.node
                and peer not in self._stream_to and peer not in self._dead):
            # A stream to the sender, whoever opened it, is how its death is seen at once.
            # Failing to open one raises nothing here: what the sender sent before it went
            # may be in the inbox already, and the wait raises if the receive misses it.
            try:
                self._stream_link(peer, "recv")
            except PeerDiedError:
                pass
        self._inbox.post((peer, channel_tag(channel)), receive)
        return receive

    def test(self, request: Request) -> bool:
        if not request.done:
            self._flush_remote()
        return request.done

    def _read_segment(self, part: wire.Part) -> np.ndarray:
        return self._segments.view(part.origin.peer, part.segment, part.segment_offset,
                                   part.part_bytes)

    def _release(self, part: wire.Part) -> None:
        link = part.origin
        self._segments.done(link.peer, part.segment)
        if not (link.closed or link.unwritable):
            link.send((wire.release_frame(part.segment, part.segment_offset),))
            if link.backlogged:
                self._poll.modify(link.fd, select.POLLIN | select.POLLOUT)

    def _on_packet(self, link: uds.Link, nbytes: int, fd: Optional[int]) -> None:
        packet = self._view[:nbytes]
        if link.peer < 0:
            self._on_hello(link, packet, fd)
            return
        try:
            kind = packet[0]
            if kind == wire.DATA:
                tag, part = wire.parse_data(packet, link)
                if part.segment != wire.INLINE:
                    if fd is not None:
                        self._segments.add(link.peer, part.segment, fd)
                        fd = None
                    self._segments.hold(link.peer, part.segment)
                self._inbox.arrive((link.peer, tag), part)
            elif kind == wire.RELEASE:
                self._arena.release(*wire.parse_release(packet))
            else:
                raise ValueError(f"unknown frame kind {kind}")
        except (ValueError, KeyError, struct.error, OSError) as err:
            self._protocol_error = self._malformed_frame(link.peer, err, "its connection")
            self._drop_link(link)
        finally:
            if fd is not None:
                uds.close_quietly(fd)

    def _on_hello(self, link: uds.Link, packet, fd: Optional[int]) -> None:
        """The first packet of an accepted connection must prove the group's key; a connection
        that does not is closed before anything else it sent is read."""
        try:
            sender, key = wire.parse_hello(packet)
        except ValueError:
            sender, key = -1, b""
        if fd is not None:
            uds.close_quietly(fd)
        if not hmac.compare_digest(key, self.group_key) or not 0 <= sender < self.world_size:
            self.refused_connections += 1
            self._drop_link(link)
            return
        link.peer = sender

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            link = uds.accepted(sock)
            self._links_by_fd[link.fd] = link
            self._poll.register(link.fd, select.POLLIN)

    def _accept_streams(self) -> None:
        while True:
            try:
                sock, _ = self._streams.listener.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # the connection went before it was accepted
            self._add_stream(tcp.accepted(sock, self.rank, self.group_key))

    def _read_stream(self, link: tcp.StreamLink, budget: Optional[int] = None) -> None:
        """Handle what ``link`` has received: its handshake, then its frames; once it has kept
        ``budget`` bytes of parts that no receive waits for yet, only the frames already
        whole in its buffer (the socket stays readable, and the next poll comes back to it).
        Likewise once a read drained the kernel: reading on would only fail with ``EAGAIN``
        (3 to 4 µs here, with its exception), for every small message."""
        read = True
        try:
            while True:
                was_open = link.open
                frame = link.receive(read and (budget is None or budget > 0))
                if link.open and not was_open:
                    self._on_stream_open(link)
                if frame is None:
                    return
                kept = self._on_stream_frame(link, frame)
                if budget is not None:
                    budget -= kept
                read = not link.drained
        except tcp.HandshakeError:
            self.refused_connections += 1
            if link.peer >= 0 and self._stream_to.get(link.peer) is link:
                self._dead.setdefault(link.peer, "its stream did not prove the group's key")
            self._drop_stream(link)
        except ValueError as err:
            self._stream_protocol_error(link, err)

    def _on_stream_open(self, link: tcp.StreamLink) -> None:
        if not 0 <= link.peer < self.world_size or self.peers[link.peer].node == self.node:
            self.refused_connections += 1
            link.peer = -1
            self._drop_stream(link)
            return
        # The first stream between two ranks carries both ways; a second one (both connected
        # at once) only brings the other's messages.
        self._stream_to.setdefault(link.peer, link)
        if link.backlogged:
            self._poll.modify(link.fd, select.POLLIN | select.POLLOUT)

    def _on_stream_frame(self, link: tcp.StreamLink, frame: memoryview) -> int:
        """Handle one frame; returns the bytes of the part kept for a later receive (0 when
        a receive took it, or it was no part)."""
        if link.peer < 0:
            return 0  # refused on opening: nothing it sent is read
        try:
            if frame[0] == wire.ABORT:
                self._publish_other_node_abort(wire.parse_abort(frame), "an ABORT frame")
                return 0
            if frame[0] != wire.DATA:
                raise ValueError(f"frame kind {frame[0]} on a stream")
            tag, part = wire.parse_data(frame, link, link.placed)
            if part.segment != wire.INLINE:
                raise ValueError("a shared-memory part on a stream")
            if not self._inbox.arrive((link.peer, tag), part, link.own):
                return part.part_bytes
        except (ValueError, struct.error) as err:
            self._stream_protocol_error(link, err)
        return 0

    def _publish_other_node_abort(self, record: dict, carrier: str) -> None:
        """Publish another node's failure on this node, as its post office would.

        Raises:
            ValueError: the record, which came in ``carrier``, describes no error of this
                group.
        """
        try:
            error_from_record(record, self.rank)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{carrier} with a malformed record: {err!r}") from err
        if record["group"] != self.group_name or not isinstance(record["rank"], int):
            raise ValueError(f"{carrier} of group {record['group']!r}, rank "
                             f"{record['rank']!r}")
        if self.state.abort(record):
            self._knock_local_peers()

    def _stream_protocol_error(self, link: tcp.StreamLink, err: Exception) -> None:
        self._protocol_error = self._malformed_frame(link.peer, err, "its stream")
        self._drop_stream(link, ended=False)

    def _malformed_frame(self, peer: int, err: Exception, carrier: str) -> CollectiveError:
        """The error of a call after ``peer`` sent a frame this rank could not read on
        ``carrier`` (which is then closed)."""
        return CollectiveError(
            f"rank {self.rank} of group '{self.group_name}': rank {peer} sent a malformed frame "
            f"on {carrier} ({type(err).__name__}: {err}); it was closed and the group is broken. "
            f"Destroy the group and create it again.")

    def _drop_stream(self, link: tcp.StreamLink, ended: bool = True) -> None:
        """Forget a stream that closed. Once every stream with a peer has ended, the peer is
        dead (a rank closes its streams only when it dies or leaves the group): two ranks that
        connected to each other at once have two, and each delivers what was sent on it before
        its end, so a message is never lost to the other one's end arriving first."""
        if self._streams_by_fd.get(link.fd) is not link:
            return
        del self._streams_by_fd[link.fd]
        self._poll.unregister(link.fd)
        peer = link.peer
        ours = peer >= 0 and self._stream_to.get(peer) is link
        others = [other for other in self._streams_by_fd.values() if other.peer == peer]
        if ours:
            # The other stream with the peer, if any, carries on: a new connection would be
            # refused by a peer that left after sending on it, and call it dead unread.
            del self._stream_to[peer]
            for other in others:
                if other.open:
                    self._stream_to[peer] = other
                    break
        if ended and peer >= 0 and (link.open or ours) and not others:
            self._dead.setdefault(peer, f"its stream from node {self.peers[peer].node[:8]} "
                                        f"ended (its process exited or left the group)")
        link.close()

    def _expire_handshakes(self, now: float) -> None:
        """Close the accepted streams whose other end has not proved the key in time (a
        stranger that connected and said nothing holds no socket for long). Streams this
        rank opened wait: their peer answers when it next waits, however busy it is now."""
        for link in list(self._streams_by_fd.values()):
            if link.peer < 0 and now - link.opened_at > tcp.HANDSHAKE_TIMEOUT_S:
                self.refused_connections += 1
                self._drop_stream(link, ended=False)

    def _on_stream_event(self, link: tcp.StreamLink, events: int) -> None:
        if events & select.POLLOUT:
            link.flush()
        if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
            self._read_stream(link, tcp.READ_BUDGET_BYTES)
        self._watch_stream(link)

    def _read_link(self, link: uds.Link) -> None:
        """Handle every packet ``link`` has received."""
        buffer = self._buffer
        while not link.closed:
            got = link.receive_into(buffer)
            if got is None:
                break
            self._on_packet(link, *got)

    def _read_packet(self, link: uds.Link) -> None:
        """Handle the next packet ``link`` has received, if any. One per ``poll``: most
        events bring one packet, and reading on until the kernel says it holds no more would
        cost every small message a failed read; a second packet makes the next ``poll`` return
        at once."""
        got = link.receive_into(self._buffer)
        if got is not None:
            self._on_packet(link, *got)

    def _progress(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for socket events and handle every one that is ready;
        returns how many sockets had events."""
        ready = self._poll.poll(timeout_s * 1000.0)
        for fd, events in ready:
            if fd == self._listener_fd:
                self._accept()
                continue
            link = self._links_by_fd.get(fd)
            if link is None:
                stream = self._streams_by_fd.get(fd)
                if stream is not None:
                    self._on_stream_event(stream, events)
                elif fd == self._stream_listener_fd:
                    self._accept_streams()
                continue
            if events & select.POLLOUT:
                link.flush()
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                self._read_packet(link)
            if link.closed:
                self._drop_link(link)
            elif link.backlogged:
                self._poll.modify(fd, select.POLLIN | select.POLLOUT)
            else:
                self._poll.modify(fd, select.POLLIN)
        return len(ready)

    def _collect_releases(self) -> None:
        """Read what the links this rank sends on have received (releases) without waiting."""
        for link in list(self._out_links.values()):
            self._read_link(link)

    def _drop_link(self, link: uds.Link) -> None:
        if self._links_by_fd.pop(link.fd, None) is None:
            return
        self._poll.unregister(link.fd)
        self._deliveries.drop(link)
        if link.peer >= 0 and self._out_links.get(link.peer) is link:
            del self._out_links[link.peer]
        if link.peer >= 0 and _exits_within(self.peers[link.peer].pid, _HANG_UP_GRACE_S):
            self._dead.setdefault(link.peer, "its process exited")
        link.close()

    # ------------------------------------------------------------------ waiting

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        self._flush_remote()
        if self._local_post_office_lost():
            raise self._post_office_died(self.node)
        deliveries = self._deliveries
        if self.spin_s:
            # Spin while messages keep coming: each arrival buys another spin_s, so a rank
            # exchanging a large message part by part never sleeps between parts.
            spin_until = time.monotonic() + self.spin_s
            while True:
                if deliveries.pending:
                    deliveries.advance()
                if all(r.done for r in requests):
                    return ()
                self._raise_if_failed(requests)
                now = time.monotonic()
                if now >= spin_until or now >= deadline:
                    break
                if self._progress(0):
                    spin_until = now + self.spin_s
        next_local = time.monotonic() + _LOCAL_LIVENESS_INTERVAL_S
        next_remote = next_local
        while True:
            if deliveries.pending:
                deliveries.advance()
            pending = [r for r in requests if not r.done]
            if not pending:
                return ()
            self._raise_if_failed(pending)
            now = time.monotonic()
            if now >= deadline:
                return pending
            if now >= next_local:
                self.state.beat(self.rank)
                self._expire_handshakes(now)
                remote = self._check_liveness({r.peer for r in pending}, now >= next_remote)
                next_local = now + _LOCAL_LIVENESS_INTERVAL_S
                if remote:
                    next_remote = now + _REMOTE_LIVENESS_INTERVAL_S
                continue
            self._progress(0 if deliveries.pending else min(deadline - now, _POLL_INTERVAL_S))

    def _raise_if_failed(self, pending: Sequence[Request]) -> None:
        if self._inbox.error is not None:
            raise self._inbox.error
        if self._protocol_error is not None:
            raise self._protocol_error
        record = self.state.aborted()
        if record is not None:
            error = error_from_record(record, self.rank)
            # A dead or stalled rank is named by every survivor's own error; the stalled rank
            # itself, once it runs again, learns that the group broke without it.
            if isinstance(error, (PeerDiedError, PostOfficeDiedError)) or (
                    isinstance(error, CollectiveTimeoutError)
                    and self.rank not in error.missing_ranks):
                raise error
            raise GroupBrokenError(self.group_name, self.rank, error)
        if self._dead:
            dead = sorted({r.peer for r in pending} & set(self._dead))
            if dead:
                raise self._peer_died(dead)
        if self._lost_post_offices:
            # This node's post office carried every message from the other nodes here; another
            # node's carried those to its ranks, so it matters only when waiting on them.
            if self.node in self._lost_post_offices:
                raise self._post_office_died(self.node)
            for request in pending:
                node = self.peers[request.peer].node
                if node in self._lost_post_offices:
                    raise self._post_office_died(node)

    def _call(self, what: str = "") -> Tuple[str, int]:
        """(collective, sequence number) of the call in progress, for an error's message."""
        stamp = self._current
        return (stamp.template.collective, stamp.seq) if stamp else (what or "call", -1)

    def _peer_died(self, dead: List[int], what: str = "") -> PeerDiedError:
        return PeerDiedError(self.group_name, self.rank, *self._call(what), dead,
                             "; ".join(self._dead[r] for r in dead))

    def _check_liveness(self, peers: set, remote_too: bool) -> bool:
        """Look for dead peers among ``peers``, and for a dead post office on this node or
        theirs; returns whether remote ones were asked about."""
        remote: Dict[str, List[int]] = defaultdict(list)
        waits_on_other_nodes = False
        for peer in peers:
            where = self.peers[peer]
            if where.node != self.node:
                waits_on_other_nodes = True
                # A peer with a stream is seen to die when the stream ends: asking its post
                # office (an actor call that can take seconds on a loaded cluster) would only
                # hold this rank away from reading that end.
                if peer not in self._stream_to:
                    remote[where.node].append(peer)
            elif not process_alive(where.pid):
                self._dead.setdefault(peer, "its process exited")
        if self.post_offices is None:
            return False
        self._local_post_office_lost()
        if not (remote_too and waits_on_other_nodes):
            return False
        self._learn_published_abort()
        for node, ranks in remote.items():
            dead = self.post_offices.dead_ranks(node, ranks)
            if dead is None:
                self._lost_post_offices.add(node)
                continue
            for peer in dead:
                self._dead.setdefault(peer, f"its process on node {node[:8]} exited")
        return True

    def _learn_published_abort(self) -> None:
        """Publish on this node a failure published for the whole group, if there is one (a
        malformed record is no failure of this group's, and is left alone)."""
        record = self.post_offices.published_abort()
        if record is not None:
            try:
                self._publish_other_node_abort(record, "the abort published for the group")
            except ValueError:
                pass

    def _local_post_office_lost(self) -> bool:
        """Whether this node's post office is known to be dead; looked at again at most once
        per liveness interval.

        Asked at every wait, not only in waits long enough for the liveness checks: over
        streams a group's calls can all finish within that interval, and a rank must still
        learn of the loss (its abort then tells the other nodes)."""
        if self.post_offices is None:
            return False
        now = time.monotonic()
        if self.node not in self._lost_post_offices and now >= self._next_post_office_check:
            self._next_post_office_check = now + _LOCAL_LIVENESS_INTERVAL_S
            if not self.post_offices.local_post_office_alive():
                self._lost_post_offices.add(self.node)
        return self.node in self._lost_post_offices

    def _post_office_died(self, node: str) -> PostOfficeDiedError:
        return PostOfficeDiedError(self.group_name, self.rank, *self._call(), node,
                                   [r for r, peer in enumerate(self.peers) if peer.node == node])

    # ------------------------------------------------------------ group status

    def arrive(self, stamp: wire.CallStamp) -> None:
        self.state.arrive(self.rank, stamp.seq)
        self._inbox.begin(stamp)

    def complete(self, stamp: wire.CallStamp) -> None:
        self.state.complete(self.rank)

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        by_node: Dict[str, List[int]] = defaultdict(list)
        for rank, peer in enumerate(self.peers):
            by_node[peer.node].append(rank)
        responsive = []
        for node, ranks in by_node.items():
            if node == self.node:
                responsive += self.state.responsive(ranks, seq)
            elif self.post_offices is None:
                return None  # nothing reaches that node's state page
            else:
                responsive += self.post_offices.responsive(node, ranks, seq)
        absent = sorted(set(range(self.world_size)) - set(responsive))
        return absent or None

    def abort(self, error: BaseException) -> None:
        record = error_record(self.group_name, self.rank, error)
        # Only the rank that publishes the failure on this node wakes the others and tells the
        # other nodes: the rest raise after reading it, and all of them knocking too would be
        # n² connections at once (160 000 at 400 ranks). Whoever published first here was the
        # origin, or a rank or post office relaying the origin's abort, which told every node.
        first_here = self.state.abort(record)
        if first_here:
            self._knock_local_peers()
        # The peers this rank has streams with learn of it at once, and publish it on their
        # node (and, breaking in turn, on the nodes they have streams with); the post offices
        # reach every other node.
        frame = wire.abort_frame(record)
        for link in list(self._streams_by_fd.values()):
            if link.open and not (link.closed or link.unwritable):
                link.send(tcp.control_frame(frame))
        if first_here and self.post_offices is not None:
            self.post_offices.abort(record)

    def _knock_local_peers(self) -> None:
        """Wake the ranks of this node blocked in poll, so that they look at the state page now
        rather than at their next wake-up."""
        for rank, peer in enumerate(self.peers):
            if rank != self.rank and peer.node == self.node:
                uds.knock(peer.socket_path)

    def close(self) -> None:
        for link in list(self._links_by_fd.values()):
            link.close()
        self._links_by_fd.clear()
        self._out_links.clear()
        for stream in list(self._streams_by_fd.values()):
            stream.close()
        self._streams_by_fd.clear()
        self._stream_to.clear()
        if self._streams is not None:
            self._streams.listener.close()
        self._listener.close()
        self._segments.close()
        self._arena.close()
        self.state.close()
