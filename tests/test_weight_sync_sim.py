"""A sync's plan on the simulator, for 1-4 publishers and 8 to 1024 subscribers over nodes of
8: the bytes each node's link carries, checked against the formula of the broadcast that
carries each bucket. Up to 16 nodes (one link between two nodes, the chain through the nodes'
leaders from 3) no link carries more than the model once, whatever the number of subscribers;
beyond 16 leaders the broadcast between them is binomial (ceil(log2 L) times the model out of
the root's node, L leaders), which these tests pin so that a change shows."""

import math

import pytest

from ray_collective.weight_sync.simulate import placement, simulate_sync, uniform_plan

MiB = 1 << 20


def test_members_are_placed_publishers_first_one_per_node():
    assert placement(2, 5, 4) == [0, 1, 0, 0, 0, 1, 1]
    assert placement(4, 2, 8) == [0, 1, 2, 3, 0, 0]


@pytest.mark.parametrize("publishers", [1, 2, 4])
def test_up_to_sixteen_members_no_link_carries_more_than_the_model(publishers):
    plan = uniform_plan(32 * MiB, 16, publishers, bucket_bytes=4 * MiB)
    for subscribers, per_node in ((8, 8), (15, 8), (15, 4)):
        run = simulate_sync(plan, subscribers, per_node)
        assert run.busiest_link <= 1.0
        # Every node with subscribers takes in the whole model but what its own publisher
        # holds (publisher p sits on node p), exactly once.
        nodes = placement(publishers, subscribers, per_node)
        for node in set(nodes[publishers:]):
            own = sum(b.nbytes for b in plan.buckets if b.owner == node)
            assert run.node_bytes_received[node] == plan.nbytes - own
        assert sum(run.node_bytes_sent) == sum(run.node_bytes_received)


@pytest.mark.parametrize("subscribers, leaders_formula", [
    (64, lambda leaders: 1.0),
    (1024, lambda leaders: math.ceil(math.log2(leaders))),
])
def test_the_root_link_carries_what_the_leaders_broadcast_sends(
        subscribers, leaders_formula):
    plan = uniform_plan(64 * MiB, 8, 1, bucket_bytes=8 * MiB)
    run = simulate_sync(plan, subscribers, 8)
    leaders = run.nodes
    assert run.algorithms == ("hierarchical",)
    assert run.node_bytes_sent[0] / plan.nbytes == pytest.approx(leaders_formula(leaders),
                                                                 rel=1e-3)
    # Every other node still takes the model in at most twice.
    assert max(run.node_bytes_received[1:]) <= 2 * plan.nbytes


@pytest.mark.parametrize("publishers", [2, 4])
def test_more_publishers_on_the_leaders_chain_still_send_each_byte_once(publishers):
    run = simulate_sync(uniform_plan(64 * MiB, 8, publishers, 8 * MiB), 64, 8)
    assert run.nodes == 9
    # Node 0 sends its own share as the root of its chain and forwards every other share once
    # as a leader of the others': the model once, as with one publisher.
    assert run.node_bytes_sent[0] == pytest.approx(run.model_bytes, rel=1e-3)
    assert run.busiest_link <= 1.0 + 1e-3
