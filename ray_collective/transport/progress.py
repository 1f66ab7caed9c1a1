"""One rank's progress loop: the inbox, the poll loop over the carriers' sockets, the wait.

Nothing runs in the background: the calling thread makes progress inside :meth:`ProgressLoop.wait`,
so an idle rank costs nothing and a busy one has no thread to contend with. The loop knows no
carrier's protocol: a carrier registers each of its sockets with a handler
(:meth:`ProgressLoop.register`), hands every part it reads to :attr:`ProgressLoop.inbox` (the wire
protocol's one matcher), and may give the loop a *pump*, outgoing work done a piece per turn
(the node carrier writes the next part of its large sends between reading the parts that
arrive, so that its peers reduce one part while it writes the next).

Waiting: a rank first polls its sockets without sleeping for a short while (``spin_s``), which
answers a small message in microseconds instead of a process wake-up; it is given that while
only where its machine has a core for every rank of the group there (the rendezvous knows), and
none at all on an oversubscribed machine, where spinning would take the core a peer needs. Then
it blocks in ``poll``, waking at least every 0.1 s to look for failures
(``transport.failures``): the state page's abort, dead peers, lost post offices.
"""

from __future__ import annotations

import select
import time
from typing import Callable, Dict, List, Sequence

import numpy as np

from . import wire
from .base import Request
from .failures import LOCAL_LIVENESS_INTERVAL_S, REMOTE_LIVENESS_INTERVAL_S, FailureWatch
from .link import Carrier

POLL_INTERVAL_S = 0.1
"""The longest a waiting rank sleeps in ``poll`` before it looks for failures."""

PROGRESS_SPIN_S = 50e-6
"""How long a rank with a core of its own polls the Python engine's carriers without sleeping
before it blocks (the native core's rings have their own, ``engine.native_runner.CORE_SPIN_S``)."""


