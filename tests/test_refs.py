"""The declarative ObjectRef collectives on real actors, against numpy references: every call,
chaining without the driver blocking, interleaving with imperative calls, validation before
submission, and a failed ref breaking the group fast instead of hanging it."""

import time

import numpy as np
import pytest

import ray_collective as col
from support import extras
from support.helpers import numpy_reduce, rank_data

WORLD = 3


class Holder:
    """A user's actor: it holds a buffer and knows nothing about collectives."""

    def __init__(self, rank):
        self.rank = rank
        self.buffer = rank_data(rank, (4, 3), np.float64, seed=5)

    def get_buffer(self):
        return self.buffer

    def fail(self):
        raise RuntimeError(f"holder {self.rank} cannot make its buffer")

    def imperative_allreduce(self, group_name):
        col.allreduce(self.buffer, group_name)
        return self.buffer.copy()


@pytest.fixture(scope="module")
def holders(ray_session):
    actor_class = ray_session.remote(num_cpus=0)(Holder)
    actors = [actor_class.remote(rank) for rank in range(WORLD)]
    ray_session.get([a.get_buffer.remote() for a in actors])
    yield actors
    for actor in actors:
        ray_session.kill(actor)


@pytest.fixture
def group(ray_session, holders, request):
    name = f"refs-{request.node.name}"[:60]
    col.declare_collective_group(holders, backend="ray", group_name=name, timeout=120)
    yield name
    col.destroy_collective_group(name)


def _inputs(seed, shape=(6, 2), dtype=np.float32):
    return [rank_data(rank, shape, dtype, seed=seed) for rank in range(WORLD)]


def test_every_declarative_collective_matches_numpy(ray_session, group):
    ray = ray_session
    arrays = _inputs(1)
    refs = [ray.put(a) for a in arrays]

    for op in (col.ReduceOp.SUM, col.ReduceOp.MAX):
        results = ray.get(col.allreduce_refs(refs, group, op))
        for result in results:
            np.testing.assert_array_equal(result, numpy_reduce(arrays, op))

    reduced = ray.get(col.reduce_refs(refs, dst_rank=1, group_name=group))
    np.testing.assert_array_equal(reduced[1], numpy_reduce(arrays, col.ReduceOp.SUM))
    for rank in (0, 2):
        np.testing.assert_array_equal(reduced[rank], arrays[rank])

    for result in ray.get(col.broadcast_refs(refs, src_rank=2, group_name=group)):
        np.testing.assert_array_equal(result, arrays[2])

    for gathered in ray.get(col.allgather_refs(refs, group)):
        assert len(gathered) == WORLD
        for rank in range(WORLD):
            np.testing.assert_array_equal(gathered[rank], arrays[rank])

    total = numpy_reduce(arrays, col.ReduceOp.SUM)
    parts = ray.get(col.reducescatter_refs(refs, group))  # 6 rows split into 3 blocks of 2
    for rank in range(WORLD):
        np.testing.assert_array_equal(parts[rank], total[2 * rank:2 * rank + 2])
    lists = [ray.put([a[2 * i:2 * i + 2].copy() for i in range(WORLD)]) for a in arrays]
    parts = ray.get(col.reducescatter_refs(lists, group, col.ReduceOp.SUM))
    for rank in range(WORLD):
        np.testing.assert_array_equal(parts[rank], total[2 * rank:2 * rank + 2])


def test_refs_made_by_the_members_themselves(ray_session, holders, group):
    ray = ray_session
    refs = [h.get_buffer.remote() for h in holders]
    expected = numpy_reduce([rank_data(r, (4, 3), np.float64, seed=5) for r in range(WORLD)],
                            col.ReduceOp.SUM)
    for result in ray.get(col.allreduce_refs(refs, group)):
        np.testing.assert_array_equal(result, expected)
    # the members' own buffers were not changed by the declarative call
    np.testing.assert_array_equal(ray.get(holders[0].get_buffer.remote()),
                                  rank_data(0, (4, 3), np.float64, seed=5))


def test_send_ref_delivers_numpy_and_torch_tensors(ray_session, holders, group):
    ray = ray_session
    torch = extras.need("torch", "the torch case")
    array = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    received = ray.get(col.send_ref(ray.put(array), src_rank=0, dst_rank=2, group_name=group))
    assert received.dtype == np.int16 and received.shape == (2, 3, 4)
    np.testing.assert_array_equal(received, array)
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    received = ray.get(col.send_ref(ray.put(tensor), src_rank=2, dst_rank=1, group_name=group))
    assert isinstance(received, torch.Tensor) and received.dtype == torch.bfloat16
    assert torch.equal(received, tensor)
    from_member = col.send_ref(holders[1].get_buffer.remote(), 1, 0, group)
    np.testing.assert_array_equal(ray.get(from_member),
                                  rank_data(1, (4, 3), np.float64, seed=5))


