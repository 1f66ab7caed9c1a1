"""Calls of a known shape: after a shape's first call, later blocking calls on numpy arrays of
the same dtype, shape and strides skip the API's per-call checks (``api._collective``).
They must give the same results and fail the same way as the full path."""

import threading
import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.group import current_registry, use_registry
from ray_collective.testing import run_ranks
from support import extras
from support.helpers import count_full_path


def _runners():
    return current_registry().get("default").prepared


def _counting_full_path(monkeypatch):
    """Count the calls that take the full path (``Group.submit``) in every rank."""
    from ray_collective.engine.cpu import TransportMembership
    return count_full_path(monkeypatch, TransportMembership)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_repeated_calls_give_numpy_results_and_skip_the_full_path(world_size, monkeypatch):
    taken = _counting_full_path(monkeypatch)

    def body(rank):
        results = []
        for step in range(4):
            x = np.arange(5, dtype=np.float64) * (rank + 1) + step
            col.allreduce(x)
            results.append(x.copy())
            y = np.full(3, rank + step, np.int32)
            col.broadcast(y, src_rank=world_size - 1)
            results.append(y.copy())
            z = np.full(2, rank + 1.0)
            col.reduce(z, dst_rank=0, op=col.ReduceOp.MAX)
            results.append(z.copy())
            gathered = [np.full((2, 2), -1.0) for _ in range(world_size)]
            col.allgather(gathered, np.full((2, 2), rank * 10.0 + step))
            results.append(np.stack(gathered))
            part = np.zeros(3, np.int64)
            col.reducescatter(part, [np.full(3, rank + j + step, np.int64)
                                     for j in range(world_size)])
            results.append(part)
            col.barrier()
            root = step % world_size
            into = [np.full(3, -1, np.int16) for _ in range(world_size)]
            col.gather(into if rank == root else None, np.full(3, rank + step, np.int16),
                       dst_rank=root)
            results.append(np.stack(into))
            mine = np.zeros((2, 1), np.float32)
            col.scatter(mine, [np.full((2, 1), 100.0 * j + step, np.float32)
                               for j in range(world_size)] if rank == root else None,
                        src_rank=root)
            results.append(mine)
            received = [np.full(2, 255, np.uint8) for _ in range(world_size)]
            col.alltoall(received, [np.full(2, 10 * rank + j + step, np.uint8)
                                    for j in range(world_size)])
            results.append(np.stack(received))
        return results, len(_runners())

    outcome = run_ranks(world_size, body)
    for rank, (results, learnt) in enumerate(outcome):
        # allreduce, broadcast, reduce, allgather, reducescatter, barrier, alltoall, and
        # gather and scatter once per root
        assert learnt == 7 + 2 * min(world_size, 4)
        for step in range(4):
            got = results[8 * step:8 * step + 8]
            expected = sum(np.arange(5, dtype=np.float64) * (r + 1) + step
                           for r in range(world_size))
            np.testing.assert_array_equal(got[0], expected)
            np.testing.assert_array_equal(got[1], np.full(3, world_size - 1 + step, np.int32))
            if rank == 0:
                np.testing.assert_array_equal(got[2], np.full(2, float(world_size)))
            np.testing.assert_array_equal(
                got[3], np.stack([np.full((2, 2), r * 10.0 + step) for r in range(world_size)]))
            np.testing.assert_array_equal(
                got[4], np.full(3, sum(r + rank + step for r in range(world_size))))
            if rank == step % world_size:
                np.testing.assert_array_equal(
                    got[5], np.stack([np.full(3, r + step, np.int16) for r in range(world_size)]))
            else:
                assert (got[5] == -1).all()
            np.testing.assert_array_equal(got[6], np.full((2, 1), 100.0 * rank + step))
            np.testing.assert_array_equal(
                got[7], np.stack([np.full(2, 10 * r + rank + step, np.uint8)
                                  for r in range(world_size)]))
    # Only each shape's first call took the full path, on every rank (gather and scatter: the
    # first call at each root).
    roots = min(world_size, 4)
    assert sorted(taken) == sorted((["allreduce", "broadcast", "reduce", "allgather",
                                     "reducescatter", "barrier", "alltoall"]
                                    + ["gather", "scatter"] * roots) * world_size)


def test_gather_and_scatter_of_a_known_shape_refuse_a_missing_list_at_their_root():
    def body(rank):
        for _ in range(2):
            col.gather([np.zeros(2), np.zeros(2)] if rank == 0 else None, np.ones(2))
            col.scatter(np.zeros(2), [np.ones(2), np.ones(2)] if rank == 0 else None)
        if rank == 0:
            with pytest.raises(col.ArgumentError, match="tensor_list"):
                col.gather(None, np.ones(2))
            with pytest.raises(col.ArgumentError, match="tensor_list"):
                col.scatter(np.zeros(2), None)
            with pytest.raises(col.ArgumentError, match="tensor_list"):
                col.scatter(np.zeros(2), [np.ones(2), np.ones(3)])
        return len(_runners())

    assert run_ranks(2, body) == [2, 2]


