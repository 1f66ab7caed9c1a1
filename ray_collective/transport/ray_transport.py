"""The transport of the ``ray`` backend: shared memory on a node, Ray actor tasks across nodes.

On one node, each message is one packet on a Unix socket (``transport.uds``): small payloads
ride inline in the packet; large ones are copied once into the sender's shared memory
(``transport.shm``) and the receiver reduces or copies straight out of it, then releases it.
Nothing runs in the background: the calling thread makes progress inside :meth:`wait`, polling
its sockets, so an idle rank costs nothing and a busy one has no thread to contend with.

Across nodes, sends go to a :class:`Relay` (the node's post office actor, see
``backends.ray_backend``), batched: one actor task per destination node per round, however
many ranks of that node the round addresses. The post office delivers them on its node as if
it were the sender.

Failures: a peer's socket closing, or its process gone from the process table, means it died;
an abort by any rank is published in the node's shared state page (``transport.node_state``)
and, through the relay, on every other node, and every waiting rank raises it within one poll
interval.
"""

from __future__ import annotations

import select
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import (GroupBrokenError, PeerDiedError, error_from_record, error_record)
from . import uds
from .base import (COLLECTIVE_CHANNEL, CallHeader, RecvRequest, Request, SendRequest, Transport,
                   check_arrival)
from .node_state import NodeState
from .shm import PeerSegments, SendArena

INLINE_LIMIT = 1 << 16
_POLL_INTERVAL_S = 0.1
_LIVENESS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Peer:
    """Where a rank lives: its node, its process id and (on this node) its socket."""

    node: str
    pid: int
    socket_path: str


