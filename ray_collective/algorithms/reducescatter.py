"""Reduce-scatter: every rank ends with one block of the elementwise reduction of all buffers.

The buffer holds p blocks (``Blocks``, possibly uneven or empty) of this rank's input; on exit
block v of virtual rank v's buffer holds block v reduced over all ranks. The other blocks are
scratch and left in an unspecified state. Every algorithm sends each of a rank's p-1 foreign
blocks out exactly once, partially reduced or not, so each rank sends (p-1)·b elements for
blocks of b elements; they differ in rounds and in whom a rank talks to:

- **ring** — in round s, rank v sends its partial sum of block (v-s-1) mod p to v+1 and adds
  v-1's partial sum of block (v-s-2) mod p into its own. After p-1 rounds block v has passed
  every rank once and ends at v. One fixed neighbour each way: chosen for large blocks on few
  ranks across nodes, where the bandwidth term dominates the p-1 latencies.
- **recursive halving** — rank v holds a range of blocks, all p at first; in round i it keeps
  the half of its range that holds block v, sends the other half to v XOR 2^(k-1-i) (whose
  half it is) and adds the partner's copy of the kept half. log2(p) rounds, p a power of two
  only: chosen at powers of two whenever the ring is not (small blocks, or many ranks).
- **halving_fold** — recursive halving at any p: the fold (``fold.py``) leaves p' = 2^k
  survivors; survivor i owns the blocks of the ranks it stands for (2i and 2i+1 when it
  absorbed a folded rank), and recursive halving runs over those p' groups of blocks. Then
  each survivor that absorbed a rank hands it its block. log2(p') + 2 rounds; a folded rank
  sends its whole buffer (p·b), every other rank (p-1)·b. The choice at other rank counts for
  small blocks or many ranks.
- **pairwise** — in round s (1 ≤ s < p), rank v sends block v+s straight to its owner v+s
  and adds v-s's copy of block v into its own. p-1 rounds at any p, like the ring, but with
  all-to-all traffic instead of one neighbour: every block is reduced only at its owner, from
  the original inputs, so no partial sums are forwarded. Chosen for large blocks on one node
  (up to 16 ranks): there the native core reads each block where it lies in the sender's list
  and reduces it into the receiver's tensor, with no buffer at all.

Incoming blocks are reduced in place with ``Recv(reduce=True)``: the block a round receives
into is never one it sends from. Each algorithm labels round i with step ``step0 + i``.
"""

from __future__ import annotations

import functools

import numpy as np

from .core import Algorithm, AlgorithmGen, Blocks, Context, Cost, Recv, Send, Team
from .fold import Survivors, fold, fold_rounds, unfold


def ring(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
         step0: int = 0) -> AlgorithmGen:
    """Reduce-scatter by passing partial sums around the ring v -> v+1."""
    p, v = team.size, team.index
    right, left = team.peer(v + 1), team.peer(v - 1)
    for s in range(p - 1):
        yield (Send(right, blocks.view(buf, (v - s - 1) % p), step0 + s),
               Recv(left, blocks.view(buf, (v - s - 2) % p), step0 + s, reduce=True))


def recursive_halving(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
                      step0: int = 0) -> AlgorithmGen:
    """Reduce-scatter by exchanging halves of the held block range with v XOR 2^i (p = 2^k)."""
    v = team.index
    half, step = team.size >> 1, step0
    while half:
        keep = v & ~(half - 1)
        give = keep ^ half
        partner = team.peer(v ^ half)
        yield (Send(partner, blocks.view(buf, give, give + half), step),
               Recv(partner, blocks.view(buf, keep, keep + half), step, reduce=True))
        half >>= 1
        step += 1


@functools.lru_cache(maxsize=64)
def _survivor_blocks(blocks: Blocks, extra: int) -> Blocks:
    """``blocks`` regrouped per survivor: survivor i < extra owns blocks 2i and 2i+1, survivor
    i >= extra owns block i + extra. Cached: every simulated rank asks for the same one."""
    survivors = blocks.parts - extra
    firsts = [2 * i if i < extra else i + extra for i in range(survivors)] + [blocks.parts]
    return Blocks(tuple(blocks.offsets[first] for first in firsts))


def halving_fold(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
                 step0: int = 0) -> AlgorithmGen:
    """Reduce-scatter at any p: fold to a power of two, recursive halving, unfold one block."""
    survivors = Survivors(team)
    levels = survivors.count.bit_length() - 1
    yield from fold(team, buf, step0)
    if survivors.index >= 0:
        yield from recursive_halving(survivors.as_team(), buf,
                                     _survivor_blocks(blocks, survivors.extra), ctx, step0 + 1)
    # The folded (even) rank v receives block v from v+1, which sends that same block.
    v = team.index
    yield from unfold(team, blocks.view(buf, v - v % 2), step0 + 1 + levels)


def pairwise(team: Team, buf: np.ndarray, blocks: Blocks, ctx: Context,
             step0: int = 0) -> AlgorithmGen:
    """Reduce-scatter by sending every block straight to its owner, one distance per round."""
    p, v = team.size, team.index
    mine = blocks.view(buf, v)
    for s in range(1, p):
        yield (Send(team.peer(v + s), blocks.view(buf, (v + s) % p), step0 + s - 1),
               Recv(team.peer(v - s), mine, step0 + s - 1, reduce=True))


def ring_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """p-1 rounds, (p-1)·count elements per rank."""
    return Cost(p - 1, (p - 1) * count)


def recursive_halving_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """log2(p) rounds, (p-1)·count elements per rank."""
    return Cost(p.bit_length() - 1, (p - 1) * count)


def halving_fold_cost(p: int, count: int, ranks_per_node: int, itemsize: int) -> Cost:
    """log2(p') (+2 with the fold) rounds; a folded rank sends p·count, others (p-1)·count."""
    folded = fold_rounds(p) > 0
    return Cost(p.bit_length() - 1 + fold_rounds(p), (p if folded else p - 1) * count)


ALGORITHMS = (
    Algorithm("reducescatter", "ring", ring, ring_cost),
    Algorithm("reducescatter", "recursive_halving", recursive_halving, recursive_halving_cost,
              power_of_two_only=True),
    Algorithm("reducescatter", "halving_fold", halving_fold, halving_fold_cost),
    Algorithm("reducescatter", "pairwise", pairwise, ring_cost),
)
