"""Unix-socket links between the processes of one node: the frames and their buffering.

Each sender opens one ``SOCK_SEQPACKET`` connection to each local peer it sends to (the peer
listens on ``<group dir>/<rank>.sock``, in a 0700 directory). Sequenced packets keep message
boundaries and order, and the kernel wakes a ``poll`` at once, so a small message costs one
``send`` and one ``recv``. Frames are fixed binary structs plus the packed call header; nothing
from a peer is ever unpickled.

Frames:
- ``HELLO``: the first packet on a connection: the sender's rank and the group's key.
- ``DATA``: one message: step, channel, element count, byte size, the packed call header, and
  either the payload inline (small) or a place in the sender's shared memory (segment id, byte
  offset), with the segment's file descriptor attached the first time (``SCM_RIGHTS``).
- ``RELEASE``: from receiver back to sender: the shared-memory payload at (segment id, byte
  offset) was read.
"""

from __future__ import annotations

import array
import errno
import socket
import struct
from collections import deque
from typing import Deque, List, Optional, Tuple

HELLO, DATA, RELEASE = 1, 2, 3
INLINE = -1
COLLECTIVE_TAG = -1

HELLO_FRAME = struct.Struct("<Bi16s")
DATA_FRAME = struct.Struct("<BiqqqiQH")
RELEASE_FRAME = struct.Struct("<BiQ")

SOCKET_BUFFER = 1 << 21
_FD_SPACE = socket.CMSG_SPACE(struct.calcsize("i"))


def listen(path: str, backlog: int) -> socket.socket:
    """A nonblocking listening socket at ``path``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(backlog)
    server.setblocking(False)
    return server


def _enlarge_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass  # the system maximum applies; smaller buffers only mean more polling


def connect(path: str, sender: int, group_key: bytes, timeout: float) -> "Link":
    """Open a link to the rank listening at ``path``, introducing this end as ``sender``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _enlarge_buffers(sock)
    sock.settimeout(timeout)
    sock.connect(path)
    sock.sendall(HELLO_FRAME.pack(HELLO, sender, group_key))
    sock.setblocking(False)
    return Link(sock)


def accepted(sock: socket.socket) -> "Link":
    """Wrap a socket returned by ``accept`` (its peer is known once its HELLO is read)."""
    _enlarge_buffers(sock)
    sock.setblocking(False)
    return Link(sock)


class Link:
    """One end of a connection: ordered packets out (queued while the kernel is full) and in.

    Attributes:
        peer: the rank at the other end (-1 until its HELLO arrives on an accepted link).
        closed: the other end hung up or the connection failed.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = -1
        self.closed = False
        self.segments_sent: set = set()
        self._outbox: Deque[Tuple[bytes, Optional[int], object]] = deque()

    @property
    def backlogged(self) -> bool:
        """Whether packets wait for room in the kernel."""
        return bool(self._outbox)

    def send(self, packet: bytes, fd: Optional[int] = None, request=None) -> None:
        """Send one packet (with ``fd`` attached); ``request.done`` turns true once it is out."""
        self._outbox.append((packet, fd, request))
        if len(self._outbox) == 1:
            self.flush()

    def flush(self) -> None:
        """Hand queued packets to the kernel until it is full."""
        outbox = self._outbox
        while outbox and not self.closed:
            packet, fd, request = outbox[0]
            try:
                if fd is None:
                    self.sock.send(packet)
                else:
                    socket.send_fds(self.sock, [packet], [fd])
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    self.closed = True
                    return
                raise
            outbox.popleft()
            if request is not None:
                request.done = True

    def receive(self, limit: int) -> List[Tuple[bytes, Optional[int]]]:
        """Every packet ready now, each with the file descriptor it carried (or None)."""
        packets = []
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(limit, _FD_SPACE)
            except BlockingIOError:
                return packets
            except OSError as err:
                if err.errno in (errno.ECONNRESET, errno.ENOTCONN):
                    self.closed = True
                    return packets
                raise
            if not data:
                self.closed = True
                return packets
            fd = None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                    fd = fds[0]
            packets.append((data, fd))

    def close(self) -> None:
        """Close the socket; queued packets are dropped."""
        self.closed = True
        self._outbox.clear()
        self.sock.close()
