"""Links and carriers: how one rank reaches each of its peers.

A *carrier* is one way of moving messages between ranks: Unix sockets and shared memory on a
node (``transport.node_carrier``), authenticated TCP streams between nodes
(``transport.stream_carrier``), or the post office actors between nodes
(``transport.post_office_carrier``). The transport keeps one :class:`Link` per peer, its
carrier bound to the peer, and sends every message through it, whichever carrier it is:
nothing above a link asks where a peer lives.

Receiving is the carriers' too: each reads what arrives in its own way (a packet per ``poll``
event, a stream's frames, a post office's deliveries) and hands every part to the one matcher,
the progress loop's :class:`~ray_collective.transport.wire.Inbox` (``transport.progress``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .base import Request


class Link:
    """The way this rank sends messages to one peer: its carrier, bound to the peer.

    Attributes:
        carrier: the carrier that reaches the peer.
        peer: the rank at the other end.
    """

    __slots__ = ("carrier", "peer")

    def __init__(self, carrier: "Carrier", peer: int):
        self.carrier = carrier
        self.peer = peer

    def send(self, tag: int, step: int, header: bytes, data: np.ndarray) -> Request:
        """Start sending ``data`` to the peer as one message (see :meth:`Carrier.send`)."""
        return self.carrier.send(self.peer, tag, step, header, data)

    def expect(self) -> None:
        """A receive from the peer was just posted (see :meth:`Carrier.expect`)."""
        self.carrier.expect(self.peer)


class Carrier(ABC):
    """One way of reaching some of this rank's peers."""

    def link(self, peer: int) -> Link:
        """The link to ``peer``."""
        return Link(self, peer)

    @abstractmethod
    def send(self, peer: int, tag: int, step: int, header: bytes, data: np.ndarray) -> Request:
        """Start sending ``data`` to ``peer`` as one message.

        Args:
            peer: the receiving rank.
            tag: the message's tag (``COLLECTIVE_TAG`` or a point-to-point tag).
            step: the algorithm's step the message belongs to.
            header: the call's packed header (``CallStamp.packed``).
            data: the payload; unchanged until the returned request is done.

        Returns:
            The send's request (done once ``data`` may be reused).

        Raises:
            PeerDiedError: the peer is known to be dead, or could not be reached.
        """

    def expect(self, peer: int) -> None:
        """A receive from ``peer`` was just posted. A carrier whose way must be opened before
        anything can arrive (a stream, which is also how the peer's death is seen) opens it
        now; the default does nothing."""

    def before_wait(self) -> None:
        """Called before this rank waits: a carrier that holds sends back (to batch them)
        lets them go. The default does nothing."""

    def tick(self, now: float) -> None:
        """Called about every 0.1 s while this rank waits (``now`` is ``time.monotonic()``),
        for a carrier's own deadlines. The default does nothing."""

    @abstractmethod
    def close(self) -> None:
        """Close everything the carrier holds."""
