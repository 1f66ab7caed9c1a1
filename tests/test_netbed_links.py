"""What each node's link carries for the algorithms the selector picks across nodes, counted
from the algorithms' rounds without a bed: the bytes the busiest link must carry set the link
bound (``benchmarks.netbed_bench``), so an algorithm whose busiest link carries more can never
reach it. The network bed's counters show the same shares (``benchmarks.netbed_profile``,
``benchmarks/results/netbed-profile-*.json``)."""

import numpy as np
import pytest

from ray_collective.algorithms import broadcast, catalog
from ray_collective.algorithms.core import Context, Send, Team
from ray_collective.algorithms.selector import select

MIB = 1 << 20
FLOAT32 = 4


def _link_shares(algorithm, node_of, count, root=0):
    """Bytes each node sends to and receives from other nodes over the message's size."""
    nodes = max(node_of) + 1
    sent, received = [0] * nodes, [0] * nodes
    for rank in range(len(node_of)):
        # Nothing is reduced (only the rounds are counted), and np.zeros maps its pages lazily.
        ctx = Context(np.float32, lambda acc, incoming: None, node_of=node_of,
                      choose=catalog.flat_choice(FLOAT32, True), oversubscribed=True)
        buf = np.zeros(count, np.float32)
        arguments = (buf, ctx) if algorithm.collective == "allreduce" else (buf, root, ctx)
        for round_ in algorithm.run(Team.world(len(node_of), rank), *arguments):
            for op in round_:
                if node_of[op.peer] != node_of[rank]:
                    share = (op.data if isinstance(op, Send) else op.out).nbytes
                    (sent if isinstance(op, Send) else received)[node_of[rank]] += share
    size = count * FLOAT32
    return [s / size for s in sent], [r / size for r in received]


@pytest.mark.parametrize("nodes_in_core", [True, False])
@pytest.mark.parametrize("node_of", [(0, 0, 1, 1, 2, 2, 3, 3), (0, 1, 2, 3), (0, 0, 1, 1, 2, 2)])
def test_a_large_broadcast_across_nodes_has_every_link_carry_it_once(node_of, nodes_in_core):
    count = 64 * MIB // FLOAT32
    algorithm = select("broadcast", count, FLOAT32, len(node_of), node_of, oversubscribed=True,
                       nodes_in_core=nodes_in_core)
    sent, received = _link_shares(algorithm, node_of, count)
    assert max(sent) == pytest.approx(1.0) and max(received) == pytest.approx(1.0), (
        algorithm.name, sent, received)


def test_the_leaders_scatter_allgather_would_load_the_roots_link_half_again():
    """What the leaders ran before the chain: 2 (N-1)/N of the message on the root's link."""
    sent, _ = _link_shares(catalog.lookup("broadcast", "scatter_allgather"), (0, 1, 2, 3),
                           64 * MIB // FLOAT32)
    assert sent[0] == pytest.approx(1.5)


def test_one_rank_per_node_broadcasts_down_the_link_chain():
    assert select("broadcast", 16 * MIB // FLOAT32, FLOAT32, 4, (0, 1, 2, 3)).name == \
        "link_pipeline"
    assert select("broadcast", 16 * MIB // FLOAT32, FLOAT32, 2, (0, 1)).name == "binomial"
    assert select("broadcast", 1024, FLOAT32, 4, (0, 1, 2, 3)).name == "binomial"


@pytest.mark.parametrize("nbytes, chunks", [(512 << 10, 1), (4 * MIB, 4), (64 * MIB, 64),
                                            (256 * MIB, 64)])
def test_the_link_chain_takes_a_chunk_per_mib_up_to_64(nbytes, chunks):
    assert broadcast.link_pipeline_chunks(nbytes // FLOAT32, FLOAT32) == chunks


def test_the_sharded_allreduce_carries_the_link_bound_and_a_flat_ring_more():
    """2 (N-1)/N of the message each way on every node's link for the sharded allreduce (the
    bound); a ring over all N·R ranks crosses each node's link with 2 (NR-1)/NR of it."""
    node_of = (0, 0, 1, 1, 2, 2, 3, 3)
    count = 64 * MIB // FLOAT32
    chosen = select("allreduce", count, FLOAT32, 8, node_of, oversubscribed=True,
                    nodes_in_core=True)
    assert chosen.name == "hierarchical_sharded"
    for algorithm, share in ((chosen, 2 * 3 / 4), (catalog.lookup("allreduce", "ring"),
                                                   2 * 7 / 8)):
        sent, received = _link_shares(algorithm, node_of, count)
        assert sent == pytest.approx([share] * 4) and received == pytest.approx([share] * 4)
