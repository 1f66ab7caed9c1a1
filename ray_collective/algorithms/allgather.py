"""Allgather: every rank contributes one block and ends with all p blocks, in rank order.

The buffer holds p blocks (``Blocks``, possibly uneven or empty); block v belongs to virtual
rank v and is filled on entry at rank v only. Every algorithm sends each rank's p-1 missing
blocks to it exactly once, so each rank sends (p-1)·b elements for blocks of b elements; they
differ in rounds and in whom a rank talks to:

- **ring** — in round s, rank v passes block (v-s) mod p on to v+1 and takes block
  (v-s-1) mod p from v-1. p-1 rounds with one fixed neighbour each way: chosen for large
  blocks on few ranks, where the bandwidth term dominates the p-1 latencies.
- **recursive doubling** — in round i, rank v swaps the 2^i blocks it holds (the aligned range
  around its own block) with v XOR 2^i, doubling what it holds. log2(p) rounds, p a power of
  two only: chosen at powers of two whenever the ring is not (small blocks, or many ranks).
- **Bruck** — any p: rank v gathers into a scratch buffer rotated so that its own block comes
  first; in round i it sends its first min(2^i, p-2^i) blocks to v-2^i and appends as many from
  v+2^i. ceil(log2 p) rounds, then a local copy undoes the rotation. Chosen instead of
  recursive doubling when p is not a power of two.
- **linear** — one round: rank v sends its own block to every other rank (v+1, v+2, ...) and
  takes every other block straight from its owner. The same bytes as the ring, but no round
  waits on another. Chosen on one node (up to 8 ranks, blocks of 16 KiB to 128 KiB:
  ``rules.LINEAR_EXCHANGE_MAX_BLOCK_BYTES``), where the native core runs every pair's ring
  side by side.

Each algorithm labels round i with step ``step0 + i``, so that composites can run phases back
to back with step offsets.
"""

from __future__ import annotations

import numpy as np

from .core import Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team


def ring(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
         step0: int = 0) -> AlgorithmGen:
    """Allgather by passing blocks around the ring v -> v+1."""
    p, v = team.size, team.index
    right, left = team.peer(v + 1), team.peer(v - 1)
    for s in range(p - 1):
        yield (Send(right, blocks.view(buf, (v - s) % p), step0 + s),
               Recv(left, blocks.view(buf, (v - s - 1) % p), step0 + s))


def linear(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
           step0: int = 0) -> AlgorithmGen:
    """Allgather in one round: every rank's block straight to every other rank."""
    p, v = team.size, team.index
    if p == 1:
        return
    others = [(v + s) % p for s in range(1, p)]
    yield (tuple(Send(team.peer(w), blocks.view(buf, v), step0) for w in others)
           + tuple(Recv(team.peer(w), blocks.view(buf, w), step0) for w in others))


def recursive_doubling(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
                       step0: int = 0) -> AlgorithmGen:
    """Allgather by swapping ever larger aligned block ranges with v XOR 2^i (p = 2^k)."""
    v = team.index
    mask, step = 1, step0
    while mask < team.size:
        mine = v & ~(mask - 1)
        theirs = mine ^ mask
        partner = team.peer(v ^ mask)
        yield (Send(partner, blocks.view(buf, mine, mine + mask), step),
               Recv(partner, blocks.view(buf, theirs, theirs + mask), step))
        mask <<= 1
        step += 1


def bruck(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
          step0: int = 0) -> AlgorithmGen:
    """Allgather in ceil(log2 p) rounds at any p, gathering into a rotated scratch buffer."""
    p, v = team.size, team.index
    total, base = blocks.total, blocks.offsets[v]

    def at(j: int) -> int:
        # Offset of block v+j in the scratch buffer (buf rotated left by base); at(p) = total.
        k = v + j
        return blocks.offsets[k] - base if k < p else total - base + blocks.offsets[k - p]

    rotated = ctx.alloc(total)
    ctx.copy(rotated[:at(1)], blocks.view(buf, v))
    distance, step = 1, step0
    while distance < p:
        count = min(distance, p - distance)
        yield (Send(team.peer(v - distance), rotated[:at(count)], step),
               Recv(team.peer(v + distance), rotated[at(distance):at(distance + count)], step))
        distance <<= 1
        step += 1
    ctx.copy(buf[base:], rotated[:total - base])
    ctx.copy(buf[:base], rotated[total - base:])


def ring_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """p-1 rounds, (p-1)·count elements per rank."""
    return Cost(p - 1, (p - 1) * count)


def linear_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """One round; every rank sends its block to each of the p - 1 others."""
    return Cost(min(1, p - 1), count * (p - 1))


def recursive_doubling_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """log2(p) rounds, (p-1)·count elements per rank."""
    return Cost(p.bit_length() - 1, (p - 1) * count)


def bruck_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """ceil(log2 p) rounds, (p-1)·count elements per rank."""
    return Cost((p - 1).bit_length(), (p - 1) * count)


ALGORITHMS = (
    Algorithm("allgather", "ring", ring, ring_cost),
    Algorithm("allgather", "recursive_doubling", recursive_doubling, recursive_doubling_cost,
              power_of_two_only=True),
    Algorithm("allgather", "bruck", bruck, bruck_cost),
    Algorithm("allgather", "linear", linear, linear_cost),
)
