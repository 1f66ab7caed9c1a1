"""``status`` over a 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a group
of 4, ranks 0-1 on the head and 2-3 on the other node, where rank 3 never calls. Records what
``python -m ray_collective status --json`` answers from the driver's machine, and what the
pages say when read through each node's post office (the route taken for a node on another
machine); prints one ``SUMMARY {json}`` line (tests/test_status_nodes.py asserts on it)."""

import json

import ray
from ray.cluster_utils import Cluster

import ray_collective as col
from ray_collective.backends.ray import status
from support.observing import allreduce_once, status_json, wait_until_in_call
from support.paths import python_path

GROUP = "hung-across-nodes"
RANKS_PER_NODE = 2


@ray.remote(num_cpus=0)
class Member:
    def node(self):
        return ray.get_runtime_context().get_node_id()


def main():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node0": 4}, "include_dashboard": False,
        "object_store_memory": 100 << 20})
    cluster.add_node(num_cpus=0, resources={"node1": 4}, object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": python_path()}})
    try:
        actors = [Member.options(resources={f"node{rank // RANKS_PER_NODE}": 1}).remote()
                  for rank in range(2 * RANKS_PER_NODE)]
        nodes = ray.get([actor.node.remote() for actor in actors])
        col.declare_collective_group(actors, group_name=GROUP)
        hung = [actor.__ray_call__.remote(lambda _self, r=rank: allreduce_once(r, GROUP))
                for rank, actor in enumerate(actors[:3])]
        wait_until_in_call(cluster.address, GROUP, [0, 1, 2])
        answer, wall = status_json(cluster.address, GROUP)
        (group,) = [g for g in status._groups(
            status.KeyValue(status._ControlStore(status._control_store_client(cluster.address))),
            {ray.get_runtime_context().get_job_id()}, GROUP)]
        through_post_offices = status._remote_pages(
            cluster.address, [(group, node) for node in sorted(set(nodes))], {})
        last = actors[3].__ray_call__.remote(lambda _self: allreduce_once(3, GROUP))
        results = ray.get(hung + [last], timeout=120)
        col.destroy_collective_group(GROUP)
        summary = {
            "nodes": nodes, "answer": answer, "wall_s": wall,
            "post_office_pages": {node: [list(rank) for rank in page.ranks]
                                  for (_, node), page in through_post_offices.items()},
            "results": [list(map(float, r)) for r in results]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
