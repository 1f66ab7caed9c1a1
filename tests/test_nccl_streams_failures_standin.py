"""The NCCL backend's stream ordering, argument checks, failure handling and lifetime, against
the recording stand-in for CuPy and NCCL (no GPU; no claim about real NCCL behaviour).

Ordering: the collective's stream waits for an event on the caller's stream, and the caller's
stream waits for the collective's completion event. Failures: a deadline (in the launch or the
wait), an asynchronous NCCL error, an NCCL error at launch and a CUDA error abort the
communicators and never destroy them; a healthy group's destroy releases everything.
"""

import sys
import threading
import time
import types

import numpy as np
import pytest

import ray_collective as col
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import StandInGpus
from ray_collective.backends.nccl import InProcessRendezvous, NcclOptions
from ray_collective.tensors import TensorView, as_view

FAST_WATCHDOG = NcclOptions(watchdog_period_seconds=0.01)


@pytest.fixture
def gpus():
    gpus = StandInGpus(device_count=4)
    yield gpus
    gpus.close()  # what still waits (a rank that never came) raises instead


def _two_gpus(rank):
    return [2 * rank, 2 * rank + 1]


def _index(log, predicate):
    return next(i for i, entry in enumerate(log) if predicate(entry))


# ------------------------------------------------------------------ stream ordering

def test_collective_runs_on_its_own_stream_between_two_events(gpus):
    def body(rank):
        caller = gpus.new_stream(0)
        gpus.use_stream(0, caller)
        col.allreduce(gpus.array(np.ones(4, np.float32), device=0))
        return caller

    caller = values_of(run_nccl_ranks(gpus.library(), 1, body))[0]
    log = gpus.log
    launch = _index(log, lambda e: e[1] == "allReduce")
    dedicated = log[launch][3]
    assert dedicated != caller and gpus.stream_device(dedicated) == 0
    created = [e for e in gpus.calls("streamCreateWithFlags") if e[2] == dedicated]
    assert created and created[0][4] == 1  # non-blocking: no implicit sync with stream 0
    ready = _index(log, lambda e: e[1] == "eventRecord" and e[3] == caller)
    waits = _index(log, lambda e: e[1] == "streamWaitEvent" and e[2] == dedicated)
    done = _index(log, lambda e: e[1] == "eventRecord" and e[3] == dedicated)
    after = _index(log, lambda e: e[1] == "streamWaitEvent" and e[2] == caller)
    assert ready < waits < launch < done < after
    assert log[waits][3] == log[ready][2]  # the dedicated stream waits on the caller's event
    assert log[after][3] == log[done][2]  # the caller's stream waits on the completion event


def test_collective_waits_for_the_callers_earlier_work(gpus):
    def body(rank):
        caller = gpus.new_stream(0)
        gpus.use_stream(0, caller)
        release = gpus.hold(caller)  # caller work still running on the GPU
        tensor = gpus.array(np.full(2, 3.0), device=0)
        work = col.allreduce(tensor, async_op=True)
        time.sleep(0.2)
        pending = not work.is_completed()
        release()
        work.wait(5)
        return pending, work.is_completed()

    assert values_of(run_nccl_ranks(gpus.library(), 1, body))[0] == (True, True)


def test_async_call_orders_after_the_stream_current_in_the_callers_thread(gpus):
    """The group runs async calls on a worker thread, whose current stream is not the
    caller's; the event is recorded in the caller's thread when the call is submitted."""
    def body(rank):
        caller = gpus.new_stream(rank)
        gpus.use_stream(rank, caller)
        work = col.allreduce(gpus.array(np.ones(2), device=rank), async_op=True)
        work.wait(5)
        return caller

    callers = values_of(run_nccl_ranks(gpus.library(), 2, body))
    for rank, caller in enumerate(callers):
        records = [e for e in gpus.calls("eventRecord") if e[3] == caller]
        assert records and records[0][0] == f"rank-{rank}"
        assert any(e[2] == caller for e in gpus.calls("streamWaitEvent"))


