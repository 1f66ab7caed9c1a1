"""Scatter: every rank v ends with block v of the root's buffer.

One algorithm, for any number of ranks p and any blocks (uneven and empty ones included, as
the broadcast built from scatter + allgather passes):

- **binomial** — the gather tree run backwards. With the team rotated so that the root is
  virtual rank 0, each rank receives its whole subtree [v, v + lowbit(v)) (clipped to p) from
  its parent into its own buffer, then hands each child its subtree, farthest (largest) child
  first: the child at level j gets its data in round K - j (K = ceil(log2 p)) and its own
  children follow on from there, so every rank has its block after K rounds. The root sends
  the p - 1 blocks that are not its own; every other rank sends less. Chosen for small blocks,
  and across nodes.

A subtree whose blocks wrap past the last block travels as two messages in one round, as in
``gather`` (see there for why): the blocks land in place with no scratch and no copy.

- **linear** — one round: the root sends every other rank its block, and each receives it
  straight from the root. Each block crosses once, where the tree forwards a subtree's blocks
  down a level at every round; on one node the receivers then copy their blocks side by side
  (on the native core out of their rings from the root, or from 32 MiB out of the root's
  memory itself) instead of one after another down the tree. Chosen for large blocks on one node.
"""

from __future__ import annotations

import numpy as np

from .core import (Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team,
                   one_round_with_root)
from .gather import subtree_views
from .reduce import child_levels, log_rounds, parent_level, subtree_end


def binomial(team: Team, buf: np.ndarray, blocks: Blocks, root: int, ctx: Context,
             step0: int = 0) -> AlgorithmGen:
    """Scatter the blocks of the buffer of virtual rank ``root``: block v ends on rank v."""
    tree = team.rotated(root)
    v, p = tree.index, tree.size
    if v != 0:
        k = parent_level(v)
        views = subtree_views(buf, blocks, root, v, subtree_end(v, p))
        yield tuple(Recv(tree.peer(v - (1 << k)), view, step0 + k) for view in views)
    for j in reversed(child_levels(v, p)):
        child = v + (1 << j)
        views = subtree_views(buf, blocks, root, child, subtree_end(child, p))
        yield tuple(Send(tree.peer(child), view, step0 + j) for view in views)


def binomial_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; the root sends the p - 1 blocks that are not its own."""
    return Cost(log_rounds(p), count * (p - 1))


def linear(team: Team, buf: np.ndarray, blocks: Blocks, root: int, ctx: Context,
           step0: int = 0) -> AlgorithmGen:
    """The root sends block v to every other rank v in one round."""
    yield from one_round_with_root(team, root, lambda w: blocks.view(buf, w), step0,
                                   to_root=False)


def linear_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """One round; the root sends the p - 1 blocks that are not its own."""
    return Cost(min(1, p - 1), count * (p - 1))


ALGORITHMS = (Algorithm("scatter", "binomial", binomial, binomial_cost),
              Algorithm("scatter", "linear", linear, linear_cost))
