"""Every algorithm of the catalog runs on the native core, one process per rank, and ends with
what the Python engine and numpy give.

Each rank records its plan as TransportMembership does (the world team, uniform blocks, the
flat chooser, a node map for the node-aware algorithms) and runs it on its own Node; the same
plans replayed by the Python engine (``executor.run_plan`` over a ``LocalFabric``, one thread
per rank) must leave every slot bitwise equal, and the collective's result must be numpy's
(data of small integers, so that every summation order is exact). Messages are cut into many
parts (part_bytes 256), and with tiny rings (1 KiB: one part of 16 bytes per frame, a few
frames) every algorithm must still finish. The catalog's algorithms finish there even without
the overflow of eager sends (each round sends and receives at once: measured with the overflow
disabled); a plan that sends in one round and receives in the next on both ranks does not, and
shows that the overflow keeps bounded rings free of deadlocks.
"""

import threading

import numpy as np
import pytest

from ray_collective import native
from ray_collective.algorithms.catalog import ALGORITHMS, flat_choice
from ray_collective.algorithms.core import Blocks, Context, Team
from ray_collective.algorithms.selector import select
from ray_collective.engine.executor import run_plan
from ray_collective.engine.plan import Local, Message, Place, Plan, record
from ray_collective.reductions import combiner
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.local import LocalFabric
from ray_collective.transport.wire import CallHeader, HeaderTemplate
from ray_collective.types import ReduceOp

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native core not built: {native.import_error()}")

if native.available():
    from ray_collective.native import _core
    from ray_collective.native.codes import NO_OP, dtype_code, encode_plan, op_code
    from support.native_processes import Call, ProcessRanks, node_directory, run_calls

ROOTED = ("reduce", "broadcast", "gather", "scatter")
WHOLE_BUFFER = ("allreduce", "reduce", "broadcast")
REDUCING = ("allreduce", "reduce", "reducescatter")
LARGE = 301  # elements per rank: messages of many 256-byte parts
CALL_TIMEOUT = 60.0
WORKERS = 16


@pytest.fixture(scope="module")
def ranks():
    with ProcessRanks(WORKERS) as pool:
        yield pool


class Case:
    """One call of one collective on every rank: plans, inputs and headers."""

    def __init__(self, algorithm, p, count, root, node_of, dtype_name, op, seq, rng):
        self.algorithm, self.p, self.count, self.root = algorithm, p, count, root
        self.dtype_name, self.op = dtype_name, op
        collective = algorithm.collective
        dtype = np.dtype(dtype_name)
        reducing = collective in REDUCING
        self.combine = combiner(op, dtype_name) if reducing else None
        ctx = Context(dtype, self.combine, node_of=node_of, choose=flat_choice(dtype.itemsize))
        length = count if collective in WHOLE_BUFFER else p * count
        blocks = Blocks.uniform(count, p)
        self.exact = not (dtype.kind == "f" and seq % 2)
        if not self.exact:
            self.inputs = [rng.standard_normal(length).astype(dtype) for _ in range(p)]
        else:
            self.inputs = [rng.integers(-50, 50, length).astype(dtype) for _ in range(p)]
        self.plans = [record(algorithm, Team.world(p, rank), dtype, length, blocks, root, ctx)
                      for rank in range(p)]
        header = CallHeader("native", 0, 0, collective, algorithm.name, dtype_name, count,
                            (count,), root, op.name if reducing else "")
        self.stamp = HeaderTemplate(header).stamp(seq)
        self.codes = (dtype_code(dtype_name), op_code(op, dtype_name) if reducing else NO_OP)

    def slots(self, rank):
        """Fresh slots of ``rank`` holding its input (scratch memory of its own)."""
        recvbuf = (np.zeros(len(self.inputs[rank]), self.inputs[rank].dtype)
                   if self.algorithm.collective == "alltoall" else None)
        plan = self.plans[rank]
        return [a.copy() for a in plan.slots(self.inputs[rank].copy(), recvbuf)]

    def native_call(self, rank):
        return Call(encode_plan(self.plans[rank]), self.slots(rank), self.stamp.packed,
                    *self.codes)

    def python_engine(self):
        """The slots of every rank after the Python engine ran the same plans."""
        fabric = LocalFabric(self.p, "native")
        finals = [self.slots(rank) for rank in range(self.p)]
        errors = []

        def rank_main(rank):
            try:
                run_plan(self.plans[rank], finals[rank], fabric.transport(rank),
                         COLLECTIVE_TAG, self.stamp, self.combine, CALL_TIMEOUT,
                         self.algorithm.collective)
            except BaseException as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.p)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        return finals

    def check_numpy(self, finals):
        """The collective's result, as numpy computes it, on every rank that gets one."""
        collective, p, count, root, inputs = (self.algorithm.collective, self.p, self.count,
                                              self.root, self.inputs)
        if not self.exact:
            return  # random floats: only the Python engine's bits are the reference
        total = np.sum(inputs, axis=0, dtype=inputs[0].dtype) if collective in REDUCING else None

        def block(array, i):
            return array[i * count:(i + 1) * count]

        gathered = np.concatenate([block(inputs[i], i) for i in range(p)]) if p else None
        for rank in range(p):
            buf = finals[rank][0]
            if collective == "allreduce" or (collective == "reduce" and rank == root):
                np.testing.assert_array_equal(buf, total)
            elif collective == "broadcast":
                np.testing.assert_array_equal(buf, inputs[root])
            elif collective == "allgather" or (collective == "gather" and rank == root):
                np.testing.assert_array_equal(buf, gathered)
            elif collective == "reducescatter":
                np.testing.assert_array_equal(block(buf, rank), block(total, rank))
            elif collective == "scatter":
                np.testing.assert_array_equal(block(buf, rank), block(inputs[root], rank))
            elif collective == "alltoall":
                np.testing.assert_array_equal(
                    finals[rank][1], np.concatenate([block(inputs[i], rank) for i in range(p)]))


