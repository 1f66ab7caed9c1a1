"""Hierarchical (node-aware) allreduce, broadcast and reduce: only one rank per node crosses nodes.

Ranks are grouped by node (``ctx.topology``, from the group's rank→node map). Each node has a
*leader*: its lowest rank, except that for broadcast and reduce the root leads its own node.

- **allreduce** — binomial reduce onto each leader inside its node, an allreduce between the
  leaders (the flat algorithm for that many ranks and that size), then a binomial broadcast
  inside each node.
- **broadcast** — a broadcast between the leaders from the root, then a binomial broadcast inside
  each node.
- **reduce** — a binomial reduce onto each leader inside its node, then a reduce between the
  leaders onto the root.

Inside a node messages are cheap (shared memory); between nodes they are not, so the leaders
carry the only inter-node traffic: one message per leader and round of the inter-node phase
instead of one per rank. Rounds: 2·ceil(log2 q) + the leaders' algorithm for allreduce and
ceil(log2 q) + the leaders' algorithm for broadcast and reduce, q the most ranks on one node.
The selector picks these whenever the group spans several nodes and some node holds several
ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Callable, Tuple

import numpy as np

from . import broadcast as flat_broadcast
from . import reduce as flat_reduce
from .core import Algorithm, AlgorithmGen, Chooser, Context, Cost, Team, Topology
from .reduce import log_rounds

_INTER_NODE_PHASE = 1 << 22
_INTRA_NODE_FINAL_PHASE = 2 << 22


class Leaders(Sequence):
    """The leader of every node: its lowest rank, or ``root`` on the root's node."""

    __slots__ = ("topology", "root")

    def __init__(self, topology: Topology, root: int = -1):
        self.topology = topology
        self.root = root

    def __len__(self) -> int:
        return len(self.topology.nodes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self.root >= 0 and i == self.topology.node_index[self.root]:
            return self.root
        return self.topology.leaders[i]


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
                  functools.partial(_allreduce_cost, flat_choice)),
        Algorithm("broadcast", "hierarchical", broadcast,
                  functools.partial(_broadcast_cost, flat_choice)),
        Algorithm("reduce", "hierarchical", reduce, functools.partial(_reduce_cost, flat_choice)),
    )
