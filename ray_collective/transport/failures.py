"""Failure watching for one rank: who died, who aborted, and the error every wait raises.

A rank learns of a failure in five ways, all gathered here:

- a peer's connection or stream ending (the carriers report it: :meth:`FailureWatch.mark_dead`);
- a peer on this node gone from the process table, checked every 0.1 s for the peers this rank
  waits for (:meth:`FailureWatch.check_liveness`); a peer on another node that has no stream
  through its node's post office, every second;
- an abort by any rank of the group, published in this node's shared state page
  (``transport.node_state``) by the rank that aborted, by a stream's ABORT frame, or by a post
  office; the rank that publishes it wakes the others of its node (:func:`uds.knock`);
- the abort published for the whole group, read every second by a rank that waits on another
  node (``PostOffices.published_abort``): how it learns of a failure that no stream and no post
  office brought it (a post office still starting, a stream whose peer left before answering);
- this node's post office gone (its pid, checked at every wait at most every 0.1 s), or the
  post office of a node this rank waits on.

:meth:`FailureWatch.raise_if_failed` turns what is known into the error of the call in
progress; the progress loop asks it at every turn of its wait.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Container, Dict, List, Optional, Sequence, Tuple

from ..errors import (CollectiveError, CollectiveTimeoutError, GroupBrokenError, PeerDiedError,
                      PostOfficeDiedError, error_from_record, error_record)
from . import uds, wire
from .base import Request
from .node_state import NodeState
from .post_office_carrier import PostOffices
from .processes import ProcessWatch

LOCAL_LIVENESS_INTERVAL_S = 0.1
"""How often a waiting rank looks at the process table (and its node's post office)."""

REMOTE_LIVENESS_INTERVAL_S = 1.0
"""How often a waiting rank asks other nodes' post offices about the peers it waits for."""


class FailureWatch:
    """What one rank knows of its group's failures.

    Args:
        rank: this rank.
        group_name: the group's name (errors).
        peers: where every rank lives (``node``, ``pid``, ``socket_path``), by rank.
        state: this node's shared state page of the group.
        post_offices: reaches other nodes' post offices; None when the group has one node.

    Attributes:
        dead: why each peer known to be dead is dead.
        current: the stamp of the call in progress (errors name it).
        streamed: the peers whose death a stream shows at once (the stream carrier's own map);
            their post office is not asked about them.
    """

    def __init__(self, rank: int, group_name: str, peers: Sequence, state: NodeState,
                 post_offices: Optional[PostOffices]):
        self.rank = rank
        self.group_name = group_name
        self.peers = tuple(peers)
        self.node = self.peers[rank].node
        self.state = state
        self.post_offices = post_offices
        self.dead: Dict[int, str] = {}
        self._unreachable: Dict[int, Tuple[int, ...]] = {}
        self.current: Optional[wire.CallStamp] = None
        self.streamed: Container[int] = frozenset()
        self._protocol_error: Optional[CollectiveError] = None
        self._lost_post_offices: set = set()
        self._next_post_office_check = 0.0
        self._processes = ProcessWatch()

    # ------------------------------------------------------------------ what is known

    def close(self) -> None:
        """Let go of what watching the node's processes holds (their pidfds)."""
        self._processes.close()

    def mark_dead(self, peer: int, reason: str) -> None:
        """Record that ``peer`` is dead (the first reason stays)."""
        self.dead.setdefault(peer, reason)

    def mark_unreachable(self, node: str, reason: str) -> None:
        """Record that every rank on ``node`` is out of reach (its link is gone): each is dead
        to this rank, and an error naming one names them all."""
        ranks = tuple(r for r, where in enumerate(self.peers) if where.node == node)
        for rank in ranks:
            self.mark_dead(rank, reason)
            self._unreachable.setdefault(rank, ranks)

    def protocol_failed(self, peer: int, err: Exception, carrier: str) -> None:
        """Record that ``peer`` sent a frame this rank could not read on ``carrier`` (which the
        caller then closes): every later wait raises."""
        self._protocol_error = CollectiveError(
            f"rank {self.rank} of group '{self.group_name}': rank {peer} sent a malformed frame "
            f"on {carrier} ({type(err).__name__}: {err}); it was closed and the group is broken. "
            f"Destroy the group and create it again.")

    def raise_if_failed(self, pending: Sequence[Request]) -> None:
        """Raise the error of the call in progress if something it waits for has failed.

        Raises:
            CollectiveError: a peer sent a malformed frame.
            PeerDiedError, PostOfficeDiedError, CollectiveTimeoutError: the failure published
                on this node, when it names another rank (or this one as not stalled).
            GroupBrokenError: another failure published on this node.
            PeerDiedError: a peer in ``pending`` is known to be dead.
            PostOfficeDiedError: this node's post office, or that of a node a request in
                ``pending`` waits on, is gone.
        """
        if self._protocol_error is not None:
            raise self._protocol_error
        record = self.state.aborted()
        if record is not None:
            error = error_from_record(record, self.rank)
            # A dead or stalled rank is named by every survivor's own error; the stalled rank
            # itself, once it runs again, learns that the group broke without it.
            if isinstance(error, (PeerDiedError, PostOfficeDiedError)) or (
                    isinstance(error, CollectiveTimeoutError)
                    and self.rank not in error.missing_ranks):
                raise error
            raise GroupBrokenError(self.group_name, self.rank, error)
        if self.dead:
            dead = sorted({r.peer for r in pending} & set(self.dead))
            if dead:
                raise self.peer_died(dead)
        if self._lost_post_offices:
            # This node's post office carried every message from the other nodes here; another
            # node's carried those to its ranks, so it matters only when waiting on them.
            if self.node in self._lost_post_offices:
                raise self.post_office_died(self.node)
            for request in pending:
                node = self.peers[request.peer].node
                if node in self._lost_post_offices:
                    raise self.post_office_died(node)

    def call(self, what: str = "") -> Tuple[str, int]:
        """(collective, sequence number) of the call in progress, for an error's message."""
        stamp = self.current
        return (stamp.template.collective, stamp.seq) if stamp else (what or "call", -1)

    def peer_died(self, dead: List[int], what: str = "") -> PeerDiedError:
        """The error of a call whose peers ``dead`` are dead (why: from :attr:`dead`); with a
        rank of an unreachable node it names all of that node's ranks, each reason once."""
        named = sorted(set(dead).union(*(self._unreachable.get(r, ()) for r in dead)))
        return PeerDiedError(self.group_name, self.rank, *self.call(what), named,
                             "; ".join(dict.fromkeys(self.dead[r] for r in named)))

    def post_office_died(self, node: str) -> PostOfficeDiedError:
        """The error of a call that needs ``node``'s post office, which is gone."""
        return PostOfficeDiedError(self.group_name, self.rank, *self.call(), node,
                                   [r for r, peer in enumerate(self.peers) if peer.node == node])

    # ------------------------------------------------------------------ looking

    def beat(self) -> None:
        """Record on the node's state page that this rank, waiting in a call, is alive."""
        self.state.beat(self.rank)

    def check_liveness(self, peers: set, remote_too: bool) -> bool:
        """Look for dead peers among ``peers``, and for a dead post office on this node or
        theirs; returns whether remote ones were asked about."""
        remote: Dict[str, List[int]] = defaultdict(list)
        waits_on_other_nodes = False
        local = []
        for peer in peers:
            where = self.peers[peer]
            if where.node != self.node:
                waits_on_other_nodes = True
                # A peer with a stream is seen to die when the stream ends: asking its post
                # office (an actor call that can take seconds on a loaded cluster) would only
                # hold this rank away from reading that end.
                if peer not in self.streamed:
                    remote[where.node].append(peer)
            else:
                local.append(peer)
        if local:
            exited = set(self._processes.exited(self.peers[peer].pid for peer in local))
            for peer in local:
                if self.peers[peer].pid in exited:
                    self.mark_dead(peer, "its process exited")
        if self.post_offices is None:
            return False
        self.local_post_office_lost()
        if not (remote_too and waits_on_other_nodes):
            return False
        self._learn_published_abort()
        for node, ranks in remote.items():
            dead = self.post_offices.dead_ranks(node, ranks)
            if dead is None:
                self._lost_post_offices.add(node)
                continue
            for peer in dead:
                self.mark_dead(peer, f"its process on node {node[:8]} exited")
        return True

    def local_post_office_lost(self) -> bool:
        """Whether this node's post office is known to be dead; looked at again at most once
        per liveness interval.

        Asked at every wait, not only in waits long enough for the liveness checks: over
        streams a group's calls can all finish within that interval, and a rank must still
        learn of the loss (its abort then tells the other nodes)."""
        if self.post_offices is None:
            return False
        now = time.monotonic()
        if self.node not in self._lost_post_offices and now >= self._next_post_office_check:
            self._next_post_office_check = now + LOCAL_LIVENESS_INTERVAL_S
            if not self.post_offices.local_post_office_alive():
                self._lost_post_offices.add(self.node)
        return self.node in self._lost_post_offices

    def _learn_published_abort(self) -> None:
        """Publish on this node a failure published for the whole group, if there is one (a
        malformed record is no failure of this group's, and is left alone)."""
        record = self.post_offices.published_abort()
        if record is not None:
            try:
                self.publish_other_node_abort(record, "the abort published for the group")
            except ValueError:
                pass

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        """The ranks that hold up collective ``seq``: never came to it, or stalled in it (see
        ``NodeState.responsive``); None when nothing can be known of some node."""
        by_node: Dict[str, List[int]] = defaultdict(list)
        for rank, peer in enumerate(self.peers):
            by_node[peer.node].append(rank)
        responsive = []
        for node, ranks in by_node.items():
            if node == self.node:
                responsive += self.state.responsive(ranks, seq)
            elif self.post_offices is None:
                return None  # nothing reaches that node's state page
            else:
                responsive += self.post_offices.responsive(node, ranks, seq)
        absent = sorted(set(range(len(self.peers))) - set(responsive))
        return absent or None

    # ------------------------------------------------------------------ aborting

    def abort(self, error: BaseException) -> Tuple[dict, bool]:
        """Publish ``error`` as the group's failure on this node and, through the post offices,
        on the others.

        Only the rank that publishes it first on this node wakes the others and tells the other
        nodes: the rest raise after reading it, and all of them knocking too would be n²
        connections at once (160 000 at 400 ranks). Whoever published first here was the
        origin, or a rank or post office relaying the origin's abort, which told every node.

        Returns:
            (the error's record, whether this call published it first on this node).
        """
        record = error_record(self.group_name, self.rank, error)
        first_here = self.state.abort(record)
        if first_here:
            self.wake_local_peers()
            if self.post_offices is not None:
                self.post_offices.abort(record)
        return record, first_here

    def publish_other_node_abort(self, record: dict, carrier: str) -> None:
        """Publish another node's failure on this node, as its post office would.

        Raises:
            ValueError: the record, which came in ``carrier``, describes no error of this
                group.
        """
        try:
            error_from_record(record, self.rank)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{carrier} with a malformed record: {err!r}") from err
        if record["group"] != self.group_name or not isinstance(record["rank"], int):
            raise ValueError(f"{carrier} of group {record['group']!r}, rank "
                             f"{record['rank']!r}")
        if self.state.abort(record):
            self.wake_local_peers()

    def wake_local_peers(self) -> None:
        """Wake the ranks of this node blocked in poll, so that they look at the state page now
        rather than at their next wake-up."""
        for rank, peer in enumerate(self.peers):
            if rank != self.rank and peer.node == self.node:
                uds.knock(peer.socket_path)