class ProgressLoop:
    """Makes progress for one rank: reads what its carriers receive, sends what they queue.

    Args:
        rank: this rank.
        failures: what the rank knows of failures (asked at every turn of a wait).
        spin_s: seconds to poll without sleeping before blocking (0 on oversubscribed nodes).

    Attributes:
        inbox: the rank's receiving side (posted receives, early parts, header checks).
    """

    def __init__(self, rank: int, failures: FailureWatch, spin_s: float = 0.0):
        self.rank = rank
        self.failures = failures
        self.spin_s = spin_s
        self.inbox = wire.Inbox(rank, self._read_segment, self._consumed)
        self._poll = select.poll()
        self._handlers: Dict[int, Callable[[int], None]] = {}
        self._pumps: List = []
        self._carriers: List[Carrier] = []
        self._segment_reader: Callable[[wire.Part], np.ndarray] = _no_segments
        self._segment_release: Callable[[wire.Part], None] = _no_segments

    # -------------------------------------------------------------- carriers

    def add_carrier(self, carrier: Carrier) -> None:
        """Give ``carrier`` its turn before every wait and at every liveness tick."""
        self._carriers.append(carrier)

    def add_pump(self, pump) -> None:
        """Advance ``pump`` (an object with ``pending`` and ``advance()``) at every turn."""
        self._pumps.append(pump)

    def use_segments(self, read: Callable[[wire.Part], np.ndarray],
                     release: Callable[[wire.Part], None]) -> None:
        """Where the inbox reads a shared-memory part's bytes, and whom it tells once read."""
        self._segment_reader, self._segment_release = read, release

    def _read_segment(self, part: wire.Part) -> np.ndarray:
        return self._segment_reader(part)

    def _consumed(self, part: wire.Part) -> None:
        self._segment_release(part)

    def register(self, fd: int, handler: Callable[[int], None], writable: bool = False) -> None:
        """Call ``handler(events)`` whenever ``fd`` is readable (or writable, if asked)."""
        self._handlers[fd] = handler
        self._poll.register(fd, select.POLLIN | (select.POLLOUT if writable else 0))

    def watch(self, fd: int, writable: bool) -> None:
        """Whether to wake for ``fd`` becoming writable too (it has frames queued)."""
        self._poll.modify(fd, select.POLLIN | (select.POLLOUT if writable else 0))

    def sockets(self) -> List[int]:
        """Every socket the loop watches."""
        return list(self._handlers)

    def serve(self, fd: int) -> None:
        """Handle what socket ``fd`` has now (it was seen ready outside :meth:`progress`)."""
        handler = self._handlers.get(fd)
        if handler is not None:
            handler(select.POLLIN)

    def unregister(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed)."""
        if self._handlers.pop(fd, None) is not None:
            self._poll.unregister(fd)

    # -------------------------------------------------------------- progress

    def progress(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for socket events and handle every one that is ready;
        returns how many sockets had events."""
        ready = self._poll.poll(timeout_s * 1000.0)
        handlers = self._handlers
        for fd, events in ready:
            handler = handlers.get(fd)
            if handler is not None:
                handler(events)
        return len(ready)

    def _pumping(self) -> None:
        """Advance every pump that has work."""
        for pump in self._pumps:
            if pump.pending:
                pump.advance()

    def raise_if_failed(self, pending: Sequence[Request]) -> None:
        """Raise the call's error if a message did not match or a failure is known."""
        if self.inbox.error is not None:
            raise self.inbox.error
        self.failures.raise_if_failed(pending)

    def raise_if_post_office_lost(self) -> None:
        """Raise ``PostOfficeDiedError`` if this node's post office is known to be dead (asked
        at every wait: ``FailureWatch.local_post_office_lost``)."""
        failures = self.failures
        if failures.local_post_office_lost():
            raise failures.post_office_died(failures.node)

    def look_for_failures(self, peers: set, now: float, remote_too: bool) -> bool:
        """One liveness turn of a wait: record that this rank is alive, give the carriers
        their tick, look for dead ``peers`` (on other nodes too when ``remote_too``); returns
        whether remote ones were asked about. The caller then raises what is known
        (:meth:`raise_if_failed`)."""
        self.failures.beat()
        for carrier in self._carriers:
            carrier.tick(now)
        return self.failures.check_liveness(peers, remote_too)

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        """Make progress until every request completes or ``deadline`` passes.

        Returns:
            The requests still incomplete at the deadline (empty when all completed).

        Raises:
            CollectiveMismatchError, PeerDiedError, PostOfficeDiedError, GroupBrokenError,
            CollectiveError: see :meth:`raise_if_failed`.
        """
        for carrier in self._carriers:
            carrier.before_wait()
        self.raise_if_post_office_lost()
        if self.spin_s:
            # Spin while messages keep coming: each arrival buys another spin_s, so a rank
            # exchanging a large message part by part never sleeps between parts.
            spin_until = time.monotonic() + self.spin_s
            while True:
                self._pumping()
                if all(r.done for r in requests):
                    return ()
                self.raise_if_failed(requests)
                now = time.monotonic()
                if now >= spin_until or now >= deadline:
                    break
                if self.progress(0):
                    spin_until = now + self.spin_s
        next_local = time.monotonic() + LOCAL_LIVENESS_INTERVAL_S
        next_remote = next_local
        while True:
            self._pumping()
            pending = [r for r in requests if not r.done]
            if not pending:
                return ()
            self.raise_if_failed(pending)
            now = time.monotonic()
            if now >= deadline:
                return pending
            if now >= next_local:
                remote = self.look_for_failures({r.peer for r in pending}, now,
                                                now >= next_remote)
                next_local = now + LOCAL_LIVENESS_INTERVAL_S
                if remote:
                    next_remote = now + REMOTE_LIVENESS_INTERVAL_S
                continue
            self.progress(0 if self._still_pumping() else min(deadline - now, POLL_INTERVAL_S))

    def _still_pumping(self) -> bool:
        return any(pump.pending for pump in self._pumps)


def _no_segments(part: wire.Part):
    raise ValueError("a shared-memory part arrived where no carrier maps segments")
