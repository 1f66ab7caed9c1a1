"""Gather: the root ends with every rank's block, block v from rank v.

Two algorithms, for any number of ranks p and any blocks (uneven and empty ones included):

- **binomial** — the binomial tree of ``reduce``, walked with blocks. With the team rotated so
  that the root is virtual rank 0, the subtree of virtual rank v covers the contiguous virtual
  range [v, v + lowbit(v)) clipped to p. Each rank receives its children's subtrees straight
  into their blocks of its own buffer, nearest child first, then sends its whole subtree to its
  parent as one message. ceil(log2 p) rounds, as for reduce. The root sends nothing; with
  K = ceil(log2 p), the most any rank sends is the largest subtree below the root: that of
  virtual rank 2^(K-1), p - 2^(K-1) blocks, or when that one is clipped small, that of 2^(K-2),
  2^(K-2) blocks. Chosen for small blocks, and across nodes.
- **linear** — one round: every other rank sends its block to the root, which receives each
  straight into its place. Each block crosses once, where the tree forwards a subtree's blocks
  up a level at every round; on one node the root then copies every block out of its sender's
  memory (the native core's reads in place) with no round waiting on another. ``scatter``'s
  linear run backwards; chosen for large blocks on one node.

Virtual rank u holds block (u + root) mod p, so a virtual range is a contiguous run of blocks
that may wrap past the last block. Rather than gathering into a rotated scratch buffer and
copying it into place at the end, a wrapping subtree travels as two messages in the same round
(the run up to the last block, then the run from block 0): the data lands where it belongs with
no scratch and no local copy, at the price of one extra message for at most one subtree per
level. ``scatter`` uses the same layout in the opposite direction.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .core import (Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team,
                   one_round_with_root)
from .reduce import child_levels, log_rounds, parent_level, subtree_end


def subtree_views(buf: np.ndarray, blocks: Blocks, root: int, first: int,
                  stop: int) -> Tuple[np.ndarray, ...]:
    """The views of ``buf`` holding virtual blocks first .. stop-1 of a team rotated by ``root``."""
    p = blocks.parts
    start = (first + root) % p
    end = start + stop - first
    if end <= p:
        return (blocks.view(buf, start, end),)
    return blocks.view(buf, start, p), blocks.view(buf, 0, end - p)


def binomial(team: Team, buf: np.ndarray, blocks: Blocks, root: int, ctx: Context,
             step0: int = 0) -> AlgorithmGen:
    """Gather every rank's block of ``buf`` into the buffer of virtual rank ``root``."""
    tree = team.rotated(root)
    v, p = tree.index, tree.size
    for j in child_levels(v, p):
        child = v + (1 << j)
        views = subtree_views(buf, blocks, root, child, subtree_end(child, p))
        yield tuple(Recv(tree.peer(child), view, step0 + j) for view in views)
    if v != 0:
        k = parent_level(v)
        views = subtree_views(buf, blocks, root, v, subtree_end(v, p))
        yield tuple(Send(tree.peer(v - (1 << k)), view, step0 + k) for view in views)


def binomial_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; the largest subtree below the root is sent once."""
    if p == 1:
        return Cost(0, 0)
    rounds = log_rounds(p)
    half = 1 << (rounds - 1)
    return Cost(rounds, count * max(p - half, half // 2))


def linear(team: Team, buf: np.ndarray, blocks: Blocks, root: int, ctx: Context,
           step0: int = 0) -> AlgorithmGen:
    """Every rank v other than the root sends its block v to the root in one round."""
    yield from one_round_with_root(team, root, lambda w: blocks.view(buf, w), step0,
                                   to_root=True)


def linear_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """One round; each rank sends its own block, and the root takes in the p - 1 others."""
    return Cost(min(1, p - 1), count if p > 1 else 0)


ALGORITHMS = (Algorithm("gather", "binomial", binomial, binomial_cost),
              Algorithm("gather", "linear", linear, linear_cost))
