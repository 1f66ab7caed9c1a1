"""The NCCL backend's collectives against the recording stand-in for CuPy and NCCL (no GPU).

These check the backend's own logic end to end through the public API: how each collective
and multi-GPU variant is decomposed into NCCL calls (peers, roots, counts, datatypes, scratch
copies, groups), with the stand-in moving the data on host memory so results are compared with
numpy. They say nothing about real NCCL or a real GPU: ``test_nccl_gpu.py`` does.
"""

import numpy as np
import pytest

import ray_collective as col
from support.helpers import numpy_reduce, rank_data
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import NCCL_CONSTANTS, StandInGpus

OPS = [col.ReduceOp.SUM, col.ReduceOp.PRODUCT, col.ReduceOp.MIN, col.ReduceOp.MAX,
       col.ReduceOp.AVG]
# The dtypes NCCL reduces natively, plus the ones the backend maps (bool on uint8 bytes,
# complex on its float parts).
REDUCIBLE = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"]
ALL_DTYPES = REDUCIBLE + ["int16", "uint16"]


def _ops_for(dtype):
    if dtype == "bool":
        return [op for op in OPS if op is not col.ReduceOp.AVG]
    if dtype.startswith("complex"):
        return [col.ReduceOp.SUM, col.ReduceOp.AVG]
    return OPS


def _expect(got, want):
    # The inputs are small integers: every result, float or not, is exact (the stand-in reduces
    # in numpy's order, so even AVG's division rounds alike).
    np.testing.assert_array_equal(got, want)


@pytest.fixture
def gpus():
    gpus = StandInGpus(device_count=4)
    yield gpus
    gpus.close()  # what still waits (a rank that never came) raises instead


@pytest.mark.parametrize("dtype", REDUCIBLE)
@pytest.mark.parametrize("world_size", [1, 3])
def test_allreduce_every_mapped_dtype_and_op(gpus, dtype, world_size):
    def body(rank):
        results = {}
        for op in _ops_for(dtype):
            tensor = gpus.array(rank_data(rank, (2, 3), dtype, op), device=rank)
            col.allreduce(tensor, op=op)
            results[op] = tensor.host.copy()
        return results

    for results in values_of(run_nccl_ranks(gpus.library(), world_size, body)):
        for op, got in results.items():
            inputs = [rank_data(r, (2, 3), dtype, op) for r in range(world_size)]
            if dtype.startswith("complex"):
                # NCCL reduces the real and imaginary parts as floats: AVG divides each part,
                # which may round otherwise than numpy's complex division
                parts = numpy_reduce([x.view(x.real.dtype) for x in inputs], op)
                _expect(got, parts.view(dtype))
            else:
                _expect(got, numpy_reduce(inputs, op))


def test_reduce_writes_only_the_root(gpus):
    def body(rank):
        tensor = gpus.array(rank_data(rank, 5, "int64"), device=rank)
        col.reduce(tensor, dst_rank=1, op=col.ReduceOp.MAX)
        return tensor.host.copy()

    results = values_of(run_nccl_ranks(gpus.library(), 3, body))
    _expect(results[1], numpy_reduce([rank_data(r, 5, "int64") for r in range(3)],
                                     col.ReduceOp.MAX))
    for rank in (0, 2):
        _expect(results[rank], rank_data(rank, 5, "int64"))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_broadcast_moves_every_dtype_unchanged(gpus, dtype):
    def body(rank):
        tensor = gpus.array(rank_data(rank, (4,), dtype), device=rank)
        col.broadcast(tensor, src_rank=2)
        return tensor.host.copy()

    for got in values_of(run_nccl_ranks(gpus.library(), 3, body)):
        np.testing.assert_array_equal(got, rank_data(2, (4,), dtype))


@pytest.mark.parametrize("dtype", ["int16", "complex128", "bool", "float32"])
def test_allgather_fills_the_list_through_scratch(gpus, dtype):
    def body(rank):
        outputs = [gpus.array(np.zeros(3, dtype), device=rank) for _ in range(3)]
        col.allgather(outputs, gpus.array(rank_data(rank, 3, dtype), device=rank))
        return [o.host.copy() for o in outputs]

    for outputs in values_of(run_nccl_ranks(gpus.library(), 3, body)):
        for peer, got in enumerate(outputs):
            np.testing.assert_array_equal(got, rank_data(peer, 3, dtype))


@pytest.mark.parametrize("op", OPS)
def test_reducescatter_gives_each_rank_its_part(gpus, op):
    def inputs(rank):
        return [rank_data(rank * 10 + part, 4, "float64", op) for part in range(3)]

    def body(rank):
        output = gpus.array(np.zeros(4), device=rank)
        col.reducescatter(output, [gpus.array(x, device=rank) for x in inputs(rank)], op=op)
        return output.host.copy()

    for rank, got in enumerate(values_of(run_nccl_ranks(gpus.library(), 3, body))):
        _expect(got, numpy_reduce([inputs(r)[rank] for r in range(3)], op))


