"""Recorded plans replay exactly what their algorithms do, and calls reuse them.

The reference is the algorithm itself: every algorithm runs twice in the lockstep simulator on
the same inputs -- once as its live generator, once as its recorded plan replayed -- and both
runs must post the same operations (peer, step, length, and the bytes of every message) in the
same order on every rank, and end with bitwise equal buffers.
"""

import numpy as np
import pytest

from ray_collective.algorithms.catalog import ALGORITHMS, flat_choice, start
from ray_collective.algorithms.core import Blocks, Context, Recv, Send, Team
from ray_collective.engine.plan import KEEP_SCRATCH_BYTES, Local, record, view
from ray_collective.sim.lockstep import run_lockstep
from ray_collective.reductions import combiner
from ray_collective.group import current_registry
from ray_collective.testing import run_ranks
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.local import LocalFabric, LocalTransport
from ray_collective.transport.wire import CallHeader, CallStamp
from ray_collective.types import ReduceOp
import ray_collective as col

ROOTED = ("reduce", "broadcast", "gather", "scatter")
WHOLE_BUFFER = ("allreduce", "reduce", "broadcast")


class TracingTransport(LocalTransport):
    """A local transport that logs every operation posted on it, with the bytes sent."""

    def __init__(self, fabric, rank, log):
        super().__init__(fabric, rank)
        self.log = log

    def isend(self, peer, channel, stamp, step, data):
        self.log.append(("send", peer, step, len(data), data.tobytes()))
        return super().isend(peer, channel, stamp, step, data)

    def irecv(self, peer, channel, stamp, step, out, combine=None):
        self.log.append(("recv", peer, step, len(out), combine is not None))
        return super().irecv(peer, channel, stamp, step, out, combine)


class TracingFabric(LocalFabric):
    def __init__(self, world_size):
        super().__init__(world_size, "plan", deferred=True)
        self.logs = [[] for _ in range(world_size)]

    def transport(self, rank):
        return TracingTransport(self, rank, self.logs[rank])


def replay(plan, slots, combine):
    """A recorded plan as a generator, so that the simulator can drive it like the algorithm."""
    for step in plan.steps:
        if isinstance(step, Local):
            step.run(slots, combine)
            continue
        yield tuple(Send(m.peer, view(slots, m.place), m.step) if m.is_send
                    else Recv(m.peer, view(slots, m.place), m.step, m.reduce) for m in step)


def _inputs(collective, p, count, seed):
    rng = np.random.default_rng(seed)
    length = count if collective in WHOLE_BUFFER else p * count
    return [rng.integers(-50, 50, length).astype(np.float64) for _ in range(p)], length


def _run(algorithm, p, count, root, node_of, use_plan, oversubscribed=False):
    collective = algorithm.collective
    dtype = np.dtype(np.float64)
    combine = combiner(ReduceOp.SUM, "float64")
    ctx = Context(dtype, combine, node_of=node_of,
                  choose=flat_choice(dtype.itemsize, oversubscribed), oversubscribed=oversubscribed)
    inputs, length = _inputs(collective, p, count, seed=p * 1000 + count)
    blocks = Blocks.uniform(count, p)
    bufs = [x.copy() for x in inputs]
    recvbufs = [np.zeros(length) if collective == "alltoall" else None for _ in range(p)]
    generators = []
    for rank in range(p):
        team = Team.world(p, rank)
        if use_plan:
            plan = record(algorithm, team, dtype, length, blocks, root, ctx)
            generators.append(replay(plan, plan.slots(bufs[rank], recvbufs[rank]), combine))
        else:
            generators.append(start(algorithm, team, ctx, bufs[rank], blocks, root,
                                    recvbufs[rank]))
    fabric = TracingFabric(p)
    stamp = CallStamp.of(CallHeader("plan", 0, 0, collective, algorithm.name, "float64", count,
                                    (count,)))
    rounds = run_lockstep(fabric, generators, COLLECTIVE_TAG, [stamp] * p, combine)
    return rounds, fabric.logs, bufs, recvbufs


