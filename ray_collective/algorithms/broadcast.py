"""Broadcast: the root's buffer ends on every rank.

- **binomial** — the reduce tree (``reduce.py``) run backwards: with the root renumbered as
  virtual rank 0, a rank receives once from its parent v - lowbit(v), then forwards to its
  children v + 2^j, farthest first, one send per round. ceil(log2 p) rounds; the root sends n·ceil(log2 p) elements. The choice
  for small messages, where rounds dominate.
- **scatter_allgather** (van de Geijn) — a binomial scatter of p blocks of the buffer, then a
  ring allgather of those blocks: ceil(log2 p) + p - 1 rounds, about 2n elements per rank
  instead of n·log2(p) at the root. The choice for large messages.
- **pipeline** — a chain v -> v+1 from the root, the buffer cut into k chunks
  (``pipeline_chunks``: one per MiB, at most 16, or 8 where machines run more ranks than
  cores): in round t, rank v forwards chunk t - v to v+1 while it takes chunk t - v + 1 from
  v-1, so every link of the chain is busy at once.
  k + p - 2 rounds, n elements per rank (the last sends none). Not picked on one node; the
  hierarchical broadcast across nodes (``hierarchical.py``) runs it on a chain that visits the
  nodes one after the other, so that only the links between them cross nodes.
- **link_pipeline** — the same chain for ranks on different nodes (the node leaders of the
  hierarchical broadcast, or a group of one rank per node), cut for a network link rather
  than for the cores: every hop is a link, which carries the buffer once (n each way, the
  least any broadcast can) and binds the call where it is slower than the cores, so more
  chunks (``link_pipeline_chunks``: one per MiB, at most 64) shorten the chain's fill, k + p
  - 2 chunk times for k chunks, to a few percent of the call. A round costs a wake-up and a
  stream's send and receive, a small share of a chunk's time on a link.
- **linear** — one round: the root sends the whole buffer to every other rank. The root sends
  n·(p-1) elements, so it is no choice where the root's link bounds the call; on one node the
  receivers copy the buffer side by side (on the native core out of their rings from the root,
  or from 32 MiB out of the root's memory itself), each exactly once, with no round waiting
  on another.
"""

from __future__ import annotations

import numpy as np

from . import allgather, scatter
from .core import (Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team,
                   one_round_with_root)
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


