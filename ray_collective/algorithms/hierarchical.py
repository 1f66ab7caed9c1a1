"""Hierarchical (node-aware) allreduce, broadcast and reduce: the traffic between nodes is cut
to one message per node (leaders) or one shard per rank (sharded allreduce).

Ranks are grouped by node (``ctx.topology``, from the group's rank→node map). Each node has a
*leader*: its lowest rank, except that for broadcast and reduce the root leads its own node.

- **allreduce** — binomial reduce onto each leader inside its node, an allreduce between the
  leaders (the flat algorithm for that many ranks and that size), then a binomial broadcast
  inside each node.
- **broadcast** — a broadcast between the leaders from the root, then a binomial broadcast inside
  each node.
- **reduce** — a binomial reduce onto each leader inside its node, then a reduce between the
  leaders onto the root.

- **sharded allreduce** (``hierarchical_sharded``, nodes of equal size q) — a reduce-scatter
  inside each node leaves local rank i with the node's sum of shard i (of q); the i-th ranks
  of all nodes allreduce their shard among themselves; an allgather inside each node puts
  the shards together. Every rank crosses nodes, with 1/q of the data: the leaders' version
  has one rank per node carry (and reduce) all of it while the others wait, this one spreads
  the work and the streams over every rank. On nodes of unequal size it runs the leaders'
  version.
- **pipelined broadcast** (``hierarchical_pipeline``) — the flat chain broadcast
  (``broadcast.pipeline``) down a chain that starts at the root, goes through the rest of its
  node, then through every other node in turn: one link per pair of consecutive nodes crosses
  nodes, and chunk by chunk every link of the chain carries data at once (the leaders'
  version sends the whole message between nodes before the nodes pass it on). k + p - 2
  rounds for k chunks, so the selector keeps it to groups of at most 16 ranks.

Inside a node messages are cheap (shared memory); between nodes they are not, so the leaders
carry the only inter-node traffic: one message per leader and round of the inter-node phase
instead of one per rank. Rounds: 2·ceil(log2 q) + the leaders' algorithm for allreduce and
ceil(log2 q) + the leaders' algorithm for broadcast and reduce, q the most ranks on one node;
the sharded allreduce has the rounds of the local reduce-scatter and allgather (q - 1 each
for a ring) around the shards' allreduce. The selector picks these whenever the group spans
several nodes and some node holds several ranks (the sharded allreduce for large messages on
nodes of equal size, the pipelined broadcast for large messages over 3 nodes or more: see
``selector``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Callable, Tuple

import numpy as np

from . import broadcast as flat_broadcast
from . import reduce as flat_reduce
from .core import Algorithm, AlgorithmGen, Blocks, Chooser, Context, Cost, Team, Topology
from .reduce import log_rounds

_INTER_NODE_PHASE = 1 << 22
_INTRA_NODE_FINAL_PHASE = 2 << 22


class Column(Sequence):
    """The ``position``-th rank of every node, in node order (every node holding more than
    ``position`` ranks)."""

    __slots__ = ("topology", "position")

    def __init__(self, topology: Topology, position: int):
        self.topology = topology
        self.position = position

    def __len__(self) -> int:
        return len(self.topology.nodes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._rank_of_node(i)

    def _rank_of_node(self, i: int) -> int:
        return self.topology.nodes[i][self.position]


class Leaders(Column):
    """The leader of every node: its lowest rank, or ``root`` on the root's node."""

    __slots__ = ("root",)

    def __init__(self, topology: Topology, root: int = -1):
        super().__init__(topology, 0)
        self.root = root

    def _rank_of_node(self, i: int) -> int:
        if self.root >= 0 and i == self.topology.node_index[self.root]:
            return self.root
        return self.topology.leaders[i]


