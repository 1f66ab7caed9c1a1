"""The fold that lets power-of-two algorithms run on any number of ranks.

With p' = 2^floor(log2 p) and r = p - p', the first 2r ranks pair up: each even rank hands its
buffer to the next odd rank, which reduces it into its own, and sits out. The p' *survivors*
(odd ranks below 2r, every rank from 2r on) run the power-of-two algorithm; at the end the
*unfold* hands each sitting-out rank its result. Fold and unfold cost one round each, and
nothing at all when p is a power of two. Used by recursive doubling and Rabenseifner allreduce
and by the halving reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Tuple

import numpy as np

from .core import AlgorithmGen, Recv, Send, Team


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


def _folded_pair(team: Team) -> Optional[Tuple[int, bool]]:
    """For one of the first 2r ranks: its partner's real rank, and whether it is the even
    (sitting-out) one of the pair; None for every other rank."""
    extra = team.size - (1 << (team.size.bit_length() - 1))
    v = team.index
    if v >= 2 * extra:
        return None
    return (team.peer(v + 1), True) if v % 2 == 0 else (team.peer(v - 1), False)


def fold(team: Team, buf: np.ndarray, step: int) -> AlgorithmGen:
    """Reduce the buffers of the first 2r ranks pairwise onto the odd ones (no-op for p = 2^k)."""
    pair = _folded_pair(team)
    if pair is not None:
        partner, sits_out = pair
        yield ((Send(partner, buf, step),) if sits_out
               else (Recv(partner, buf, step, reduce=True),))


def unfold(team: Team, buf: np.ndarray, step: int) -> AlgorithmGen:
    """Hand the result to the ranks that sat out: each odd rank below 2r sends ``buf`` to the
    even rank before it, which receives into its own ``buf``."""
    pair = _folded_pair(team)
    if pair is not None:
        partner, sits_out = pair
        yield (Recv(partner, buf, step),) if sits_out else (Send(partner, buf, step),)


def fold_rounds(p: int) -> int:
    """Rounds the fold plus unfold add at p ranks: 0 for powers of two, else 2."""
    return 0 if p & (p - 1) == 0 else 2
