"""The transport interface: nonblocking send/recv of a flat buffer to/from a peer, with headers.

A transport knows nothing of algorithms. It moves one message per ``isend``/``irecv`` pair and
checks the header on arrival: every message carries the call's header (a
:class:`~ray_collective.transport.wire.CallStamp`, packed once per call shape) plus the
algorithm's step, and a receiver whose expectation differs raises
:class:`~ray_collective.errors.CollectiveMismatchError` instead of hanging or reading garbage.

Matching: messages between two ranks with one tag are delivered in posting order (MPI's
non-overtaking rule). Collectives use the tag ``COLLECTIVE_TAG`` (-1); a call that is a
sequence number ahead on one rank therefore shows up as a mismatch of ``seq``, not as a hang.
Point-to-point calls use their own tag (>= 0). Every transport matches with the one matcher of
the wire protocol, :class:`~ray_collective.transport.wire.Inbox`; a posted receive is a
:class:`~ray_collective.transport.wire.Receive`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence

import numpy as np

from .node_state import RankWords
from .wire import COLLECTIVE_TAG, CallStamp

__all__ = ["COLLECTIVE_TAG", "Request", "SendRequest", "Transport"]


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


class Transport(ABC):
    """Moves flat buffers between the ranks of one group.

    Implementations: ``transport.local`` (ranks in one process: unit tests, the simulator) and
    ``transport.link_transport`` (the ``ray`` backend: sockets and shared memory on a node,
    streams or post offices between nodes).
    """

    rank: int
    world_size: int

    @abstractmethod
    def isend(self, peer: int, tag: int, stamp: CallStamp, step: int,
              data: np.ndarray) -> Request:
        """Post a send of ``data`` to ``peer``; complete once ``data`` may be reused."""

    @abstractmethod
    def irecv(self, peer: int, tag: int, stamp: CallStamp, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        """Post a receive from ``peer`` into ``out`` (combined into it when ``combine`` is given).

        ``stamp`` and ``step`` are what this rank expects; a different arrival raises
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

    def check_failures(self, requests: Sequence[Request]) -> None:
        """Look now for a failure that concerns ``requests`` (their peers dead, the group
        aborted) and raise it, as :meth:`wait` would; also record that this rank, in a call,
        is alive. For a rank whose call runs outside the transport (the native core), between
        its slices. The default knows of no failure.

        Raises:
            PeerDiedError, GroupBrokenError: as :meth:`wait`.
        """

    def rank_words(self) -> Optional[RankWords]:
        """Where this rank's words lie on its node's state page, for the native core to
        record there itself what :meth:`arrive` and :meth:`complete` record of a call it runs
        (so that a call the core finishes in its first slice needs neither); None where the
        transport keeps no such page (then the runner calls them around every call). A
        transport that returns words needs nothing else of ``arrive`` and ``complete`` for a
        call the core finishes at once."""
        return None

    def arrive(self, stamp: CallStamp) -> None:
        """Note that this rank has started the collective of ``stamp`` (its number and header).

        Transports that can share this cheaply let a timed-out rank name the ranks that never
        came (see :meth:`absent_ranks`); the default shares nothing.
        """

    def complete(self, stamp: CallStamp) -> None:
        """Note that this rank has finished the collective of ``stamp``. Default: nothing."""

    def name_call(self, stamp: CallStamp) -> None:
        """Name the send or recv of ``stamp`` in the errors of failures met from now on: a
        point-to-point call that runs outside the transport (the native core) and waits.
        (:meth:`arrive` names a collective.) Default: nothing to name."""

    def take_in(self) -> None:
        """Handle what has arrived, without waiting, while the rank waits elsewhere (a call's
        part on the native core): a collective's part whose header differs from the current
        call's is then a mismatch that :meth:`check_failures` raises. Default: nothing to
        take in (a transport whose parts arrive by themselves)."""

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        """The ranks known to hold up collective ``seq``: those that have not started it, and
        (where the transport can tell) those stalled in it; None when it cannot tell."""
        return None

    @abstractmethod
    def abort(self, error: BaseException) -> None:
        """Mark the group broken for every rank: their pending and later waits raise."""

    def close(self) -> None:
        """Release what the transport holds. Default: nothing to release."""
