"""Calls of a known shape on the NCCL backend, against the recording stand-in (no GPU).

After an allreduce, reduce or broadcast on a GPU tensor (cupy, or torch on CUDA) has run once,
later blocking calls on tensors of the same dtype, shape, strides and device skip the API's
checks and the step building (``NcclMembership.one_operation``). They must give the same
results, keep the same stream order and fail the same way as the full path; the completion poll they end in must not
sleep while it spins.
"""

import dataclasses
import sys
import time
import types

import numpy as np
import pytest

import ray_collective as col
from ray_collective.backends.nccl import NcclOptions
from ray_collective.backends.nccl import completion
from ray_collective.backends.nccl.backend import NcclMembership
from support.helpers import count_full_path
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import StandInCupyArray, StandInGpus


@pytest.fixture
def gpus():
    gpus = StandInGpus(device_count=4)
    yield gpus
    gpus.close()  # what still waits (a rank that never came) raises instead


def _values(rank, step):
    return (np.arange(6, dtype=np.float32).reshape(2, 3) + 1) * (rank + 2) + step


CALLS = {
    "allreduce": (lambda x: col.allreduce(x, op=col.ReduceOp.MAX),
                  lambda inputs, rank: np.max(inputs, axis=0)),
    "reduce": (lambda x: col.reduce(x, dst_rank=1),
               lambda inputs, rank: np.sum(inputs, axis=0) if rank == 1 else inputs[rank]),
    "broadcast": (lambda x: col.broadcast(x, src_rank=2),
                  lambda inputs, rank: inputs[2]),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_repeated_calls_on_new_arrays_match_numpy_and_skip_the_full_path(gpus, name,
                                                                        monkeypatch):
    taken = count_full_path(monkeypatch, NcclMembership)
    call, _ = CALLS[name]
    steps = 4

    def body(rank):
        results = []
        for step in range(steps):
            # A new array each step: the runner must use each call's own address.
            tensor = gpus.array(_values(rank, step), device=rank)
            call(tensor)
            results.append(tensor.host.copy())
        return results

    results = values_of(run_nccl_ranks(gpus.library(), 3, body))
    _, expect = CALLS[name]
    for rank, per_step in enumerate(results):
        for step, got in enumerate(per_step):
            inputs = [_values(r, step) for r in range(3)]
            np.testing.assert_array_equal(got, expect(inputs, rank))
    assert taken == [name] * 3  # each rank's first call only
    assert len(gpus.calls({"allreduce": "allReduce"}.get(name, name))) == 3 * steps


def test_a_known_shape_call_keeps_the_callers_stream_order(gpus):
    def body(rank):
        caller = gpus.new_stream(0)
        gpus.use_stream(0, caller)
        col.allreduce(gpus.array(np.ones(4, np.float32), device=0))
        start = len(gpus.log)
        col.allreduce(gpus.array(np.ones(4, np.float32), device=0))
        return caller, start

    caller, start = values_of(run_nccl_ranks(gpus.library(), 1, body))[0]
    log = gpus.log[start:]
    names = [e[1] for e in log]
    ready = names.index("eventRecord")
    launch = names.index("allReduce")
    dedicated = log[launch][3]
    assert log[ready][3] == caller
    waits = next(i for i, e in enumerate(log) if e[1] == "streamWaitEvent" and e[2] == dedicated)
    done = next(i for i, e in enumerate(log) if e[1] == "eventRecord" and e[3] == dedicated)
    after = next(i for i, e in enumerate(log) if e[1] == "streamWaitEvent" and e[2] == caller)
    assert ready < waits < launch < done < after


def test_a_cupy_array_unlike_the_known_shape_takes_the_full_path_and_its_checks(gpus):
    def body(rank):
        col.allreduce(gpus.array(np.ones((3, 2), np.float32), device=0))
        wide = gpus.array(np.ones((3, 4), np.float32), device=0)
        strided = StandInCupyArray(wide.host[:, ::2], 0, wide.data)  # shape (3, 2), strided
        with pytest.raises(col.ArgumentValueError, match="non-contiguous"):
            col.allreduce(strided)
        other_dtype = gpus.array(np.ones((3, 2), np.float64), device=0)
        col.allreduce(other_dtype)
        return other_dtype.host.copy()

    np.testing.assert_array_equal(values_of(run_nccl_ranks(gpus.library(), 1, body))[0],
                                  np.ones((3, 2)))


@dataclasses.dataclass(frozen=True)
class _TorchDevice:
    type: str
    index: int


class _StandInTorch:
    """Just enough of torch for CUDA tensors over stand-in memory: the module's ``Tensor``,
    ``strided`` and ``cuda.current_stream``."""

    strided = "strided"

    def __init__(self, gpus):
        torch = self

        class Tensor:
            def __init__(self, array):
                self.array = array  # the stand-in memory; the test reads results from it
                self.dtype = f"torch.{array.dtype.name}"
                self.shape, self.is_cuda, self.layout = array.shape, True, torch.strided
                self.device = _TorchDevice("cuda", array.device.id)

            def stride(self):
                return tuple(s // self.array.dtype.itemsize for s in self.array.strides)

            def is_contiguous(self):
                return self.array.flags.c_contiguous

            def is_conj(self):
                return False

            def is_neg(self):
                return False

            def data_ptr(self):
                return self.array.data.ptr

        self.Tensor = Tensor
        self.cuda = types.SimpleNamespace(current_stream=lambda device: types.SimpleNamespace(
            cuda_stream=gpus.default_streams[device]))


def test_torch_cuda_tensors_take_the_known_shape_path_too(gpus, monkeypatch):
    taken = count_full_path(monkeypatch, NcclMembership)
    torch = _StandInTorch(gpus)
    monkeypatch.setitem(sys.modules, "torch", torch)

    def body(rank):
        results = []
        for step in range(3):
            tensor = torch.Tensor(gpus.array(_values(rank, step), device=rank))
            col.allreduce(tensor)
            results.append(tensor.array.host.copy())
        return results

    results = values_of(run_nccl_ranks(gpus.library(), 2, body))
    for per_step in results:
        for step, got in enumerate(per_step):
            np.testing.assert_array_equal(got, _values(0, step) + _values(1, step))
    assert taken == ["allreduce"] * 2


def test_a_known_shape_call_times_out_naming_the_missing_rank_and_its_seq(gpus):
    def body(rank):
        for step in range(2 if rank == 1 else 3):
            col.allreduce(gpus.array(np.ones(2, np.float32), device=rank))
        return None

    results = run_nccl_ranks(gpus.library(), 2, body, timeout=0.5,
                             options=NcclOptions(watchdog_period_seconds=0.01))
    error = results[0]
    assert isinstance(error, col.CollectiveTimeoutError), error
    assert (error.collective, error.seq, error.missing_ranks) == ("allreduce", 2, (1,))
    assert results[1] is None


def test_the_completion_poll_spins_without_a_timed_sleep(monkeypatch):
    """time.sleep(0) lasts the kernel's timer slack (55-75 us measured), longer than a small
    collective: the spin phase yields the processor instead."""
    polls = []

    class Library:
        def done(self, event):
            polls.append(event)
            return len(polls) >= 5

        def check_async_error(self, communicator):
            pass

    def no_sleep(seconds):
        raise AssertionError(f"slept {seconds} s while spinning")

    yields = []
    # Replaced in the module alone: other threads keep the real time and os modules.
    monkeypatch.setattr(completion, "time",
                        types.SimpleNamespace(monotonic=time.monotonic, sleep=no_sleep))
    monkeypatch.setattr(completion, "os",
                        types.SimpleNamespace(sched_yield=lambda: yields.append(1)))
    assert completion.wait_for_events(Library(), [7], [object()], time.monotonic() + 5,
                                      NcclOptions())
    assert len(polls) == 5 and len(yields) == 4
