"""TCP streams between ranks on different nodes: a handshake, then wire frames with a length
prefix.

A rank whose group spans nodes listens on its node's address (never on all interfaces), on a
port the OS picks. A stream carries the frames of the wire protocol (``transport.wire``), each
preceded by its length, since a byte stream keeps no packet boundaries. Only ``DATA`` frames
with an inline payload (and ``ABORT`` when a group breaks) travel on it: a large message is cut
into parts of :data:`STREAM_PART_BYTES`, each sent straight from the caller's tensor (gathered
by the kernel with the frame and call header, no copy) and reduced or copied by the receiver
while the next part is on its way.

Before any frame is read, both ends prove that they know the group's incarnation key, without
sending it (``transport.handshake``). An accepting end reads exactly the handshake's bytes before
it decides, so nothing a connection that fails sent afterwards is ever read; it is closed and
counted by the caller. Nothing from a peer is unpickled: frames are fixed binary structs and raw
payload bytes.

A :class:`Stream` is sans-policy: it reads and writes without blocking and reports what it saw
(frames, the end of the stream, a failed handshake); the stream carrier
(``transport.stream_carrier``) decides what a closed stream means (a dead peer).
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np

from . import uds, wire
from .handshake import Handshake, HandshakeError

STREAM_PART_BYTES = 256 << 10
"""A large payload travels in parts of this many bytes: the receiver reduces one part while
the next arrives."""

MAX_HEADER_BYTES = 4096
MAX_FRAME_BYTES = wire.DATA_FRAME.size + MAX_HEADER_BYTES + STREAM_PART_BYTES
"""The largest frame a stream accepts; a longer length prefix is a protocol error."""

LENGTH = struct.Struct("<I")
_LENGTH_AND_DATA_FRAME = struct.Struct("<I" + wire.DATA_FRAME.format.lstrip("<"))
SMALL_BUFFER_BYTES = LENGTH.size + wire.DATA_FRAME.size + MAX_HEADER_BYTES + (64 << 10)
"""A stream's receive buffer until a larger frame comes: a rank with streams to many peers
(an alltoall across many nodes) keeps a quarter of a part's size per stream that carries only
small messages."""
LARGE_PAYLOAD_BYTES = 64 << 10
"""From this size on, a payload whose receive is waiting is read straight into the receive's
buffer (see ``StreamLink.placer``), and one kept for a later receive takes the stream's buffer
with it; a smaller one is copied either way (cheaper than a system call or a new buffer)."""
SOCKET_BUFFER = 4 << 20

READ_BUDGET_BYTES = 4 * STREAM_PART_BYTES
"""What a rank reads ahead from one stream (parts no receive waits for yet) before it turns to
its other sockets: a peer that sends faster than this rank reads would otherwise keep it
reading ahead while its own sends wait, which stalled a chain of ranks for 0.4 to 3 s."""

HANDSHAKE_TIMEOUT_S = 10.0
"""A connection whose handshake has not completed this long after it opened is closed."""


def _buffer(nbytes: int) -> np.ndarray:
    """Receive memory, not zeroed (the kernel writes it before anything reads it)."""
    return np.empty(nbytes, np.uint8)


def listen(host: str, backlog: int) -> socket.socket:
    """A nonblocking listening TCP socket on ``host`` (an address, never all interfaces), on a
    port the OS picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    try:
        server.bind((host, 0))
        server.listen(backlog)
    except BaseException:
        server.close()
        raise
    server.setblocking(False)
    return server


LINK_TIMEOUT_S = 3
"""A stream fails (``ETIMEDOUT``, read as its end: the peer is named dead) once its peer's
kernel has acknowledged nothing for this long, while data waits to be acknowledged
(``TCP_USER_TIMEOUT``) or while the stream is idle, probed every :data:`KEEPALIVE_S`
(keepalive). A cut cable or a node cut off shows no end of its streams: without this, a rank
waits for it until the call's deadline. A live peer's kernel acknowledges at once, however busy
its process (a full receive window is probed and answered, which resets the clock)."""
KEEPALIVE_S = 1
"""An idle stream is probed after this long without traffic, and again this often."""
_TCP_CLOSE = 7
"""``tcp_info``'s state of a connection the kernel gave up (``TCP_CLOSE``; a peer's orderly
end leaves ``CLOSE_WAIT``)."""


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_TIMEOUT_S * 1000)
    uds.enlarge_buffers(sock, SOCKET_BUFFER)


