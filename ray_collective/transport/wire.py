"""The wire protocol between ranks, without I/O: call headers, frames, and matching.

Everything two ranks say to each other is defined here, and nothing here touches a socket (the
sans-I/O style of h11): the carriers (``transport.node_carrier``, ``transport.stream_carrier``,
``transport.local``) and the post office that carries messages between nodes
(``transport.post_office``) are drivers that feed it packets and send the frames it builds.
Nothing from a peer is ever unpickled: frames are fixed binary structs, the call header a fixed
binary encoding, payloads raw bytes.

Frames, one per packet:

- ``HELLO``: the first frame on a connection: the sender's rank and the group's 16-byte key.
- ``DATA``: one *part* of a message: its step and tag, the whole message's element count
  and byte size, the part's byte offset and size within the message, where the part's bytes are
  (inline, after the header, or at an offset of one of the sender's shared-memory segments), and
  the sender's packed call header. Small messages are one inline part; large ones are cut into
  parts so that the receiver reduces one part while the sender writes the next.
- ``RELEASE``: receiver to sender: the shared-memory part at (segment, offset) has been read.
- ``ABORT``: (on streams between nodes) the sender's group broke: its error record as JSON, for
  the receiver to publish on its node as a post office would.

Matching follows MPI: messages between two ranks on one channel are received in the order they
were sent, and receives are matched in the order they were posted. A part that arrives before
its receive is posted waits in the *unexpected* queue of its (sender, channel); a part whose
receive is already posted is consumed as it arrives, straight from the driver's receive buffer.
Every part's header, step and size are compared with what the receive expects, byte for byte;
a difference is a :class:`~ray_collective.errors.CollectiveMismatchError` naming both calls.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict, deque
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Deque, Dict, Hashable, Optional, Tuple

import numpy as np

from ..errors import CollectiveMismatchError

HELLO, DATA, RELEASE = 1, 2, 3
ABORT = 4
INLINE = -1
"""The segment number of a part whose bytes follow its header in the packet."""
SIZES_ONLY = -2
"""The segment number of a part that carries no bytes at all, only its sizes and header: the
simulator's zero-memory mode (``transport.local`` with ``move_data=False``)."""

COLLECTIVE_TAG = -1
"""The channel tag of collectives; point-to-point messages use their own tag (>= 0)."""

HELLO_FRAME = struct.Struct("<Bi16s")
DATA_FRAME = struct.Struct("<BiqqqqqiQH")
RELEASE_FRAME = struct.Struct("<BiQ")

_SEQ = struct.Struct("<q")


# ------------------------------------------------------------------------- call headers

@dataclass(frozen=True)
class CallHeader:
    """What a call is: identical on every rank of a well-formed collective.

    ``count`` and ``shape`` describe the caller's tensor (for list collectives, one block);
    ``root`` is -1 where the collective has none; ``seq`` counts collectives on the group,
    or sends/recvs per (peer, tag) on a p2p channel.
    """

    group: str
    epoch: int
    seq: int
    collective: str
    algorithm: str
    dtype: str
    count: int
    shape: Tuple[int, ...]
    root: int = -1
    op: str = ""

    def differences(self, theirs: "CallHeader") -> dict:
        """``{field: (mine, theirs)}`` for every field that differs."""
        return {f.name: (getattr(self, f.name), getattr(theirs, f.name))
                for f in fields(self) if getattr(self, f.name) != getattr(theirs, f.name)}

    _FIXED = struct.Struct("<HqqHHHqhqH")
    SEQ_OFFSET = 10
    """Byte offset of ``seq`` in the packed header (after the group name's length and epoch)."""

    def pack(self) -> bytes:
        """A fixed binary encoding (no pickle), for transports that cross process boundaries."""
        texts = [s.encode() for s in (self.group, self.collective, self.algorithm, self.dtype,
                                      self.op)]
        head = self._FIXED.pack(len(texts[0]), self.epoch, self.seq, len(texts[1]), len(texts[2]),
                                len(texts[3]), self.count, len(self.shape), self.root,
                                len(texts[4]))
        dims = struct.pack(f"<{len(self.shape)}q", *self.shape)
        return head + dims + b"".join(texts)

    @classmethod
    def unpack(cls, data: bytes) -> "CallHeader":
        """Inverse of :meth:`pack`; raises ``ValueError`` on a malformed header."""
        try:
            (n_group, epoch, seq, n_coll, n_alg, n_dtype, count, ndim, root,
             n_op) = cls._FIXED.unpack_from(data, 0)
            pos = cls._FIXED.size
            shape = struct.unpack_from(f"<{ndim}q", data, pos)
            pos += 8 * ndim
            texts = []
            for n in (n_group, n_coll, n_alg, n_dtype, n_op):
                texts.append(bytes(data[pos:pos + n]).decode())
                pos += n
        except (struct.error, UnicodeDecodeError) as err:
            raise ValueError(f"malformed collective message header: {err}") from err
        if pos != len(data):
            raise ValueError("malformed collective message header: trailing bytes")
        group, collective, algorithm, dtype, op = texts
        return cls(group, epoch, seq, collective, algorithm, dtype, count, tuple(shape), root, op)


