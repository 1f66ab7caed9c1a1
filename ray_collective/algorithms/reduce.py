"""Reduce: the root ends with the elementwise reduction of all ranks' buffers.

One algorithm, for any number of ranks p and any length n (here in elements):

- **binomial** — a binomial tree rooted at the root. With the team rotated so that the root is
  virtual rank 0, virtual rank v (v > 0) owns the subtree [v, v + lowbit(v)) clipped to p; its
  children are v + 2^j for every 2^j < lowbit(v) that is still below p (every 2^j < p for the
  root). Each rank reduces its children's partial results into an accumulator, nearest child
  first, then sends the accumulator to its parent v - lowbit(v). Child v + 2^j finishes after
  j rounds, exactly when its parent is ready for it, so the root is done after ceil(log2 p)
  rounds. Every non-root rank sends n elements once. The only reduce algorithm, so the
  selector always picks it.

Non-root buffers are left unchanged: a rank with children accumulates into scratch, and a leaf
sends its buffer as it is. The tree helpers below are shared with gather and scatter, which
walk the same tree with blocks instead of whole buffers.
"""

from __future__ import annotations

import numpy as np

from .core import Algorithm, AlgorithmGen, Context, Cost, Recv, Send, Team


def log_rounds(p: int) -> int:
    """ceil(log2 p): the depth of a binomial tree (or dissemination) over p ranks."""
    return (p - 1).bit_length()


def child_levels(v: int, p: int) -> range:
    """The levels j whose child v + 2^j virtual rank v has in the binomial tree rooted at 0."""
    below_p = (p - v - 1).bit_length()
    return range(below_p if v == 0 else min(below_p, parent_level(v)))


def parent_level(v: int) -> int:
    """The level k of virtual rank v > 0: its parent is v - 2^k and its subtree spans 2^k."""
    return (v & -v).bit_length() - 1


def subtree_end(v: int, p: int) -> int:
    """The end of the virtual range [v, end) that the subtree of virtual rank v covers."""
    return p if v == 0 else min(v + (v & -v), p)


def binomial(team: Team, buf: np.ndarray, root: int, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Reduce ``buf`` onto virtual rank ``root`` up a binomial tree; other buffers are unchanged."""
    tree = team.rotated(root)
    v, p = tree.index, tree.size
    levels = child_levels(v, p)
    # The root reduces in place; any other rank with children into scratch, so that its own
    # buffer stays as the caller passed it.
    acc = buf
    if v != 0 and levels:
        acc = ctx.alloc(len(buf))
        ctx.copy(acc, buf)
    for j in levels:
        yield (Recv(tree.peer(v + (1 << j)), acc, step0 + j, reduce=True),)
    if v != 0:
        k = parent_level(v)
        yield (Send(tree.peer(v - (1 << k)), acc, step0 + k),)


def binomial_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; every non-root rank sends its n elements once."""
    return Cost(log_rounds(p), count if p > 1 else 0)


ALGORITHMS = (Algorithm("reduce", "binomial", binomial, binomial_cost),)
