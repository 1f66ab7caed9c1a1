"""A ``ray`` group across a three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``),
observed from the driver and from inside the members; prints one ``SUMMARY {json}`` line.

Run by tests/test_multinode.py in its own process: a Cluster cannot share the test session's Ray.

Layout: the head (num_cpus=1) and two worker nodes, each with a custom resource ``node<k>``;
two members per node pinned by that resource, rank r on node r // 2. What it records:

- the members' real nodes, the rank→node map each member's backend holds, and what the
  selector picks for that map;
- which ranks sent anything to another node, after a phase of only the collectives that have a
  hierarchical variant: the relay reaches a node's post office lazily, on a rank's first send
  there, so a rank that never sent across nodes holds no post-office handle;
- every collective (and send/recv, barrier) on small and large (> 64 KiB) tensors, checked
  against numpy; failures are recorded as text;
- the post-office actors while the group lives (one per node, checked by asking each where it
  runs), and the named actors and internal-KV keys left after the driver destroys the group;
- the same for an imperative group (init_collective_group inside each member);
- what every rank raises, and how soon, when node 1's post office is killed mid-allreduce.
"""

import json
import os
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

import ray_collective as col
from ray_collective.algorithms.selector import select
from ray_collective.backends.ray_backend import POST_OFFICE_LOOKUP_S
from conftest import Member, numpy_reduce, rank_data, run_in
from contract import check_every_collective, every_collective
from test_ray_backend import _group_keys, join, leave

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
NODES = 3
RANKS_PER_NODE = 2
WORLD_SIZE = NODES * RANKS_PER_NODE
SMALL, LARGE = 7, 100_000
"""Element counts: 7 float64 ride inline; 100_000 float64 (800 KB) go by reference."""
OBJECT_STORE_BYTES = 200 * 2**20
NAMESPACE = "ray_collective"
POST_OFFICE_PREFIX = "post-office-"
EVERY_COLLECTIVE_CASES = [("int64", "SUM", SMALL), ("float64", "SUM", LARGE),
                          ("float32", "MAX", 30_000), ("int32", "PRODUCT", 1)]
HIERARCHICAL_COLLECTIVES = ("allreduce", "broadcast", "reduce")


