"""Allreduce: every rank ends with the elementwise reduction of all ranks' buffers.

Five algorithms, all for any number of ranks p and any length n (here in elements):

- **recursive doubling** — in round i, rank v exchanges its whole buffer with v XOR 2^i and
  reduces. log2(p) rounds, n·log2(p) elements sent per rank. Best for small messages, where
  rounds (latency) dominate. For p not a power of two, the first 2r ranks (r = p - p', p' the
  largest power of two ≤ p) *fold* first: each even rank hands its buffer to the next odd rank
  and sits out; at the end the odd rank *unfolds* the result back. That adds 2 rounds and n
  elements.
- **Rabenseifner** — recursive-halving reduce-scatter, then recursive-doubling allgather, on
  the p' survivors of the same fold (the buffer split into p' blocks). 2·log2(p') rounds
  (+2 with the fold), 2·n·(p'-1)/p' elements per rank (+n with the fold). Bandwidth-optimal
  with log rounds: the choice for large messages at any p.
- **ring** — ring reduce-scatter then ring allgather over p blocks: 2(p-1) rounds,
  2·n·(p-1)/p elements per rank, every rank sends to one fixed neighbour only. Chosen for large
  messages on few ranks, where its single neighbour and pipelining win over log rounds.
- **reduce-broadcast** — binomial reduce onto rank 0, then binomial broadcast from it:
  2·ceil(log2 p) rounds, n elements sent per rank, but only 2(p-1) messages in all against
  p·log2(p) for recursive doubling. Chosen for small messages when a node holds more ranks
  than cores: there every message costs a process wake-up on a shared core, so the count of
  messages rather than the rounds sets the time.
- **hierarchical** (in ``hierarchical.py``, with the node-aware broadcast and reduce) —
  binomial reduce onto a leader per node, an allreduce between the leaders (the selector's
  choice for their count), binomial broadcast inside each node. Only leaders cross node
  boundaries: chosen when ranks span several nodes.

Every rank ends bitwise identical: each block is reduced once along one path and then copied
(ring, Rabenseifner), or partners combine the same two operands (recursive doubling).
"""

from __future__ import annotations

import numpy as np

from . import allgather, broadcast, reduce, reducescatter
from .core import Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team
from .fold import Survivors, fold, fold_rounds, unfold

_BROADCAST_PHASE = 1 << 20


def recursive_doubling(team: Team, buf: np.ndarray, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf`` in place by pairwise exchange at distances 1, 2, 4, ..."""
    survivors = Survivors(team)
    index = survivors.index
    yield from fold(team, buf, step0)
    if index >= 0 and len(survivors) > 1:
        incoming = ctx.alloc(len(buf))
        mask, step = 1, step0 + 1
        while mask < len(survivors):
            partner = survivors[index ^ mask]
            yield (Send(partner, buf, step), Recv(partner, incoming, step))
            ctx.combine(buf, incoming)
            mask <<= 1
            step += 1
    yield from unfold(team, buf, step0 + 1 + survivors.count.bit_length() - 1)


def rabenseifner(team: Team, buf: np.ndarray, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf`` in place: halving reduce-scatter, then doubling allgather."""
    survivors = Survivors(team)
    levels = survivors.count.bit_length() - 1
    yield from fold(team, buf, step0)
    if survivors.index >= 0:
        sub = survivors.as_team()
        blocks = Blocks.even(len(buf), survivors.count)
        yield from reducescatter.recursive_halving(sub, buf, blocks, ctx, step0 + 1)
        yield from allgather.recursive_doubling(sub, buf, blocks, ctx, step0 + 1 + levels)
    yield from unfold(team, buf, step0 + 1 + 2 * levels)


def ring(team: Team, buf: np.ndarray, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf`` in place: ring reduce-scatter, then ring allgather."""
    blocks = Blocks.even(len(buf), team.size)
    yield from reducescatter.ring(team, buf, blocks, ctx, step0)
    yield from allgather.ring(team, buf, blocks, ctx, step0 + team.size - 1)


def reduce_broadcast(team: Team, buf: np.ndarray, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Allreduce ``buf`` in place: binomial reduce onto member 0, binomial broadcast back."""
    yield from reduce.binomial(team, buf, 0, ctx, step0)
    yield from broadcast.binomial(team, buf, 0, ctx, step0 + _BROADCAST_PHASE)


def reduce_broadcast_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """2·ceil(log2 p) rounds; a rank sends n elements up and at most n·log2 p down (the root)."""
    rounds = reduce.log_rounds(p)
    return Cost(2 * rounds, count * rounds if p > 1 else 0)


def recursive_doubling_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """log2(p') (+2 with the fold) rounds; count·log2(p') elements (+count with the fold)."""
    levels = p.bit_length() - 1
    unfold_sent = count if fold_rounds(p) else 0
    return Cost(levels + fold_rounds(p), count * levels + unfold_sent)


def rabenseifner_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """2·log2(p') (+2 with the fold) rounds; about 2·count·(p'-1)/p' elements (+count, fold)."""
    levels = p.bit_length() - 1
    survivors = 1 << levels
    small, extra = divmod(count, survivors)
    # Exact, reached by survivor 0. Blocks.even puts the `extra` larger blocks first, so block 0
    # is a largest one (the reduce-scatter sends every block but it) and each range the
    # allgather sends, [0, 2^i), holds the most large blocks of any range of its size; survivor
    # 0 is also the one that unfolds to virtual rank 0 when there is a fold.
    reduce_scatter = count - small - (1 if extra else 0)
    all_gather = (survivors - 1) * small + sum(min(1 << i, extra) for i in range(levels))
    unfold_sent = count if fold_rounds(p) else 0
    return Cost(2 * levels + fold_rounds(p), reduce_scatter + all_gather + unfold_sent)


def ring_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """2(p-1) rounds; about 2·count·(p-1)/p elements per rank."""
    small, extra = divmod(count, p)
    # Exact: rank v sends every block but v, then every block but v+1, so the most is sent by a
    # rank whose two blocks are small. Blocks.even puts the `extra` larger blocks first: two
    # adjacent small blocks exist unless block p-1 is the only small one.
    return Cost(2 * (p - 1), 2 * (count - small) - (1 if 0 < extra == p - 1 else 0))


ALGORITHMS = (
    Algorithm("allreduce", "recursive_doubling", recursive_doubling, recursive_doubling_cost),
    Algorithm("allreduce", "rabenseifner", rabenseifner, rabenseifner_cost),
    Algorithm("allreduce", "ring", ring, ring_cost),
    Algorithm("allreduce", "reduce_broadcast", reduce_broadcast, reduce_broadcast_cost),
)