class NodeChain(Sequence):
    """Every rank, node after node: ``root`` first, then the rest of its node, then the other
    nodes in order, each node's ranks in rank order."""

    __slots__ = ("topology", "root", "root_node", "_node_order", "_starts")

    def __init__(self, topology: Topology, root: int):
        self.topology = topology
        self.root = root
        self.root_node = topology.node_index[root]
        self._node_order = [self.root_node] + [k for k in range(len(topology.nodes))
                                               if k != self.root_node]
        self._starts = [0]
        for k in self._node_order:
            self._starts.append(self._starts[-1] + len(topology.nodes[k]))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        slot = bisect.bisect_right(self._starts, i) - 1
        node = self.topology.nodes[self._node_order[slot]]
        place = i - self._starts[slot]
        if slot == 0:
            # the root first, the rest of its node after it in rank order
            root_place = node.index(self.root)
            place = root_place if place == 0 else place - (place <= root_place)
        return node[place]

    def position(self, rank: int) -> int:
        """Where ``rank`` is in the chain."""
        node_index = self.topology.node_index[rank]
        node = self.topology.nodes[node_index]
        place = node.index(rank)
        if node_index == self.root_node:
            root_place = node.index(self.root)
            return 0 if rank == self.root else place + (place < root_place)
        return self._starts[self._node_order.index(node_index)] + place


def _local_team(topology: Topology, rank: int) -> Team:
    node = topology.nodes[topology.node_index[rank]]
    return Team(node, node.index(rank))


def _leaders_team(leaders: Leaders, rank: int) -> Team:
    return Team(leaders, leaders.topology.node_index[rank])