class CallStamp:
    """One call's header as it travels: packed once per call shape, stamped with the call's
    sequence number.

    Attributes:
        template: the header with ``seq`` 0 (the same object for every call of one shape).
        seq: this call's sequence number.
        packed: the packed header of this call, what every message of it carries.
    """

    __slots__ = ("template", "seq", "packed")

    def __init__(self, template: CallHeader, seq: int, packed: bytes):
        self.template = template
        self.seq = seq
        self.packed = packed

    @classmethod
    def of(cls, header: CallHeader) -> "CallStamp":
        """The stamp of a header built for a single call."""
        return cls(header, header.seq, header.pack())

    @property
    def header(self) -> CallHeader:
        """The full header of this call (built on demand: only errors need it)."""
        return replace(self.template, seq=self.seq)


class HeaderTemplate:
    """A header packed once, stamped with a sequence number per call (no repacking).

    Args:
        header: the call shape's header; its ``seq`` is ignored.

    Attributes:
        header: the header with ``seq`` 0.
        packed: its packed form (the native core writes a call's number into a copy).
    """

    __slots__ = ("header", "packed", "_prefix", "_suffix")

    def __init__(self, header: CallHeader):
        self.header = replace(header, seq=0)
        self.packed = packed = self.header.pack()
        self._prefix = packed[:CallHeader.SEQ_OFFSET]
        self._suffix = packed[CallHeader.SEQ_OFFSET + _SEQ.size:]

    def stamp(self, seq: int) -> CallStamp:
        """The stamp of call number ``seq``."""
        return CallStamp(self.header, seq, self._prefix + _SEQ.pack(seq) + self._suffix)


def check_arrival(rank: int, peer: int, expected: CallHeader, expected_step: int,
                  expected_count: int, got: CallHeader, got_step: int, got_count: int) -> None:
    """Raise ``CollectiveMismatchError`` unless an arriving message is the one this rank expects."""
    if got == expected and got_step == expected_step and got_count == expected_count:
        return
    diff = expected.differences(got)
    if not diff:
        if got_step != expected_step:
            diff["step"] = (expected_step, got_step)
        if got_count != expected_count:
            diff["message elements"] = (expected_count, got_count)
    raise CollectiveMismatchError(expected.group, rank, peer, expected.collective, expected.seq,
                                  diff)


def mismatch(rank: int, peer: int, stamp: CallStamp, step: int, count: int, got_packed: bytes,
             got_step: int, got_count: int) -> CollectiveMismatchError:
    """The error for a message whose packed header, step or count differs from the receive's."""
    try:
        theirs = CallHeader.unpack(got_packed)
    except ValueError as err:
        mine = stamp.header
        return CollectiveMismatchError(mine.group, rank, peer, mine.collective, mine.seq,
                                       {"header": ("valid", str(err))})
    try:
        check_arrival(rank, peer, stamp.header, step, count, theirs, got_step, got_count)
    except CollectiveMismatchError as err:
        return err
    mine = stamp.header
    return CollectiveMismatchError(mine.group, rank, peer, mine.collective, mine.seq,
                                   {"message": ("as expected", "differently encoded")})


def part_difference(rank: int, peer: int, stamp: CallStamp, step: int, out: np.ndarray,
                    received: int, header, got_step: int, got_count: int, got_nbytes: int,
                    got_offset: int, got_part_bytes: int) -> Optional[CollectiveMismatchError]:
    """How an arriving part differs from what the receive into ``out`` expects next, or None.

    Args:
        rank: this rank; peer: the sender.
        stamp, step: the receive's call and step.
        out: the receive's buffer; received: its bytes already in.
        header, got_step, got_count: the part's packed call header, step and element count.
        got_nbytes, got_offset, got_part_bytes: the part's message size, offset and size.
    """
    if header != stamp.packed or got_step != step or got_count != len(out):
        return mismatch(rank, peer, stamp, step, len(out), bytes(header), got_step, got_count)
    if (got_nbytes != out.nbytes or got_offset != received or got_part_bytes % out.itemsize
            or got_offset + got_part_bytes > out.nbytes):
        mine = stamp.header
        return CollectiveMismatchError(
            mine.group, rank, peer, mine.collective, mine.seq,
            {"message part (offset, bytes of message)": (
                (received, out.nbytes), (got_offset, got_nbytes))})
    return None