def connect(host: str, port: int, rank: int, peer: int, key: bytes,
            timeout: float) -> "Stream":
    """Open a stream to rank ``peer`` listening at (``host``, ``port``), as rank ``rank``.

    The TCP connection is made now (the peer's kernel accepts it without the peer's help); the
    handshake goes on as the stream is read (:meth:`Stream.receive`), and what is sent waits
    for it.

    Raises:
        OSError: the connection was refused or timed out.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return Stream(sock, Handshake(rank, key, peer))


def accepted(sock: socket.socket, rank: int, key: bytes) -> "Stream":
    """Wrap a socket returned by ``accept``: its challenge leaves now; the peer is known once
    its response proves the key."""
    _tune(sock)
    sock.setblocking(False)
    return Stream(sock, Handshake(rank, key))


def control_frame(body: bytes) -> list:
    """The pieces of a frame that is not a message (an ABORT)."""
    return [LENGTH.pack(len(body)) + body]


def frame_pieces(step: int, tag: int, count: int, header: bytes, payload: np.ndarray,
                 part_bytes: int = STREAM_PART_BYTES) -> List[list]:
    """The frames of one message as lists of pieces to gather (length prefix and DATA frame,
    call header, a view of the payload's part), one list per part."""
    nbytes = payload.nbytes
    if nbytes <= part_bytes:
        # One part, most messages: packed at once, with no view to cut.
        length = wire.DATA_FRAME.size + len(header) + nbytes
        head = _LENGTH_AND_DATA_FRAME.pack(length, wire.DATA, step, tag, count, nbytes, 0,
                                           nbytes, wire.INLINE, 0, len(header))
        return [[head, header, memoryview(payload).cast("B") if nbytes else b""]]
    raw = payload.view(np.uint8) if payload.dtype != np.uint8 else payload
    nbytes = raw.nbytes
    view = memoryview(raw).cast("B") if nbytes else memoryview(b"")
    frames = []
    start = 0
    while True:
        stop = min(nbytes, start + part_bytes)
        frame = wire.data_frame(step, tag, count, nbytes, start, stop - start, wire.INLINE, 0,
                                len(header))
        length = len(frame) + len(header) + stop - start
        frames.append([LENGTH.pack(length) + frame, header, view[start:stop]])
        start = stop
        if start >= nbytes:
            return frames


_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ETIMEDOUT,
                        errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN})
"""What a write to a stream raises once its peer is out of reach: it died, reset the
connection, or its link timed out (an unreachable network or host, when this end's own link
is the one cut)."""


def write_frames(sock: socket.socket, outbox: Deque[Tuple[list, object]]) -> bool:
    """Write the frames of ``outbox`` (each a list of pieces, with its request) to ``sock`` until
    the kernel is full; a frame the kernel took in part keeps its rest at the front, and a
    frame wholly written completes its request.

    Returns:
        False when the other end is gone (the outbox is then cleared), True otherwise.
    """
    while outbox:
        pieces, request = outbox[0]
        try:
            sent = sock.sendmsg(pieces)
        except BlockingIOError:
            return True
        except OSError as err:
            if err.errno in _PEER_GONE:
                outbox.clear()
                return False
            raise
        while sent:
            first = pieces[0]
            if len(first) <= sent:
                sent -= len(first)
                del pieces[0]
            else:
                pieces[0] = memoryview(first)[sent:]
                sent = 0
        while pieces and not len(pieces[0]):
            del pieces[0]
        if pieces:
            continue
        outbox.popleft()
        if request is not None:
            request.done = True
    return True


