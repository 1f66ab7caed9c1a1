"""Barrier: no rank leaves before every rank has entered.

One algorithm, for any number of ranks p:

- **dissemination** — in round k (0 <= k < ceil(log2 p)), rank v signals rank v + 2^k and
  waits for the signal of rank v - 2^k (mod p). After round k a rank has heard, directly or
  through the chain, from the 2^(k+1) - 1 ranks before it, so after ceil(log2 p) rounds it has
  heard from all of them. Signals are empty messages: 0 elements sent. The only barrier
  algorithm, so the selector always picks it.
"""

from __future__ import annotations

from .core import Algorithm, AlgorithmGen, Context, Cost, Recv, Send, Team
from .reduce import log_rounds


def dissemination(team: Team, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Exchange empty signals at distances 1, 2, 4, ... around the ring of ranks."""
    v, p = team.index, team.size
    signal, heard = ctx.alloc(0), ctx.alloc(0)
    for k in range(log_rounds(p)):
        yield (Send(team.peer(v + (1 << k)), signal, step0 + k),
               Recv(team.peer(v - (1 << k)), heard, step0 + k))


def dissemination_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds of empty messages."""
    return Cost(log_rounds(p), 0)


ALGORITHMS = (Algorithm("barrier", "dissemination", dissemination, dissemination_cost),)
