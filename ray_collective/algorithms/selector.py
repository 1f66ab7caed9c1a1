"""Picks the algorithm of a call from the collective, the message size, the number of ranks and
the rank→node map; or takes the one forced by the caller.

The rules, and why:
- several nodes (and some node with several ranks): the hierarchical variants of allreduce,
  broadcast and reduce, so that only one rank per node crosses nodes;
- small messages are latency-bound: log-round algorithms (recursive doubling, Bruck, binomial);
  but where a node runs more ranks than it has cores, every message costs a process wake-up
  on a shared core, and allreduce goes by binomial reduce + broadcast (2(p-1) messages instead
  of p·log2 p): measured on 2 cores at 8 B, 1.13× faster than recursive doubling at 8 ranks,
  1.2× at 16, 1.45× at 64, and even (within 3%) at 4, where recursive doubling is kept;
- large messages are bandwidth-bound: ring on few ranks (one neighbour, 2(p-1)/p·n bytes),
  Rabenseifner / recursive halving+doubling on many ranks (same bytes, log rounds instead of
  2(p-1): a ring over hundreds of ranks pays hundreds of latencies);
- algorithms that need a power of two are only picked when p is one.

Forcing, for tests and benchmarks: ``CallOptions.algorithm``, or the environment variable
``RAY_COLLECTIVE_ALGORITHM`` as ``collective=name[,collective=name...]`` (for example
``allreduce=ring,broadcast=binomial``), read by :func:`forced_algorithms` once per group. Every
rank must force the same algorithm; a rank that runs another one is reported as a mismatch.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from .catalog import lookup
from .core import Algorithm, Topology

ENVIRONMENT_VARIABLE = "RAY_COLLECTIVE_ALGORITHM"

SMALL_MESSAGE_BYTES = 16 * 1024
"""Below this many bytes per rank, latency dominates and log-round algorithms win."""

RING_MAX_RANKS = 16
"""Above this many ranks, ring algorithms pay too many latencies; log-round ones are used."""

OVERSUBSCRIBED_TREE_MIN_RANKS = 4
"""On an oversubscribed node, small allreduces above this many ranks go by reduce+broadcast."""

SMALL_BLOCK_BYTES = 1024
"""Alltoall blocks below this size go through Bruck's log-round packing."""


def forced_algorithms() -> Mapping[str, str]:
    """The algorithm ``RAY_COLLECTIVE_ALGORITHM`` forces, by collective (empty when unset).

    Raises:
        ValueError: the variable is malformed.
    """
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    forced = {}
    if not value:
        return MappingProxyType(forced)
    for item in value.split(","):
        name, sep, algorithm = item.partition("=")
        if not sep or not name.strip() or not algorithm.strip():
            raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r} is malformed: expected "
                             f"'collective=algorithm[,collective=algorithm...]'")
        forced[name.strip()] = algorithm.strip()
    return MappingProxyType(forced)


def _is_power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


def _flat(collective: str, nbytes: int, world_size: int, oversubscribed: bool = False) -> str:
    p = world_size
    small = nbytes < SMALL_MESSAGE_BYTES
    if collective == "allreduce":
        if small:
            return ("reduce_broadcast" if oversubscribed and p > OVERSUBSCRIBED_TREE_MIN_RANKS
                    else "recursive_doubling")
        return "ring" if p <= RING_MAX_RANKS else "rabenseifner"
    if collective == "broadcast":
        return "binomial" if small or p < 3 else "scatter_allgather"
    if collective == "allgather":
        if not small and p <= RING_MAX_RANKS:
            return "ring"
        return "recursive_doubling" if _is_power_of_two(p) else "bruck"
    if collective == "reducescatter":
        if _is_power_of_two(p):
            return "recursive_halving" if small or p > RING_MAX_RANKS else "ring"
        return "ring" if not small and p <= RING_MAX_RANKS else "halving_fold"
    if collective == "alltoall":
        return "bruck" if nbytes < SMALL_BLOCK_BYTES and p > 8 else "pairwise"
    if collective == "barrier":
        return "dissemination"
    return "binomial"


def select(collective: str, count: int, itemsize: int, world_size: int,
           node_of: Optional[Sequence] = None, forced: Optional[str] = None,
           oversubscribed: bool = False, topology: Optional[Topology] = None) -> Algorithm:
    """The algorithm to run.

    Args:
        collective: the collective's name.
        count: elements of one rank's tensor (one block for the list collectives).
        itemsize: bytes per element.
        world_size: ranks in the group.
        node_of: node id of every rank, or None for one node.
        forced: an algorithm name that overrides the rules (see :func:`forced_algorithms`).
        oversubscribed: some node runs more ranks than it has cores.
        topology: ``node_of`` grouped by node, when the caller has it already.

    Returns:
        The chosen :class:`Algorithm`.

    Raises:
        ValueError: the forced algorithm does not exist or cannot run on ``world_size`` ranks.
    """
    name = forced
    if name is None:
        if topology is None and node_of:
            topology = Topology.from_node_of(node_of)
        if (topology is not None and topology.is_multi_node
                and collective in ("allreduce", "broadcast", "reduce")):
            name = "hierarchical"
        else:
            name = _flat(collective, count * itemsize, world_size, oversubscribed)
    algorithm = lookup(collective, name)
    if algorithm.power_of_two_only and not _is_power_of_two(world_size):
        raise ValueError(f"{collective} algorithm {name!r} needs a power-of-two number of ranks, "
                         f"not {world_size}; choose another with {ENVIRONMENT_VARIABLE}")
    if name == "hierarchical" and not node_of:
        raise ValueError(f"{collective} algorithm 'hierarchical' needs the group's rank-to-node map")
    return algorithm


def chooser(itemsize: int):
    """The ``Context.choose`` callback: the flat algorithm for a sub-team (no forcing applies)."""
    def choose(collective: str, team_size: int, count: int) -> Algorithm:
        return lookup(collective, _flat(collective, count * itemsize, team_size))
    return choose