# ------------------------------------------------------------------------------ frames

def hello(rank: int, group_key: bytes) -> bytes:
    """The first frame a connecting rank sends."""
    return HELLO_FRAME.pack(HELLO, rank, group_key)


def data_frame(step: int, tag: int, count: int, nbytes: int, part_offset: int,
               part_bytes: int, segment: int, segment_offset: int, header_len: int) -> bytes:
    """The fixed part of a DATA frame; the packed header (and an inline payload) follow it."""
    return DATA_FRAME.pack(DATA, step, tag, count, nbytes, part_offset, part_bytes, segment,
                           segment_offset, header_len)


def release_frame(segment: int, offset: int) -> bytes:
    """The frame telling a sender that its shared-memory part at (segment, offset) was read."""
    return RELEASE_FRAME.pack(RELEASE, segment, offset)


def abort_frame(record: dict) -> bytes:
    """The frame telling a peer that the group broke, with the error record (JSON, no pickle)."""
    return bytes([ABORT]) + json.dumps(record).encode()


def parse_abort(packet) -> dict:
    """The error record of an ABORT packet.

    Raises:
        ValueError: the packet is not an ABORT holding a JSON object.
    """
    if not len(packet) or packet[0] != ABORT:
        raise ValueError("not an ABORT frame")
    record = json.loads(bytes(packet[1:]).decode())
    if not isinstance(record, dict):
        raise ValueError("an ABORT frame whose record is not an object")
    return record


def parse_hello(packet) -> Tuple[int, bytes]:
    """(sender rank, group key) of a HELLO packet.

    Raises:
        ValueError: the packet is not a well-formed HELLO.
    """
    if len(packet) != HELLO_FRAME.size or packet[0] != HELLO:
        raise ValueError("the first packet on a connection is not a HELLO")
    _, sender, key = HELLO_FRAME.unpack_from(packet)
    return sender, key


def parse_release(packet) -> Tuple[int, int]:
    """(segment, offset) of a RELEASE packet.

    Raises:
        ValueError: the packet is not a well-formed RELEASE.
    """
    if len(packet) != RELEASE_FRAME.size:
        raise ValueError(f"RELEASE frame of {len(packet)} bytes")
    _, segment, offset = RELEASE_FRAME.unpack_from(packet)
    return segment, offset


class Part:
    """One arrived part of a message, as the receiver keeps it until it is consumed.

    ``payload`` holds an inline part's bytes (a view of the driver's receive buffer while the
    packet is being handled, a copy once kept); a shared-memory part has ``payload`` None and
    is read at (``segment``, ``segment_offset``) of its sender's memory. ``placed`` is true when
    the driver read the payload straight into the receive's buffer, at the place
    :meth:`Inbox.destination` gave it: consuming the part then copies nothing.
    """

    __slots__ = ("step", "count", "nbytes", "part_offset", "part_bytes", "segment",
                 "segment_offset", "header", "payload", "origin", "placed")

    def __init__(self, step, count, nbytes, part_offset, part_bytes, segment, segment_offset,
                 header, payload, origin, placed=False):
        self.step = step
        self.count = count
        self.nbytes = nbytes
        self.part_offset = part_offset
        self.part_bytes = part_bytes
        self.segment = segment
        self.segment_offset = segment_offset
        self.header = header
        self.payload = payload
        self.origin = origin
        self.placed = placed

    def keep(self, own: Callable[[memoryview], object] = bytes) -> "Part":
        """Own the header and inline payload: copy the header out of the driver's receive
        buffer, and the payload through ``own`` (a copy unless the carrier can give up the
        memory it lies in)."""
        self.header = bytes(self.header)
        if self.placed:
            # Not reached by the drivers (a placed part's receive is waiting for it); should
            # it be, the bytes are copied out of the receive's buffer, which may change.
            self.payload, self.placed = bytes(self.payload), False
        elif self.payload is not None:
            self.payload = own(self.payload)
        return self


