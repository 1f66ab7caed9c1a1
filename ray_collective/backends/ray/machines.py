"""Whether the machines of a group run more of its ranks than they have cores.

The answer decides how ranks wait (spin only with a core of one's own) and which algorithms the
selector prefers (fewer messages on a crowded machine). It comes from the shared membership, so
every rank reaches the same one.
"""

from __future__ import annotations

from typing import Dict, Sequence

from .rendezvous import Member


def ranks_per_core(members: Sequence[Member]) -> Dict[str, float]:
    """For every node, the ranks of the group its machine runs per core it has (a machine is
    the Ray nodes at one address, as in :func:`ranks_over_cores`; the same answer on every
    rank)."""
    machine_of = {member.node: member.host or member.node for member in members}
    ranks: Dict[str, int] = {}
    cores: Dict[str, int] = {}
    for member in members:
        machine = machine_of[member.node]
        ranks[machine] = ranks.get(machine, 0) + 1
        cores[machine] = max(cores.get(machine, 0), member.cores)
    return {node: ranks[machine] / max(cores[machine], 1)
            for node, machine in machine_of.items()}


def ranks_over_cores(members: Sequence[Member]) -> Dict[str, bool]:
    """For every node, whether its machine runs more ranks of the group than it has cores (the
    same answer on every rank, since it comes from the shared membership).

    A machine is the Ray nodes at one address: the nodes of a ``ray.cluster_utils.Cluster``
    share the cores of the host they all run on, and counting each node's ranks alone would
    let ranks spin on cores their peers on the other nodes need (4 nodes x 2 ranks on 2
    cores: allreduce 8 B 1.5 ms counted by address, 1.9-2.0 ms by node).
    """
    return {node: per_core > 1 for node, per_core in ranks_per_core(members).items()}


def oversubscribed(members: Sequence[Member]) -> bool:
    """Whether some machine runs more ranks of the group than it has cores."""
    return any(ranks_over_cores(members).values())