def test_an_alltoall_of_a_known_shape_refuses_lists_unlike_it():
    """The key is checked per call: another length, or an entry of another shape or dtype,
    takes the full path, which refuses it on every rank before anything is sent; a read-only
    input is only read."""
    def body(rank):
        outputs, inputs = [np.zeros(3) for _ in range(2)], [np.full(3, rank + 1.0)] * 2
        for _ in range(2):
            col.alltoall(outputs, inputs)
        for bad_outputs, bad_inputs, match in (
                ([np.zeros(3)] * 3, inputs, "3 tensors"),
                (outputs, [np.ones(3), np.ones(4)], "shape"),
                ([np.zeros(3), np.zeros(3, np.float32)], inputs, "dtype")):
            with pytest.raises(col.ArgumentError, match=match):
                col.alltoall(bad_outputs, bad_inputs)
        read_only = np.full(3, 10.0 * (rank + 1))
        read_only.setflags(write=False)
        col.alltoall(outputs, [read_only, read_only])
        return np.stack(outputs), len(_runners())

    for stacked, learnt in run_ranks(2, body):
        np.testing.assert_array_equal(stacked, [np.full(3, 10.0), np.full(3, 20.0)])
        assert learnt == 1


def test_average_divides_on_the_known_shape_path_too():
    def body(rank):
        outs = []
        for _ in range(3):
            x = np.full(4, float(rank))
            col.allreduce(x, op=col.ReduceOp.AVG)
            outs.append(x[0])
        return outs

    for outs in run_ranks(4, body):
        assert outs == [1.5, 1.5, 1.5]


def test_another_dtype_layout_or_op_takes_the_full_path(monkeypatch):
    taken = _counting_full_path(monkeypatch)

    def body(rank):
        base = np.ones((4, 4))
        col.allreduce(base)
        col.allreduce(np.ones((4, 4)))                  # known
        col.allreduce(np.ones((4, 4), np.float32))      # another dtype
        col.allreduce(np.ones(16))                      # another shape
        col.allreduce(np.ones((4, 4)), op=col.ReduceOp.MAX)   # another op
        with pytest.raises(col.ArgumentValueError, match="non-contiguous"):
            col.allreduce(np.ones((4, 8))[:, ::2])      # same shape, other strides
        return True

    run_ranks(1, body)
    assert taken == ["allreduce"] * 4


def test_a_read_only_array_of_a_known_shape_is_written_through_with_the_warning():
    def body(rank):
        col.allreduce(np.ones(3))
        frozen = np.ones(3)
        frozen.setflags(write=False)
        with pytest.warns(col.ReadOnlyTensorWarning):
            col.allreduce(frozen)
        return frozen.copy()

    for result in run_ranks(2, body):
        np.testing.assert_array_equal(result, [2.0, 2.0, 2.0])


def test_a_bad_argument_of_a_known_shape_is_still_refused():
    def body(rank):
        col.allreduce(np.ones(2))
        with pytest.raises(col.ArgumentError, match="group_name"):
            col.allreduce(np.ones(2), group_name=["default"])
        with pytest.raises(col.GroupNotInitializedError):
            col.allreduce(np.ones(2), group_name="other")
        col.broadcast(np.ones(2), src_rank=0)
        with pytest.raises(col.ArgumentValueError):
            col.broadcast(np.ones(2), src_rank=5)
        return True

    run_ranks(1, body)


def test_a_broken_group_fails_fast_on_the_known_shape_path():
    def body(rank):
        col.allreduce(np.ones(2), timeout=5)
        col.allreduce(np.ones(2))                      # learnt, group deadline
        if rank == 1:
            return "left"
        with pytest.raises(col.CollectiveTimeoutError):
            col.allreduce(np.ones(2), timeout=0.5)
        started = time.monotonic()
        with pytest.raises(col.GroupBrokenError):
            col.allreduce(np.ones(2))
        return time.monotonic() - started

    elapsed, _ = run_ranks(2, body, timeout=30)
    assert elapsed < 5  # raised at once, not after the group's 30 s deadline