def test_gather_and_scatter_through_grouped_send_recv(gpus):
    def body(rank):
        gathered = [gpus.array(np.zeros(2, np.int32), device=rank) for _ in range(3)]
        col.gather(gathered if rank == 1 else None,
                   gpus.array(np.array([rank, -rank], np.int32), device=rank), dst_rank=1)
        part = gpus.array(np.zeros(2, np.int32), device=rank)
        parts = [gpus.array(np.array([7 * r, 8], np.int32), device=rank) for r in range(3)]
        col.scatter(part, parts if rank == 2 else None, src_rank=2)
        return [g.host.copy() for g in gathered], part.host.copy()

    results = values_of(run_nccl_ranks(gpus.library(), 3, body))
    for peer, got in enumerate(results[1][0]):
        np.testing.assert_array_equal(got, [peer, -peer])
    for rank, (_, part) in enumerate(results):
        np.testing.assert_array_equal(part, [7 * rank, 8])
    # Rank 2 sends its gather part to root 1, then scatters to ranks 0 and 1.
    sends = [c for c in gpus.calls("send") if c[0] == "rank-2"]
    assert [c[4]["peer"] for c in sends] == [1, 0, 1]
    assert len(gpus.calls("groupStart")) >= 2


def test_alltoall_exchanges_every_block(gpus):
    def body(rank):
        inputs = [gpus.array(np.full(3, 10 * rank + peer, np.float32), device=rank)
                  for peer in range(3)]
        outputs = [gpus.array(np.zeros(3, np.float32), device=rank) for _ in range(3)]
        col.alltoall(outputs, inputs)
        return [o.host.copy() for o in outputs]

    for rank, outputs in enumerate(values_of(run_nccl_ranks(gpus.library(), 3, body))):
        for peer, got in enumerate(outputs):
            np.testing.assert_array_equal(got, np.full(3, 10 * peer + rank))


def test_send_recv_and_barrier(gpus):
    def body(rank):
        if rank == 0:
            col.send(gpus.array(np.arange(6, dtype=np.uint16), device=0), dst_rank=2)
        if rank == 2:
            box = gpus.array(np.zeros(6, np.uint16), device=2)
            col.recv(box, src_rank=0)
            return box.host.copy()
        col.barrier()
        return None

    def with_barrier(rank):
        got = body(rank)
        if rank == 2:
            col.barrier()
        return got

    results = values_of(run_nccl_ranks(gpus.library(), 3, with_barrier))
    np.testing.assert_array_equal(results[2], np.arange(6))
    # uint16 has no NCCL type: it travels as its bytes.
    send = gpus.calls("send")[0][4]
    assert (send["datatype"], send["count"]) == (NCCL_CONSTANTS["NCCL_UINT8"], 12)


def test_empty_tensors_launch_nothing(gpus):
    def body(rank):
        tensor = gpus.array(np.zeros(0, np.float32), device=rank)
        col.allreduce(tensor)
        col.allgather([gpus.array(np.zeros(0, np.float32), device=rank) for _ in range(2)],
                      tensor)
        return tensor.host.shape

    assert values_of(run_nccl_ranks(gpus.library(), 2, body)) == [(0,), (0,)]
    assert not gpus.calls("allReduce") and not gpus.calls("allGather")


def test_the_stand_in_records_datatypes_counts_and_ops(gpus):
    def body(rank):
        col.allreduce(gpus.array(np.ones(4, bool), device=rank), op=col.ReduceOp.SUM)
        col.allreduce(gpus.array(np.ones(3, np.complex64), device=rank))
        col.allreduce(gpus.array(np.ones(2, np.float32), device=rank), op=col.ReduceOp.AVG)

    values_of(run_nccl_ranks(gpus.library(), 1, body))
    seen = [(c[4]["datatype"], c[4]["count"], c[4]["op"]) for c in gpus.calls("allReduce")]
    c = NCCL_CONSTANTS
    assert seen == [(c["NCCL_UINT8"], 4, c["NCCL_MAX"]), (c["NCCL_FLOAT32"], 6, c["NCCL_SUM"]),
                    (c["NCCL_FLOAT32"], 2, c["NCCL_AVG"])]


# ------------------------------------------------------------------ multi-GPU variants

def _two_gpus(rank):
    return [2 * rank, 2 * rank + 1]


def _per_gpu(gpus, rank, make):
    return [gpus.array(make(2 * rank + i), device=2 * rank + i) for i in range(2)]


