"""A ``ray`` group across a three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``),
observed from the driver and from inside the members; prints one ``SUMMARY {json}`` line.

Run by tests/test_multinode.py in its own process (``python -m support.multinode_cluster``): a
Cluster cannot share the test session's Ray.

Layout: the head (num_cpus=1) and two worker nodes, each with a custom resource ``node<k>``;
two members per node pinned by that resource, rank r on node r // 2. What it records:

- the members' real nodes, the rank→node map each member's backend holds, and what the
  selector picks for that map;
- which ranks talked to another node, after a phase of only the collectives that have a
  hierarchical variant: the peers of every call shape's plan, as the flight recorder has
  them (streams are opened at the join, whether or not a rank's calls use them: for an
  imperative group, the streams each member holds open right after its join, before any
  call, are recorded too);
- every collective (and send/recv, barrier) on small and large (> 64 KiB) tensors, checked
  against numpy; failures are recorded as text;
- the post-office actors while the group lives (one per node, checked by asking each where it
  runs), and the named actors and internal-KV keys left after the driver destroys the group;
- the same for the declared group over the object store (``RAY_COLLECTIVE_CROSS_NODE``) and
  for an imperative group (init_collective_group inside each member) over streams;
- a declared group over the object store on nodes 0 and 1, grown by node 2's members: the
  post-office actors (by name and process) before and after, and every collective over the
  grown group (small and large) checked against numpy; then the same group declared again at
  once over every member (its post offices' names those just stopped), one allreduce checked;
- over streams: a stranger that connects to a rank's stream listener with a wrong key
  (refused, counted, the group unharmed), and the stream sockets each member held, looked
  for among its open files after the destroy;
- what every rank raises, and how soon, when node 1's post office is killed mid-allreduce;
- what every survivor raises, and how soon, when rank 3 is SIGKILLed mid-allreduce, the
  allreduce a ring so that rank 3 has a stream to rank 4 (it costs a member);
- what every survivor raises, the ranks it names, and how soon, when node 2 is removed from
  the cluster mid-allreduce (last: it costs a node); then the driver shrinks the group to the
  ranks on the other nodes, and an allreduce over them is checked against numpy.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

import ray_collective as col
from ray_collective.algorithms.selector import select
from ray_collective.backends.ray.environment import CROSS_NODE_VARIABLE
from ray_collective.backends.ray.post_offices import POST_OFFICE_LOOKUP_S
from ray_collective.backends.key_value import NAMESPACE
from ray_collective.transport import handshake, tcp
from ray_collective.transport.processes import exits_within
from support.helpers import Member, group_keys, join, leave, numpy_reduce, rank_data, run_in
from support.contract import check_every_collective, every_collective
from support.paths import python_path

NODES = 3
RANKS_PER_NODE = 2
WORLD_SIZE = NODES * RANKS_PER_NODE
SMALL, LARGE = 7, 100_000
"""Element counts: 7 float64 ride inline; 100_000 float64 (800 KB) go by reference."""
KILLED_RANK = 3
"""The member rank_killed SIGKILLs (not a node's lowest rank: that one owns a post office)."""
OBJECT_STORE_BYTES = 200 * 2**20
POST_OFFICE_PREFIX = "post-office-"
EVERY_COLLECTIVE_CASES = [("int64", "SUM", SMALL), ("float64", "SUM", LARGE),
                          ("float32", "MAX", 30_000), ("int32", "PRODUCT", 1),
                          ("float64", "AVG", LARGE), ("float32", "PRODUCT", SMALL)]
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
    ray.init(address=cluster.address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": python_path()}})
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
    backend = current_registry().get(group).membership
    transport = backend.transport
    carrier = transport.stream_carrier
    streams = carrier.streams if carrier is not None else None
    talked = {peer for shape in col.get_collective_trace(group) for peer in shape["peers"]}
    stream_nodes = {transport.peers[peer].node for peer in talked
                    if transport.peers[peer].node != transport.node}
    runner = backend.native
    return {"outputs": outputs, "membership": type(backend).__name__,
            "stream_rounds_in_core": (runner.streams.rounds_run if runner is not None
                                      and runner.streams is not None else 0),
            "node": ray.get_runtime_context().get_node_id(),
            "node_of": None if backend.node_of is None else list(backend.node_of),
            "streams": streams is not None,
            "stream_sockets": [] if streams is None else sorted(
                [_inode(streams.listener.fileno())]
                + [_inode(stream.fd) for stream in carrier.open_streams()]),
            "sent_to_nodes": sorted(stream_nodes)}


def open_streams_of(_rank: int, group: str) -> list:
    """The ranks this member holds an open stream with, each with whether the stream its
    peer sends on is known (what lets the first round with it run in the native core)."""
    from ray_collective.group import current_registry
    from ray_collective.transport.base import COLLECTIVE_TAG
    carrier = current_registry().get(group).membership.transport.stream_carrier
    return sorted([stream.peer,
                   carrier.quiet_streams(stream.peer, COLLECTIVE_TAG, True, True) is not None]
                  for stream in carrier.open_streams() if stream.open)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def open_socket_inodes(_rank: int) -> list:
    """Inside a member: the inodes of every socket its process holds open."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.append(int(target[len("socket:["):-1]))
    return found


def set_environment(_rank: int, name: str, value: str) -> None:
    """Inside a member: set what its next groups read from the environment (the transport
    between nodes, a forced algorithm)."""
    os.environ[name] = value


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
        "streams": [r["streams"] for r in results],
        "stream_rounds_in_core": [r["stream_rounds_in_core"] for r in results],
        "root": root,
        "failures": check_hierarchical_phase(results, root),
    }


def every_collective_failures(members: list, group: str,
                              cases: list = EVERY_COLLECTIVE_CASES) -> list:
    failures = []
    for dtype, op_name, length in cases:
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


def _seconds_until(condition, seconds: float) -> float:
    """Seconds until ``condition()`` holds, looked at every 50 ms, or -1 after ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    return -1.0


def post_offices_gone_within(seconds: float) -> float:
    """Seconds until no post-office name is registered (ray.kill is asynchronous), or -1."""
    return _seconds_until(lambda: not post_office_names(), seconds)


def declared_group(members: list, cross_node: str = "streams") -> dict:
    group = f"multinode-declared-{cross_node}"
    run_in(ray, members, set_environment, CROSS_NODE_VARIABLE, cross_node)
    col.declare_collective_group(members, backend="ray", group_name=group)
    root = WORLD_SIZE - 1
    results = run_in(ray, members, hierarchical_phase, group, root)
    summary = observe_hierarchy(results, root)
    summary["failures"] += every_collective_failures(members, group)
    if cross_node == "streams":
        summary["stranger"] = stranger_with_a_wrong_key(members, group)
    summary["post_office_nodes"] = post_office_nodes()
    col.destroy_collective_group(group)
    summary["post_offices_gone_after_s"] = post_offices_gone_within(10.0)
    summary["keys_left"] = [k.decode() for k in group_keys(ray, group)]
    still_open = run_in(ray, members, open_socket_inodes)
    summary["stream_sockets_left"] = [sorted(set(r["stream_sockets"]) & set(now))
                                      for r, now in zip(results, still_open)]
    summary["stream_sockets_seen"] = sum(len(r["stream_sockets"]) for r in results)
    return summary


def post_office_processes() -> dict:
    """``{actor name: its process id}`` of every live post-office actor."""
    names = post_office_names()
    handles = [ray.get_actor(name, namespace=NAMESPACE) for name in names]
    return dict(zip(names, ray.get([h.__ray_call__.remote(lambda _self: os.getpid())
                                    for h in handles])))


def grown_group(members: list) -> dict:
    """The group over nodes 0 and 1 grown by node 2's members (the object store carries its
    messages, so each node's post office delivers the new incarnation's): which post-office
    processes served it before and after."""
    group = "multinode-grown"
    first = members[:2 * RANKS_PER_NODE]
    run_in(ray, members, set_environment, CROSS_NODE_VARIABLE, "object_store")
    col.declare_collective_group(first, backend="ray", group_name=group)
    before = post_office_processes()
    col.grow_collective_group(group, actors=members[len(first):], timeout=60)
    after = post_office_processes()
    summary = {"before": before, "after": after,
               "failures": every_collective_failures(members, group,
                                                     EVERY_COLLECTIVE_CASES[:2])}
    col.destroy_collective_group(group)
    # At once, with the same name and owners: the new post offices' names are those of the
    # ones just stopped, which may still be registered.
    col.declare_collective_group(members, backend="ray", group_name=group)
    summary["declared_again_sums_right"] = run_in(ray, members, _allreduce_once, group)
    col.destroy_collective_group(group)
    summary["post_offices_gone_after_s"] = post_offices_gone_within(10.0)
    summary["keys_left"] = [k.decode() for k in group_keys(ray, group)]
    return summary


def _allreduce_once(rank: int, group: str) -> bool:
    tensor = rank_data(rank, SMALL, "float64")
    col.allreduce(tensor, group)
    return bool(np.array_equal(tensor, numpy_reduce(
        [rank_data(r, SMALL, "float64") for r in range(WORLD_SIZE)], col.ReduceOp.SUM)))


def _refused_connections(_rank: int, group: str) -> int:
    from ray_collective.group import current_registry
    return current_registry().get(group).membership.transport.refused_connections


def stranger_with_a_wrong_key(members: list, group: str) -> dict:
    """The driver connects to rank 2's stream listener (its endpoint read from the group's
    keys) with a key of its own, while the members run allreduces (a rank accepts while it
    waits): what the stranger saw, what rank 2 counted, and whether the group still works."""
    target = 2
    endpoint = next(k.decode().rsplit("/", 3)[1:] for k in group_keys(ray, group)
                    if f"/stream/{target}/" in k.decode())
    host, port = endpoint[1], int(endpoint[2])
    stranger = tcp.connect(host, port, 0, target, os.urandom(16), 10)
    refused_by_stranger = False
    correct = []
    deadline = time.monotonic() + 30
    while not stranger.closed and time.monotonic() < deadline:
        refs = [m.__ray_call__.remote(lambda _self, r=r: _allreduce_once(r, group))
                for r, m in enumerate(members)]
        while not stranger.closed and ray.wait(refs, num_returns=len(refs), timeout=0.01)[1]:
            try:
                stranger.receive()
            except handshake.HandshakeError:
                refused_by_stranger = True
        correct += ray.get(refs)
    stranger_closed = stranger.closed
    stranger.close()
    correct += run_in(ray, members, _allreduce_once, group)
    return {"host": host, "closed": stranger_closed, "opened": stranger.open,
            "refused_by_stranger": refused_by_stranger,
            "refused_by_target": run_in(ray, members, _refused_connections, group),
            "allreduces_correct": all(correct)}


def imperative_group(members: list) -> dict:
    group = "multinode-imperative"
    run_in(ray, members, set_environment, CROSS_NODE_VARIABLE, "streams")
    joined = run_in(ray, members, join, group, WORLD_SIZE)
    streams_after_join = run_in(ray, members, open_streams_of, group)
    root = 0
    summary = observe_hierarchy(run_in(ray, members, hierarchical_phase, group, root), root)
    summary["joined"] = joined
    summary["streams_after_join"] = streams_after_join
    summary["post_office_nodes"] = post_office_nodes()
    summary["still_initialized_after_leave"] = run_in(ray, members, leave, group)
    summary["post_offices_gone_after_s"] = post_offices_gone_within(10.0)
    summary["keys_left"] = [k.decode() for k in group_keys(ray, group)]
    return summary


def _loop_until_error(rank: int, group: str) -> tuple:
    """Allreduce back to back until a call fails: (error class, message, wall clock, the
    ranks the error names as dead or served by a lost post office)."""
    tensor = np.ones(SMALL, np.float64)
    while True:
        try:
            col.allreduce(tensor, group, timeout=60.0)
            tensor[:] = 1
        except col.CollectiveError as err:
            named = getattr(err, "dead_ranks", None) or getattr(err, "served_ranks", ())
            return type(err).__name__, str(err), time.time(), list(named)


def post_office_killed(members: list) -> dict:
    """Kill node 1's post office while every rank loops on allreduce: what each rank raises,
    how long after the kill, and what is left once the driver destroys the group."""
    group = "multinode-post-office-killed"
    col.declare_collective_group(members, backend="ray", group_name=group)
    formed = time.monotonic()
    refs = [m.__ray_call__.remote(lambda _self, r=r: _loop_until_error(r, group))
            for r, m in enumerate(members)]
    # Past the moments after joining when a post office's name may not be registered yet
    # (RayPostOffices: POST_OFFICE_LOOKUP_S), so that a missing name means a dead post office.
    time.sleep(max(1.0, POST_OFFICE_LOOKUP_S - (time.monotonic() - formed)))
    node = node_ids()[1]
    victim = next(name for name in post_office_names() if name.endswith(node[:16]))
    killed_at = time.time()
    ray.kill(ray.get_actor(victim, namespace=NAMESPACE))
    outcomes = ray.get(refs, timeout=120)
    col.destroy_collective_group(group)
    return {"node": node, "errors": [kind for kind, *_ in outcomes],
            "messages": [message for _, message, *_ in outcomes],
            "seconds_after_kill": [at - killed_at for _, _, at, _ in outcomes],
            "post_offices_gone_after_s": post_offices_gone_within(10.0),
            "post_offices_left": post_office_names(),
            "keys_left": [k.decode() for k in group_keys(ray, group)]}


def _wait_for_post_offices(count: int, seconds: float) -> float:
    """Seconds until ``count`` post offices answer where they run (-1 if they never do)."""
    return _seconds_until(lambda: len(post_office_names()) >= count
                          and len(post_office_nodes()) >= count, seconds)


def rank_killed(members: list) -> dict:
    """SIGKILL rank 3 while every rank loops on a ring allreduce (rank 3 sends to rank 4 on
    node 2 over a stream): what each survivor raises and how long after the kill.

    Not a node's lowest rank: that one owns its node's post office, which dies with it, and
    its node's other ranks then raise ``PostOfficeDiedError`` (see test_multinode)."""
    group = "multinode-rank-killed"
    victim = KILLED_RANK
    run_in(ray, members, set_environment, "RAY_COLLECTIVE_ALGORITHM", "allreduce=ring")
    col.declare_collective_group(members, backend="ray", group_name=group)
    pid = ray.get(members[victim].pid.remote())
    refs = {r: m.__ray_call__.remote(lambda _self, r=r: _loop_until_error(r, group))
            for r, m in enumerate(members)}
    # The kill falls in the group's steady state: while the nodes' post offices start (a
    # Python process each, on this machine's two cores shared by three nodes) the first
    # calls take up to half a second each, and a death is seen up to a second late.
    post_offices_up = _wait_for_post_offices(NODES, 30.0)
    time.sleep(0.5)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    survivors = [r for r in refs if r != victim]
    outcomes = dict(zip(survivors, ray.get([refs[r] for r in survivors], timeout=120)))
    return {"victim": victim, "ranks": survivors, "post_offices_up_s": post_offices_up,
            "errors": [kind for kind, *_ in outcomes.values()],
            "messages": [message for _, message, *_ in outcomes.values()],
            "seconds_after_kill": [at - killed_at for _, _, at, _ in outcomes.values()]}


def _allreduce_over_group(rank: int, group: str) -> bool:
    """Inside a member: whether an allreduce over the group's ranks, whatever their number,
    equals numpy's sum."""
    world_size = col.get_collective_group_size(group)
    tensor = rank_data(rank, LARGE, "float64")
    col.allreduce(tensor, group)
    return bool(np.array_equal(tensor, numpy_reduce(
        [rank_data(r, LARGE, "float64") for r in range(world_size)], col.ReduceOp.SUM)))


def node_removed(members: list, cluster: Cluster) -> dict:
    """Remove node 2 from the cluster (its raylet and every process on it, ranks and post
    office) while a group of the members still alive loops on allreduce: what each survivor
    raises, the ranks it names and how long after the removal; then the shrink from the
    driver, how long it took, and an allreduce over the ranks it kept.

    The group is the five members rank_killed left: ranks 0-1 on node 0, 2 on node 1, 3-4 on
    node 2 (last: it costs the cluster a node)."""
    group = "multinode-node-removed"
    alive = [m for r, m in enumerate(members) if r != KILLED_RANK]
    lost = [r for r, m in enumerate(alive) if members.index(m) // RANKS_PER_NODE == 2]
    run_in(ray, alive, set_environment, "RAY_COLLECTIVE_ALGORITHM", "")
    col.declare_collective_group(alive, backend="ray", group_name=group)
    # Asked before the loops start: an actor runs one task at a time.
    lost_pids = ray.get([alive[r].pid.remote() for r in lost])
    refs = {r: m.__ray_call__.remote(lambda _self, r=r: _loop_until_error(r, group))
            for r, m in enumerate(alive)}
    post_offices_up = _wait_for_post_offices(NODES, 30.0)
    time.sleep(0.5)
    node_id = node_ids()[2]
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    removed_at = time.time()
    cluster.remove_node(node, allow_graceful=False)
    survivors = [r for r in refs if r not in lost]
    outcomes = dict(zip(survivors, ray.get([refs[r] for r in survivors], timeout=120)))
    # The lost node's rank processes die after their raylet, a moment later under load. One
    # still alive would come to the shrink and be kept, and the next allreduce would fail on
    # its death: that is the library's contract (shrink again), not what this scenario checks.
    for pid in lost_pids:
        if not exits_within(pid, 60.0):
            raise TimeoutError(f"process {pid} of the removed node still runs after 60 s")
    shrink_started, attempts = time.time(), 0
    while True:
        # A process of the lost node may live on a moment and come to the shrink, then die:
        # the group went on with it, and shrinks again.
        attempts += 1
        try:
            new_ranks = col.shrink_collective_group(group, timeout=60)
            break
        except col.PeerDiedError:
            if attempts == 3:
                raise
    shrunk_at = time.time()
    kept = [alive[old] for old in sorted(new_ranks, key=new_ranks.get)]
    correct = run_in(ray, kept, _allreduce_over_group, group)
    col.destroy_collective_group(group)
    return {"lost": lost, "ranks": survivors, "post_offices_up_s": post_offices_up,
            "errors": [kind for kind, *_ in outcomes.values()],
            "messages": [message for _, message, *_ in outcomes.values()],
            "named": [named for *_, named in outcomes.values()],
            "seconds_after_removal": [at - removed_at for _, _, at, _ in outcomes.values()],
            "new_ranks": {str(old): new for old, new in new_ranks.items()},
            "shrink_s": shrunk_at - shrink_started, "shrink_attempts": attempts,
            "removal_to_shrunk_s": shrunk_at - removed_at,
            "allreduce_after_shrink_correct": correct,
            "keys_left": [k.decode() for k in group_keys(ray, group)]}


def main() -> dict:
    started = time.monotonic()
    cluster = start_cluster()
    try:
        summary = {"nodes": node_ids(), "cluster_start_s": time.monotonic() - started}
        members = start_members_on_nodes()
        for name, scenario in (("declared", declared_group),
                               ("declared_object_store",
                                lambda m: declared_group(m, "object_store")),
                               ("grown", grown_group),
                               ("imperative", imperative_group),
                               ("post_office_killed", post_office_killed),
                               ("rank_killed", rank_killed),
                               ("node_removed", lambda m: node_removed(m, cluster))):
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
