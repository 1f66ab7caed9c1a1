"""Which flat (single-level) algorithm suits a call, by collective, message size and number
of ranks: names only, so that every layer above the catalog can ask.

The rules, and why:
- small messages are latency-bound: log-round algorithms (recursive doubling, Bruck, binomial);
  but where a machine runs more ranks than it has cores, every message costs a process wake-up
  on a shared core, and allreduce goes by binomial reduce + broadcast (2(p-1) messages instead
  of p·log2 p): measured on 2 cores at 8 B, 1.13× faster than recursive doubling at 8 ranks,
  1.2× at 16, 1.45× at 64, and even (within 3%) at 4, where recursive doubling is kept;
  between the nodes of a hierarchical allreduce (one rank per node, each message on a stream)
  fewer messages pay from 4 ranks (``OVERSUBSCRIBED_BETWEEN_NODES_TREE_MIN_RANKS``);
- large messages are bandwidth-bound: ring on few ranks (one neighbour, 2(p-1)/p·n bytes),
  Rabenseifner / recursive halving+doubling on many ranks (same bytes, log rounds instead of
  2(p-1): a ring over hundreds of ranks pays hundreds of latencies); a large broadcast on many
  ranks goes binomially unless the message is so large that the root's extra bytes cost more
  than a ring's rounds (``BROADCAST_ROUND_BYTES``); between nodes (one rank per node, or the
  leaders of the hierarchical broadcast) a broadcast of 1 MiB or more over 3 to 16 ranks goes
  chunk by chunk down a chain (``LINK_PIPELINE_MIN_BYTES``): each link carries the buffer once;
- on one node, a large scatter goes in one round from the root (linear): its receivers copy
  their blocks side by side rather than down a tree; an alltoall or allgather of blocks up
  to 128 KiB there goes in one round too, every pair's message at once;
- algorithms that need a power of two are only picked when p is one.

The choice between these and the hierarchical variants (several nodes) is the selector's
(``selector.select``).
"""

from __future__ import annotations

from .reduce import log_rounds

SMALL_MESSAGE_BYTES = 16 * 1024
"""Below this many bytes per rank, latency dominates and log-round algorithms win."""

RING_MAX_RANKS = 16
"""Above this many ranks, ring algorithms pay too many latencies; log-round ones are used."""

OVERSUBSCRIBED_TREE_MIN_RANKS = 4
"""On an oversubscribed node, small allreduces above this many ranks go by reduce+broadcast."""

OVERSUBSCRIBED_BETWEEN_NODES_TREE_MIN_RANKS = 3
"""Between nodes (the leaders of a hierarchical allreduce) where machines are oversubscribed,
small allreduces above this many ranks go by reduce+broadcast: a message there costs a stream's
send and receive besides the wake-up. Measured at 4 leaders (4 nodes x 2 ranks on 2 cores,
8 B, p50 beside torch): 1.67-1.94 ms against recursive doubling's 1.95-2.27 ms (three runs
each); 0.95-1.02 ms against 0.97-1.13 ms (four runs each, alternated, another
host). At 3 leaders both send 4 messages, and recursive doubling is kept."""

BROADCAST_ROUND_BYTES = 512 * 1024
"""What one round of a broadcast is worth in bytes copied: the scale model's latency per round
over its cost per byte (128 µs / 0.25 ns, ``benchmarks/results/scale.json``). Past
``RING_MAX_RANKS`` a large broadcast goes binomially (log2 p rounds, about (log2 p - 2)·n more
bytes from the root) unless those extra bytes cost more than the p - 1 extra rounds of
scatter+allgather's ring: measured at 1 MiB on 2 cores, scatter+allgather took 0.44 s at 64
ranks and 4.2 s at 128, a cost that grows with p²."""

LINK_PIPELINE_MIN_BYTES = 1 << 20
"""From this size, a broadcast between nodes over 3 ranks or more (up to ``RING_MAX_RANKS``)
goes down a chain in chunks (``broadcast.link_pipeline``): every node's link carries the
buffer once each way, where scatter+allgather has the root's link carry 2 (p-1)/p of it
and binomial log2 p times it. Measured on the network bed (4 nodes x 2 ranks, 1 Gbit/s links,
2 cores, ``benchmarks.netbed_profile``), 256 MiB from rank 0: the leaders' scatter+allgather
sent 1.50 of the buffer from the root's node and took 1.75x the link's time; see
``docs/netbed.md`` for the chain's figures. Past a ring's size the chain's p - 2 extra rounds
are kept out."""

LINEAR_BROADCAST_MAX_RANKS = 8
"""Up to this many ranks on one node, a broadcast that is not small goes from the root in one
round (``broadcast.linear``): every receiver copies the buffer once, side by side. Measured
on 2 cores against MPICH in the same run (ray / MPICH p50, medians of four runs at 4 ranks,
two at 8, receivers then reading 256 KiB or more out of the root's memory): at 4
ranks, 256 KiB 0.99 against scatter+allgather's 1.13 and binomial's 1.15, 1 MiB 0.91 (1.22,
0.83), 4 MiB 0.74 (0.99, 0.77), 16 MiB 0.46 (0.61, 0.53); at 8 ranks, 1 MiB 0.58 (0.81,
0.63), 16 MiB 0.64 (0.62, 0.60). Through the rings (``engine.native_runner.REMOTE_MIN_BYTES``), 1 MiB
at 4 ranks 0.31-0.40 in six runs. Not measured beyond 8 ranks, where scatter+allgather
stays."""