def linear(team: Team, buf: np.ndarray, root: int, ctx: Context, step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from team member ``root`` to every other rank in one round."""
    yield from one_round_with_root(team, root, lambda w: buf, step0, to_root=False)


def scatter_allgather(team: Team, buf: np.ndarray, root: int, ctx: Context,
                      step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` as a binomial scatter of p blocks followed by a ring allgather."""
    team = team.rotated(root)
    blocks = Blocks.even(len(buf), team.size)
    yield from scatter.binomial(team, buf, blocks, 0, ctx, step0)
    yield from allgather.ring(team, buf, blocks, ctx, step0 + _ALLGATHER_PHASE)


PIPELINE_CHUNK_BYTES = 1 << 20
PIPELINE_MAX_CHUNKS = 16

CROWDED_PIPELINE_MAX_CHUNKS = 8
"""The most chunks where machines run more ranks than cores: there a chain longer than the
cores gains nothing from more links busy at once, and every round costs each rank a wake-up.
Measured on 2 cores, 4 nodes x 2 ranks, six runs each beside torch (p50 of ray):
64 MiB 112-121 ms with 8 chunks against 111-134 ms with 16 (medians 116 and 126) and
134-154 ms with 64; 16 MiB 32-41 ms against 36-41 ms (medians 36 and 38); 4 chunks level
with 8."""


def pipeline_chunks(count: int, itemsize: int, oversubscribed: bool = False) -> int:
    """Chunks of a pipelined broadcast of ``count`` elements: one per MiB, 1 to 16 (every
    chunk costs a round, in which each rank waits for its slowest link), or 1 to 8 where
    machines are ``oversubscribed``."""
    most = CROWDED_PIPELINE_MAX_CHUNKS if oversubscribed else PIPELINE_MAX_CHUNKS
    return max(1, min(most, count * itemsize // PIPELINE_CHUNK_BYTES))


LINK_PIPELINE_MAX_CHUNKS = 64
"""The most chunks of a chain whose every hop is a network link (``link_pipeline``). Measured on
the network bed (``benchmarks.netbed_profile``, 4 nodes x 2 ranks, 1 Gbit/s links, 2 cores),
256 MiB from rank 0: the leaders' scatter+allgather (the root's link carrying 1.5 n) 1.75x
the link's time; the chain of the 8 ranks in 8 chunks 1.29x; see ``docs/netbed.md``."""


def link_pipeline_chunks(count: int, itemsize: int) -> int:
    """Chunks of a pipelined broadcast between nodes of ``count`` elements: one per MiB, 1 to
    :data:`LINK_PIPELINE_MAX_CHUNKS`."""
    return max(1, min(LINK_PIPELINE_MAX_CHUNKS, count * itemsize // PIPELINE_CHUNK_BYTES))


def _chain(team: Team, buf: np.ndarray, root: int, parts: int, step0: int) -> AlgorithmGen:
    """Broadcast ``buf`` from team member ``root`` down the chain root, root+1, ..., in
    ``parts`` chunks, each rank forwarding one chunk while it receives the next."""
    chain = team.rotated(root)
    v, p = chain.index, chain.size
    if p == 1:
        return
    chunks = Blocks.even(len(buf), parts)
    # Rank v takes chunk c from v-1 in round c + v - 1 and forwards it to v+1 in round c + v.
    for t in range(max(v - 1, 0), v + chunks.parts):
        ops = []
        if v > 0 and t - v + 1 < chunks.parts:
            ops.append(Recv(chain.peer(v - 1), chunks.view(buf, t - v + 1), step0 + t))
        if v < p - 1 and t >= v:
            ops.append(Send(chain.peer(v + 1), chunks.view(buf, t - v), step0 + t))
        if ops:
            yield tuple(ops)


def pipeline(team: Team, buf: np.ndarray, root: int, ctx: Context,
             step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from team member ``root`` down the chain root, root+1, ..., in
    :func:`pipeline_chunks` chunks, each rank forwarding one chunk while it receives the next."""
    yield from _chain(team, buf, root, pipeline_chunks(len(buf), ctx.dtype.itemsize,
                                                       ctx.oversubscribed), step0)


def link_pipeline(team: Team, buf: np.ndarray, root: int, ctx: Context,
                  step0: int = 0) -> AlgorithmGen:
    """Broadcast ``buf`` from team member ``root`` down the chain root, root+1, ... of ranks on
    different nodes, in :func:`link_pipeline_chunks` chunks."""
    yield from _chain(team, buf, root, link_pipeline_chunks(len(buf), ctx.dtype.itemsize), step0)


def link_pipeline_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """k + p - 2 rounds for k chunks; every rank but the last sends the buffer once."""
    if p == 1:
        return Cost(0, 0)
    return Cost(link_pipeline_chunks(count, itemsize) + p - 2, count)


def pipeline_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """k + p - 2 rounds (k chunks, as on machines with a core per rank); every rank but the
    last sends the buffer once."""
    if p == 1:
        return Cost(0, 0)
    return Cost(pipeline_chunks(count, itemsize) + p - 2, count)


def binomial_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds; the root sends the buffer ceil(log2 p) times."""
    return Cost(log_rounds(p), count * log_rounds(p))


def linear_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """One round; the root sends the buffer p - 1 times."""
    return Cost(min(1, p - 1), count * (p - 1))


def scatter_allgather_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """A bound: the scatter and the ring counted with ceil(n/p)-element blocks."""
    scattered = scatter.binomial_cost(p, -(-count // p), ranks_per_node, itemsize)
    gathered = allgather.ring_cost(p, -(-count // p), ranks_per_node, itemsize)
    return Cost(scattered.rounds + gathered.rounds,
                scattered.max_elements_sent + gathered.max_elements_sent)


ALGORITHMS = (
    Algorithm("broadcast", "binomial", binomial, binomial_cost),
    Algorithm("broadcast", "scatter_allgather", scatter_allgather, scatter_allgather_cost),
    Algorithm("broadcast", "pipeline", pipeline, pipeline_cost),
    Algorithm("broadcast", "link_pipeline", link_pipeline, link_pipeline_cost),
    Algorithm("broadcast", "linear", linear, linear_cost),
)