def _cases():
    for collective, by_name in ALGORITHMS.items():
        for name, algorithm in by_name.items():
            for p in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17):
                if algorithm.power_of_two_only and p & (p - 1):
                    continue
                node_maps = [None]
                if algorithm.node_aware:
                    node_maps = [tuple(r // 2 for r in range(p)), tuple(r // 3 for r in range(p))]
                for node_of in node_maps:
                    for count in (0, 1, 7, 100):
                        roots = (0, p - 1) if collective in ROOTED else (-1,)
                        for root in sorted(set(roots)):
                            yield pytest.param(algorithm, p, count, root, node_of,
                                               id=f"{collective}-{name}-p{p}-n{count}-root{root}"
                                                  f"{'-nodes' if node_of else ''}"
                                                  f"{len(set(node_of)) if node_of else ''}")


@pytest.mark.parametrize("algorithm, p, count, root, node_of", list(_cases()))
def test_a_replayed_plan_does_exactly_what_its_algorithm_does(algorithm, p, count, root,
                                                               node_of):
    live = _run(algorithm, p, count, root, node_of, use_plan=False)
    replayed = _run(algorithm, p, count, root, node_of, use_plan=True)
    assert replayed[0] == live[0]                     # rounds on the critical path
    for rank in range(p):
        assert replayed[1][rank] == live[1][rank], f"rank {rank} posted other operations"
        np.testing.assert_array_equal(replayed[2][rank], live[2][rank])
        if live[3][rank] is not None:
            np.testing.assert_array_equal(replayed[3][rank], live[3][rank])


@pytest.mark.parametrize("p", [4, 8, 9, 16])
def test_leaders_on_crowded_machines_reduce_then_broadcast_and_every_rank_gets_the_sum(p):
    """Where machines run more ranks than cores, the leaders of 4 nodes or more allreduce a
    small message by reduce+broadcast: 2(L-1) messages between nodes instead of recursive
    doubling's L·log2 L or more; 2 leaders keep their one exchange. Every rank ends with the
    sum either way."""
    algorithm = ALGORITHMS["allreduce"]["hierarchical"]
    node_of = tuple(r // 2 for r in range(p))
    leaders = len(set(node_of))
    inputs, _ = _inputs("allreduce", p, 7, seed=p * 1000 + 7)
    between_nodes = {}
    for crowded in (False, True):
        _, logs, bufs, _ = _run(algorithm, p, 7, -1, node_of, True, oversubscribed=crowded)
        for buf in bufs:
            np.testing.assert_array_equal(buf, np.sum(inputs, axis=0))
        between_nodes[crowded] = sum(1 for rank, log in enumerate(logs) for op in log
                                     if op[0] == "send" and node_of[op[1]] != node_of[rank])
    if leaders >= 4:
        assert between_nodes[True] == 2 * (leaders - 1) < between_nodes[False]
    else:
        assert between_nodes[True] == between_nodes[False] == 2


def test_crowded_machines_pipeline_a_broadcast_in_8_chunks_and_every_rank_gets_the_root_buffer():
    """16 MiB down the node chain of 4 nodes x 2 ranks: 16 chunks of 1 MiB where every rank has
    a core, 8 of 2 MiB where machines run more ranks than cores (each round a wake-up)."""
    algorithm = ALGORITHMS["broadcast"]["hierarchical_pipeline"]
    p, count = 8, (16 << 20) // 8
    node_of = tuple(r // 2 for r in range(p))
    inputs, _ = _inputs("broadcast", p, count, seed=p * 1000 + count)
    for crowded, chunks in ((False, 16), (True, 8)):
        _, logs, bufs, _ = _run(algorithm, p, count, 0, node_of, True, oversubscribed=crowded)
        for buf in bufs:
            np.testing.assert_array_equal(buf, inputs[0])
        root_sends = [op for op in logs[0] if op[0] == "send"]
        assert [op[3] for op in root_sends] == [count // chunks] * chunks


def test_recording_touches_no_memory_for_the_call_buffers():
    algorithm = ALGORITHMS["allreduce"]["ring"]
    # A 1 GiB call records without allocating 1 GiB of resident memory: its stand-ins are
    # never written, and the ring needs no scratch.
    plan = record(algorithm, Team.world(4, 1), np.float32, 1 << 28,
                  Blocks.uniform(1 << 28, 4))
    assert plan.scratch == () and plan.rounds == 6


def test_small_scratch_is_kept_and_large_scratch_is_not():
    algorithm = ALGORITHMS["allreduce"]["recursive_doubling"]
    small = record(algorithm, Team.world(2, 0), np.float64, 8)
    assert small.slots(np.zeros(8))[2] is small.slots(np.zeros(8))[2]
    large_count = KEEP_SCRATCH_BYTES // 8 + 1
    large = record(algorithm, Team.world(2, 0), np.float64, large_count)
    assert large.slots(np.zeros(large_count))[2] is not large.slots(np.zeros(large_count))[2]


def test_a_part_of_a_plan_runs_on_its_scratch_and_allocates_none():
    """The segments of a plan cut by way (``engine.cpu._segments``) are parts of it: a call
    runs them one after the other on the whole plan's slots."""
    algorithm = ALGORITHMS["allreduce"]["recursive_doubling"]
    plan = record(algorithm, Team.world(4, 0), np.float64, 8)
    part = plan.part(plan.steps[:1])
    assert part.steps == plan.steps[:1] and part.scratch == plan.scratch
    buf = np.zeros(8)
    assert all(a is b for a, b in zip(part.slots(buf), plan.slots(buf), strict=True))


def test_scratch_freed_during_a_recording_is_still_its_own_slot():
    """An algorithm that drops a scratch array and allocates another gets two slots, even
    where the allocator hands the second the first one's address."""
    from ray_collective.algorithms.core import Algorithm, Cost

    def reuse(team, buf, ctx, step0=0):
        for step in range(3):
            scratch = ctx.alloc(len(buf))
            yield (Send(1 - team.index, buf, step0 + step),
                   Recv(1 - team.index, scratch, step0 + step))
            ctx.combine(buf, scratch)
            del scratch

    algorithm = Algorithm("allreduce", "reuse", reuse, lambda *a: Cost(3, 3))
    plan = record(algorithm, Team.world(2, 0), np.float64, 4)
    received = [message.place.slot for step in plan.steps if type(step) is not Local
                for message in step if not message.is_send]
    assert received == [2, 3, 4] and plan.scratch == (4, 4, 4)


def test_an_algorithm_naming_foreign_memory_is_refused():
    from ray_collective.algorithms.core import Algorithm, Cost

    def rogue(team, buf, ctx, step0=0):
        yield (Send(1 - team.index, np.zeros(3), 0),)

    algorithm = Algorithm("allreduce", "rogue", rogue, lambda *a: Cost(1, 3))
    with pytest.raises(ValueError, match="neither the call's nor scratch"):
        record(algorithm, Team.world(2, 0), np.float64, 3)


def test_calls_of_one_shape_reuse_one_plan_and_never_select_again(monkeypatch):
    import threading

    import ray_collective.engine.cpu as cpu_engine
    counted = {"select": 0, "record": 0}
    lock = threading.Lock()

    def counting(name, function):
        def wrapper(*args, **kwargs):
            with lock:
                counted[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for name in ("select", "record"):
        monkeypatch.setattr(cpu_engine, name, counting(name, getattr(cpu_engine, name)))

    def body(rank):
        x = np.full(10, rank, np.float32)
        for _ in range(6):
            col.allreduce(x)                   # one shape: recorded once
        col.allreduce(np.zeros((2, 5), np.float32))   # another shape: a second plan
        return x, len(current_registry().get("default").prepared)

    for x, prepared in run_ranks(3, body):
        np.testing.assert_array_equal(x, np.full(10, 3 * 3 ** 5, np.float32))
        assert prepared == 2
    assert counted == {"select": 3 * 2, "record": 3 * 2}


def test_the_cache_of_prepared_calls_is_bounded(monkeypatch):
    import ray_collective.group as group
    monkeypatch.setattr(group, "PREPARED_CACHE_SIZE", 4)

    def body(rank):
        for n in range(1, 10):
            x = np.full(n, 1.0)
            col.allreduce(x)
            assert (x == 2.0).all()
        return len(current_registry().get("default").prepared)

    assert run_ranks(2, body) == [4, 4]


def test_a_shape_mismatch_is_still_caught_with_cached_plans():
    def body(rank):
        x = np.ones(4)
        col.allreduce(x)
        col.allreduce(x)
        col.allreduce(np.ones(5 if rank == 1 else 4))

    errors = run_ranks(2, body, return_exceptions=True, timeout=10)
    assert all(isinstance(e, (col.CollectiveMismatchError, col.GroupBrokenError))
               for e in errors)
    assert any(isinstance(e, col.CollectiveMismatchError) for e in errors)


NODE_LAYOUTS = [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 1), (0, 1, 1, 1, 2, 2),
                (0, 0, 1, 1, 2, 2, 3, 3), (0, 1, 2, 0, 1, 2), (1, 0, 0, 1, 2, 2, 2)]


def _rounds_mixing_ways(algorithm, node_of, counts, oversubscribed):
    """How many rounds of the plans of ``algorithm`` (every rank and root) have peers both on
    the rank's node and on others; and how many plans were recorded."""
    from ray_collective.algorithms.core import Topology
    p, topology = len(node_of), Topology.from_node_of(node_of)
    dtype = np.dtype(np.float32)
    reduces = algorithm.collective != "broadcast"
    mixed = recorded = 0
    for count in counts:
        for root in (range(p) if algorithm.collective != "allreduce" else [0]):
            for rank in range(p):
                ctx = Context(dtype, combiner(ReduceOp.SUM, "float32") if reduces else None,
                              node_of=node_of, choose=flat_choice(4, oversubscribed),
                              topology=topology, oversubscribed=oversubscribed)
                try:
                    plan = record(algorithm, Team.world(p, rank), dtype, count,
                                  Blocks.uniform(count, p), root, ctx)
                except ValueError:
                    continue  # a layout the algorithm refuses (the sharded one's uneven nodes)
                recorded += 1
                mixed += sum(len({node_of[m.peer] == node_of[rank] for m in step}) > 1
                             for step in plan.steps if type(step) is not Local)
    return mixed, recorded


@pytest.mark.parametrize("name", ["hierarchical", "hierarchical_sharded"])
@pytest.mark.parametrize("node_of", NODE_LAYOUTS)
@pytest.mark.parametrize("oversubscribed", [False, True])
def test_the_plans_cut_by_way_never_mix_node_and_remote_peers_in_a_round(name, node_of,
                                                                        oversubscribed):
    """A group on the native core across nodes runs these algorithms' rounds within a node on
    the core and the others over the transport, one after the other
    (``engine.cpu._segments``): no round of any rank may have peers both ways."""
    from ray_collective.engine.cpu import CUT_BY_WAY
    assert name in CUT_BY_WAY
    for collective, by_name in ALGORITHMS.items():
        if name in by_name:
            mixed, recorded = _rounds_mixing_ways(by_name[name], node_of,
                                                  (1, 7, 70_000, 1 << 20), oversubscribed)
            assert recorded and not mixed, (collective, mixed, recorded)


def test_the_pipelined_broadcast_mixes_ways_so_it_is_not_cut():
    """Its leaders forward a chunk to the next node and to their node-mates in one round: it
    must run over the transport as a whole (a cut would raise, or hang the ranks that do not
    cut)."""
    from ray_collective.engine.cpu import CUT_BY_WAY
    mixed, _ = _rounds_mixing_ways(ALGORITHMS["broadcast"]["hierarchical_pipeline"],
                                   (0, 0, 1, 1, 2, 2, 3, 3), (1 << 20,), True)
    assert mixed and "hierarchical_pipeline" not in CUT_BY_WAY