LINEAR_EXCHANGE_MAX_RANKS = 8
LINEAR_EXCHANGE_MAX_BLOCK_BYTES = 128 * 1024
"""Up to this many ranks on one node and blocks of up to this size, an alltoall or an allgather
(of blocks not small) posts all its messages in one round (``alltoall.linear``,
``allgather.linear``) instead of one peer per round (pairwise, the ring): no rank waits for a
slow peer before serving the next. Measured on 2 cores with the native core, ray p50, two
alternated pairs of runs, at 8 ranks: alltoall against pairwise (medians of
four runs) 256 KiB 213 against 280 us, 1 MiB (blocks of 128 KiB) 705 against 853, but 4 MiB
(blocks of 512 KiB) 2.74 against 2.37 ms, where every pair's parts in flight at once crowd
the cache; allgather against the ring, 256 KiB 175 and 202 against 231 and 329 us, 1 MiB 554
and 682 against 703 and 782, 4 MiB 2.59 and 2.87 against 1.99 and 2.38 ms. At 4 ranks both
level. Not measured beyond 8 ranks, where pairwise and the ring stay."""

SMALL_BLOCK_BYTES = 1024
"""Alltoall blocks below this size go through Bruck's log-round packing."""


def is_power_of_two(p: int) -> bool:
    """Whether ``p`` is a power of two."""
    return p & (p - 1) == 0


def flat_algorithm_name(collective: str, nbytes: int, world_size: int,
                        oversubscribed: bool = False, between_nodes: bool = False,
                        one_node: bool = False) -> str:
    """The name of the flat algorithm for ``nbytes`` per rank on ``world_size`` ranks.

    Args:
        collective: the collective's name.
        nbytes: bytes of one rank's tensor (one block for the list collectives).
        world_size: ranks taking part.
        oversubscribed: some machine runs more ranks than it has cores.
        between_nodes: the ranks are on different nodes, one per node (a composite
            algorithm's phase between nodes).
        one_node: all the ranks are on one node.

    Returns:
        An algorithm name of the catalog.
    """
    p = world_size
    small = nbytes < SMALL_MESSAGE_BYTES
    exchange_in_one_round = (one_node and p <= LINEAR_EXCHANGE_MAX_RANKS
                             and nbytes <= LINEAR_EXCHANGE_MAX_BLOCK_BYTES)
    if collective == "allreduce":
        if small:
            tree_above = (OVERSUBSCRIBED_BETWEEN_NODES_TREE_MIN_RANKS if between_nodes
                          else OVERSUBSCRIBED_TREE_MIN_RANKS)
            return ("reduce_broadcast" if oversubscribed and p > tree_above
                    else "recursive_doubling")
        return "ring" if p <= RING_MAX_RANKS else "rabenseifner"
    if collective == "broadcast":
        if between_nodes and 3 <= p <= RING_MAX_RANKS and nbytes >= LINK_PIPELINE_MIN_BYTES:
            return "link_pipeline"
        if small or p < 3:
            return "binomial"
        if one_node and p <= LINEAR_BROADCAST_MAX_RANKS:
            return "linear"
        if p > RING_MAX_RANKS and \
                nbytes * (log_rounds(p) - 2) < (p - 1) * BROADCAST_ROUND_BYTES:
            return "binomial"
        return "scatter_allgather"
    if collective == "allgather":
        if not small and exchange_in_one_round:
            return "linear"
        if not small and p <= RING_MAX_RANKS:
            return "ring"
        return "recursive_doubling" if is_power_of_two(p) else "bruck"
    if collective == "reducescatter":
        if one_node and not small and p <= RING_MAX_RANKS:
            # Every block is reduced at its owner straight from the inputs, so a receiver can
            # read each one where it lies (no partial sums to forward through a buffer):
            # on the native core, 4 ranks, 16 MiB, 8.0 ms against the ring's 12.2 (MPICH 8.5).
            return "pairwise"
        # Small blocks halve even on a crowded node: pairwise, tried there for 4 ranks on 2
        # cores, did not beat halving beyond the machine's noise, so the simpler rule stays.
        if is_power_of_two(p):
            return "recursive_halving" if small or p > RING_MAX_RANKS else "ring"
        return "ring" if not small and p <= RING_MAX_RANKS else "halving_fold"
    if collective == "scatter":
        # Each receiver takes its block from the root side by side instead of down a tree:
        # on the native core, 4 ranks, 16 MiB, 1.95-2.32 ms against binomial's 4.10-4.31
        # (MPICH 3.1-3.3 ms); 1 MiB 278-334 us against 428-488.
        return "linear" if one_node and not small and p <= RING_MAX_RANKS else "binomial"
    if collective == "gather":
        # Each sender's block goes to the root in one round instead of up a tree: on the
        # native core against MPICH in the same run (ray / MPICH p50), 4 ranks
        # (medians of four runs) 1 MiB 0.66 against binomial's 0.84, 16 MiB 0.27 against
        # 0.66; 8 ranks (two runs) 1 MiB 0.67 against 0.97, 16 MiB 0.17 against 0.30.
        return "linear" if one_node and not small and p <= RING_MAX_RANKS else "binomial"
    if collective == "alltoall":
        if nbytes < SMALL_BLOCK_BYTES and p > 8:
            return "bruck"
        return "linear" if exchange_in_one_round else "pairwise"
    if collective == "barrier":
        return "dissemination"
    return "binomial"
