"""A ``ray`` group across three Ray nodes on one machine (``ray.cluster_utils.Cluster``), two
ranks per node: every collective correct on small and large tensors, the hierarchical path taken
(only one rank per node, or the root, talks across nodes, its rounds between nodes in the native
core), streams to other nodes open right after the join, one post office per node while the
group lives and nothing left after it is destroyed (keys, post offices, stream sockets); for a
declared group over streams and over the object store, and an imperative group over streams.
Over streams: a stranger with a wrong key refused by a live listener, a rank SIGKILLed on
another node named by every survivor, and a node removed: its ranks named, then left out by a
shrink.

The cluster runs in a subprocess (tests/support/multinode_cluster.py), since it cannot share the test
session's Ray instance; the script reports what it saw as JSON and the assertions live here.
"""

import json
import os
import subprocess
import sys

import pytest

from support.paths import python_path

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SCRIPT_TIMEOUT_S = 420
RANKS_PER_NODE = 2
WORLD_SIZE = 6


@pytest.fixture(scope="module")
def summary():
    env = dict(os.environ, PYTHONPATH=python_path())
    finished = subprocess.run([sys.executable, "-m", "support.multinode_cluster"],
                              check=False, capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT_S, env=env)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert finished.returncode == 0 and lines, finished.stdout[-5000:] + finished.stderr[-5000:]
    return json.loads(lines[-1][len("SUMMARY "):])


def test_cluster_has_three_distinct_nodes(summary):
    assert len(set(summary["nodes"])) == 3