class Relay:
    """Reaches the ranks on other nodes (implemented over Ray by the backend).

    ``messages`` are ``(source rank, destination rank, packet, large payload or None)``.
    """

    def deliver(self, node: str, messages: List[Tuple[int, int, bytes, Optional[np.ndarray]]]
                ) -> None:
        """Hand ``messages`` to ``node`` in one batch (asynchronously, order kept per node)."""
        raise NotImplementedError

    def dead_ranks(self, node: str, ranks: List[int]) -> List[int]:
        """Those of ``ranks`` (all on ``node``) known to be dead."""
        raise NotImplementedError

    def started(self, node: str, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` (all on ``node``) that have started collective ``seq``."""
        raise NotImplementedError

    def abort(self, record: dict) -> None:
        """Publish a failure on every other node."""
        raise NotImplementedError


def channel_tag(channel: Hashable) -> int:
    """The wire number of a channel: -1 for collectives, the tag for point-to-point."""
    return uds.COLLECTIVE_TAG if channel == COLLECTIVE_CHANNEL else channel[1]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on this node."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _Arrived:
    __slots__ = ("step", "count", "nbytes", "segment", "offset", "header", "payload", "link")

    def __init__(self, step, count, nbytes, segment, offset, header, payload, link):
        self.step = step
        self.count = count
        self.nbytes = nbytes
        self.segment = segment
        self.offset = offset
        self.header = header
        self.payload = payload
        self.link = link


class RayTransport(Transport):
    """One rank's endpoint.

    Args:
        rank: this rank.
        group_name: the group's name (errors).
        group_key: 16 bytes identifying this incarnation of the group (links check it).
        peers: where every rank lives, indexed by rank.
        listener: this rank's listening socket (bound before the rendezvous).
        state: this node's shared state page of the group.
        relay: reaches other nodes; None when the group has one node.
        connect_timeout: seconds to wait for a local peer's socket to accept.
    """

    def __init__(self, rank: int, group_name: str, group_key: bytes, peers: Sequence[Peer],
                 listener, state: NodeState, relay: Optional[Relay] = None,
                 connect_timeout: float = 30.0):
        self.rank = rank
        self.world_size = len(peers)
        self.group_name = group_name
        self.group_key = group_key
        self.peers = tuple(peers)
        self.node = peers[rank].node
        self.state = state
        self.relay = relay
        self.connect_timeout = connect_timeout
        self._listener = listener
        self._poll = select.poll()
        self._poll.register(listener.fileno(), select.POLLIN)
        self._links_by_fd: Dict[int, uds.Link] = {}
        self._out_links: Dict[int, uds.Link] = {}
        self._boxes: Dict[Tuple[int, int], deque] = defaultdict(deque)
        self._arena = SendArena(f"ray_collective-{group_name}-{rank}")
        self._segments = PeerSegments()
        self._remote_batches: Dict[str, list] = {}
        self._dead: Dict[int, str] = {}
        self._packed: Tuple[Optional[CallHeader], bytes] = (None, b"")
        self._receive_limit = uds.DATA_FRAME.size + 4096 + INLINE_LIMIT

    # ------------------------------------------------------------------ sending

    def _packed_header(self, header: CallHeader) -> bytes:
        cached, packed = self._packed
        if cached is not header:
            packed = header.pack()
            self._packed = (header, packed)
        return packed

    def isend(self, peer: int, channel: Hashable, header: CallHeader, step: int,
              data: np.ndarray) -> Request:
        packed = self._packed_header(header)
        nbytes = data.nbytes
        tag = channel_tag(channel)
        if self.peers[peer].node != self.node:
            return self._send_remote(peer, tag, packed, step, data)
        link = self._link_to(peer)
        request = SendRequest(peer)
        if nbytes <= INLINE_LIMIT:
            frame = uds.DATA_FRAME.pack(uds.DATA, step, tag, len(data), nbytes, uds.INLINE, 0,
                                        len(packed))
            self._send_on(link, frame + packed + data.tobytes(), None, request)
            return request
        segment, fd, offset = self._arena.place(data, self._collect_releases)
        frame = uds.DATA_FRAME.pack(uds.DATA, step, tag, len(data), nbytes, segment, offset,
                                    len(packed))
        first_use = segment not in link.segments_sent
        link.segments_sent.add(segment)
        self._send_on(link, frame + packed, fd if first_use else None, request)
        return request

    def _send_on(self, link: uds.Link, packet: bytes, fd: Optional[int] = None,
                 request: Optional[SendRequest] = None) -> None:
        link.send(packet, fd, request)
        if link.closed:
            self._drop_link(link)
        elif link.backlogged:
            self._poll.modify(link.fd, select.POLLIN | select.POLLOUT)

    def _send_remote(self, peer: int, tag: int, packed: bytes, step: int,
                     data: np.ndarray) -> Request:
        large = data.nbytes > INLINE_LIMIT
        frame = uds.DATA_FRAME.pack(uds.DATA, step, tag, len(data), data.nbytes, uds.INLINE, 0,
                                    len(packed)) + packed
        if not large:
            frame += data.tobytes()
        batch = self._remote_batches.setdefault(self.peers[peer].node, [])
        batch.append((self.rank, peer, frame, data.copy() if large else None))
        return SendRequest(peer, done=True)

    def _flush_remote(self) -> None:
        if self._remote_batches:
            batches, self._remote_batches = self._remote_batches, {}
            for node, messages in batches.items():
                self.relay.deliver(node, messages)

    def _link_to(self, peer: int) -> uds.Link:
        link = self._out_links.get(peer)
        if link is None:
            if peer in self._dead:
                raise PeerDiedError(self.group_name, self.rank, "send", -1, [peer],
                                    self._dead[peer])
            try:
                link = uds.connect(self.peers[peer].socket_path, self.rank, self.group_key,
                                   self.connect_timeout)
            except OSError as err:
                self._dead[peer] = f"its socket refused a connection: {err}"
                raise PeerDiedError(self.group_name, self.rank, "send", -1, [peer],
                                    self._dead[peer]) from err
            link.peer = peer
            self._out_links[peer] = link
            self._links_by_fd[link.fd] = link
            self._poll.register(link.fd, select.POLLIN)
        return link

    # ---------------------------------------------------------------- receiving

    def irecv(self, peer: int, channel: Hashable, header: CallHeader, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        return RecvRequest(peer, (peer, channel_tag(channel)), header, step, out, combine)

    def test(self, request: Request) -> bool:
        if request.done:
            return True
        if isinstance(request, SendRequest):
            return False
        box = self._boxes.get(request.key)
        if not box:
            return False
        message = box.popleft()
        peer, out = request.peer, request.out
        if (message.header != self._packed_header(request.header)
                or message.step != request.step or message.count != len(out)):
            check_arrival(self.rank, peer, request.header, request.step, len(out),
                          CallHeader.unpack(message.header), message.step, message.count)
        if message.payload is not None:
            payload = np.frombuffer(message.payload, out.dtype, len(out))
        else:
            payload = self._segments.view(peer, message.segment, message.offset,
                                          message.nbytes).view(out.dtype)
        if request.combine is None:
            np.copyto(out, payload)
        else:
            request.combine(out, payload)
        if message.payload is None:
            del payload
            self._segments.done(peer, message.segment)
            if not message.link.closed:
                self._send_on(message.link, uds.RELEASE_FRAME.pack(uds.RELEASE, message.segment,
                                                                   message.offset))
        request.done = True
        return True

    def _on_packet(self, link: uds.Link, packet: bytes, fd: Optional[int]) -> None:
        kind = packet[0]
        if kind == uds.DATA:
            (_, step, tag, count, nbytes, segment, offset,
             header_len) = uds.DATA_FRAME.unpack_from(packet)
            start = uds.DATA_FRAME.size
            header = packet[start:start + header_len]
            payload = None
            if segment == uds.INLINE:
                payload = memoryview(packet)[start + header_len:]
            else:
                if fd is not None:
                    self._segments.add(link.peer, segment, fd)
                self._segments.hold(link.peer, segment)
            self._boxes[(link.peer, tag)].append(
                _Arrived(step, count, nbytes, segment, offset, header, payload, link))
        elif kind == uds.RELEASE:
            _, segment, offset = uds.RELEASE_FRAME.unpack_from(packet)
            self._arena.release(segment, offset)
        elif kind == uds.HELLO:
            _, sender, key = uds.HELLO_FRAME.unpack_from(packet)
            if key != self.group_key or not 0 <= sender < self.world_size:
                link.close()
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

    def _progress(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for socket events and handle every one that is ready."""
        for fd, events in self._poll.poll(timeout_s * 1000.0):
            if fd == self._listener.fileno():
                self._accept()
                continue
            link = self._links_by_fd.get(fd)
            if link is None:
                continue
            if events & select.POLLOUT:
                link.flush()
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                for packet, passed_fd in link.receive(self._receive_limit):
                    self._on_packet(link, packet, passed_fd)
            if link.closed:
                self._drop_link(link)
            elif link.backlogged:
                self._poll.modify(fd, select.POLLIN | select.POLLOUT)
            else:
                self._poll.modify(fd, select.POLLIN)

    def _collect_releases(self) -> None:
        """Read what the links this rank sends on have received (releases) without waiting."""
        for link in list(self._out_links.values()):
            for packet, passed_fd in link.receive(self._receive_limit):
                self._on_packet(link, packet, passed_fd)

    def _drop_link(self, link: uds.Link) -> None:
        if self._links_by_fd.pop(link.fd, None) is None:
            return
        self._poll.unregister(link.fd)
        if link.peer >= 0 and self._out_links.get(link.peer) is link:
            del self._out_links[link.peer]
        if link.peer >= 0 and not process_alive(self.peers[link.peer].pid):
            self._dead.setdefault(link.peer, "its process exited")
        link.close()

    # ------------------------------------------------------------------ waiting

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        self._flush_remote()
        next_liveness = time.monotonic() + _LIVENESS_INTERVAL_S
        while True:
            pending = [r for r in requests if not self.test(r)]
            if not pending:
                return ()
            self._raise_if_failed(pending)
            now = time.monotonic()
            if now >= deadline:
                return pending
            if now >= next_liveness:
                self._check_liveness({r.peer for r in pending})
                next_liveness = now + _LIVENESS_INTERVAL_S
            self._progress(min(deadline - now, _POLL_INTERVAL_S))

    def _raise_if_failed(self, pending: Sequence[Request]) -> None:
        record = self.state.aborted()
        if record is not None:
            error = error_from_record(record, self.rank)
            if isinstance(error, PeerDiedError):
                raise error
            raise GroupBrokenError(self.group_name, self.rank, error)
        dead = sorted({r.peer for r in pending} & set(self._dead))
        if dead:
            header = self._packed[0]
            raise PeerDiedError(self.group_name, self.rank,
                                header.collective if header else "call",
                                header.seq if header else -1, dead,
                                "; ".join(self._dead[r] for r in dead))

    def _check_liveness(self, peers: set) -> None:
        remote: Dict[str, List[int]] = defaultdict(list)
        for peer in peers:
            where = self.peers[peer]
            if where.node != self.node:
                remote[where.node].append(peer)
            elif not process_alive(where.pid):
                self._dead.setdefault(peer, "its process exited")
        for node, ranks in remote.items():
            for peer in self.relay.dead_ranks(node, ranks):
                self._dead.setdefault(peer, f"its process on node {node[:8]} exited")

    # ------------------------------------------------------------ group status

    def arrive(self, header: CallHeader) -> None:
        self.state.arrive(self.rank, header.seq)

    def absent_ranks(self, header: CallHeader) -> Optional[Sequence[int]]:
        by_node: Dict[str, List[int]] = defaultdict(list)
        for rank, peer in enumerate(self.peers):
            by_node[peer.node].append(rank)
        started = []
        for node, ranks in by_node.items():
            if node == self.node:
                started += self.state.started(ranks, header.seq)
            else:
                started += self.relay.started(node, ranks, header.seq)
        absent = sorted(set(range(self.world_size)) - set(started))
        return absent or None

    def abort(self, error: BaseException) -> None:
        record = error_record(self.group_name, self.rank, error)
        self.state.abort(record)
        if self.relay is not None:
            self.relay.abort(record)

    def shared_memory_in_use(self) -> int:
        """Bytes of shared memory this rank's arena holds now (for tests and benchmarks)."""
        return self._arena.in_use()

    def close(self) -> None:
        for link in list(self._links_by_fd.values()):
            link.close()
        self._links_by_fd.clear()
        self._out_links.clear()
        self._boxes.clear()
        self._listener.close()
        self._segments.close()
        self._arena.close()
        self.state.close()