def parse_data_head(packet: memoryview, origin) -> Tuple[int, Part]:
    """(channel tag, part) announced by the start of a DATA frame, up to its call header (the
    part's payload None: not read yet).

    Raises:
        ValueError: the frame is shorter than its fixed part or its call header.
    """
    try:
        (_, step, tag, count, nbytes, part_offset, part_bytes, segment, segment_offset,
         header_len) = DATA_FRAME.unpack_from(packet)
    except struct.error as err:
        raise ValueError(f"DATA frame too short: {err}") from err
    end = DATA_FRAME.size + header_len
    if end > len(packet):
        raise ValueError("DATA frame shorter than its header")
    return tag, Part(step, count, nbytes, part_offset, part_bytes, segment, segment_offset,
                     packet[DATA_FRAME.size:end], None, origin)


def parse_data(packet: memoryview, origin, placed: Optional[memoryview] = None
               ) -> Tuple[int, Part]:
    """(channel tag, part) of a DATA packet; the part's views point into ``packet``.

    Args:
        packet: the frame.
        origin: the carrier it came on (kept with the part).
        placed: the payload of an inline part, when the driver read it straight into the
            place :meth:`Inbox.destination` gave (``packet`` then ends with the call header).

    Raises:
        ValueError: the packet is shorter or longer than its frame says.
    """
    tag, part = parse_data_head(packet, origin)
    end = DATA_FRAME.size + len(part.header)
    if part.segment != INLINE:
        if len(packet) != end:
            raise ValueError("shared-memory part with trailing bytes")
        if placed is not None:
            raise ValueError("a shared-memory part cannot have been placed")
        return tag, part
    if placed is None:
        part.payload = packet[end:]
    elif len(packet) != end:
        raise ValueError("placed part with trailing bytes")
    else:
        part.payload, part.placed = placed, True
    if len(part.payload) != part.part_bytes:
        raise ValueError(f"inline part of {len(part.payload)} bytes, frame says "
                         f"{part.part_bytes}")
    return tag, part


# ---------------------------------------------------------------------------- matching

@dataclass(eq=False, slots=True)
class Receive:
    """A posted receive: from whom, what it expects, where the bytes go.

    Attributes:
        peer: the sending rank.
        done: true once every byte has arrived (and was reduced into ``out`` when
            ``combine`` is given).
    """

    peer: int
    stamp: CallStamp
    step: int
    out: np.ndarray
    combine: Optional[Callable[[np.ndarray, np.ndarray], None]]
    done: bool = field(default=False, init=False)
    received: int = field(default=0, init=False)


SegmentReader = Callable[[Part], np.ndarray]
"""Returns a shared-memory part's bytes (a uint8 view of the sender's memory)."""

PartConsumed = Callable[[Part], None]
"""Called once a shared-memory part has been read (the driver releases it to its sender)."""


