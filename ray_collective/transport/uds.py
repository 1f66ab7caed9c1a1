"""Unix-socket connections between the processes of one node: packets out and in, and messages
cut into the parts the wire protocol (``transport.wire``) defines.

Each sender opens one ``SOCK_SEQPACKET`` connection to each local peer it sends to (the peer
listens on ``<group dir>/<rank>.sock``, in a 0700 directory). Sequenced packets keep message
boundaries and order, and the kernel wakes a ``poll`` at once, so a small message costs one
``sendmsg`` and one ``recvmsg_into``. A packet is sent straight from its pieces (frame, header,
the caller's payload) with scatter/gather I/O and received into one reusable buffer: nothing is
concatenated or allocated per message.

A large payload is copied, part by part, into the sender's shared memory (``transport.shm``),
and each part's frame names its place there; the segment's file descriptor travels with the
first frame that uses it on a connection (``SCM_RIGHTS``). The receiver reads each part straight
from the sender's memory, then sends a RELEASE back on the same connection.
"""

from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
from collections import deque
from typing import Callable, Deque, Dict, Optional, Sequence, Tuple

import numpy as np

from . import wire
from .shm import SendArena

SOCKET_BUFFER = 1 << 21
INLINE_LIMIT = 1 << 16
"""Payloads up to this many bytes travel inside their packet; larger ones in shared memory."""

PART_BYTES = 1 << 20
"""A large payload travels in parts of this many bytes (the last one shorter): the receiver
reduces one part while the sender writes the next."""

RECEIVE_BUFFER_BYTES = wire.DATA_FRAME.size + 4096 + INLINE_LIMIT
"""Room for the largest packet: frame, call header (names and shape), inline payload."""

_FD_SPACE = socket.CMSG_SPACE(struct.calcsize("i"))


def listen(path: str, backlog: int) -> socket.socket:
    """A nonblocking listening socket at ``path``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    # Connecting takes write permission on the socket file: the owner's alone, whatever the
    # umask (the group's directory already keeps other users out; this holds if it did not).
    os.chmod(path, 0o600)
    server.listen(backlog)
    server.setblocking(False)
    return server


def enlarge_buffers(sock: socket.socket, nbytes: int = SOCKET_BUFFER) -> None:
    """Ask for send and receive buffers of ``nbytes`` on ``sock`` (the system caps them)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, nbytes)
        except OSError:
            pass  # the system maximum applies; smaller buffers only mean more polling


def connect(path: str, sender: int, group_key: bytes, timeout: float) -> "Connection":
    """Open a connection to the rank listening at ``path``, introducing this end as
    ``sender``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    enlarge_buffers(sock)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(wire.hello(sender, group_key))
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return Connection(sock)


def knock(path: str) -> None:
    """Wake the rank listening at ``path``: connect and hang up at once, without waiting.

    A waiting rank sleeps in ``poll`` on its sockets, its listener among them; the connection
    wakes it, it finds the hang-up (no HELLO, nothing read) and looks at its node's state page,
    where the caller has published what it must know (an abort). Errors are ignored: a rank
    that is gone or whose backlog is full needs no knock (it will look at its next wake-up).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    try:
        sock.connect(path)
    except OSError:
        pass
    finally:
        sock.close()


def wait_for_knock(listener: socket.socket, seconds: float) -> bool:
    """Sleep up to ``seconds``, or less if a connection (a :func:`knock`) comes to
    ``listener``, which is left to accept; returns whether one came."""
    return bool(select.select([listener], [], [], seconds)[0])


def accepted(sock: socket.socket) -> "Connection":
    """Wrap a socket returned by ``accept`` (its peer is known once its HELLO is read)."""
    enlarge_buffers(sock)
    sock.setblocking(False)
    return Connection(sock)


