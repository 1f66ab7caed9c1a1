"""The NCCL stand-in itself (``support.nccl_standin``), driven through the backend's CuPy
adapter as the backend drives it: it must be no kinder than NCCL where a backend could tell.
Work moves only when the host looks; parties that disagree wait instead of raising; data moves
without a defensive copy, so aliasing NCCL forbids gives wrong results; bfloat16 is reduced as
bfloat16 (checked against torch's own bfloat16 arithmetic); inert launches move nothing. And the
GPU tests at world size 1 (``tests/test_nccl_gpu.py``), run here on the stand-in: they pass, and
they fail when the stand-in's launches move nothing."""

import threading

import numpy as np
import pytest

from support import extras
from support import gpu_world_one as world_one
from support.contract import CASES, check_every_collective, every_collective
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import NCCL_CONSTANTS, StandInGpus, StandInKind

C = NCCL_CONSTANTS
F64 = C["NCCL_FLOAT64"]


@pytest.fixture
def gpus():
    gpus = StandInGpus(device_count=3)
    yield gpus
    gpus.close()


def _clique(gpus, n):
    """``n`` communicators of one clique, NCCL rank r on device r, made by this thread; their
    library and one stream per device."""
    library = gpus.library()
    communicators = library.open_communicators(library.unique_id(), n,
                                               [(d, d) for d in range(n)])
    return library, communicators, [library.create_stream(d) for d in range(n)]


def _grouped(library, launches):
    library.group_start()
    for launch in launches:
        launch()
    library.group_end()


def _events(library, streams):
    """An event recorded after the work queued so far on each stream."""
    events = [library.create_event(d) for d in range(len(streams))]
    for event, stream in zip(events, streams):
        library.record(event, stream)
    return events


def _allreduce(gpus, communicators, streams, inputs, outputs, datatype=F64, op=C["NCCL_SUM"]):
    return [lambda r=r: communicators[r].allReduce(
        inputs[r].data.ptr, outputs[r].data.ptr, inputs[r].size, datatype, op, streams[r])
        for r in range(len(communicators))]


def test_work_moves_only_when_the_host_looks(gpus):
    library, communicators, streams = _clique(gpus, 2)
    inputs = [gpus.array(np.full(3, r + 1.0), device=r) for r in range(2)]
    outputs = [gpus.array(np.zeros(3), device=r) for r in range(2)]
    _grouped(library, _allreduce(gpus, communicators, streams, inputs, outputs))
    events = _events(library, streams)
    assert [o.host.tolist() for o in outputs] == [[0.0] * 3] * 2  # launched, not yet run
    assert all(library.done(event) for event in events)
    assert [o.host.tolist() for o in outputs] == [[3.0] * 3] * 2


def test_parties_that_disagree_wait_for_ever_instead_of_raising(gpus):
    library, communicators, streams = _clique(gpus, 2)
    inputs = [gpus.array(np.ones(2 + r), device=r) for r in range(2)]  # counts 2 and 3
    _grouped(library, _allreduce(gpus, communicators, streams, inputs, inputs))
    events = _events(library, streams)
    for _ in range(3):
        assert not any(library.done(event) for event in events)
    [(_, _, key, what)] = gpus.calls("mismatch")
    assert what == "count [2, 3]"
    assert [i.host.tolist() for i in inputs] == [[1.0] * 2, [1.0] * 3]
    for communicator in communicators:
        library.abort(communicator)  # what a backend's deadline does
    assert all(library.done(event) for event in events)


def test_a_synchronize_waits_for_the_rank_that_comes_last(gpus):
    library, communicators, streams = _clique(gpus, 2)
    tensors = [gpus.array(np.full(2, r + 1.0), device=r) for r in range(2)]
    launches = _allreduce(gpus, communicators, streams, tensors, tensors)
    launches[0]()
    second_launched = threading.Event()
    seen = []

    def synchronize():
        library.synchronize(0)
        seen.append((second_launched.is_set(), tensors[0].host.tolist()))

    waiter = threading.Thread(target=synchronize)
    waiter.start()
    gpus.wait_for_call("deviceSynchronize")
    second_launched.set()
    launches[1]()
    library.record(library.create_event(1), streams[1])  # and the waiter's look moves both
    waiter.join(10)
    assert seen == [(True, [3.0, 3.0])]


def test_a_synchronize_still_waiting_at_close_fails(gpus):
    library, communicators, streams = _clique(gpus, 2)
    tensor = gpus.array(np.ones(2), device=0)
    communicators[0].allReduce(tensor.data.ptr, tensor.data.ptr, 2, F64, C["NCCL_SUM"],
                               streams[0])
    failures = []
    waiter = threading.Thread(target=lambda: failures.append(pytest.raises(
        gpus.cuda.runtime.CUDARuntimeError, library.synchronize, 0)))
    waiter.start()
    gpus.wait_for_call("deviceSynchronize")
    gpus.close()
    waiter.join(10)
    assert len(failures) == 1