def test_queued_asynchronous_calls_keep_their_order_before_a_known_shape():
    def body(rank):
        x = np.ones(2)
        col.allreduce(x)                               # learnt
        works = [col.allreduce(np.full(2, float(i)), async_op=True) for i in range(3)]
        y = np.full(2, 10.0 * (rank + 1))
        col.allreduce(y)                               # must run after the three
        for work in works:
            work.wait()
        return y.copy()

    for result in run_ranks(2, body):
        np.testing.assert_array_equal(result, [30.0, 30.0])


def test_a_mismatch_on_the_known_shape_path_is_named_on_every_rank():
    def body(rank):
        col.allreduce(np.ones(2))
        col.allreduce(np.ones(2))
        if rank == 0:
            col.allreduce(np.ones(2))
        else:
            col.broadcast(np.ones(2), src_rank=0)
        return None

    outcome = run_ranks(2, body, return_exceptions=True, timeout=10)
    assert all(isinstance(err, col.CollectiveMismatchError) for err in outcome)


def test_a_list_unlike_its_tensor_takes_the_full_path_and_its_checks(monkeypatch):
    taken = _counting_full_path(monkeypatch)

    def body(rank):
        col.allgather([np.zeros(2), np.zeros(2)], np.ones(2))            # learnt
        col.allgather([np.zeros(2), np.zeros(2)], np.ones(2))            # known
        with pytest.raises(col.ArgumentError):
            col.allgather([np.zeros(2), np.zeros(3)], np.ones(2))        # unlike: refused
        with pytest.raises(col.ArgumentError):
            col.allgather([np.zeros(2)], np.ones(2))                    # too short: refused
        frozen = np.zeros(2)
        frozen.setflags(write=False)
        with pytest.warns(col.ReadOnlyTensorWarning):
            col.allgather([np.zeros(2), frozen], np.ones(2))            # full path
        return True

    run_ranks(2, body)
    assert taken.count("allgather") == 4  # two ranks: the first call and the read-only one


@pytest.mark.parametrize("world_size", [1, 2])
def test_torch_cpu_tensors_take_the_known_shape_path_on_their_numpy_memory(world_size,
                                                                          monkeypatch):
    torch = extras.need("torch", "torch tensors")
    taken = _counting_full_path(monkeypatch)

    def body(rank):
        results = []
        for step in range(3):
            # requires_grad: the call works on the detached tensor's memory, as the full path.
            x = torch.arange(5, dtype=torch.float64, requires_grad=True) * (rank + 1) + step
            x = x.detach().requires_grad_(True)
            col.allreduce(x)
            results.append(x.detach().numpy().copy())
            y = torch.full((3,), rank + step, dtype=torch.int32)
            col.broadcast(y, src_rank=world_size - 1)
            results.append(y.numpy().copy())
            z = torch.full((2,), rank + 1.0 + step)
            col.reduce(z, dst_rank=0, op=col.ReduceOp.MAX)
            results.append(z.numpy().copy())
            b = torch.full((2,), float(rank + step), dtype=torch.bfloat16)
            col.allreduce(b)
            results.append(b.float().numpy().copy())
        return results

    outcome = run_ranks(world_size, body)
    for rank, results in enumerate(outcome):
        for step in range(3):
            allreduced, broadcast, reduced, bf16 = results[4 * step:4 * step + 4]
            np.testing.assert_array_equal(allreduced, sum(
                np.arange(5, dtype=np.float64) * (r + 1) + step for r in range(world_size)))
            np.testing.assert_array_equal(broadcast, np.full(3, world_size - 1 + step))
            np.testing.assert_array_equal(
                reduced, np.full(2, (world_size if rank == 0 else rank + 1.0) + step))
            np.testing.assert_array_equal(
                bf16, np.full(2, sum(float(r + step) for r in range(world_size))))
    # Each rank's first allreduce, broadcast and reduce, and every bfloat16 allreduce (its
    # numpy array is a view the full path makes).
    assert sorted(taken) == sorted(["allreduce", "broadcast", "reduce"] * world_size
                                   + ["allreduce"] * 3 * world_size)


def test_threads_sharing_a_group_take_every_number_once():
    """Threads of one rank calling a known shape at once each take a number of their own (the
    known-shape path numbers its calls without the group's lock): the recorder sees every
    number from 0 once, and every call's result."""
    threads, calls = 4, 50

    def body(rank):
        registry = current_registry()
        sums = []

        def caller():
            with use_registry(registry):
                for _ in range(calls):
                    x = np.full(2, 3.0)
                    col.allreduce(x)
                    sums.append(x[0])

        workers = [threading.Thread(target=caller) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return sorted(call["seq"] for call in col.get_collective_trace()), sums

    numbers, sums = run_ranks(1, body)[0]
    assert numbers == list(range(threads * calls))
    assert sums == [3.0] * (threads * calls)