def test_torch_and_cupy_streams_and_pointers_are_asked_per_tensor_kind(gpus, monkeypatch):
    asked = []
    stand_in_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        current_stream=lambda device: asked.append(device) or types.SimpleNamespace(
            cuda_stream=777)))
    monkeypatch.setitem(sys.modules, "torch", stand_in_torch)
    library = gpus.library()
    gpus.use_stream(1, 4242)
    assert library.caller_stream("cupy", 1) == 4242
    assert library.caller_stream("torch", 3) == 777 and asked == [3]
    torch_tensor = types.SimpleNamespace(data_ptr=lambda: 0xABC0)
    view = TensorView(torch_tensor, None, "float32", np.dtype(np.float32), (2,), "cuda:0",
                      "torch")
    assert library.pointer(view) == 0xABC0
    array = gpus.array(np.ones(2), device=0)
    assert library.pointer(as_view(array, writable=True)) == array.data.ptr


# ------------------------------------------------------------------ argument checks

def test_cpu_tensor_is_refused_and_the_group_stays_usable(gpus):
    def body(rank):
        with pytest.raises(TypeError, match="CPU numpy tensor.*nccl.*cupy"):
            col.allreduce(np.ones(3))
        tensor = gpus.array(np.ones(3), device=0)
        col.allreduce(tensor)
        return tensor.host.copy()

    np.testing.assert_array_equal(values_of(run_nccl_ranks(gpus.library(), 1, body))[0], np.ones(3))


def test_tensor_on_a_gpu_outside_the_group_is_refused(gpus):
    def body(rank):
        with pytest.raises(ValueError, match=r"cuda:3.*\[cuda:0, cuda:1\]"):
            col.allreduce(gpus.array(np.ones(3), device=3))
        with pytest.raises(ValueError, match="device 'cuda:1'"):
            col.allgather([gpus.array(np.ones(1), device=1)], gpus.array(np.ones(1), device=0))
        return True

    assert values_of(run_nccl_ranks(gpus.library(), 1, body, devices_of=lambda r: [0, 1]))


@pytest.mark.parametrize("dtype, op, message", [
    ("int16", col.ReduceOp.SUM, "no such type.*int32"),
    ("complex64", col.ReduceOp.MAX, "only SUM and AVG"),
])
def test_reductions_nccl_cannot_do_are_refused(gpus, dtype, op, message):
    def body(rank):
        with pytest.raises(TypeError, match=message):
            col.allreduce(gpus.array(np.ones(2, dtype), device=0), op=op)
        return True

    assert values_of(run_nccl_ranks(gpus.library(), 1, body))


def test_avg_on_an_old_nccl_is_refused_with_the_version():
    old = StandInGpus(device_count=1, version=2708, without=["NCCL_AVG", "NCCL_BFLOAT16"])

    def body(rank):
        with pytest.raises(TypeError, match="NCCL 2.10.*2.7.8"):
            col.allreduce(old.array(np.ones(2), device=0), op=col.ReduceOp.AVG)
        return True

    assert values_of(run_nccl_ranks(old.library(), 1, body))


def test_multigpu_arguments_are_checked_before_anything_runs(gpus):
    def body(rank):
        def two(make=np.ones):
            return [gpus.array(make(2), device=d) for d in (2 * rank, 2 * rank + 1)]

        with pytest.raises(ValueError, match="has 1 tensors.*2 GPUs"):
            col.allreduce_multigpu(two()[:1])
        with pytest.raises(ValueError, match="belongs on cuda"):
            col.allreduce_multigpu(list(reversed(two())))
        with pytest.raises(TypeError, match="CPU"):
            col.allreduce_multigpu([np.ones(2), np.ones(2)])
        with pytest.raises(ValueError, match="shape"):
            col.allreduce_multigpu([gpus.array(np.ones(2), device=2 * rank),
                                    gpus.array(np.ones(3), device=2 * rank + 1)])
        with pytest.raises(ValueError, match="dst_tensor=2 is out of range"):
            col.reduce_multigpu(two(), dst_rank=0, dst_tensor=2)
        with pytest.raises(ValueError, match="to itself"):
            col.send_multigpu(two()[0], dst_rank=rank, dst_gpu_index=1)
        with pytest.raises(ValueError, match="n_elements=5"):
            col.send_multigpu(two()[0], dst_rank=1 - rank, dst_gpu_index=1, n_elements=5)
        with pytest.raises(ValueError, match="lists"):
            col.allgather_multigpu([[gpus.array(np.ones(2), device=2 * rank)] * 4],
                                   two())
        return True

    assert all(values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus)))
    assert not gpus.calls("allReduce") and not gpus.calls("send")