SCENARIOS = ["declared", "declared_object_store", "imperative"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_results_match_numpy_across_nodes(summary, scenario):
    # declared: every collective, send/recv and barrier; imperative: allreduce, broadcast, reduce
    assert summary[scenario]["failures"] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_chosen_transport_carries_messages_between_nodes(summary, scenario):
    over_streams = scenario != "declared_object_store"
    assert summary[scenario]["streams"] == [over_streams] * WORLD_SIZE


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hierarchical_path_is_taken(summary, scenario):
    seen = summary[scenario]
    expected_nodes = [summary["nodes"][r // RANKS_PER_NODE] for r in range(WORLD_SIZE)]
    assert seen["rank_nodes"] == expected_nodes
    assert seen["memberships"] == ["RayMembership"]
    assert seen["node_of"] == [expected_nodes] * WORLD_SIZE
    assert set(seen["selected"].values()) == {"hierarchical"}, seen["selected"]
    # Node leaders (the lowest rank of each node) and the broadcast/reduce root head their
    # nodes; under a flat algorithm every rank would send across nodes.
    leaders = {expected_nodes.index(node) for node in expected_nodes}
    assert seen["ranks_that_crossed_nodes"] == sorted(leaders | {seen["root"]})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rounds_between_nodes_run_in_the_native_core_over_streams(summary, scenario):
    """Every rank that crosses nodes runs some of its rounds between nodes in the core
    (``engine.stream_rounds``); none over the object store."""
    seen = summary[scenario]
    rounds = seen["stream_rounds_in_core"]
    if scenario == "declared_object_store":
        assert rounds == [0] * WORLD_SIZE
    else:
        assert all(rounds[r] > 0 for r in seen["ranks_that_crossed_nodes"]), rounds


def test_streams_to_other_nodes_are_open_and_known_right_after_the_join(summary):
    """The join opens and authenticates them (a group this small: every pair across nodes),
    so that no call pays a connection and the first round with a peer may run in the core."""
    nodes = [r // RANKS_PER_NODE for r in range(WORLD_SIZE)]
    expected = [[[peer, True] for peer in range(WORLD_SIZE) if nodes[peer] != nodes[rank]]
                for rank in range(WORLD_SIZE)]
    assert summary["imperative"]["streams_after_join"] == expected


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_post_office_per_node_and_nothing_left_after_destroy(summary, scenario):
    seen = summary[scenario]
    assert sorted(seen["post_office_nodes"]) == sorted(summary["nodes"])
    assert seen["post_offices_gone_after_s"] >= 0, "post offices still named 10 s after destroy"
    assert seen["keys_left"] == []


@pytest.mark.parametrize("scenario", ["declared", "declared_object_store"])
def test_no_stream_socket_is_left_open_after_destroy(summary, scenario):
    seen = summary[scenario]
    if scenario == "declared":
        assert seen["stream_sockets_seen"] >= WORLD_SIZE  # a listener each, and streams
    else:
        assert seen["stream_sockets_seen"] == 0
    assert seen["stream_sockets_left"] == [[]] * WORLD_SIZE


def test_a_grown_group_reuses_its_nodes_post_office_processes(summary):
    """The grow opens the new incarnation's post offices in the processes of the old one on
    nodes 0 and 1 (no process started there), and starts one on node 2; every collective of
    the grown group, carried by them, matches numpy; the group declared again at once, its
    post offices named as those just stopped, sums right."""
    grown = summary["grown"]
    assert len(grown["before"]) == 2 and len(grown["after"]) == 3
    assert set(grown["before"].items()) < set(grown["after"].items())
    assert grown["failures"] == []
    assert grown["declared_again_sums_right"] == [True] * WORLD_SIZE
    assert grown["post_offices_gone_after_s"] >= 0, "post offices still named after destroy"
    assert grown["keys_left"] == []


def test_a_stranger_with_a_wrong_key_is_refused_by_a_live_listener(summary):
    stranger = summary["declared"]["stranger"]
    assert stranger["closed"] and not stranger["opened"], stranger
    assert not stranger["refused_by_stranger"], "the listener never proved anything to it"
    assert stranger["refused_by_target"] == [0, 0, 1, 0, 0, 0]
    assert stranger["allreduces_correct"]
    assert stranger["host"] not in ("0.0.0.0", "::", "")


def test_imperative_members_join_and_leave(summary):
    seen = summary["imperative"]
    assert seen["joined"] == [[rank, WORLD_SIZE] for rank in range(WORLD_SIZE)]
    assert seen["still_initialized_after_leave"] == [False] * WORLD_SIZE


def test_a_killed_post_office_is_reported_as_such_on_every_rank(summary, record_property):
    """No live rank is called dead: every rank names the lost helper and its node."""
    killed = summary["post_office_killed"]
    record_property("seconds_after_kill", killed["seconds_after_kill"])
    assert killed["errors"] == ["PostOfficeDiedError"] * 6, killed["messages"]
    assert all(f"post office of node {killed['node'][:8]} died" in m
               for m in killed["messages"]), killed["messages"]
    # the target is 1 s; the bound here leaves room for a loaded machine
    assert max(killed["seconds_after_kill"]) < 5.0, killed["seconds_after_kill"]
    assert killed["post_offices_gone_after_s"] >= 0 and killed["keys_left"] == [], (
        killed["post_offices_left"], killed["keys_left"])



def test_a_rank_killed_on_another_node_is_named_by_every_survivor(summary, record_property):
    killed = summary["rank_killed"]
    victim = killed["victim"]
    record_property("seconds_after_kill", killed["seconds_after_kill"])
    record_property("messages", killed["messages"])
    assert killed["errors"] == ["PeerDiedError"] * (WORLD_SIZE - 1), killed["messages"]
    assert all(f"ranks [{victim}] died" in m for m in killed["messages"]), killed["messages"]
    # the target is 1 s; the bound here leaves room for a loaded machine
    assert max(killed["seconds_after_kill"]) <= 2.0, killed["seconds_after_kill"]


def test_a_node_removed_mid_allreduce_is_named_by_every_survivor(summary, record_property):
    """The node's raylet and every process on it go at once: each survivor raises the first
    death found (a rank of that node can report its node-mate's before it dies in turn)."""
    removed = summary["node_removed"]
    record_property("seconds_after_removal", removed["seconds_after_removal"])
    record_property("messages", removed["messages"])
    # a lost rank, or the lost node's post office (which names that node's ranks)
    assert set(removed["errors"]) <= {"PeerDiedError", "PostOfficeDiedError"}, \
        removed["messages"]
    assert len(removed["errors"]) == len(removed["ranks"]), removed["messages"]
    assert all(named and set(named) <= set(removed["lost"]) for named in removed["named"]), \
        removed["messages"]
    # the target is 5 s
    assert max(removed["seconds_after_removal"]) < 5.0, removed["seconds_after_removal"]


def test_the_survivors_of_a_lost_node_shrink_to_the_other_nodes_and_go_on(summary,
                                                                          record_property):
    """After node 2's removal, a shrink from the driver keeps the ranks of nodes 0 and 1
    (ranks 0-2, in order) and an allreduce over them equals numpy's; nothing is left after
    the group is destroyed."""
    removed = summary["node_removed"]
    record_property("shrink_s", removed["shrink_s"])
    record_property("removal_to_shrunk_s", removed["removal_to_shrunk_s"])
    assert removed["new_ranks"] == {str(r): r for r in removed["ranks"]}
    assert removed["allreduce_after_shrink_correct"] == [True] * len(removed["ranks"])
    assert removed["keys_left"] == []
