"""The transport of the ``ray`` backend: every peer reached through the link of its carrier.

One rank's endpoint (:class:`LinkTransport`) is made of:

- a progress loop (``transport.progress``): the inbox that matches and checks every part, the poll
  loop, the wait;
- the carriers that reach its peers (``transport.link``): its node's ranks over Unix sockets
  and shared memory (``transport.node_carrier``); other nodes' ranks over authenticated TCP
  streams (``transport.stream_carrier``, the default) or through their node's post office
  (``transport.post_office_carrier``, where the group chose the object store);
- its failure watch (``transport.failures``): dead peers, aborts, lost post offices.

The transport itself only maps each peer to its link and posts receives; see those modules for
how each part works.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from . import uds, wire
from .base import Request, Transport
from .progress import ProgressLoop
from .failures import FailureWatch
from .link import Carrier, Link
from .node_carrier import CROWDED_PART_BYTES, NodeCarrier
from .node_state import NodeState, RankWords
from .post_office_carrier import PostOfficeCarrier, PostOffices
from .stream_carrier import StreamCarrier, Streams, open_at_join, peers_at_join


@dataclass(frozen=True)
class Peer:
    """Where a rank lives: its node, its process id and (on this node) its socket."""

    node: str
    pid: int
    socket_path: str


class LinkTransport(Transport):
    """One rank's endpoint.

    Args:
        rank: this rank.
        group_name: the group's name (errors).
        group_key: 16 bytes identifying this incarnation of the group (links check it).
        peers: where every rank lives, indexed by rank.
        listener: this rank's listening socket (bound before the rendezvous).
        state: this node's shared state page of the group.
        post_offices: reaches other nodes' post offices; None when the group has one node.
        connect_timeout: seconds to wait for a peer's socket to accept.
        spin_s: seconds to poll without sleeping before blocking (0 on oversubscribed nodes).
        streams: carries messages to other nodes when given (else the post offices do).
    """

    def __init__(self, rank: int, group_name: str, group_key: bytes, peers: Sequence[Peer],
                 listener, state: NodeState, post_offices: Optional[PostOffices] = None,
                 connect_timeout: float = 30.0, spin_s: float = 0.0,
                 streams: Optional[Streams] = None):
        self.rank = rank
        self.world_size = len(peers)
        self.group_name = group_name
        self.group_key = group_key
        self.peers = tuple(peers)
        self.node = self.peers[rank].node
        self.state = state
        self.failures = FailureWatch(rank, group_name, self.peers, state, post_offices)
        self.progress = ProgressLoop(rank, self.failures, spin_s)
        self.node_carrier = NodeCarrier(rank, group_name, group_key, self.peers, listener,
                                        self.progress, self.failures, connect_timeout,
                                        uds.PART_BYTES if spin_s else CROWDED_PART_BYTES)
        self.stream_carrier: Optional[StreamCarrier] = None
        self.post_office_carrier: Optional[PostOfficeCarrier] = None
        other_nodes: Optional[Carrier] = None
        if streams is not None:
            self.stream_carrier = StreamCarrier(rank, group_key, self.peers, streams,
                                                self.progress, self.failures, connect_timeout)
            other_nodes = self.stream_carrier
        elif post_offices is not None:
            self.post_office_carrier = PostOfficeCarrier(
                rank, [peer.node for peer in self.peers], post_offices)
            other_nodes = self.post_office_carrier
        self._carriers: List[Carrier] = [self.node_carrier] + (
            [other_nodes] if other_nodes is not None else [])
        for carrier in self._carriers:
            self.progress.add_carrier(carrier)
        self._links: List[Optional[Link]] = [None] * self.world_size
        self._inbox = self.progress.inbox
        self._flush_batches: Callable[[], None] = (
            self.post_office_carrier.before_wait if self.post_office_carrier else _nothing)

    def _link(self, peer: int) -> Link:
        link = self._links[peer]
        if link is None:
            if self.peers[peer].node == self.node:
                carrier: Carrier = self.node_carrier
            elif len(self._carriers) > 1:
                carrier = self._carriers[1]
            else:
                raise ValueError(f"rank {peer} is on another node, and this transport was "
                                 f"given no way there (streams or post offices)")
            link = self._links[peer] = carrier.link(peer)
        return link

    @property
    def refused_connections(self) -> int:
        """Connections closed because they did not prove the group's key (or came from a
        rank that has no business connecting)."""
        return self.node_carrier.refused + (self.stream_carrier.refused
                                            if self.stream_carrier else 0)

    def open_streams(self, timeout: float) -> None:
        """Open and authenticate this rank's streams to other nodes now (the join), those
        ``stream_carrier.peers_at_join`` names, so that the group's first calls pay no
        connection; nothing where other nodes are reached through post offices.

        Args:
            timeout: seconds the streams may take to open.

        Raises:
            PeerDiedError: a peer refused a connection or failed the handshake.
            CollectiveTimeoutError: a stream was still not open after ``timeout``.
        """
        if self.stream_carrier is not None:
            open_at_join(self.stream_carrier,
                         peers_at_join([peer.node for peer in self.peers], self.rank),
                         time.monotonic() + timeout)

    # ------------------------------------------------------------------ Transport

    def isend(self, peer: int, tag: int, stamp: wire.CallStamp, step: int,
              data: np.ndarray) -> Request:
        self.failures.current = stamp
        return (self._links[peer] or self._link(peer)).send(tag, step, stamp.packed, data)

    def irecv(self, peer: int, tag: int, stamp: wire.CallStamp, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        self.failures.current = stamp
        receive = wire.Receive(peer, stamp, step, out, combine)
        (self._links[peer] or self._link(peer)).expect()
        self._inbox.post((peer, tag), receive)
        return receive

    def test(self, request: Request) -> bool:
        if not request.done:
            self._flush_batches()
        return request.done

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        return self.progress.wait(requests, deadline)

    def check_failures(self, requests: Sequence[Request]) -> None:
        failures = self.failures
        failures.beat()
        failures.check_liveness({r.peer for r in requests}, False)
        self.progress.raise_if_failed(requests)

    def arrive(self, stamp: wire.CallStamp) -> None:
        # A call the native core runs never reaches isend/irecv: its failures name it from here.
        self.failures.current = stamp
        self.state.arrive(self.rank, stamp.seq, stamp.template.collective)
        self._inbox.begin(stamp)

    def rank_words(self) -> RankWords:
        # The inbox carries no collective of a group on the native core (it runs them all),
        # and the failure record's call is needed only by a call that waits: arrive() then.
        return self.state.words_of(self.rank)

    def complete(self, stamp: wire.CallStamp) -> None:
        self.state.complete(self.rank)
        if self._inbox.error is not None:
            raise self._inbox.error  # found on a part no receive of the call waited for

    def name_call(self, stamp: wire.CallStamp) -> None:
        self.failures.current = stamp

    def take_in(self) -> None:
        self.progress.progress(0)

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        return self.failures.absent_ranks(seq)

    def abort(self, error: BaseException) -> None:
        record, _ = self.failures.abort(error)
        if self.stream_carrier is not None:
            self.stream_carrier.send_abort(wire.abort_frame(record))

    def close(self) -> None:
        for carrier in self._carriers:
            carrier.close()
        self.failures.close()
        self.state.close()


def _nothing() -> None:
    return None
