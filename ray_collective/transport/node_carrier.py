"""The node carrier: a rank's peers on its own node, over Unix sockets and shared memory.

Each message goes to its peer over a Unix-socket connection (``transport.uds``): small
payloads inline in one packet, large ones part by part through the sender's shared memory
(``transport.shm``), read in place by the receiver, which sends a RELEASE back. A rank connects
to a peer at its first send to it and listens for the connections of the others; an accepted
connection must prove the group's key in its first packet (a HELLO) before anything else it sent
is read.

A peer's connection closing means it died when its process leaves the process table within
``HANG_UP_GRACE_S`` (a killed process closes its sockets a moment before it goes); the failure
watch (``transport.failures``) learns of it at once, and of a silent death at its next look.
"""

from __future__ import annotations

import hmac
import select
import struct
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import uds, wire
from .base import Request, SendRequest
from .progress import ProgressLoop
from .failures import FailureWatch
from .link import Carrier
from .processes import exits_within
from .shm import PeerSegments, SendArena

HANG_UP_GRACE_S = 0.02
"""How long a hang-up waits for the peer's process to exit, so that a death is known at once
rather than at the next liveness check. A peer that closed its connections on purpose (it left
the group) costs it once."""

CROWDED_PART_BYTES = 64 << 20
"""The part size of large messages on a node with more ranks than cores: every part wakes its
receiver, and where ranks outnumber cores a wake-up is a context switch, so parts are as large
as the message allows (overlap needs a core anyway)."""