def allreduce(team: Team, buf: np.ndarray, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf``: reduce inside nodes, allreduce between leaders, broadcast inside nodes."""
    topology = ctx.topology
    rank = team.rank
    local = _local_team(topology, rank)
    yield from flat_reduce.binomial(local, buf, 0, ctx, step0)
    if local.index == 0:
        inner = ctx.choose("allreduce", len(topology.nodes), len(buf))
        yield from inner.run(_leaders_team(Leaders(topology), rank), buf, ctx,
                             step0=step0 + _INTER_NODE_PHASE)
    yield from flat_broadcast.binomial(local, buf, 0, ctx, step0 + _INTRA_NODE_FINAL_PHASE)


def sharded_allreduce(team: Team, buf: np.ndarray, ctx: Context,
                      step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf``: reduce-scatter inside nodes, an allreduce of each shard across nodes
    by the ranks that hold it, allgather inside nodes (the leader version on unequal nodes)."""
    topology = ctx.topology
    if not topology.uniform:
        yield from allreduce(team, buf, ctx, step0)
        return
    rank = team.rank
    local = _local_team(topology, rank)
    blocks = Blocks.even(len(buf), local.size)
    # Every column decides by the largest shard, so that all of them run the same algorithms.
    shard_count = blocks.size(0)
    yield from ctx.choose("reducescatter", local.size, shard_count).run(
        local, buf, blocks, ctx, step0=step0)
    column = Team(Column(topology, local.index), topology.node_index[rank])
    yield from ctx.choose("allreduce", len(topology.nodes), shard_count).run(
        column, blocks.view(buf, local.index), ctx, step0=step0 + _INTER_NODE_PHASE)
    yield from ctx.choose("allgather", local.size, shard_count).run(
        local, buf, blocks, ctx, step0=step0 + _INTRA_NODE_FINAL_PHASE)


def broadcast(team: Team, buf: np.ndarray, root: int, ctx: Context,
              step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from ``root``: between node leaders first, then inside every node."""
    topology = ctx.topology
    rank, root_rank = team.rank, team.members[root]
    leaders = Leaders(topology, root_rank)
    local = _local_team(topology, rank)
    leader = leaders[topology.node_index[rank]]
    if rank == leader:
        inner = ctx.choose("broadcast", len(leaders), len(buf))
        yield from inner.run(_leaders_team(leaders, rank), buf, topology.node_index[root_rank],
                             ctx, step0=step0 + _INTER_NODE_PHASE)
    yield from flat_broadcast.binomial(local, buf, local.members.index(leader), ctx,
                                       step0 + _INTRA_NODE_FINAL_PHASE)


def pipelined_broadcast(team: Team, buf: np.ndarray, root: int, ctx: Context,
                        step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from ``root`` chunk by chunk down a chain that visits the nodes one
    after the other (``broadcast.pipeline``): one link per pair of consecutive nodes crosses
    nodes, and every link carries a chunk at once."""
    chain = NodeChain(ctx.topology, team.members[root])
    yield from flat_broadcast.pipeline(Team(chain, chain.position(team.rank)), buf, 0, ctx,
                                       step0)


def reduce(team: Team, buf: np.ndarray, root: int, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Reduce onto ``root``: inside every node onto its leader, then between leaders onto it."""
    topology = ctx.topology
    rank, root_rank = team.rank, team.members[root]
    leaders = Leaders(topology, root_rank)
    local = _local_team(topology, rank)
    leader = leaders[topology.node_index[rank]]
    # A leader that is not the root must leave its own input intact, so it reduces into scratch.
    acc = buf
    if rank == leader and rank != root_rank:
        acc = ctx.alloc(len(buf))
        ctx.copy(acc, buf)
    yield from flat_reduce.binomial(local, acc, local.members.index(leader), ctx, step0)
    if rank == leader:
        inner = ctx.choose("reduce", len(leaders), len(buf))
        yield from inner.run(_leaders_team(leaders, rank), acc, topology.node_index[root_rank],
                             ctx, step0=step0 + _INTER_NODE_PHASE)


def _phase_costs(flat_choice: Callable[[int], Chooser], collective: str, p: int, count: int,
                 ranks_per_node: int, itemsize: int) -> tuple:
    """(local rounds, local elements, leaders' Cost), the leaders running what ``flat_choice``
    picks."""
    leaders = -(-p // max(ranks_per_node, 1))
    inner = flat_choice(itemsize)(collective, leaders, count).cost(leaders, count, 1, itemsize)
    local = log_rounds(ranks_per_node)
    return local, count * local, inner


def _allreduce_cost(flat_choice, p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """A bound: local reduce, the leaders' allreduce and local broadcast, one after the other."""
    rounds, elements, inner = _phase_costs(flat_choice, "allreduce", p, count, ranks_per_node,
                                           itemsize)
    return Cost(2 * rounds + inner.rounds, elements + inner.max_elements_sent)


def _sharded_allreduce_cost(flat_choice, p: int, count: int, ranks_per_node: int,
                            itemsize: int) -> Cost:
    """A bound: the local reduce-scatter, the shards' allreduce and the local allgather, one
    after the other (the leader version's cost where the last node holds fewer ranks)."""
    q = max(ranks_per_node, 1)
    if p % q:
        return _allreduce_cost(flat_choice, p, count, ranks_per_node, itemsize)
    nodes, shard = p // q, -(-count // q)
    choose = flat_choice(itemsize)
    phases = [choose("reducescatter", q, shard).cost(q, shard, 1, itemsize),
              choose("allreduce", nodes, shard).cost(nodes, shard, 1, itemsize),
              choose("allgather", q, shard).cost(q, shard, 1, itemsize)]
    return Cost(sum(c.rounds for c in phases), sum(c.max_elements_sent for c in phases))


def _broadcast_cost(flat_choice, p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """A bound: the leaders' broadcast, then the local broadcast."""
    rounds, elements, inner = _phase_costs(flat_choice, "broadcast", p, count, ranks_per_node,
                                           itemsize)
    return Cost(rounds + inner.rounds, elements + inner.max_elements_sent)


def _reduce_cost(flat_choice, p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """A bound: the local reduce, then the leaders' reduce."""
    rounds, elements, inner = _phase_costs(flat_choice, "reduce", p, count, ranks_per_node,
                                           itemsize)
    return Cost(rounds + inner.rounds, elements + inner.max_elements_sent)


def algorithms(flat_choice: Callable[[int], Chooser]) -> Tuple[Algorithm, ...]:
    """The hierarchical algorithms, their costs bound to the leaders' choice.

    Args:
        flat_choice: gives, for an element size, the chooser of the algorithm between leaders
            (the catalog's; passed in because the catalog is built from this module).

    Returns:
        The allreduce, broadcast and reduce entries of the catalog.
    """
    return (
        Algorithm("allreduce", "hierarchical", allreduce,
                  functools.partial(_allreduce_cost, flat_choice), node_aware=True),
        Algorithm("allreduce", "hierarchical_sharded", sharded_allreduce,
                  functools.partial(_sharded_allreduce_cost, flat_choice), node_aware=True),
        Algorithm("broadcast", "hierarchical", broadcast,
                  functools.partial(_broadcast_cost, flat_choice), node_aware=True),
        Algorithm("broadcast", "hierarchical_pipeline", pipelined_broadcast,
                  flat_broadcast.pipeline_cost, node_aware=True),
        Algorithm("reduce", "hierarchical", reduce, functools.partial(_reduce_cost, flat_choice),
                  node_aware=True),
    )
