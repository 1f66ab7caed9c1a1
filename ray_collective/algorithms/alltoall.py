"""Alltoall: block j of rank v's send buffer ends in block v of rank j's receive buffer.

Block j of every rank travels into a block v of the same size, so the blocks are necessarily
all of one size n (elements); ``bruck`` relies on that to see the buffers as p rows of n. The
send and receive buffers must not overlap. Three algorithms, for any number of ranks p:

- **pairwise** — in round s (1 <= s < p), rank v sends block v + s to rank v + s and receives
  block v - s from rank v - s (mod p); its own block is a local copy. p - 1 rounds,
  n·(p - 1) elements per rank: each block crosses the network once, straight from the send
  buffer into its place. Chosen for large blocks, where bandwidth dominates.
- **linear** — the same messages in one round: rank v posts its p - 1 sends (to v + 1, v + 2,
  ...) and its p - 1 receives at once, so every pair's message moves as soon as both sides are
  in the call, and no rank waits on a slow peer before serving the others. Chosen on one node
  (up to 8 ranks, blocks up to 128 KiB: ``rules.LINEAR_EXCHANGE_MAX_BLOCK_BYTES``), where the
  native core runs every pair's ring side by side.
- **Bruck** — rank v first rotates its blocks into scratch so that row i holds the block bound
  for rank v + i. In round k (0 <= k < ceil(log2 p)) it packs every row whose index has bit k
  set into one message to rank v + 2^k and unpacks the message from rank v - 2^k into the same
  rows; a block bound i ranks ahead moves by the bits of i, so after the last round row i holds
  the block from rank v - i, which a reversed copy puts in place. ceil(log2 p) rounds, but
  about n·(p/2)·log2(p) elements per rank (round k sends the rows below p with bit k set), plus
  local packing. Chosen for small blocks at large p, where rounds (latency) dominate.
"""

from __future__ import annotations

from typing import Iterator, List

import numpy as np

from .core import Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team
from .reduce import log_rounds


def pairwise(team: Team, sendbuf: np.ndarray, recvbuf: np.ndarray, blocks: Blocks, ctx: Context,
             step0: int = 0) -> AlgorithmGen:
    """Exchange blocks directly with every other rank, one peer pair per round."""
    v, p = team.index, team.size
    ctx.copy(blocks.view(recvbuf, v), blocks.view(sendbuf, v))
    for s in range(1, p):
        to, source = (v + s) % p, (v - s) % p
        yield (Send(team.peer(to), blocks.view(sendbuf, to), step0 + s - 1),
               Recv(team.peer(source), blocks.view(recvbuf, source), step0 + s - 1))


def linear(team: Team, sendbuf: np.ndarray, recvbuf: np.ndarray, blocks: Blocks, ctx: Context,
           step0: int = 0) -> AlgorithmGen:
    """Exchange blocks directly with every other rank, all in one round."""
    v, p = team.index, team.size
    ctx.copy(blocks.view(recvbuf, v), blocks.view(sendbuf, v))
    if p == 1:
        return
    yield (tuple(Send(team.peer(v + s), blocks.view(sendbuf, (v + s) % p), step0)
                 for s in range(1, p))
           + tuple(Recv(team.peer(v - s), blocks.view(recvbuf, (v - s) % p), step0)
                   for s in range(1, p)))


def rows_with_bit(rows: np.ndarray, k: int) -> List[np.ndarray]:
    """Views of the rows whose index has bit k set, in index order (at most two views)."""
    half, period = 1 << k, 2 << k
    periods = len(rows) // period
    whole = periods * period
    views = [rows[:whole].reshape(periods, period, rows.shape[1])[:, half:]]
    if len(rows) - whole > half:
        views.append(rows[whole + half:])
    return views


def packed(flat: np.ndarray, views: List[np.ndarray]) -> Iterator[np.ndarray]:
    """Consecutive pieces of ``flat``, each shaped like the matching view."""
    offset = 0
    for view in views:
        yield flat[offset:offset + view.size].reshape(view.shape)
        offset += view.size


def bruck(team: Team, sendbuf: np.ndarray, recvbuf: np.ndarray, blocks: Blocks, ctx: Context,
          step0: int = 0) -> AlgorithmGen:
    """Exchange blocks in ceil(log2 p) rounds, forwarding them by the bits of their distance."""
    v, p = team.index, team.size
    n = blocks.size(0)
    send = blocks.view(sendbuf, 0, p).reshape(p, n)
    recv = blocks.view(recvbuf, 0, p).reshape(p, n)
    work = ctx.alloc(p * n).reshape(p, n)
    ctx.copy(work[:p - v], send[v:])
    ctx.copy(work[p - v:], send[:v])
    # No round moves more than half the rows, so half the buffer holds any message.
    outgoing, incoming = ctx.alloc(p // 2 * n), ctx.alloc(p // 2 * n)
    for k in range(log_rounds(p)):
        rows = rows_with_bit(work, k)
        size = sum(view.size for view in rows)
        for piece, view in zip(packed(outgoing, rows), rows):
            ctx.copy(piece, view)
        yield (Send(team.peer(v + (1 << k)), outgoing[:size], step0 + k),
               Recv(team.peer(v - (1 << k)), incoming[:size], step0 + k))
        for piece, view in zip(packed(incoming, rows), rows):
            ctx.copy(view, piece)
    ctx.copy(recv[v::-1], work[:v + 1])
    ctx.copy(recv[:v:-1], work[v + 1:])


def pairwise_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """p - 1 rounds; every block but the own one is sent once."""
    return Cost(p - 1, count * (p - 1))


def linear_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """One round; every block but the own one is sent once."""
    return Cost(min(1, p - 1), count * (p - 1))


def bruck_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; round k sends the rows i < p with bit k set."""
    rounds = log_rounds(p)
    rows = sum((p >> (k + 1) << k) + max(0, p % (2 << k) - (1 << k)) for k in range(rounds))
    return Cost(rounds, count * rows)


ALGORITHMS = (
    Algorithm("alltoall", "pairwise", pairwise, pairwise_cost),
    Algorithm("alltoall", "linear", linear, linear_cost),
    Algorithm("alltoall", "bruck", bruck, bruck_cost),
)