class NodeCarrier(Carrier):
    """Links to the ranks of this node.

    Args:
        rank: this rank.
        group_name: the group's name (names the shared memory).
        group_key: the incarnation's key (a HELLO proves it).
        peers: where every rank lives (``node``, ``pid``, ``socket_path``), by rank.
        listener: this rank's listening socket (bound before the rendezvous).
        progress: the rank's progress loop (its sockets are registered there).
        failures: the rank's failure watch (dead peers are reported there).
        connect_timeout: seconds to wait for a peer's socket to accept.
        part_bytes: the size of a large message's parts.

    Attributes:
        refused: connections closed because their first packet did not prove the key.
    """

    def __init__(self, rank: int, group_name: str, group_key: bytes, peers: Sequence,
                 listener, progress: ProgressLoop, failures: FailureWatch,
                 connect_timeout: float = 30.0, part_bytes: int = uds.PART_BYTES):
        self.rank = rank
        self.group_key = group_key
        self.peers = tuple(peers)
        self.world_size = len(self.peers)
        self.progress = progress
        self.failures = failures
        self.connect_timeout = connect_timeout
        self.refused = 0
        self._listener = listener
        self._connections_by_fd: Dict[int, uds.Connection] = {}
        self._out: Dict[int, uds.Connection] = {}
        self._arena = SendArena(f"ray_collective-{group_name}-{rank}")
        self._segments = PeerSegments()
        self.deliveries = uds.Deliveries(self._arena, self.collect_releases, part_bytes)
        self._buffer = bytearray(uds.RECEIVE_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        progress.register(listener.fileno(), self._on_listener)
        progress.add_pump(self.deliveries)
        progress.use_segments(self._read_segment, self._release)

    # ------------------------------------------------------------------ sending

    def send(self, peer: int, tag: int, step: int, header: bytes,
             data: np.ndarray) -> Request:
        request = SendRequest(peer)
        connection = self._connection_to(peer)
        self.deliveries.send(connection, step, tag, len(data), header, data, request)
        if connection.unwritable:
            self.read(connection)  # what the peer sent before it went is still to be read
        if connection.closed:
            self.drop(connection)
        elif connection.backlogged:
            self.progress.watch(connection.fd, writable=True)
        return request

    def _connection_to(self, peer: int) -> uds.Connection:
        connection = self._out.get(peer)
        if connection is None:
            failures = self.failures
            if peer in failures.dead:
                raise failures.peer_died([peer], "send")
            try:
                connection = uds.connect(self.peers[peer].socket_path, self.rank,
                                         self.group_key, self.connect_timeout)
            except OSError as err:
                failures.mark_dead(peer, f"its socket refused a connection: {err}")
                raise failures.peer_died([peer], "send") from err
            connection.peer = peer
            self._out[peer] = connection
            self._add(connection)
        return connection

    def collect_releases(self) -> None:
        """Read what the connections this rank sends on have received (releases) without
        waiting."""
        for connection in list(self._out.values()):
            self.read(connection)

    def live_payloads(self) -> int:
        """Large payloads sent and not yet released by their receiver."""
        return self._arena.live_payloads()

    # ---------------------------------------------------------------- receiving

    def _add(self, connection: uds.Connection) -> None:
        self._connections_by_fd[connection.fd] = connection
        self.progress.register(connection.fd,
                             lambda events: self._on_event(connection, events))

    def _on_listener(self, events: int) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            self._add(uds.accepted(sock))

    def _on_event(self, connection: uds.Connection, events: int) -> None:
        if events & select.POLLOUT:
            connection.flush()
        if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
            self._read_packet(connection)
        if connection.closed:
            self.drop(connection)
        else:
            self.progress.watch(connection.fd, connection.backlogged)

    def read(self, connection: uds.Connection) -> None:
        """Handle every packet ``connection`` has received."""
        buffer = self._buffer
        while not connection.closed:
            got = connection.receive_into(buffer)
            if got is None:
                break
            self._on_packet(connection, *got)

    def _read_packet(self, connection: uds.Connection) -> None:
        """Handle the next packet ``connection`` has received, if any. One per ``poll``: most
        events bring one packet, and reading on until the kernel says it holds no more would
        cost every small message a failed read; a second packet makes the next ``poll`` return
        at once."""
        got = connection.receive_into(self._buffer)
        if got is not None:
            self._on_packet(connection, *got)

    def _on_packet(self, connection: uds.Connection, nbytes: int, fd: Optional[int]) -> None:
        packet = self._view[:nbytes]
        if connection.peer < 0:
            self._on_hello(connection, packet, fd)
            return
        try:
            kind = packet[0]
            if kind == wire.DATA:
                tag, part = wire.parse_data(packet, connection)
                if part.segment != wire.INLINE:
                    if fd is not None:
                        self._segments.add(connection.peer, part.segment, fd)
                        fd = None
                    self._segments.hold(connection.peer, part.segment)
                self.progress.inbox.arrive((connection.peer, tag), part)
            elif kind == wire.RELEASE:
                self._arena.release(*wire.parse_release(packet))
            else:
                raise ValueError(f"unknown frame kind {kind}")
        except (ValueError, KeyError, struct.error, OSError) as err:
            self.failures.protocol_failed(connection.peer, err, "its connection")
            self.drop(connection)
        finally:
            if fd is not None:
                uds.close_quietly(fd)

    def _on_hello(self, connection: uds.Connection, packet, fd: Optional[int]) -> None:
        """The first packet of an accepted connection must prove the group's key; a connection
        that does not is closed before anything else it sent is read."""
        try:
            sender, key = wire.parse_hello(packet)
        except ValueError:
            sender, key = -1, b""
        if fd is not None:
            uds.close_quietly(fd)
        if not hmac.compare_digest(key, self.group_key) or not 0 <= sender < self.world_size:
            self.refused += 1
            self.drop(connection)
            return
        connection.peer = sender

    def _read_segment(self, part: wire.Part) -> np.ndarray:
        return self._segments.view(part.origin.peer, part.segment, part.segment_offset,
                                   part.part_bytes)

    def _release(self, part: wire.Part) -> None:
        connection = part.origin
        self._segments.done(connection.peer, part.segment)
        if not (connection.closed or connection.unwritable):
            connection.send((wire.release_frame(part.segment, part.segment_offset),))
            if connection.backlogged:
                self.progress.watch(connection.fd, writable=True)

    def drop(self, connection: uds.Connection) -> None:
        """Forget a connection that closed; its peer is dead if its process is gone."""
        if self._connections_by_fd.pop(connection.fd, None) is None:
            return
        self.progress.unregister(connection.fd)
        self.deliveries.drop(connection)
        peer = connection.peer
        if peer >= 0 and self._out.get(peer) is connection:
            del self._out[peer]
        if peer >= 0 and exits_within(self.peers[peer].pid, HANG_UP_GRACE_S):
            self.failures.mark_dead(peer, "its process exited")
        connection.close()

    def close(self) -> None:
        for connection in list(self._connections_by_fd.values()):
            connection.close()
        self._connections_by_fd.clear()
        self._out.clear()
        self._listener.close()
        self._segments.close()
        self._arena.close()

    def connections(self) -> List[uds.Connection]:
        """Every open connection (accepted ones and this rank's own)."""
        return list(self._connections_by_fd.values())

