"""Allreduce: every rank ends with the elementwise reduction of all ranks' buffers.

Four algorithms, all for any number of ranks p and any length n (here in elements):

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
- **hierarchical** — binomial reduce onto a leader per node, an allreduce between the leaders
  (the selector's choice for their count), binomial broadcast inside each node. Only leaders
  cross node boundaries: chosen when ranks span several nodes.

Every rank ends bitwise identical: each block is reduced once along one path and then copied
(ring, Rabenseifner), or partners combine the same two operands (recursive doubling).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .core import AlgorithmGen, Blocks, Context, Recv, Send, Team


class Survivors(Sequence):
    """The p' = 2^floor(log2 p) ranks left after the fold, and this rank's index among them.

    Survivor i is virtual rank 2i+1 for i < r and i + r after; ``index`` is -1 for a rank that
    sits out. A lazy sequence of real ranks, so that building it costs O(1) at any p.
    """

    __slots__ = ("team", "count", "extra", "index")

    def __init__(self, team: Team):
        self.team = team
        self.count = 1 << (team.size.bit_length() - 1)
        self.extra = team.size - self.count
        v = team.index
        if v < 2 * self.extra:
            self.index = v // 2 if v % 2 else -1
        else:
            self.index = v - self.extra

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.team.peer(2 * i + 1 if i < self.extra else i + self.extra)

    def as_team(self) -> Team:
        """The survivors as a team of their own (for a rank that takes part)."""
        return Team(self, self.index)


def fold(team: Team, buf: np.ndarray, step: int) -> AlgorithmGen:
    """Reduce the buffers of the first 2r ranks pairwise onto the odd ones (no-op for p = 2^k)."""
    extra = team.size - (1 << (team.size.bit_length() - 1))
    v = team.index
    if v < 2 * extra:
        if v % 2 == 0:
            yield (Send(team.peer(v + 1), buf, step),)
        else:
            yield (Recv(team.peer(v - 1), buf, step, reduce=True),)


def unfold(team: Team, buf: np.ndarray, step: int) -> AlgorithmGen:
    """Return the result to the ranks that sat out of the fold."""
    extra = team.size - (1 << (team.size.bit_length() - 1))
    v = team.index
    if v < 2 * extra:
        if v % 2 == 0:
            yield (Recv(team.peer(v + 1), buf, step),)
        else:
            yield (Send(team.peer(v - 1), buf, step),)


def fold_rounds(p: int) -> int:
    """Rounds the fold plus unfold add at p ranks: 0 for powers of two, else 2."""
    return 0 if p & (p - 1) == 0 else 2


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
    yield from unfold(team, buf, step0 + 64)