def test_chained_calls_run_without_the_driver_waiting(ray_session, group):
    ray = ray_session
    arrays = _inputs(2)
    first = col.allreduce_refs([ray.put(a) for a in arrays], group)
    second = col.allreduce_refs(first, group)
    third = col.broadcast_refs(second, src_rank=1, group_name=group)
    assert all(isinstance(ref, ray.ObjectRef) for ref in first + second + third)
    expected = numpy_reduce(arrays, col.ReduceOp.SUM) * WORLD
    for result in ray.get(third):
        np.testing.assert_array_equal(result, expected)


def test_declarative_and_imperative_calls_interleave_in_submission_order(ray_session,
                                                                         holders, group):
    ray = ray_session
    initial = [rank_data(r, (4, 3), np.float64, seed=5) for r in range(WORLD)]
    imperative_first = [h.imperative_allreduce.remote(group) for h in holders]
    declarative = col.allreduce_refs([h.get_buffer.remote() for h in holders], group,
                                     col.ReduceOp.MAX)
    imperative_second = [h.imperative_allreduce.remote(group) for h in holders]
    once = numpy_reduce(initial, col.ReduceOp.SUM)
    for result in ray.get(imperative_first):
        np.testing.assert_array_equal(result, once)
    for result in ray.get(declarative):  # the buffers after the first allreduce: all equal
        np.testing.assert_array_equal(result, once)
    for result in ray.get(imperative_second):
        np.testing.assert_array_equal(result, once * WORLD)


def test_bad_calls_raise_before_anything_is_submitted(ray_session, holders, group):
    ray = ray_session
    refs = [ray.put(np.ones(3)) for _ in range(WORLD)]
    with pytest.raises(ValueError, match="2 refs but the group has 3 ranks"):
        col.allreduce_refs(refs[:2], group)
    with pytest.raises(TypeError, match=r"tensor_refs\[1\] must be an ObjectRef"):
        col.allreduce_refs([refs[0], np.ones(3), refs[2]], group)
    with pytest.raises(TypeError, match="list of ObjectRefs"):
        col.allgather_refs(refs[0], group)
    with pytest.raises(col.GroupNotInitializedError, match="never-declared"):
        col.allreduce_refs(refs, "never-declared")
    with pytest.raises(ValueError, match="dst_rank=3 is out of range"):
        col.reduce_refs(refs, dst_rank=3, group_name=group)
    with pytest.raises(ValueError, match="src_rank=-1 is out of range"):
        col.broadcast_refs(refs, src_rank=-1, group_name=group)
    with pytest.raises(ValueError, match="does not send to itself"):
        col.send_ref(refs[0], 1, 1, group)
    with pytest.raises(TypeError, match="tensor_ref must be an ObjectRef"):
        col.send_ref(np.ones(3), 0, 1, group)
    with pytest.raises((TypeError, ValueError)):
        col.allreduce_refs(refs, group, op="sum-ish")
    # the group is still healthy: nothing was submitted by the calls above
    for result in ray.get(col.allreduce_refs(refs, group)):
        np.testing.assert_array_equal(result, np.full(3, 3.0))


def test_failed_ref_breaks_the_group_fast_instead_of_hanging(ray_session, holders, group):
    ray = ray_session
    refs = [holders[0].get_buffer.remote(), holders[1].fail.remote(),
            holders[2].get_buffer.remote()]
    started = time.monotonic()
    results = col.allreduce_refs(refs, group)
    with pytest.raises(col.TensorRefError, match="rank 1 .* could not get its tensor"):
        ray.get(results[1], timeout=60)
    for rank in (0, 2):
        with pytest.raises(col.GroupBrokenError, match="rank 1") as broken:
            ray.get(results[rank], timeout=60)
        # what broke it: rank 1's own failure, as a RankFailedError naming it and its kind
        cause = broken.value.cause
        while isinstance(cause, col.GroupBrokenError):
            cause = cause.cause
        assert isinstance(cause, col.RankFailedError), repr(cause)
        assert (cause.failed_rank, cause.kind) == (1, "TensorRefError")
        assert "holder 1 cannot make its buffer" in str(cause)
    assert time.monotonic() - started < 30  # the group's deadline is 120 s


def test_tensor_that_does_not_split_into_blocks_breaks_the_group(ray_session, group):
    ray = ray_session
    refs = [ray.put(np.ones(4)) for _ in range(WORLD)]  # 4 rows do not split into 3 blocks
    results = col.reducescatter_refs(refs, group)
    with pytest.raises(col.CollectiveError, match="equal blocks|broken"):
        ray.get(results, timeout=60)