def test_allreduce_multigpu_reduces_over_every_gpu(gpus):
    def body(rank):
        tensors = _per_gpu(gpus, rank, lambda g: np.full(3, g + 1, np.float64))
        col.allreduce_multigpu(tensors, op=col.ReduceOp.AVG)
        return [t.host.copy() for t in tensors]

    for tensors in values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus)):
        for got in tensors:
            np.testing.assert_allclose(got, np.full(3, 2.5))
    # One NCCL group per call: the two communicators of a process launch together.
    assert {c[0] for c in gpus.calls("groupStart")} >= {"rank-0", "rank-1"}


def test_reduce_and_broadcast_multigpu_address_one_gpu_of_one_rank(gpus):
    def body(rank):
        reduced = _per_gpu(gpus, rank, lambda g: np.array([g, 10 * g], np.int64))
        col.reduce_multigpu(reduced, dst_rank=1, dst_tensor=0, op=col.ReduceOp.SUM)
        spread = _per_gpu(gpus, rank, lambda g: np.array([100 + g], np.int32))
        col.broadcast_multigpu(spread, src_rank=0, src_tensor=1)
        return [t.host.copy() for t in reduced], [t.host.copy() for t in spread]

    results = values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus))
    np.testing.assert_array_equal(results[1][0][0], [6, 60])  # GPU 0 of rank 1 = GPU 2
    np.testing.assert_array_equal(results[1][0][1], [3, 30])  # unchanged
    np.testing.assert_array_equal(results[0][0][0], [0, 0])
    for _, spread in results:
        for got in spread:
            np.testing.assert_array_equal(got, [101])  # GPU 1 of rank 0
    roots = {c[4]["root"] for c in gpus.calls("reduce")}
    assert roots == {2}  # NCCL rank of (rank 1, GPU 0) with 2 GPUs per process


def test_allgather_and_reducescatter_multigpu(gpus):
    def body(rank):
        inputs = _per_gpu(gpus, rank, lambda g: np.array([g, -g], np.float32))
        outputs = [[gpus.array(np.zeros(2, np.float32), device=d) for _ in range(4)]
                   for d in _two_gpus(rank)]
        col.allgather_multigpu(outputs, inputs)
        scattered = _per_gpu(gpus, rank, lambda g: np.zeros(2, np.float32))
        parts = [[gpus.array(np.full(2, 100 * g + j, np.float32), device=g) for j in range(4)]
                 for g in _two_gpus(rank)]
        col.reducescatter_multigpu(scattered, parts, op=col.ReduceOp.SUM)
        return ([[o.host.copy() for o in per] for per in outputs],
                [s.host.copy() for s in scattered])

    results = values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus))
    for rank, (gathered, scattered) in enumerate(results):
        for per_gpu in gathered:
            for g, got in enumerate(per_gpu):
                np.testing.assert_array_equal(got, [g, -g])
        for i, got in enumerate(scattered):
            g = 2 * rank + i
            np.testing.assert_array_equal(got, np.full(2, 100 * (0 + 1 + 2 + 3) + 4 * g))


def test_send_recv_multigpu_between_chosen_gpus(gpus):
    def body(rank):
        if rank == 0:
            col.send_multigpu(gpus.array(np.arange(5, dtype=np.int64), device=1), dst_rank=1,
                              dst_gpu_index=0, n_elements=3)
            return None
        box = gpus.array(np.full(5, -1, np.int64), device=2)
        col.recv_multigpu(box, src_rank=0, src_gpu_index=1, n_elements=3)
        return box.host.copy()

    results = values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus))
    np.testing.assert_array_equal(results[1], [0, 1, 2, -1, -1])
    send = gpus.calls("send")[0]
    assert (send[4]["peer"], send[4]["count"]) == (2, 3)  # rank 1, GPU 0 → NCCL rank 2


def test_plain_collective_on_a_second_gpu_gets_its_own_clique(gpus):
    rendezvous_keys = []

    def body(rank):
        tensor = gpus.array(np.full(2, rank + 1.0), device=2 * rank + 1)
        col.allreduce(tensor)
        col.allreduce(tensor)
        return tensor.host.copy()

    from ray_collective.backends.nccl import InProcessRendezvous
    rendezvous = InProcessRendezvous()
    results = values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus,
                                       rendezvous=rendezvous))
    for got in results:
        np.testing.assert_array_equal(got, [6.0, 6.0])
    rendezvous_keys.extend(rendezvous.keys())
    assert rendezvous_keys == []
    # The main clique has 4 communicators; the GPU-1 clique adds one per process, made once.
    assert len(gpus.communicators()) == 6
    assert {c.nranks for c in gpus.communicators()} == {4, 2}