@pytest.mark.parametrize("allowed", [True, False])
def test_only_the_aliasing_nccl_allows_gives_the_right_allgather(gpus, allowed):
    """Each rank's input lies inside its output: at its own place (allowed), or for rank 1 at
    rank 0's place, which rank 0's part overwrites before rank 1's part is read."""
    library, communicators, streams = _clique(gpus, 2)
    places = [0, 2 if allowed else 0]
    received = [gpus.array(np.zeros(4), device=r) for r in range(2)]
    for r, buffer in enumerate(received):
        buffer.host[places[r]:places[r] + 2] = [10.0 * r, 10.0 * r + 1]
    _grouped(library, [lambda r=r: communicators[r].allGather(
        received[r].data.ptr + 8 * places[r], received[r].data.ptr, 2, F64, streams[r])
        for r in range(2)])
    assert all(library.done(event) for event in _events(library, streams))
    right = [0.0, 1.0, 10.0, 11.0]
    assert received[0].host.tolist() == right
    assert received[1].host.tolist() == (right if allowed else [0.0, 1.0, 0.0, 1.0])


@pytest.mark.parametrize("op", ["NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_AVG"])
def test_bfloat16_is_reduced_as_bfloat16_like_torch(gpus, op):
    torch = extras.need("torch", "torch's bfloat16 arithmetic, the reference")
    values = [torch.randn(64, generator=torch.Generator().manual_seed(r)).bfloat16()
              for r in range(3)]
    library, communicators, streams = _clique(gpus, 3)
    bits = [gpus.array(v.view(torch.int16).numpy().view(np.uint16), device=r)
            for r, v in enumerate(values)]
    _grouped(library, _allreduce(gpus, communicators, streams, bits, bits,
                                 datatype=C["NCCL_BFLOAT16"], op=C[op]))
    assert all(library.done(event) for event in _events(library, streams))
    step = {"NCCL_SUM": torch.add, "NCCL_AVG": torch.add, "NCCL_PROD": torch.mul,
            "NCCL_MAX": torch.maximum}[op]
    expected = values[0]
    for value in values[1:]:
        expected = step(expected, value)  # rounded to bfloat16 at every step
    if op == "NCCL_AVG":
        expected = (expected.float() / 3).bfloat16()
    for buffer in bits:
        np.testing.assert_array_equal(buffer.host, expected.view(torch.int16).numpy().view(
            np.uint16))


def test_inert_launches_complete_without_moving_data(gpus):
    gpus.inert_launches = True
    library, communicators, streams = _clique(gpus, 2)
    inputs = [gpus.array(np.full(3, r + 1.0), device=r) for r in range(2)]
    outputs = [gpus.array(np.full(3, -7.0), device=r) for r in range(2)]
    _grouped(library, _allreduce(gpus, communicators, streams, inputs, outputs))
    assert all(library.done(event) for event in _events(library, streams))
    assert [o.host.tolist() for o in outputs] == [[-7.0] * 3] * 2


def _world_one(gpus, name):
    """Run ``tests/test_nccl_gpu.py``'s world-size-1 test ``name`` on the stand-in."""
    if name == "contract":
        for case in CASES:
            results = values_of(run_nccl_ranks(gpus.library(), 1, group_name="contract",
                                               body=lambda rank, case=case: every_collective(
                                                   rank, "contract", 1, *case,
                                                   StandInKind(gpus))))
            check_every_collective(results, 1, *case)
        return
    every_gpu = list(range(gpus.device_count))
    body = getattr(world_one, name)(gpus)
    assert values_of(run_nccl_ranks(gpus.library(), 1, body, devices_of=lambda rank: every_gpu))


WORLD_ONE_TESTS = [body.__name__ for body in world_one.BODIES] + ["contract"]


@pytest.mark.parametrize("name", WORLD_ONE_TESTS)
def test_the_gpu_tests_at_world_size_one_pass_on_the_stand_in(name):
    gpus = StandInGpus(device_count=2)  # multigpu_variants then reduces over two GPUs
    _world_one(gpus, name)
    assert gpus.calls("allReduce") and gpus.calls("reduceScatter")


@pytest.mark.parametrize("name", WORLD_ONE_TESTS)
def test_the_gpu_tests_at_world_size_one_fail_when_a_launch_does_nothing(name):
    gpus = StandInGpus(device_count=2)
    gpus.inert_launches = True
    with pytest.raises(AssertionError, match="Arrays are not equal") as caught:
        _world_one(gpus, name)
    assert "not in a live allocation" not in str(caught.value)