# ------------------------------------------------------------------ init

def test_processes_with_different_gpu_counts_fail_at_init(gpus):
    results = run_nccl_ranks(gpus.library(), 2, lambda rank: True,
                             devices_of=lambda rank: [0] if rank == 0 else [1, 2])
    for result in results:
        assert isinstance(result, ValueError)
        assert "same number of GPUs" in str(result) and "rank 1 has 2" in str(result)
    assert not gpus.communicators()


def test_init_times_out_naming_the_ranks_that_never_came(gpus):
    rendezvous = InProcessRendezvous()
    library = gpus.library()
    from ray_collective.backends.nccl import NcclBackendFactory
    with col.use_registry(col.GroupRegistry()):
        factory = NcclBackendFactory(rendezvous=rendezvous, devices=[0], library=library)
        started = time.monotonic()
        with pytest.raises(col.CollectiveTimeoutError, match=r"ranks \[1, 2\]") as caught:
            col.init_collective_group(3, 0, factory, "lonely", timeout=0.3)
        assert time.monotonic() - started < 2
        assert caught.value.collective == "init"
        assert not col.is_group_initialized("lonely")
        factory = NcclBackendFactory(rendezvous=rendezvous, devices=[1], library=library)
        with pytest.raises(col.CollectiveTimeoutError, match=r"ranks \[0\]"):
            col.init_collective_group(3, 1, factory, "lonely", timeout=0.2)
    assert rendezvous.keys() == ()  # the late rank withdrew what it published


# ------------------------------------------------------------------ failures

def _lone_allreduce(gpus, error_after=None, call_timeout=0.3, **run):
    """Rank 0 calls allreduce that rank 1 never joins; returns the error rank 0 got."""
    rank1_may_leave = threading.Event()

    def body(rank):
        if rank == 1:
            rank1_may_leave.wait(10)
            return None
        tensor = gpus.array(np.ones(2), device=0)
        try:
            if error_after is not None:
                threading.Timer(error_after, gpus.fail_communicators, (6,)).start()
            with pytest.raises(col.CollectiveError) as caught:
                col.allreduce(tensor, timeout=call_timeout)
            with pytest.raises(col.GroupBrokenError):
                col.allreduce(tensor)
            return [caught.value]
        finally:
            rank1_may_leave.set()

    return values_of(run_nccl_ranks(gpus.library(), 2, body, **run))[0][0]


def _assert_aborted_never_destroyed(gpus, rank):
    mine = [c for c in gpus.communicators() if c.rank == rank]
    assert mine and all(c.aborted and not c.destroyed for c in mine)


def test_deadline_in_the_wait_aborts_and_raises_timeout(gpus):
    error = _lone_allreduce(gpus)
    assert isinstance(error, col.CollectiveTimeoutError)
    assert (error.collective, error.seq, error.missing_ranks) == ("allreduce", 0, (1,))
    _assert_aborted_never_destroyed(gpus, 0)
    assert next(c for c in gpus.communicators() if c.rank == 1).destroyed