class Inbox:
    """One rank's receiving side: posted receives, unexpected parts, header checks.

    Args:
        rank: this rank (errors).
        read_segment: where a shared-memory part's bytes are.
        consumed: called after a shared-memory part has been read.

    Attributes:
        error: the first mismatch found (the driver raises it from its wait); parts of a
            broken call are dropped.
    """

    def __init__(self, rank: int, read_segment: SegmentReader, consumed: PartConsumed):
        self.rank = rank
        self._read_segment = read_segment
        self._consumed = consumed
        self._posted: Dict[Hashable, Deque[Receive]] = defaultdict(deque)
        self._unexpected: Dict[Hashable, Deque[Part]] = defaultdict(deque)
        self._current: Optional[CallStamp] = None
        self.error: Optional[CollectiveMismatchError] = None

    def begin(self, stamp: CallStamp) -> None:
        """Note that this rank has started the collective of ``stamp``.

        From now on a collective part of the same call number whose header differs (another
        root, op, shape...) is a mismatch as soon as it arrives, even if this rank never posts
        a receive for its sender (ranks that disagree on the root do not agree on who sends to
        whom either); parts that came early are checked now.
        """
        self._current = stamp
        for (sender, tag), parts in self._unexpected.items():
            if tag == COLLECTIVE_TAG:
                for part in parts:
                    self._check_current(sender, part)

    def post(self, key: Hashable, receive: Receive) -> None:
        """Post ``receive`` for messages on ``key`` = (sender, tag); parts already there are
        consumed at once."""
        posted = self._posted[key]
        posted.append(receive)
        if len(posted) == 1:
            self._drain(key, posted)

    def arrive(self, key: Hashable, part: Part,
               own: Callable[[memoryview], object] = bytes) -> bool:
        """Hand over a part that arrived on ``key``.

        Args:
            key: (sender, tag).
            part: the part, its views into the driver's receive buffer.
            own: makes a kept inline payload outlive that buffer's next use (a copy by
                default).

        Returns:
            True if it was consumed now; False if it was kept for a later receive (its inline
            payload owned through ``own``, so the caller may reuse its buffer either way).
        """
        posted = self._posted.get(key)
        if posted and not self._unexpected.get(key):
            self._consume(posted, part)
            return True
        kept = part.keep(own)
        self._unexpected[key].append(kept)
        if key[1] == COLLECTIVE_TAG:
            self._check_current(key[0], kept)
        return False

    def destination(self, key: Hashable, part: Part) -> Optional[memoryview]:
        """Where an inline part's payload would be copied if it arrived now, for the driver to
        read it straight there: the bytes of the posted receive's buffer it fills, when that
        receive copies (does not reduce), expects this part and its buffer is contiguous;
        None otherwise (the part then arrives with its payload, as usual).

        Args:
            key: (sender, tag).
            part: the part, known from its frame's header (its payload not read yet).
        """
        posted = self._posted.get(key)
        if not posted or self._unexpected.get(key):
            return None
        receive = posted[0]
        if (receive.combine is not None or not receive.out.flags.c_contiguous
                or self._difference(receive, part) is not None):
            return None
        return memoryview(self._target(receive, part).view(np.uint8)).cast("B")

    def _check_current(self, sender: int, part: Part) -> None:
        current = self._current
        if (current is None or part.header == current.packed
                or _SEQ.unpack_from(part.header, CallHeader.SEQ_OFFSET)[0] != current.seq):
            return
        if self.error is None:
            self.error = mismatch(self.rank, sender, current, part.step, part.count,
                                  bytes(part.header), part.step, part.count)

    def quiet(self, key: Hashable) -> bool:
        """Whether no receive is posted and no part waits on ``key`` = (sender, tag)."""
        return not self._posted.get(key) and not self._unexpected.get(key)

    def unexpected_parts(self) -> int:
        """Parts that arrived and are not yet consumed (stale messages of a failed call)."""
        return sum(len(parts) for parts in self._unexpected.values())

    def drop(self, receives) -> None:
        """Forget posted receives that will not complete (their call failed)."""
        for receive in receives:
            for key, posted in self._posted.items():
                if receive in posted:
                    posted.remove(receive)
                    break

    def _drain(self, key: Hashable, posted: Deque[Receive]) -> None:
        waiting = self._unexpected.get(key)
        while posted and waiting:
            self._consume(posted, waiting.popleft())

    def _difference(self, receive: Receive, part: Part) -> Optional[CollectiveMismatchError]:
        """How ``part`` differs from what ``receive`` expects next, or None."""
        return part_difference(self.rank, receive.peer, receive.stamp, receive.step,
                               receive.out, receive.received, part.header, part.step,
                               part.count, part.nbytes, part.part_offset, part.part_bytes)

    @staticmethod
    def _target(receive: Receive, part: Part) -> np.ndarray:
        """The elements of ``receive.out`` that ``part`` fills."""
        out = receive.out
        if part.part_bytes == out.nbytes:
            return out  # a message in one part, most small ones
        itemsize = out.itemsize
        first = part.part_offset // itemsize
        return out[first:first + part.part_bytes // itemsize]

    def _consume(self, posted: Deque[Receive], part: Part) -> None:
        receive = posted[0]
        out = receive.out
        difference = self._difference(receive, part)
        if difference is not None:
            self._fail(part, difference)
            return
        if part.part_bytes and not part.placed and part.segment != SIZES_ONLY:
            target = self._target(receive, part)
            incoming = part.payload if part.payload is not None else self._read_segment(part)
            if len(incoming) != part.part_bytes:
                mine = receive.stamp.header
                self._fail(part, CollectiveMismatchError(
                    mine.group, self.rank, receive.peer, mine.collective, mine.seq,
                    {"part bytes readable": (part.part_bytes, len(incoming))}))
                return
            incoming = np.frombuffer(incoming, out.dtype)
            if receive.combine is None:
                target[...] = incoming  # same dtype and length: np.copyto's checks, unneeded
            else:
                receive.combine(target, incoming)
            del incoming
            if part.payload is None:
                self._consumed(part)
        receive.received += part.part_bytes
        if receive.received == out.nbytes:
            receive.done = True
            posted.popleft()

    def _fail(self, part: Part, error: CollectiveMismatchError) -> None:
        if self.error is None:
            self.error = error
        if part.payload is None:
            self._consumed(part)