class Stream:
    """One end of an authenticated stream: frames out (queued while the kernel is full) and in.

    Args:
        sock: a connected nonblocking stream socket.
        handshake: this end's side of the handshake (it knows the rank connected to, or that
            this end accepted and learns the peer's rank from its response).

    Attributes:
        peer: the rank at the other end (-1 until an accepted connection proves the key).
        open: the handshake has completed; frames flow.
        closed: nothing more will arrive (the stream ended or failed, or this end closed it).
        unwritable: sending failed because the other end is gone.
        refused: the other end failed the handshake (the link is closed).
        opened_at: when the connection was made (``time.monotonic()``).
        placer: given the start of a large inline DATA frame (its fixed part and call header),
            returns the writable bytes its payload belongs in, to be read straight there, or
            None (the frame then arrives whole, as usual). Set by the transport.
        placed: the payload of the frame :meth:`receive` returned last, when it was placed
            (that frame then ends with its call header); None otherwise.
        drained: the last read from the socket came back shorter than asked: the kernel held
            nothing more then.
    """

    def __init__(self, sock: socket.socket, handshake: Handshake):
        self.sock = sock
        self.fd = sock.fileno()
        self.rank = handshake.rank
        self.peer = handshake.peer
        self.open = False
        self.closed = False
        self.unwritable = False
        self.refused = False
        self.opened_at = time.monotonic()
        self._handshake = handshake
        self._buffer = _buffer(SMALL_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._outbox: Deque[Tuple[list, object]] = deque()
        self.placer: Optional[Callable[[memoryview], Optional[memoryview]]] = None
        self.placed: Optional[memoryview] = None
        self._placing: Optional[Tuple[bytes, memoryview, int]] = None
        self._asked = False  # whether placer was asked about the frame at _start
        self.drained = False
        opening = handshake.opening()
        if opening is not None:
            self._write_handshake(opening)

    @property
    def quiet(self) -> bool:
        """Whether another reader and writer may take the socket's next frames over: open and
        whole, nothing queued to send, nothing read ahead of the frames handled."""
        return (self.open and not (self.closed or self.unwritable) and not self._outbox
                and self._start == self._end and self._placing is None)

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for room in the kernel (none can leave before the handshake)."""
        return self.open and bool(self._outbox)

    # ------------------------------------------------------------------ sending

    def send(self, pieces: list, request=None) -> None:
        """Send one frame made of ``pieces`` (gathered by the kernel); ``request.done`` turns
        true once it is out. The pieces must stay unchanged until then."""
        self._outbox.append((pieces, request))
        if self.open and len(self._outbox) == 1:
            self.flush()

    def flush(self) -> None:
        """Hand queued frames to the kernel until it is full."""
        if self.open and not (self.closed or self.unwritable) and not write_frames(
                self.sock, self._outbox):
            self.unwritable = True

    # ---------------------------------------------------------------- receiving

    def receive(self, read: bool = True) -> Optional[memoryview]:
        """The next whole frame (a view valid until the next call), or None when none is ready
        (``closed`` is set when the stream ended). Drives the handshake first. A frame whose
        payload was placed (see ``placer``) ends with its call header; ``placed`` holds it.

        Args:
            read: read from the socket; False returns only a frame already whole in the
                link's buffer (what the kernel holds is left for the next call).

        Raises:
            HandshakeError: the other end failed the handshake (the link is now closed).
            ValueError: the other end sent a frame longer than any frame of the protocol.
        """
        self.placed = None
        if not read:
            return self._next_frame() if self.open and self._placing is None else None
        while not self.open:
            if self.closed or not self._handshake_step():
                return None
        while True:
            if self._placing is not None:
                return self._go_on_placing()
            frame = self._next_frame()
            if frame is not None or self.closed:
                return frame
            if not self._asked and self._start_placing():
                continue
            if not self._fill():
                return None

    def _start_placing(self) -> bool:
        """Ask ``placer``, once per frame, where the payload of the large inline DATA frame
        begun in the buffer goes, as soon as its call header is in; whether it now goes
        there."""
        head_at = self._start + LENGTH.size
        if self.placer is None or self._end - head_at < wire.DATA_FRAME.size:
            return False
        if self._buffer[head_at] != wire.DATA:
            self._asked = True
            return False
        fields = wire.DATA_FRAME.unpack_from(self._buffer, head_at)
        part_bytes, segment, header_len = fields[6], fields[7], fields[9]
        head_bytes = wire.DATA_FRAME.size + header_len
        if self._end - head_at < head_bytes:
            return False
        self._asked = True
        length = LENGTH.unpack_from(self._buffer, self._start)[0]
        if (segment != wire.INLINE or part_bytes < LARGE_PAYLOAD_BYTES
                or length != head_bytes + part_bytes):
            return False
        head = bytes(self._view[head_at:head_at + head_bytes])
        target = self.placer(memoryview(head))
        if target is None or len(target) != part_bytes:
            return False
        payload_at = head_at + head_bytes
        arrived = min(self._end - payload_at, part_bytes)
        target[:arrived] = self._view[payload_at:payload_at + arrived]
        self._start = payload_at + arrived
        self._placing = (head, target, arrived)
        return True

    def _go_on_placing(self) -> Optional[memoryview]:
        """Read the placed payload on; the frame's start once all of it is in place."""
        head, target, arrived = self._placing
        while arrived < len(target):
            try:
                got = self.sock.recv_into(target[arrived:])
            except BlockingIOError:
                break
            except OSError:
                got = 0
            if not got:
                self.closed = True
                self._placing = None
                return None
            arrived += got
        if arrived < len(target):
            self._placing = (head, target, arrived)
            return None
        self._placing = None
        self._asked = False
        self.placed = target
        return memoryview(head)

    def _next_frame(self) -> Optional[memoryview]:
        available = self._end - self._start
        if available < LENGTH.size:
            return None
        (length,) = LENGTH.unpack_from(self._buffer, self._start)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"stream frame of {length} bytes (at most {MAX_FRAME_BYTES})")
        if available < LENGTH.size + length:
            return None
        begin = self._start + LENGTH.size
        self._start = begin + length
        self._asked = False
        return self._view[begin:self._start]

    def _fill(self, limit: Optional[int] = None) -> bool:
        """Read what the kernel has, up to ``limit`` bytes held (the buffer's size when None);
        whether anything came."""
        if self._start == self._end:
            self._start = self._end = 0
        needed = self._partial_frame_bytes() if self.open else 0
        if needed > len(self._buffer):
            # The first frame larger than the buffer: make room for the largest there is.
            kept = self._end - self._start
            larger = _buffer(MAX_FRAME_BYTES + LENGTH.size)
            larger[:kept] = self._buffer[self._start:self._end]
            self._buffer, self._view = larger, memoryview(larger)
            self._start, self._end = 0, kept
        elif self._start + needed > len(self._buffer):
            # The frame begun at the end of the buffer would not fit: move it to the front.
            kept = self._end - self._start
            self._buffer[:kept] = self._buffer[self._start:self._end]
            self._start, self._end = 0, kept
        room = (len(self._buffer) if limit is None else limit) - self._end
        if needed > SMALL_BUFFER_BYTES:
            # A large frame is read up to its end, not into the next one: the buffer can then
            # be given up with it whole (see own) without moving anything.
            room = min(room, self._start + needed - self._end)
        if room <= 0:
            return False
        try:
            got = self.sock.recv_into(self._view[self._end:self._end + room])
        except BlockingIOError:
            return False
        except OSError:
            self.closed = True
            return False
        if not got:
            self.closed = True
            return False
        self._end += got
        self.drained = got < room
        return True

    def own(self, payload: memoryview):
        """Make ``payload`` outlive the next receive: a large one by giving up the buffer it
        lies in (the link reads on into a new one), a small one by a copy.

        Args:
            payload: a view into the frame :meth:`receive` returned last.

        Returns:
            ``payload`` itself (large), or a copy of its bytes (small).
        """
        if len(payload) < LARGE_PAYLOAD_BYTES:
            return bytes(payload)
        kept = self._end - self._start
        fresh = _buffer(len(self._buffer))
        fresh[:kept] = self._buffer[self._start:self._end]
        self._buffer, self._view = fresh, memoryview(fresh)
        self._start, self._end = 0, kept
        return payload

    def _partial_frame_bytes(self) -> int:
        """The size, length prefix included, of the frame that starts at ``_start``."""
        if self._end - self._start < LENGTH.size:
            return LENGTH.size
        return LENGTH.size + LENGTH.unpack_from(self._buffer, self._start)[0]

    def _read_exact(self, nbytes: int) -> Optional[bytes]:
        """Exactly ``nbytes`` of the handshake (never a byte more), or None until they came."""
        while self._end < nbytes:
            if not self._fill(nbytes):
                return None
        data = bytes(self._buffer[:nbytes])
        self._start = self._end = 0
        return data

    def _handshake_step(self) -> bool:
        """Advance the handshake by one message; whether it moved."""
        handshake = self._handshake
        message = self._read_exact(handshake.expected_bytes())
        if message is None:
            return False
        try:
            reply = handshake.receive(message)
        except HandshakeError:
            self.refused = True
            self.close()
            raise
        self.peer = handshake.peer
        if reply is not None:
            self._write_handshake(reply)
        if handshake.done:
            self.open = not self.closed
            self.flush()
        return True

    def _write_handshake(self, message: bytes) -> None:
        # A handshake message is the first thing on a fresh stream: it fits the kernel's
        # buffer whole, or the stream is broken.
        try:
            sent = self.sock.send(message)
        except OSError:
            sent = 0
        if sent != len(message):
            self.closed = True

    def unreachable(self) -> bool:
        """Whether the stream failed because its peer's kernel stopped acknowledging (after
        retransmissions or keepalive probes: :data:`LINK_TIMEOUT_S`), not because the peer
        closed or reset it; False for a socket that is not TCP."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        except OSError:
            return False
        state, _, retransmits, probes = info[:4]
        return state == _TCP_CLOSE and (retransmits > 0 or probes > 0)

    def close(self) -> None:
        """Close the socket; queued frames are dropped."""
        self.closed = True
        self.open = False
        self._outbox.clear()
        self.sock.close()