def test_ranks_that_disagree_wait_out_the_deadline_as_nccl_makes_them(gpus):
    """NCCL does not see that two ranks disagree on a call: it hangs (or corrupts memory), and
    so does the stand-in; the deadline ends the call on each rank and breaks the group."""
    def body(rank):
        with pytest.raises(col.CollectiveTimeoutError) as caught:
            col.allreduce(gpus.array(np.ones(2 + rank), device=rank), timeout=0.3)
        return caught.value.missing_ranks

    assert values_of(run_nccl_ranks(gpus.library(), 2, body)) == [(1,), (0,)]
    assert [what for *_, what in gpus.calls("mismatch")] == ["count [2, 3]"]
    _assert_aborted_never_destroyed(gpus, 0)
    _assert_aborted_never_destroyed(gpus, 1)


def test_asynchronous_nccl_error_aborts_and_raises_peer_died(gpus):
    error = _lone_allreduce(gpus, error_after=0.1, call_timeout=30)
    assert isinstance(error, col.PeerDiedError)
    assert "NCCL reported" in str(error) and error.dead_ranks == (1,)
    _assert_aborted_never_destroyed(gpus, 0)


def test_launch_that_blocks_past_the_deadline_is_aborted_by_the_watchdog(gpus):
    gpus.block_launches = True
    started = time.monotonic()
    error = _lone_allreduce(gpus, options=FAST_WATCHDOG)
    assert isinstance(error, col.CollectiveTimeoutError)
    assert time.monotonic() - started < 5
    assert gpus.calls("blocked launch")
    _assert_aborted_never_destroyed(gpus, 0)


@pytest.mark.parametrize("status, error_type", [(6, col.PeerDiedError),
                                                (5, col.CollectiveError)])
def test_nccl_error_at_launch_breaks_the_group(gpus, status, error_type):
    def body(rank):
        gpus.launch_error = status
        with pytest.raises(error_type) as caught:
            col.broadcast(gpus.array(np.ones(2), device=0), src_rank=0)
        assert not isinstance(caught.value, col.CollectiveTimeoutError)
        assert "broadcast #0" in str(caught.value)
        return True

    assert values_of(run_nccl_ranks(gpus.library(), 1, body))
    _assert_aborted_never_destroyed(gpus, 0)


def test_cuda_error_while_waiting_breaks_the_group(gpus):
    def body(rank):
        gpus.event_error = 700
        with pytest.raises(col.CollectiveError, match="failed on the GPU.*700") as caught:
            col.allreduce(gpus.array(np.ones(2), device=0))
        assert type(caught.value) is col.CollectiveError
        gpus.event_error = 0
        return True

    assert values_of(run_nccl_ranks(gpus.library(), 1, body))
    _assert_aborted_never_destroyed(gpus, 0)


def test_async_work_reports_the_failure(gpus):
    def body(rank):
        if rank == 1:
            time.sleep(0.6)
            return None
        work = col.allreduce(gpus.array(np.ones(2), device=0), async_op=True, timeout=0.2)
        # Work.wait turns any TimeoutError of the call into its own "still running" message,
        # so the type is checked on the broken group's cause instead.
        with pytest.raises(TimeoutError):
            work.wait(5)
        with pytest.raises(col.GroupBrokenError) as broken:
            col.barrier()
        return work.is_completed(), broken.value.cause

    completed, cause = values_of(run_nccl_ranks(gpus.library(), 2, body))[0]
    assert completed and isinstance(cause, col.CollectiveTimeoutError)
    _assert_aborted_never_destroyed(gpus, 0)


# ------------------------------------------------------------------ lifetime

def test_destroy_releases_every_communicator_stream_and_event(gpus):
    def body(rank):
        tensor = gpus.array(np.ones(2), device=2 * rank)
        col.allreduce(tensor)
        col.allreduce_multigpu([gpus.array(np.ones(2), device=d)
                                for d in (2 * rank, 2 * rank + 1)])
        col.allreduce(gpus.array(np.ones(2), device=2 * rank + 1), async_op=True).wait(5)
        return True

    assert values_of(run_nccl_ranks(gpus.library(), 2, body, devices_of=_two_gpus))
    assert gpus.live_streams() == [] and gpus.live_events() == []
    assert all(c.destroyed and not c.aborted for c in gpus.communicators())
    assert len(gpus.communicators()) == 4 + 2 + 2  # main clique, then one per GPU index