def cases_of(algorithm, p, counts, seed):
    """The calls one world runs back to back: every count, root and node map, alternating
    integer-valued and random data."""
    rng = np.random.default_rng(seed)
    roots = sorted({0, p - 1}) if algorithm.collective in ROOTED else [-1]
    node_maps = ([tuple(r // 2 for r in range(p)), tuple(r // 3 for r in range(p))]
                 if algorithm.node_aware else [None])
    cases = []
    for node_of in node_maps:
        for count in counts:
            for root in roots:
                cases.append(Case(algorithm, p, count, root, node_of, "float64", ReduceOp.SUM,
                                  len(cases), rng))
                cases.append(Case(algorithm, p, count, root, node_of, "float32", ReduceOp.SUM,
                                  len(cases), rng))
    return cases


def run_world(ranks, cases, p, ring_bytes, part_bytes, remote_min_bytes=0):
    """Run ``cases`` back to back on ``p`` processes; check every result against the Python
    engine's bits and numpy. Returns the outcomes (per rank, per case)."""
    with node_directory() as directory:
        args = [(directory, rank, p, ring_bytes, part_bytes, 0,
                 [case.native_call(rank) for case in cases], CALL_TIMEOUT, 0.05,
                 remote_min_bytes) for rank in range(p)]
        outcomes = ranks.run(run_calls, args, timeout=CALL_TIMEOUT * len(cases) + 30)
    for index, case in enumerate(cases):
        statuses = [outcomes[rank][index].status if index < len(outcomes[rank]) else None
                    for rank in range(p)]
        assert statuses == [_core.DONE] * p, (
            f"call {index} ({case.count} elements, root {case.root}): statuses {statuses}, "
            f"mismatches {[o[-1].mismatch for o in outcomes]}")
        reference = case.python_engine()
        finals = [outcomes[rank][index].slots for rank in range(p)]
        for rank in range(p):
            for slot, (ours, theirs) in enumerate(zip(finals[rank], reference[rank])):
                assert ours.tobytes() == theirs.tobytes(), (
                    f"call {index} ({case.count} elements, root {case.root}): rank {rank} "
                    f"slot {slot} differs from the Python engine's")
        case.check_numpy(finals)
    return outcomes


def algorithm_cases(world_sizes):
    for collective, by_name in ALGORITHMS.items():
        for name, algorithm in by_name.items():
            for p in world_sizes:
                if algorithm.power_of_two_only and p & (p - 1):
                    continue
                yield pytest.param(algorithm, p, id=f"{collective}-{name}-p{p}")


@pytest.mark.parametrize("algorithm, p", list(algorithm_cases(range(1, 9))))
def test_every_algorithm_matches_the_python_engine_and_numpy(ranks, algorithm, p):
    cases = cases_of(algorithm, p, (0, 1, 7, LARGE), seed=p)
    run_world(ranks, cases, p, ring_bytes=1 << 16, part_bytes=256)


@pytest.mark.parametrize("algorithm, p", list(algorithm_cases((2, 3, 4))))
def test_large_messages_read_in_place_give_the_same_bits(ranks, algorithm, p):
    """Every message of 64 bytes or more offered to be read in place (remote.c), over rings
    too small to hold one: the same bits as the Python engine and numpy, and every such
    message read in place (reduced a piece at a time where the receive reduces)."""
    cases = cases_of(algorithm, p, (7, LARGE), seed=p + 200)
    outcomes = run_world(ranks, cases, p, ring_bytes=1024, part_bytes=16, remote_min_bytes=64)
    for index, case in enumerate(cases):
        reads = sum(outcomes[rank][index].remote_reads for rank in range(p))
        large = sum(message.is_send and (message.place.stop - message.place.start)
                    * plan.dtype.itemsize >= 64
                    for plan in case.plans for step in plan.steps if type(step) is not Local
                    for message in step)
        assert reads == large, (f"call {index} ({algorithm.name}): {reads} of {large} "
                                f"messages of 64 bytes or more were read in place")


@pytest.mark.parametrize("algorithm, p", list(algorithm_cases((2, 3, 4, 8))))
def test_tiny_rings_never_deadlock(ranks, algorithm, p):
    cases = cases_of(algorithm, p, (7, LARGE), seed=p + 100)
    run_world(ranks, cases, p, ring_bytes=1024, part_bytes=16)


FAN_OUT_BYTES = 2 << 20  # native/node.h: RC_FAN_OUT_REMOTE_MIN_BYTES


@pytest.mark.parametrize("collective, name, p, reads_per_call", [
    ("broadcast", "linear", 4, 3),    # the root sends one range to 3 peers: each reads it
    ("broadcast", "linear", 3, 0),    # 2 peers are no fan-out
    ("scatter", "linear", 4, 0),      # 3 sends, each of its own range
    ("alltoall", "linear", 4, 0)])
def test_a_fan_out_from_2_mib_is_read_in_place_below_the_node_s_threshold(
        ranks, collective, name, p, reads_per_call):
    """With the node's threshold at its default (32 MiB), the sends of a round that carry the
    same 2 MiB range to three peers or more are read in place by their receivers, the same
    bits as the Python engine's and numpy's; sends of distinct ranges go through the rings."""
    algorithm = ALGORITHMS[collective][name]
    count = FAN_OUT_BYTES // 8  # float64 elements: 2 MiB per message
    cases = [case for case in cases_of(algorithm, p, (count,), seed=p + 300)
             if case.dtype_name == "float64"]
    outcomes = run_world(ranks, cases, p, ring_bytes=1 << 16, part_bytes=256,
                         remote_min_bytes=32 << 20)
    for index in range(len(cases)):
        assert sum(outcomes[rank][index].remote_reads for rank in range(p)) == reads_per_call


def exchange_in_two_rounds(rank, count):
    """Both ranks send first and receive in the next round: over rings smaller than the
    message, only buffered (detached) sends let this finish."""
    peer = 1 - rank
    return Plan(None, [(Message(True, peer, 0, Place(0, 0, count), False),),
                       (Message(False, peer, 0, Place(2, 0, count), False),)], [count],
                np.dtype(np.float64))


@pytest.mark.parametrize("count", [64, 10_000])
def test_sends_that_need_buffering_finish_over_tiny_rings(ranks, count):
    inputs = [np.arange(count, dtype=np.float64) * (rank + 1) for rank in range(2)]
    header = HeaderTemplate(CallHeader("native", 0, 0, "custom", "exchange", "float64", count,
                                       (count,))).stamp(0).packed
    calls = []
    for rank in range(2):
        plan = exchange_in_two_rounds(rank, count)
        calls.append([Call(encode_plan(plan), plan.slots(inputs[rank].copy()), header,
                           dtype_code("float64"), NO_OP)])
    with node_directory() as directory:
        outcomes = ranks.run(run_calls, [(directory, rank, 2, 1024, 16, 0, calls[rank],
                                          CALL_TIMEOUT) for rank in range(2)],
                             timeout=CALL_TIMEOUT + 30)
    for rank in range(2):
        (outcome,) = outcomes[rank]
        assert outcome.status == _core.DONE
        np.testing.assert_array_equal(outcome.slots[2], inputs[1 - rank])


@pytest.mark.parametrize("p", [13, 16])
@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "allgather", "reducescatter",
                                        "alltoall", "barrier", "reduce", "gather", "scatter"])
def test_the_selected_algorithm_on_larger_worlds(ranks, collective, p):
    for count in (1, LARGE):
        algorithm = select(collective, count, 8, p)
        run_world(ranks, cases_of(algorithm, p, (count,), seed=p), p, 1 << 16, 256)
