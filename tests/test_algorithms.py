"""Every algorithm of every collective on the in-process transport, driven by the simulator:
results equal numpy's, and rounds and bytes equal the algorithm's own formula."""

import numpy as np
import pytest

from ray_collective.algorithms.catalog import ALGORITHMS
from ray_collective.errors import CollectiveMismatchError, SimulationDeadlockError
from ray_collective.sim.runner import simulate
from ray_collective.types import ReduceOp

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17]
COUNTS = [0, 1, 7, 1000]
ROOTED = ("reduce", "broadcast", "gather", "scatter")
# Composites whose formula is an upper bound (they pick sub-algorithms by size), not exact.
BOUNDED = {("broadcast", "scatter_allgather")}


def _power_of_two(p):
    return p & (p - 1) == 0


FLAT_CASES = [(collective, name, p)
              for collective, by_name in sorted(ALGORITHMS.items())
              for name, algorithm in sorted(by_name.items())
              if not algorithm.node_aware
              for p in WORLD_SIZES
              if not algorithm.power_of_two_only or _power_of_two(p)]


def assert_within_formula(report, exact):
    formula = report.formula
    sent_formula = formula.max_elements_sent * report.itemsize
    if exact:
        assert report.rounds == formula.rounds, report
        assert report.max_bytes_sent == sent_formula, report
    else:
        assert report.rounds <= formula.rounds, report
        assert report.max_bytes_sent <= sent_formula, report


@pytest.mark.parametrize("collective, name, p", FLAT_CASES)
@pytest.mark.parametrize("count", COUNTS)
def test_algorithm_matches_numpy_and_formula(collective, name, p, count):
    roots = sorted({0, p // 2, p - 1}) if collective in ROOTED else [0]
    for root in roots:
        report = simulate(collective, p, count, algorithm=name, root=root, seed=p * 31 + count)
        assert report.checked and report.algorithm == name
        assert_within_formula(report, (collective, name) not in BOUNDED)


REDUCING = [(collective, name) for collective in ("allreduce", "reduce", "reducescatter")
            for name, algorithm in ALGORITHMS[collective].items() if not algorithm.node_aware]


@pytest.mark.parametrize("collective, name", REDUCING)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64", "bool"])
def test_reducing_algorithms_for_every_op(collective, name, op, dtype):
    p = 8 if ALGORITHMS[collective][name].power_of_two_only else 6
    simulate(collective, p, 7, algorithm=name, op=op, dtype=dtype, root=p - 1)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce"])
@pytest.mark.parametrize("p, ranks_per_node", [(2, 1), (4, 2), (6, 2), (7, 3), (9, 4), (16, 4),
                                               (17, 4), (64, 8)])
@pytest.mark.parametrize("count", [0, 7, 1000])
def test_hierarchical_keeps_inter_node_traffic_between_node_heads(collective, p, ranks_per_node,
                                                                   count):
    nodes = -(-p // ranks_per_node)
    for root in sorted({0, p - 1}) if collective != "allreduce" else [0]:
        report = simulate(collective, p, count, algorithm="hierarchical", root=root,
                          ranks_per_node=ranks_per_node)
        assert report.checked
        assert report.inter_node_senders <= nodes
        assert report.rounds <= report.formula.rounds
        flat = simulate(collective, p, count, algorithm="binomial" if collective != "allreduce"
                        else "recursive_doubling", root=root, ranks_per_node=ranks_per_node)
        assert report.inter_node_senders <= flat.inter_node_senders


@pytest.mark.parametrize("p, ranks_per_node", [(2, 1), (4, 2), (6, 3), (16, 4), (64, 8),
                                               (7, 3), (9, 4)])
@pytest.mark.parametrize("count", [0, 5, 1000])
@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_sharded_allreduce_sends_every_ranks_shard_across_nodes(p, ranks_per_node, count, dtype):
    report = simulate("allreduce", p, count, algorithm="hierarchical_sharded", dtype=dtype,
                      ranks_per_node=ranks_per_node, seed=p + count)
    assert report.checked
    assert report.rounds <= report.formula.rounds
    leaders = simulate("allreduce", p, count, algorithm="hierarchical", dtype=dtype,
                       ranks_per_node=ranks_per_node, seed=p + count)
    if p % ranks_per_node:
        # unequal nodes: the leaders' version, message for message
        assert (report.rounds, report.inter_node_senders) == (leaders.rounds,
                                                              leaders.inter_node_senders)
    elif count >= ranks_per_node > 1 and p > ranks_per_node:
        assert report.inter_node_senders == p > leaders.inter_node_senders


@pytest.mark.parametrize("p, ranks_per_node", [(2, 1), (4, 2), (7, 3), (9, 4), (16, 4)])
@pytest.mark.parametrize("count", [0, 5, 300_000])
def test_pipelined_broadcast_crosses_each_node_boundary_once(p, ranks_per_node, count):
    nodes = -(-p // ranks_per_node)
    for root in sorted({0, p // 2, p - 1}):
        report = simulate("broadcast", p, count, algorithm="hierarchical_pipeline", root=root,
                          ranks_per_node=ranks_per_node, seed=root)
        assert report.checked and report.rounds == report.formula.rounds
        assert report.inter_node_senders == nodes - 1


def test_selector_takes_the_hierarchical_path_across_nodes():
    assert simulate("allreduce", 12, 5, ranks_per_node=4).algorithm == "hierarchical"
    assert simulate("allreduce", 12, 5).algorithm == "recursive_doubling"


def test_deadlocked_algorithm_is_reported_not_hung():
    from ray_collective.algorithms.core import Recv
    from ray_collective.sim.lockstep import run_lockstep
    from ray_collective.transport.base import COLLECTIVE_TAG
    from ray_collective.transport.wire import CallHeader, CallStamp
    from ray_collective.transport.local import LocalFabric

    def waits_for_the_other(rank):
        yield (Recv(1 - rank, np.zeros(1), 0),)

    header = CallStamp.of(CallHeader("g", 0, 0, "allreduce", "broken", "float64", 1, (1,)))
    with pytest.raises(SimulationDeadlockError, match="rank 0 waits for \\[1\\]"):
        run_lockstep(LocalFabric(2, deferred=True), [waits_for_the_other(r) for r in range(2)],
                     COLLECTIVE_TAG, [header] * 2, None)


def test_ranks_running_different_algorithms_are_a_mismatch():
    from ray_collective.algorithms.allreduce import recursive_doubling
    from ray_collective.algorithms.core import Context, Team
    from ray_collective.sim.lockstep import run_lockstep
    from ray_collective.transport.base import COLLECTIVE_TAG
    from ray_collective.transport.wire import CallHeader, CallStamp
    from ray_collective.transport.local import LocalFabric

    ctx = Context(np.float64, lambda acc, x: np.add(acc, x, out=acc))
    headers = [CallStamp.of(CallHeader("g", 0, 0, "allreduce", name, "float64", 4, (4,)))
               for name in ("recursive_doubling", "ring")]
    generators = [recursive_doubling(Team.world(2, r), np.ones(4), ctx) for r in range(2)]
    with pytest.raises(CollectiveMismatchError, match="algorithm"):
        run_lockstep(LocalFabric(2, deferred=True), generators, COLLECTIVE_TAG, headers,
                     ctx.combine)
