"""The post-office carrier: messages to other nodes through their post office actors.

Where a group chose the object store between nodes (``RAY_COLLECTIVE_CROSS_NODE=object_store``),
a rank's sends to another node are batched: one actor task per destination node per round,
however many ranks of that node the round addresses (``PostOffices.deliver``, implemented over
Ray by the backend). The post office delivers them on its node as if it were the sender, through
the node's own sockets, so the receiving rank reads them as it reads its local peers'. A round's
batch leaves when the rank waits (or tests a request); the sends complete then, and the caller
keeps its buffers untouched until that, so a large payload needs no copy.

:class:`PostOffices` is also how a rank learns about other nodes' ranks and failures (dead
ranks, stalled ranks, a published abort): see ``transport.failures``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import uds
from .base import Request, SendRequest
from .link import Carrier

RemoteMessage = Tuple[int, int, int, int, int, bytes, object]
"""``(source, destination, tag, step, count, packed header, payload)``: one message for a rank
on another node. The payload is the bytes of a small message, or the array of a large one
(Ray carries arrays above its inline limit through the object store)."""


class PostOffices:
    """The group's post offices as one rank reaches them: its own node's, and through the
    others', the ranks on other nodes (implemented over Ray by the backend)."""

    def deliver(self, node: str, messages: List[RemoteMessage]) -> None:
        """Hand ``messages`` to ``node`` in one batch (asynchronously, order kept per node);
        their payloads are taken by the time it returns, and the caller may reuse them."""
        raise NotImplementedError

    def dead_ranks(self, node: str, ranks: List[int]) -> Optional[List[int]]:
        """Those of ``ranks`` (all on ``node``) known to be dead; None when ``node``'s post
        office is dead (nothing is known of its ranks then)."""
        raise NotImplementedError

    def local_post_office_alive(self) -> bool:
        """Whether this node's post office is alive (True until it is known to be dead)."""
        raise NotImplementedError

    def responsive(self, node: str, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` (all on ``node``) that have started collective ``seq`` and are
        not stalled in it (see ``NodeState.responsive``)."""
        raise NotImplementedError

    def abort(self, record: dict) -> None:
        """Publish a failure on every other node."""
        raise NotImplementedError

    def published_abort(self) -> Optional[dict]:
        """The failure a rank of the group published for every node to read (the record of
        ``abort``), or None: for a rank that waits on another node which neither a stream
        nor a post office has told yet (a post office still starting, a stream whose peer
        left the call before it answered)."""
        raise NotImplementedError


class PostOfficeCarrier(Carrier):
    """Sends to the ranks of other nodes in per-node batches, one per round.

    Args:
        rank: this rank.
        nodes: the node of every rank, by rank.
        post_offices: the group's post offices.
    """

    def __init__(self, rank: int, nodes: Sequence[str], post_offices: PostOffices):
        self.rank = rank
        self.nodes = tuple(nodes)
        self.post_offices = post_offices
        self._batches: Dict[str, List[RemoteMessage]] = {}
        self._sends: List[SendRequest] = []

    def send(self, peer: int, tag: int, step: int, header: bytes, data: np.ndarray) -> Request:
        """Add a message to ``peer``'s node's batch; its request completes when the batch
        leaves."""
        request = SendRequest(peer)
        payload = data if data.nbytes > uds.INLINE_LIMIT else data.tobytes()
        batch = self._batches.setdefault(self.nodes[peer], [])
        batch.append((self.rank, peer, tag, step, len(data), header, payload))
        self._sends.append(request)
        return request

    def before_wait(self) -> None:
        if self._batches:
            batches, self._batches = self._batches, {}
            sends, self._sends = self._sends, []
            for node, messages in batches.items():
                self.post_offices.deliver(node, messages)
            for request in sends:
                request.done = True

    def close(self) -> None:
        self._batches.clear()
        self._sends.clear()

