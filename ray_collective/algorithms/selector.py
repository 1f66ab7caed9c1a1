"""Picks the algorithm of a call from the collective, the message size, the number of ranks and
the rank→node map; or takes the one forced by the caller.

The rule of its own: a group spanning several nodes (some node holding several ranks) takes the
hierarchical allreduce, broadcast and reduce, so that only one rank per node crosses nodes;
except that an allreduce of at least ``SHARDED_ALLREDUCE_MIN_BYTES`` on nodes of equal size
takes the sharded variant, in which every rank crosses nodes with its own shard, and a
broadcast of at least ``PIPELINE_BROADCAST_MIN_BYTES`` over 3 nodes or more and at most
``PIPELINE_BROADCAST_MAX_RANKS`` ranks goes chunk by chunk down a chain of the nodes, unless
the group runs its rounds within a node on the native core. Every other call takes the flat
algorithm of ``rules``.

Forcing, for tests and benchmarks: the environment variable ``RAY_COLLECTIVE_ALGORITHM`` as ``collective=name[,collective=name...]`` (for example
``allreduce=ring,broadcast=binomial``), read by :func:`forced_algorithms` once per group. Every
rank must force the same algorithm; a rank that runs another one is reported as a mismatch.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from .catalog import lookup
from .core import Algorithm, Topology
from .rules import RING_MAX_RANKS, flat_algorithm_name, is_power_of_two

ENVIRONMENT_VARIABLE = "RAY_COLLECTIVE_ALGORITHM"

SHARDED_ALLREDUCE_MIN_BYTES = 16 << 20
"""From this size, an allreduce across nodes of equal size goes by shards: measured on a local
4-node cluster (2 cores, 2 ranks a node, against torch's Gloo in the same run), 0.80× Gloo's
time at 16 MiB and 0.79× at 64 MiB against the leaders' 0.70× and 0.77×, and level on 2 nodes;
at 1 MiB the leaders' version was faster (1.9 against 3.1 ms on 2 nodes). On a machine with a
core per rank the shards' streams also run side by side, which the measurement could not show."""

PIPELINE_BROADCAST_MIN_BYTES = 1 << 20
PIPELINE_BROADCAST_MAX_RANKS = RING_MAX_RANKS
"""A broadcast across 3 nodes or more goes down the node chain (``hierarchical_pipeline``) from
1 MiB on up to this many ranks: measured on a local 4-node cluster (2 ranks a node, 2 cores),
p50 2.6, 43 and 154 ms at 1, 16 and 64 MiB against the leaders' 6.7, 57 and 178 ms (Gloo in the
same runs 4.3-6.0, 30-35 and 109-110 ms), p95 no worse; on 2 nodes it was level or slower (25
against 19 ms at 16 MiB). A chain costs a round per rank: past a ring's size the leaders' tree
is kept. Where the rounds within a node run on the native core (``select``'s
``nodes_in_core``), the leaders' tree, whose rounds within a node the core runs, won instead:
4 nodes x 2 ranks, two alternated runs each, p50 over torch's in the same run,
0.61-0.74 against the chain's 0.78-0.81 at 1 MiB, 0.92-0.95 against 1.06-1.10 at 16 MiB,
0.94-0.95 against 1.02-1.06 at 64 MiB; 4 nodes x 4 ranks, 0.46-0.50 against 0.69-0.80 at
1 MiB, 0.60-0.61 against 0.88 at 16 MiB. The chain mixes the two ways in its rounds, so it runs
over the streams and the node's sockets as a whole."""

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


def select(collective: str, count: int, itemsize: int, world_size: int,
           node_of: Optional[Sequence] = None, forced: Optional[str] = None,
           oversubscribed: bool = False, topology: Optional[Topology] = None,
           nodes_in_core: bool = False) -> Algorithm:
    """The algorithm to run.

    Args:
        collective: the collective's name.
        count: elements of one rank's tensor (one block for the list collectives).
        itemsize: bytes per element.
        world_size: ranks in the group.
        node_of: node id of every rank, or None for one node.
        forced: an algorithm name that overrides the rules (see :func:`forced_algorithms`).
        oversubscribed: some machine runs more ranks than it has cores.
        topology: ``node_of`` grouped by node, when the caller has it already.
        nodes_in_core: the group runs the rounds within a node of the hierarchical algorithms
            on the native core (the same answer on every rank).

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
            nbytes = count * itemsize
            if (collective == "allreduce" and nbytes >= SHARDED_ALLREDUCE_MIN_BYTES
                    and topology.uniform):
                name = "hierarchical_sharded"
            elif (collective == "broadcast" and nbytes >= PIPELINE_BROADCAST_MIN_BYTES
                  and len(topology.nodes) >= 3 and world_size <= PIPELINE_BROADCAST_MAX_RANKS
                  and not nodes_in_core):
                name = "hierarchical_pipeline"
        else:
            # A group of one rank per node is all between nodes, like the leaders of a
            # hierarchical algorithm.
            one_node = topology is None or len(topology.nodes) == 1
            name = flat_algorithm_name(collective, count * itemsize, world_size, oversubscribed,
                                       between_nodes=not one_node, one_node=one_node)
    algorithm = lookup(collective, name)
    if algorithm.power_of_two_only and not is_power_of_two(world_size):
        raise ValueError(f"{collective} algorithm {name!r} needs a power-of-two number of ranks, "
                         f"not {world_size}; choose another with {ENVIRONMENT_VARIABLE}")
    if algorithm.node_aware and not node_of:
        raise ValueError(f"{collective} algorithm {name!r} needs the group's rank-to-node map")
    return algorithm