class Connection:
    """One end of a connection: ordered packets out (queued while the kernel is full) and in.

    Attributes:
        peer: the rank at the other end (-1 until its HELLO arrives on an accepted connection).
        closed: nothing more will arrive: the other end hung up (after everything it sent was
            read), the connection failed, or this end closed it.
        unwritable: sending failed because the other end is gone; what it sent before can
            still be read, until ``closed``.
        segments_sent: the shared-memory segments whose descriptor this connection has
            carried.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = -1
        self.closed = False
        self.unwritable = False
        self.segments_sent: set = set()
        self._outbox: Deque[Tuple[Sequence, Optional[int], object]] = deque()

    @property
    def backlogged(self) -> bool:
        """Whether packets wait for room in the kernel."""
        return bool(self._outbox)

    def send(self, pieces: Sequence, fd: Optional[int] = None, request=None) -> None:
        """Send one packet made of ``pieces`` (bytes-like, gathered by the kernel), with ``fd``
        attached; ``request.done`` turns true once it is out. The pieces must stay unchanged
        until then."""
        self._outbox.append((pieces, fd, request))
        if len(self._outbox) == 1:
            self.flush()

    def flush(self) -> None:
        """Hand queued packets to the kernel until it is full."""
        outbox = self._outbox
        sock = self.sock
        while outbox and not (self.closed or self.unwritable):
            pieces, fd, request = outbox[0]
            try:
                if fd is None:
                    sock.sendmsg(pieces)
                else:
                    sock.sendmsg(pieces, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", [fd]))])
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    self.unwritable = True
                    outbox.clear()
                    return
                raise
            outbox.popleft()
            if request is not None:
                request.done = True

    def receive_into(self, buffer: bytearray) -> Optional[Tuple[int, Optional[int]]]:
        """Read the next packet into ``buffer``.

        Returns:
            ``(its length, the file descriptor it carried or None)``, or None when no packet is
            ready (or the connection ended: ``closed`` is then set).
        """
        resets = 0
        while True:
            try:
                nbytes, ancillary, _, _ = self.sock.recvmsg_into([buffer], _FD_SPACE)
                break
            except BlockingIOError:
                return None
            except ConnectionResetError:
                # The other end closed with packets of ours unread. The kernel reports that
                # once; what it sent before closing is still queued here, so read on.
                self.unwritable = True
                resets += 1
                if resets > 1:
                    self.closed = True
                    return None
            except OSError as err:
                if err.errno == errno.ENOTCONN:
                    self.closed = True
                    return None
                raise
        if not nbytes:
            self.closed = True
            return None
        fd = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                fd = fds[0]
                for extra in fds[1:]:
                    close_quietly(extra)  # a well-behaved peer never sends more than one
        return nbytes, fd

    def close(self) -> None:
        """Close the socket; queued packets are dropped."""
        self.closed = True
        self._outbox.clear()
        self.sock.close()


def close_quietly(fd: int) -> None:
    """Close a file descriptor a peer passed that nothing will use."""
    try:
        os.close(fd)
    except OSError:
        pass


def send_inline(connection: Connection, step: int, tag: int, count: int, header: bytes,
                payload: np.ndarray, request) -> None:
    """Send a message of at most ``INLINE_LIMIT`` bytes as one packet, its payload inline;
    ``request.done`` turns true once it is out."""
    nbytes = payload.nbytes
    frame = wire.data_frame(step, tag, count, nbytes, 0, nbytes, wire.INLINE, 0, len(header))
    connection.send((frame, header, payload), None, request)


class OutgoingMessage:
    """A message on its way out through one connection, sent part by part.

    Small payloads leave at once as one inline packet. Large ones leave one part per
    :meth:`advance` (each copied into ``arena`` and announced by its frame), so that a driver
    can interleave writing parts with reading what arrives. ``request.done`` turns true once
    the last part is handed to the kernel.
    """

    __slots__ = ("connection", "arena", "reclaim", "step", "tag", "count", "header", "payload",
                 "request", "sent", "part_bytes")

    def __init__(self, connection: Connection, arena: SendArena, reclaim, step: int, tag: int,
                 count: int, header: bytes, payload: np.ndarray, request,
                 part_bytes: int = PART_BYTES):
        self.connection = connection
        self.arena = arena
        self.reclaim = reclaim
        self.step = step
        self.tag = tag
        self.count = count
        self.header = header
        self.payload = payload
        self.request = request
        self.sent = 0
        self.part_bytes = part_bytes

    def advance(self) -> bool:
        """Send the next part; returns True once the whole message is out of this object."""
        payload, connection = self.payload, self.connection
        nbytes = payload.nbytes
        if nbytes <= INLINE_LIMIT:
            send_inline(connection, self.step, self.tag, self.count, self.header, payload,
                        self.request)
            self.sent = nbytes
            return True
        start = self.sent
        stop = min(nbytes, start + self.part_bytes)
        raw = payload.view(np.uint8) if payload.dtype != np.uint8 else payload
        segment, fd, offset = self.arena.place(raw[start:stop], self.reclaim)
        frame = wire.data_frame(self.step, self.tag, self.count, nbytes, start, stop - start,
                                segment, offset, len(self.header))
        first_use = segment not in connection.segments_sent
        connection.segments_sent.add(segment)
        self.sent = stop
        last = stop == nbytes
        connection.send((frame, self.header), fd if first_use else None,
                  self.request if last else None)
        return last


class Deliveries:
    """Moves messages into the connections of one node: a rank's own sends, or a post office's.

    Messages to one connection leave in the order they were given, each whole before the next
    (the receiver matches a message's parts in order); a large message leaves one part per call
    of :meth:`advance`, so that its sender can read what arrives in between.

    Args:
        arena: the sender's shared memory for large parts.
        reclaim: collects releases before the arena grows.
        part_bytes: the size of a large message's parts.
    """

    def __init__(self, arena: SendArena, reclaim: Callable[[], None],
                 part_bytes: int = PART_BYTES):
        self.arena = arena
        self.reclaim = reclaim
        self.part_bytes = part_bytes
        self._queues: Dict[Connection, Deque[OutgoingMessage]] = {}

    @property
    def pending(self) -> bool:
        """Whether some message still has parts to send."""
        return bool(self._queues)

    def send(self, connection: Connection, step: int, tag: int, count: int, header: bytes,
             payload: np.ndarray, request) -> None:
        """Start sending ``payload`` on ``connection``: its first part leaves now unless the
        connection is still sending an earlier message."""
        queue = self._queues.get(connection)
        if queue is None and payload.nbytes <= INLINE_LIMIT:
            # A small message whose connection is idle leaves whole at once: the common case
            # of small collectives, spared the bookkeeping of a message sent part by part.
            send_inline(connection, step, tag, count, header, payload, request)
            return
        message = OutgoingMessage(connection, self.arena, self.reclaim, step, tag, count,
                                  header, payload, request, self.part_bytes)
        if queue is not None:
            queue.append(message)
        elif not message.advance():
            self._queues[connection] = deque([message])

    def advance(self) -> None:
        """Send one more part of the first unfinished message of every connection."""
        for connection, queue in list(self._queues.items()):
            if connection.closed or connection.unwritable:
                del self._queues[connection]
                continue
            if queue[0].advance():
                queue.popleft()
                if not queue:
                    del self._queues[connection]

    def drop(self, connection: Connection) -> None:
        """Forget what was still to be sent on ``connection`` (it closed)."""
        self._queues.pop(connection, None)
