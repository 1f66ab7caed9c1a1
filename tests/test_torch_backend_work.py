"""The torch backend's call queue and work handles without Ray: where a call runs (inline, or
on the group's worker thread where the group overlaps its calls), in which order, and how
its end and its failure reach ``wait``, ``is_completed`` and the future. The machines the suite
runs on may have too few cores for a group to overlap, so the worker thread is tested here on
calls of its own rather than through a group."""

import threading

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from ray_collective.errors import CollectiveTimeoutError  # noqa: E402
from ray_collective.torch.work import QUEUED_MIN_BYTES, CallQueue, overlaps  # noqa: E402


def _timed_out():
    raise CollectiveTimeoutError("g", 0, "allreduce", 3, [1], 1.0)


def test_large_async_calls_of_an_overlapping_group_run_on_its_worker_thread_in_order():
    queue = CallQueue("g", overlap=True)
    release, ran = threading.Event(), []
    out = torch.zeros(1)

    def first():
        release.wait()
        ran.append(("first", threading.current_thread().name))
    work = queue.run(first, [out], QUEUED_MIN_BYTES, True)
    # Small, but made while a call is queued: it joins the queue behind the first.
    second = queue.run(lambda: ran.append(("second", threading.current_thread().name)),
                       [out], 8, True)
    future = work.get_future()
    assert not work.is_completed() and not second.is_completed() and ran == []
    release.set()
    assert second.wait() and work.wait()
    assert [call for call, _ in ran] == ["first", "second"]
    assert all(thread.startswith("ray_collective.torch[g]") for _, thread in ran)
    assert future.wait() == [out] and work.result() == [out] and work.is_success()
    queue.close()


def test_a_group_that_does_not_overlap_runs_a_large_async_call_inline():
    queue = CallQueue("g", overlap=False)
    ran = []
    work = queue.run(lambda: ran.append(threading.current_thread()), [], QUEUED_MIN_BYTES,
                     True)
    assert ran == [threading.current_thread()] and work.is_completed()
    queue.close()


def test_a_queued_call_that_fails_raises_the_library_s_error_as_dist_backend_error():
    queue = CallQueue("g", overlap=True)
    work = queue.run(_timed_out, [], QUEUED_MIN_BYTES, True)
    with pytest.raises(dist.DistBackendError, match="CollectiveTimeoutError") as caught:
        work.wait()
    assert isinstance(caught.value.__cause__, CollectiveTimeoutError)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(dist.DistBackendError):
        work.get_future().wait()
    queue.close()


def test_an_inline_async_call_that_fails_raises_the_error_from_wait():
    queue = CallQueue("g", overlap=False)
    work = queue.run(_timed_out, [], 8, True)
    with pytest.raises(dist.DistBackendError, match="CollectiveTimeoutError"):
        work.wait()


def test_a_group_overlaps_only_with_two_cores_per_rank(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert [overlaps(size) for size in (2, 4, 5)] == [True, True, False]
