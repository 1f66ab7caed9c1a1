"""The transport interface: nonblocking send/recv of a flat buffer to/from a peer, with headers.

A transport knows nothing of algorithms. It moves one message per ``isend``/``irecv`` pair and
checks the header on arrival: every message carries the call's :class:`CallHeader` plus the
algorithm's step, and a receiver whose expectation differs raises
:class:`~ray_collective.errors.CollectiveMismatchError` instead of hanging or reading garbage.

Matching: messages between two ranks on one channel are delivered in posting order (MPI's
non-overtaking rule). Collectives use the channel ``COLLECTIVE_CHANNEL``; a call that is a
sequence number ahead on one rank therefore shows up as a mismatch of ``seq``, not as a hang.
Point-to-point calls use one channel per tag, ``p2p_channel(tag)``.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Callable, Hashable, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveMismatchError

COLLECTIVE_CHANNEL = ("coll",)


def p2p_channel(tag: int) -> Tuple[str, int]:
    """The channel of point-to-point messages with ``tag``."""
    return ("p2p", tag)


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


class Request(ABC):
    """A posted send or receive. ``peer`` is the other rank; ``done`` turns true once complete."""

    peer: int
    done: bool


class SendRequest(Request):
    """A posted send; transports whose sends complete at once create it done."""

    __slots__ = ("peer", "done")

    def __init__(self, peer: int, done: bool = False):
        self.peer = peer
        self.done = done


class RecvRequest(Request):
    """A posted receive: where its message comes from (``key``) and what it must look like."""

    __slots__ = ("peer", "done", "key", "header", "step", "out", "combine")

    def __init__(self, peer: int, key: Hashable, header: CallHeader, step: int, out: np.ndarray,
                 combine: Optional[Callable[[np.ndarray, np.ndarray], None]]):
        self.peer = peer
        self.done = False
        self.key = key
        self.header = header
        self.step = step
        self.out = out
        self.combine = combine


class Transport(ABC):
    """Moves flat buffers between the ranks of one group.

    Implementations: ``transport.local`` (ranks in one process: unit tests, the simulator) and,
    with the Ray backend, shared memory and Ray actor tasks.
    """

    rank: int
    world_size: int

    @abstractmethod
    def isend(self, peer: int, channel: Hashable, header: CallHeader, step: int,
              data: np.ndarray) -> Request:
        """Post a send of ``data`` to ``peer``; complete once ``data`` may be reused."""

    @abstractmethod
    def irecv(self, peer: int, channel: Hashable, header: CallHeader, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        """Post a receive from ``peer`` into ``out`` (combined into it when ``combine`` is given).

        ``header`` and ``step`` are what this rank expects; a different arrival raises
        ``CollectiveMismatchError`` from :meth:`test` or :meth:`wait`.
        """

    @abstractmethod
    def test(self, request: Request) -> bool:
        """Make progress on ``request`` without blocking; True once it has completed."""

    @abstractmethod
    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        """Block until every request completes or ``time.monotonic()`` passes ``deadline``.

        Returns:
            The requests still incomplete at the deadline (empty when all completed); the
            caller turns them into a ``CollectiveTimeoutError`` naming those peers.

        Raises:
            CollectiveMismatchError: an arriving message does not match this rank's call.
            PeerDiedError: a peer this rank waits for is known to be dead.
            GroupBrokenError: another rank aborted the group.
        """

    def arrive(self, header: CallHeader) -> None:
        """Note that this rank has started the collective ``header`` describes.

        Transports that can share this cheaply let a timed-out rank name the ranks that never
        came (see :meth:`absent_ranks`); the default shares nothing.
        """

    def absent_ranks(self, header: CallHeader) -> Optional[Sequence[int]]:
        """The ranks known not to have started the collective ``header`` describes; None when
        this transport cannot tell."""
        return None

    @abstractmethod
    def abort(self, error: BaseException) -> None:
        """Mark the group broken for every rank: their pending and later waits raise."""

    def close(self) -> None:
        """Release what the transport holds. Default: nothing to release."""
