"""The NCCL backend on real GPUs with real NCCL, CuPy and (when it has CUDA) torch.

Marked ``gpu`` and skipped, with the reason, where CuPy, NCCL or a GPU is missing. No Ray is
needed: ranks are threads of this process, one GPU each, meeting through an
``InProcessRendezvous``. World size 1 covers every collective and every multi-GPU variant (with
all visible GPUs in the one process); the multi-rank tests need two or more GPUs. Results are
compared with what numpy, CuPy or torch computes itself. At world size 1 every output starts as
a sentinel and reductions also run out of place, so that a launch that did nothing fails them:
``support.gpu_world_one`` holds those bodies, and ``tests/test_nccl_standin.py`` runs them on
the NCCL stand-in, as they are and with launches that move nothing.

    python -m pytest -q -m gpu tests/test_nccl_gpu.py
"""

import threading
import time

import numpy as np
import pytest

import ray_collective as col
from support.contract import CASES, TensorKind, check_every_collective, every_collective
from support import extras
from support import gpu_world_one as world_one
from support.helpers import rank_data
from support.nccl_ranks import run_nccl_ranks, values_of


def _find_gpus():
    """``(cupy, library, gpu count)``, or ``(None, reason)`` when the tests cannot run."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (pip install cupy-cuda12x nvidia-nccl-cu12)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CuPy raises CUDARuntimeError (or others) without a driver
        return None, f"CuPy finds no usable CUDA device ({err})"
    if count == 0:
        return None, "no GPU is visible (CUDA_VISIBLE_DEVICES?)"
    from ray_collective.backends.nccl import load_library
    try:
        return (cupy, load_library(), count), ""
    except col.BackendNotAvailableError as err:
        return None, str(err)


_FOUND, _WHY_NOT = _find_gpus()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_FOUND is None, reason=f"needs a GPU, CuPy and NCCL: {_WHY_NOT}")]

def _cupy():
    return _FOUND[0]


def _library():
    return _FOUND[1]


def _gpu_count():
    return _FOUND[2]


def _cupy_reduce(arrays, op):
    """What CuPy itself computes for the reduction of ``arrays`` with ``op``."""
    cupy = _cupy()
    stacked = cupy.stack(arrays)
    if stacked.dtype == bool:
        any_, all_ = stacked.any(axis=0), stacked.all(axis=0)
        return {col.ReduceOp.SUM: any_, col.ReduceOp.PRODUCT: all_, col.ReduceOp.MIN: all_,
                col.ReduceOp.MAX: any_}[op]
    if op is col.ReduceOp.PRODUCT:
        return stacked.prod(axis=0, dtype=stacked.dtype)
    if op is col.ReduceOp.MIN:
        return stacked.min(axis=0)
    if op is col.ReduceOp.MAX:
        return stacked.max(axis=0)
    total = stacked.sum(axis=0, dtype=stacked.dtype)
    if op is col.ReduceOp.SUM:
        return total
    if stacked.dtype.kind in "iu":  # NCCL's average truncates toward zero on integers
        return (cupy.abs(total) // len(arrays) * cupy.sign(total)).astype(stacked.dtype)
    return (total / len(arrays)).astype(stacked.dtype)


def _assert_same(got, expected):
    got, expected = _cupy().asnumpy(got), _cupy().asnumpy(expected)
    if expected.dtype.kind in "fc":
        rtol = 1e-2 if expected.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(got, expected)


def _on(device, values):
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.asarray(values)


# ------------------------------------------------------------------ world size 1

class CupyGpus:
    """The visible GPUs through CuPy, for the bodies of ``support.gpu_world_one``."""

    def __init__(self):
        self.device_count = _gpu_count()

    def library(self):
        return _library()

    def array(self, values, device=0):
        return _on(device, values)

    def host(self, tensor):
        return _cupy().asnumpy(tensor)


def test_every_collective_at_world_size_one():
    body = world_one.every_collective(CupyGpus())
    assert values_of(run_nccl_ranks(_library(), 1, body, devices_of=lambda rank: [0]))


def test_multigpu_variants_at_world_size_one():
    gpus = CupyGpus()
    body = world_one.multigpu_variants(gpus)
    assert values_of(run_nccl_ranks(_library(), 1, body,
                                    devices_of=lambda rank: list(range(gpus.device_count))))


def test_torch_cuda_tensors_including_bfloat16():
    torch = extras.need("torch", "torch CUDA tensors")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")

    def body(rank):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            source = torch.arange(12, device="cuda:0").to(dtype)
            expected = source.clone()
            tensor = source.clone()
            col.allreduce(tensor, op=col.ReduceOp.MAX)
            assert torch.equal(tensor, expected)
            # out of place, so that a launch that did nothing leaves the sentinel
            output = torch.full_like(source, -1)
            col.reducescatter(output, [source.clone()], op=col.ReduceOp.MAX)
            assert torch.equal(output, expected), dtype
            output = torch.full_like(source, -1)
            col.allgather([output], source)
            assert torch.equal(output, expected), dtype
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            tensor = torch.zeros(1 << 20, device="cuda:0")
            for _ in range(20):
                tensor += 1
            outputs = [torch.full_like(tensor, -1)]
            col.allgather(outputs, tensor)
            total = float(outputs[0].sum())
        return total

    assert values_of(run_nccl_ranks(_library(), 1, body, devices_of=lambda rank: [0])) == [
        20.0 * (1 << 20)]


def test_collective_sees_the_work_queued_on_the_callers_stream():
    cupy = _cupy()

    def body(rank):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            tensor = cupy.zeros(1 << 22, cupy.float32)
            for _ in range(20):
                tensor += 1  # still running on the GPU when the collective is called
            outputs = [cupy.full_like(tensor, -1)]
            col.allgather(outputs, tensor)
            outputs[0] *= 2  # queued after the collective on the caller's stream
            total = float(outputs[0].sum())
        return total

    assert values_of(run_nccl_ranks(_library(), 1, body, devices_of=lambda rank: [0])) == [
        40.0 * (1 << 22)]


def test_async_op_completes_when_the_gpu_has():
    cupy = _cupy()

    def body(rank):
        source = cupy.ones(1 << 20, cupy.float64)
        output = cupy.full_like(source, -1)
        work = col.reducescatter(output, [source], async_op=True)
        work.wait(60)
        assert work.is_completed()
        col.synchronize(0)
        return float(output.sum())

    assert values_of(run_nccl_ranks(_library(), 1, body, devices_of=lambda rank: [0])) == [
        float(1 << 20)]
    assert col.nccl_available()


# ------------------------------------------------------------------ several ranks

needs_two_gpus = pytest.mark.skipif(
    _FOUND is None or _FOUND[2] < 2,
    reason="multi-rank tests need two or more GPUs: "
           + (_WHY_NOT if _FOUND is None else f"{_FOUND[2]} visible"))


@needs_two_gpus
def test_every_collective_across_ranks():
    cupy = _cupy()
    world = min(_gpu_count(), 4)

    def data(rank, op=col.ReduceOp.SUM, dtype="float32"):
        return rank_data(rank, 257, dtype, op)

    def body(rank):
        with cupy.cuda.Device(rank):
            for dtype in ("float32", "int64", "bool", "complex64"):
                for op in world_one.ops_for(dtype):
                    tensor = cupy.asarray(data(rank, op, dtype))
                    col.allreduce(tensor, op=op)
                    _assert_same(tensor, _cupy_reduce(
                        [cupy.asarray(data(r, op, dtype)) for r in range(world)], op))
            tensor = cupy.asarray(data(rank))
            col.broadcast(tensor, src_rank=world - 1)
            _assert_same(tensor, cupy.asarray(data(world - 1)))
            outputs = [cupy.zeros(257, cupy.float32) for _ in range(world)]
            col.allgather(outputs, cupy.asarray(data(rank)))
            for r, got in enumerate(outputs):
                _assert_same(got, cupy.asarray(data(r)))
            parts = [cupy.asarray(data(10 * rank + r)) for r in range(world)]
            mine = cupy.zeros(257, cupy.float32)
            col.reducescatter(mine, parts)
            _assert_same(mine, sum(cupy.asarray(data(10 * r + rank)) for r in range(world)))
            received = [cupy.zeros(257, cupy.float32) for _ in range(world)]
            col.alltoall(received, parts)
            for r, got in enumerate(received):
                _assert_same(got, cupy.asarray(data(10 * r + rank)))
            gathered = [cupy.full(257, -1, cupy.float32) for _ in range(world)]
            col.gather(gathered if rank == 0 else None, cupy.asarray(data(rank)), dst_rank=0)
            for r, got in enumerate(gathered if rank == 0 else []):
                _assert_same(got, cupy.asarray(data(r)))
            mine = cupy.full(257, -1, cupy.float32)
            col.scatter(mine, parts if rank == 1 else None, src_rank=1)
            _assert_same(mine, cupy.asarray(data(10 + rank)))
            if rank == 0:
                col.send(cupy.arange(9, dtype=cupy.int32), dst_rank=1, tag=3)
                col.send_multigpu(cupy.arange(9, dtype=cupy.int32), 1, 0, n_elements=4)
            elif rank == 1:
                box = cupy.zeros(9, cupy.int32)
                col.recv(box, src_rank=0, tag=3)
                _assert_same(box, cupy.arange(9, dtype=cupy.int32))
                box[:] = -1
                col.recv_multigpu(box, 0, 0, n_elements=4)
                _assert_same(box[:4], cupy.arange(4, dtype=cupy.int32))
            col.barrier()
        return True

    assert all(values_of(run_nccl_ranks(_library(), world, body)))


@needs_two_gpus
def test_multigpu_variants_across_ranks_with_two_gpus_each():
    if _gpu_count() < 4:
        pytest.skip("needs four GPUs: two processes of two GPUs")

    def body(rank):
        gpus = [2 * rank, 2 * rank + 1]
        tensors = [_on(d, np.full(4, d + 1.0)) for d in gpus]
        col.allreduce_multigpu(tensors)
        return [t.get() for t in tensors]

    for tensors in values_of(run_nccl_ranks(_library(), 2, body,
                                            devices_of=lambda rank: [2 * rank, 2 * rank + 1])):
        for got in tensors:
            np.testing.assert_allclose(got, np.full(4, 10.0))


@needs_two_gpus
def test_a_rank_that_never_calls_makes_the_other_time_out_and_abort():
    cupy = _cupy()
    may_leave = threading.Event()

    def body(rank):
        if rank == 1:
            may_leave.wait(60)
            return None
        try:
            with cupy.cuda.Device(0):
                started = time.monotonic()
                with pytest.raises(col.CollectiveTimeoutError) as caught:
                    col.allreduce(cupy.ones(4), timeout=2)
                elapsed = time.monotonic() - started
                with pytest.raises(col.GroupBrokenError):
                    col.allreduce(cupy.ones(4))
            return [caught.value.missing_ranks, elapsed]
        finally:
            may_leave.set()

    missing, elapsed = values_of(run_nccl_ranks(_library(), 2, body))[0]
    assert missing == (1,) and elapsed < 10


# ------------------------------------------------------------------ the contract

class CupyKind(TensorKind):
    """CuPy arrays on rank r's GPU (device r)."""

    def tensor(self, array, rank):
        with _cupy().cuda.Device(rank):
            return _cupy().asarray(array)

    def array(self, tensor):
        return _cupy().asnumpy(tensor)


def _check_the_contract(world_size):
    def body(rank, case):
        with _cupy().cuda.Device(rank):
            return every_collective(rank, "contract", world_size, *case, CupyKind())

    for case in CASES:
        results = values_of(run_nccl_ranks(_library(), world_size, group_name="contract",
                                           body=lambda rank, case=case: body(rank, case)))
        check_every_collective(results, world_size, *case)


def test_the_contract_at_world_size_one():
    _check_the_contract(1)


@needs_two_gpus
def test_the_contract_across_ranks():
    _check_the_contract(min(_gpu_count(), 4))