def start_cluster() -> Cluster:
    # Members and post offices need no CPU; num_cpus=0 on the worker nodes also keeps Ray from
    # prestarting idle workers there (two cores for three nodes).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node0": 4}, "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False})
    for k in range(1, NODES):
        cluster.add_node(num_cpus=0, resources={f"node{k}": 4},
                         object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    path = os.pathsep.join([TESTS_DIR, REPO_DIR, os.environ.get("PYTHONPATH", "")])
    ray.init(address=cluster.address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    return cluster


def node_ids() -> list:
    """The node id holding resource ``node<k>``, for k = 0..NODES-1."""
    by_resource = {name: node["NodeID"] for node in ray.nodes() if node["Alive"]
                   for name in node["Resources"]}
    return [by_resource[f"node{k}"] for k in range(NODES)]


def start_members_on_nodes() -> list:
    """Rank r's member actor, pinned to node r // RANKS_PER_NODE."""
    members = [ray.remote(num_cpus=0, resources={f"node{r // RANKS_PER_NODE}": 1})(Member)
               .remote() for r in range(WORLD_SIZE)]
    ray.get([m.pid.remote() for m in members])
    return members


def hierarchical_phase(rank: int, group: str, root: int) -> dict:
    """Inside a member: allreduce, broadcast and reduce (root ``root``) on small and large
    tensors, then what this member's backend shows: its type, its rank→node map, and the nodes
    this rank has sent to."""
    from ray_collective.group import current_registry
    outputs = {}
    for length in (SMALL, LARGE):
        tensor = rank_data(rank, length, "float64")
        col.allreduce(tensor, group)
        outputs[f"allreduce-{length}"] = tensor
        tensor = rank_data(rank, length, "float64")
        col.broadcast(tensor, root, group)
        outputs[f"broadcast-{length}"] = tensor
        tensor = rank_data(rank, length, "float64")
        col.reduce(tensor, root, group)
        outputs[f"reduce-{length}"] = tensor
    backend = current_registry().get(group).backend
    relay = backend.transport.relay
    return {"outputs": outputs, "membership": type(backend).__name__,
            "node": ray.get_runtime_context().get_node_id(),
            "node_of": None if backend.node_of is None else list(backend.node_of),
            "sent_to_nodes": sorted(relay._handles) if relay is not None else []}


def check_hierarchical_phase(results: list, root: int) -> list:
    """Failures of the phase's outputs against numpy."""
    failures = []
    for length in (SMALL, LARGE):
        inputs = [rank_data(r, length, "float64") for r in range(WORLD_SIZE)]
        expected = {"allreduce": [numpy_reduce(inputs, col.ReduceOp.SUM)] * WORLD_SIZE,
                    "broadcast": [inputs[root]] * WORLD_SIZE,
                    "reduce": {root: numpy_reduce(inputs, col.ReduceOp.SUM)}}
        for collective, per_rank in expected.items():
            for rank, want in dict(enumerate(per_rank) if isinstance(per_rank, list)
                                   else per_rank).items():
                got = results[rank]["outputs"][f"{collective}-{length}"]
                if not np.array_equal(got, want):
                    failures.append(f"{collective} of {length} on rank {rank}")
    return failures


def observe_hierarchy(results: list, root: int) -> dict:
    node_of = results[0]["node_of"]
    return {
        "rank_nodes": [r["node"] for r in results],
        "node_of": [r["node_of"] for r in results],
        "memberships": sorted({r["membership"] for r in results}),
        "selected": {f"{c}-{n}": select(c, n, 8, WORLD_SIZE, node_of).name
                     for c in HIERARCHICAL_COLLECTIVES for n in (SMALL, LARGE)},
        "ranks_that_crossed_nodes": [r for r, res in enumerate(results) if res["sent_to_nodes"]],
        "root": root,
        "failures": check_hierarchical_phase(results, root),
    }


def every_collective_failures(members: list, group: str) -> list:
    failures = []
    for dtype, op_name, length in EVERY_COLLECTIVE_CASES:
        results = run_in(ray, members, every_collective, group, WORLD_SIZE, dtype, op_name,
                         length, "numpy")
        try:
            check_every_collective(results, WORLD_SIZE, dtype, op_name, length)
        except AssertionError as err:
            failures.append(f"{dtype} {op_name} {length}: {err}")
    return failures


def post_office_names() -> list:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(POST_OFFICE_PREFIX)]


def post_office_nodes() -> list:
    """The node of every live post-office actor, asked of the actor itself."""
    handles = [ray.get_actor(name, namespace=NAMESPACE) for name in post_office_names()]
    return ray.get([h.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
                    for h in handles])


def post_offices_gone_within(seconds: float) -> float:
    """Seconds until no post-office name is registered (ray.kill is asynchronous), or -1."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not post_office_names():
            return time.monotonic() - start
        time.sleep(0.05)
    return -1.0


def declared_group(members: list) -> dict:
    group = "multinode-declared"
    col.declare_collective_group(members, backend="ray", group_name=group)
    root = WORLD_SIZE - 1
    summary = observe_hierarchy(run_in(ray, members, hierarchical_phase, group, root), root)
    summary["failures"] += every_collective_failures(members, group)
    summary["post_office_nodes"] = post_office_nodes()
    col.destroy_collective_group(group)
    summary["post_offices_gone_after_s"] = post_offices_gone_within(10.0)
    summary["keys_left"] = [k.decode() for k in _group_keys(ray, group)]
    return summary


def imperative_group(members: list) -> dict:
    group = "multinode-imperative"
    joined = run_in(ray, members, join, group, WORLD_SIZE)
    root = 0
    summary = observe_hierarchy(run_in(ray, members, hierarchical_phase, group, root), root)
    summary["joined"] = joined
    summary["post_office_nodes"] = post_office_nodes()
    summary["still_initialized_after_leave"] = run_in(ray, members, leave, group)
    summary["post_offices_gone_after_s"] = post_offices_gone_within(10.0)
    summary["keys_left"] = [k.decode() for k in _group_keys(ray, group)]
    return summary


def _loop_until_error(rank: int, group: str) -> tuple:
    """Allreduce back to back until a call fails: (error class, message, wall clock)."""
    tensor = np.ones(SMALL, np.float64)
    while True:
        try:
            col.allreduce(tensor, group, timeout=60.0)
            tensor[:] = 1
        except col.CollectiveError as err:
            return type(err).__name__, str(err), time.time()


def post_office_killed(members: list) -> dict:
    """Kill node 1's post office while every rank loops on allreduce: what each rank raises,
    how long after the kill, and what is left once the driver destroys the group."""
    group = "multinode-post-office-killed"
    col.declare_collective_group(members, backend="ray", group_name=group)
    formed = time.monotonic()
    refs = [m.__ray_call__.remote(lambda _self, r=r: _loop_until_error(r, group))
            for r, m in enumerate(members)]
    # Past the moments after joining when a post office's name may not be registered yet
    # (RayRelay: POST_OFFICE_LOOKUP_S), so that a missing name means a dead post office.
    time.sleep(max(1.0, POST_OFFICE_LOOKUP_S - (time.monotonic() - formed)))
    node = node_ids()[1]
    victim = next(name for name in post_office_names() if name.endswith(node[:16]))
    killed_at = time.time()
    ray.kill(ray.get_actor(victim, namespace=NAMESPACE))
    outcomes = ray.get(refs, timeout=120)
    col.destroy_collective_group(group)
    return {"node": node, "errors": [kind for kind, _, _ in outcomes],
            "messages": [message for _, message, _ in outcomes],
            "seconds_after_kill": [at - killed_at for _, _, at in outcomes],
            "post_offices_gone_after_s": post_offices_gone_within(10.0),
            "keys_left": [k.decode() for k in _group_keys(ray, group)]}


def main() -> dict:
    started = time.monotonic()
    cluster = start_cluster()
    try:
        summary = {"nodes": node_ids(), "cluster_start_s": time.monotonic() - started}
        members = start_members_on_nodes()
        for name, scenario in (("declared", declared_group), ("imperative", imperative_group),
                               ("post_office_killed", post_office_killed)):
            begun = time.monotonic()
            summary[name] = scenario(members)
            summary[name]["seconds"] = time.monotonic() - begun
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary["total_s"] = time.monotonic() - started
    return summary


if __name__ == "__main__":
    print("SUMMARY " + json.dumps(main()))
    sys.stdout.flush()
