"""Ranks across nodes: which node each rank runs on, and a Ray cluster of several nodes.

``python -m benchmarks --nodes K`` either starts a ``ray.cluster_utils.Cluster`` of K nodes on
this machine (``start_local_cluster``: every node a raylet and object store of its own, so
ranks on different nodes talk through the library's cross-node transport exactly as on real
machines, only over loopback) or uses the running cluster of ``--ray-address``. Ranks are
pinned to nodes evenly and in blocks, rank r on node ``r // ranks_per_node``
(``rank_nodes``), each by a hard node-affinity scheduling strategy on the node's id
(``pick_nodes``, ``pinned``), so that rank 0 — which serves the ``torch`` peer's rendezvous store — runs on
the driver's node.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

NODE_RESOURCE_PREFIX = "node"
"""A local cluster's node k carries the custom resource ``node<k>``; it tells the nodes'
order (the head first), nothing is scheduled by it."""

CLUSTER_OBJECT_STORE_BYTES = 512 * 2**20
"""Object store of each node of a local cluster: room for a few 64 MiB messages in flight
per node (Ray spills beyond it) without reserving gigabytes of shared memory per node on a
machine whose memory the ranks share."""

HEAD_CPUS = 1
"""CPUs the head node of a local cluster advertises; rank actors and helpers take none, and
worker nodes advertise none, so that Ray prestarts no idle workers there."""


def rank_nodes(world_size: int, nodes: int) -> Tuple[int, ...]:
    """The node index of every rank: ranks spread evenly, in blocks (rank r on node
    ``r // (world_size // nodes)``).

    Args:
        world_size: number of ranks.
        nodes: number of nodes.

    Returns:
        Node index per rank, in rank order.

    Raises:
        ValueError: ``nodes`` below 1, or ``world_size`` not a positive multiple of it.
    """
    if nodes < 1 or world_size < nodes or world_size % nodes:
        raise ValueError(f"{world_size} ranks cannot be spread evenly over {nodes} nodes: "
                         f"give a world size that is a positive multiple of the node count")
    ranks_per_node = world_size // nodes
    return tuple(rank // ranks_per_node for rank in range(world_size))


def start_local_cluster(nodes: int) -> Any:
    """A ``ray.cluster_utils.Cluster`` of ``nodes`` nodes on this machine, all up.

    Node k carries the resource ``node<k>``; the head (node 0) is where the driver connects.

    Args:
        nodes: number of nodes, >= 1.

    Returns:
        The cluster (``shutdown()`` it at the end).
    """
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": HEAD_CPUS, "resources": {f"{NODE_RESOURCE_PREFIX}0": 1},
        "object_store_memory": CLUSTER_OBJECT_STORE_BYTES, "include_dashboard": False})
    for k in range(1, nodes):
        cluster.add_node(num_cpus=0, resources={f"{NODE_RESOURCE_PREFIX}{k}": 1},
                         object_store_memory=CLUSTER_OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    return cluster


@contextlib.contextmanager
def local_cluster_driver(nodes: int) -> Iterator[Any]:
    """A local cluster of ``nodes`` nodes (``start_local_cluster``) with this process connected
    to it as its driver; both shut down on leaving.

    Yields:
        The cluster.
    """
    import ray
    cluster = start_local_cluster(nodes)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def order_nodes(alive: Sequence[dict], driver_node_id: str, nodes: int) -> List[str]:
    """The ids of the ``nodes`` nodes ranks run on, in node-index order.

    A local cluster's nodes (each with its ``node<k>`` resource) in k's order; any other
    cluster's nodes the driver's first, then the rest by address and id, so that the choice
    is the same every run.

    Args:
        alive: ``ray.nodes()``'s entries of the live nodes.
        driver_node_id: the driver's node (hex).
        nodes: how many are needed.

    Returns:
        Node ids (hex), ``nodes`` of them.

    Raises:
        RuntimeError: the cluster has fewer live nodes than ``nodes``.
    """
    if len(alive) < nodes:
        raise RuntimeError(f"the benchmark needs {nodes} nodes but the Ray cluster has "
                           f"{len(alive)} alive: add nodes or ask for fewer with --nodes")
    by_resource = {name: node["NodeID"] for node in alive for name in node["Resources"]
                   if name.startswith(NODE_RESOURCE_PREFIX)}
    marked = [by_resource.get(f"{NODE_RESOURCE_PREFIX}{k}") for k in range(nodes)]
    if None not in marked and marked[0] == driver_node_id:
        return marked
    rest = sorted((node for node in alive if node["NodeID"] != driver_node_id),
                  key=lambda node: (node["NodeManagerAddress"], node["NodeID"]))
    return [driver_node_id] + [node["NodeID"] for node in rest][:nodes - 1]


def pick_nodes(nodes: int) -> List[str]:
    """The ids of the nodes ranks run on, node 0 the driver's (see ``order_nodes``).

    Args:
        nodes: how many.

    Returns:
        Node ids (hex).

    Raises:
        RuntimeError: too few live nodes.
    """
    import ray
    alive = [node for node in ray.nodes() if node["Alive"]]
    return order_nodes(alive, ray.get_runtime_context().get_node_id(), nodes)


def pinned(node_id: Optional[str]) -> dict:
    """Actor options that place an actor on ``node_id`` and nowhere else (none for None).

    Args:
        node_id: a node id (hex), or None for wherever Ray likes.

    Returns:
        Keyword arguments for ``.options()``.
    """
    if node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
