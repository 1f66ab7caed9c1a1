"""Broadcast: the root's buffer ends on every rank.

- **binomial** — the reduce tree (``reduce.py``) run backwards: with the root renumbered as
  virtual rank 0, a rank receives once from its parent v - lowbit(v), then forwards to its
  children v + 2^j, farthest first, one send per round. ceil(log2 p) rounds; the root sends n·ceil(log2 p) elements. The choice
  for small messages, where rounds dominate.
- **scatter_allgather** (van de Geijn) — a binomial scatter of p blocks of the buffer, then a
  ring allgather of those blocks: ceil(log2 p) + p - 1 rounds, about 2n elements per rank
  instead of n·log2(p) at the root. The choice for large messages.
"""

from __future__ import annotations

import numpy as np

from . import allgather, scatter
from .core import Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team
from .reduce import child_levels, log_rounds, parent_level

_ALLGATHER_PHASE = 1 << 20


def binomial(team: Team, buf: np.ndarray, root: int, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from team member ``root`` down a binomial tree (the reduce tree reversed)."""
    tree = team.rotated(root)
    v, p = tree.index, tree.size
    if v != 0:
        k = parent_level(v)
        yield (Recv(tree.peer(v - (1 << k)), buf, step0 + k),)
    # Farthest child first: it heads the largest subtree, which needs the most rounds after it.
    for j in reversed(child_levels(v, p)):
        yield (Send(tree.peer(v + (1 << j)), buf, step0 + j),)


def scatter_allgather(team: Team, buf: np.ndarray, root: int, ctx: Context,
                      step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` as a binomial scatter of p blocks followed by a ring allgather."""
    team = team.rotated(root)
    blocks = Blocks.even(len(buf), team.size)
    yield from scatter.binomial(team, buf, blocks, 0, ctx, step0)
    yield from allgather.ring(team, buf, blocks, ctx, step0 + _ALLGATHER_PHASE)


def binomial_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; the root sends the buffer ceil(log2 p) times."""
    return Cost(log_rounds(p), count * log_rounds(p))


def scatter_allgather_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """A bound: the scatter and the ring counted with ceil(n/p)-element blocks."""
    scattered = scatter.binomial_cost(p, -(-count // p), ranks_per_node, itemsize)
    gathered = allgather.ring_cost(p, -(-count // p), ranks_per_node, itemsize)
    return Cost(scattered.rounds + gathered.rounds,
                scattered.max_elements_sent + gathered.max_elements_sent)


ALGORITHMS = (
    Algorithm("broadcast", "binomial", binomial, binomial_cost),
    Algorithm("broadcast", "scatter_allgather", scatter_allgather, scatter_allgather_cost),
)
