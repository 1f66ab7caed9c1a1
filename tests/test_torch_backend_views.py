"""The numpy arrays the torch backend keeps for small tensors (``ArrayViews``): an array is
reused only while it still covers the tensor's memory as the tensor reads it (checked against
numpy's own view of the tensor and its address), goes with its tensor, and the cache stays
bounded; and through ``dist.all_reduce`` on 2 ranks, a tensor reduced again after its memory,
dtype or layout changed in place gets the reference's result."""

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_collective.torch.views import ArrayViews  # noqa: E402
from support.torch_ranks import four, run_torch_ranks  # noqa: E402,F401 - four: a fixture


def _address(array):
    return array.__array_interface__["data"][0]


def _covers(array, tensor):
    """Whether ``array`` is ``tensor``'s memory in its order of elements, as numpy sees it."""
    reference = tensor.detach().numpy()
    return (_address(array) == tensor.data_ptr() and array.dtype == reference.dtype
            and array.size == reference.size and np.array_equal(array.ravel(), reference.ravel()))


def test_a_tensor_gets_the_same_array_again_and_writes_through_it_reach_the_tensor():
    views = ArrayViews()
    tensor = torch.arange(4, dtype=torch.float32)
    first = views.array(tensor)
    assert _covers(first, tensor)
    assert views.array(tensor) is first
    first += 10
    assert tensor.tolist() == [10.0, 11.0, 12.0, 13.0]


def test_an_array_is_made_again_when_the_tensor_changes_in_place():
    views = ArrayViews()
    tensor = torch.zeros(4)
    before = views.array(tensor)
    tensor.set_(torch.arange(6, dtype=torch.float32))  # other memory, other size
    assert views.array(tensor) is not before and _covers(views.array(tensor), tensor)
    tensor.data = tensor.view(torch.int32)  # the same memory read as another dtype
    assert views.array(tensor).dtype == np.int32 and _covers(views.array(tensor), tensor)
    square = torch.arange(4, dtype=torch.float32).reshape(2, 2)
    views.array(square)
    square.t_()  # the same memory, no longer contiguous
    assert views.array(square) is None


def test_an_entry_goes_with_its_tensor_and_does_not_keep_it_alive():
    views = ArrayViews()
    tensor = torch.ones(3)
    views.array(tensor)
    alive = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert alive() is None and len(views) == 0


def test_the_cache_is_bounded_and_starts_again_when_full():
    views = ArrayViews(entries=4)
    tensors = [torch.full((2,), float(i)) for i in range(6)]
    arrays = [views.array(t) for t in tensors]
    assert len(views) == 2  # the fifth tensor found the cache full
    assert views.array(tensors[5]) is arrays[5]
    assert views.array(tensors[0]) is not arrays[0]  # it had gone: made again
    assert len(views) == 3
    assert all(_covers(views.array(t), t) for t in tensors)


def test_large_bfloat16_non_contiguous_and_conjugate_tensors_get_no_array():
    views = ArrayViews(max_bytes=64)
    assert views.array(torch.ones(17)) is None  # 68 bytes
    half = torch.ones(2, dtype=torch.bfloat16)
    assert views.array(half) is None and views.array(half) is None
    assert views.array(torch.ones(2, 3).T) is None
    assert views.array(torch.ones(2, dtype=torch.complex64).conj()) is None
    grad = torch.ones(2, requires_grad=True)
    assert _covers(views.array(grad), grad)


def _reduce_again_after_changes(rank, size):
    import torch.distributed as dist
    out = {}
    tensor = torch.full((3,), float(rank + 1))
    dist.all_reduce(tensor)
    dist.all_reduce(tensor)
    out["twice"] = tensor.tolist()
    tensor.set_(torch.full((5,), float(rank)))
    dist.all_reduce(tensor)
    out["set_"] = tensor.tolist()
    tensor.data = torch.arange(4, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    out["data"] = (str(tensor.dtype), tensor.tolist())
    square = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    dist.all_reduce(square)
    square.t_()
    square[0, 0] = 100.0 + rank
    dist.all_reduce(square, op=dist.ReduceOp.MIN)
    out["t_"] = square.tolist()
    return out


def test_a_tensor_reduced_again_after_it_changed_in_place_equals_the_reference(ray_session,
                                                                              four):
    size = 2
    results = run_torch_ranks(ray_session, four[:size], _reduce_again_after_changes)
    ranks_sum = float(sum(r + 1 for r in range(size)))
    square = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * ranks_sum).T.clone()
    square[0, 0] = 100.0
    for out in results:
        assert out["twice"] == [ranks_sum * size] * 3
        assert out["set_"] == [float(sum(range(size)))] * 5
        assert out["data"] == ("torch.float64", [float(i * size) for i in range(4)])
        assert out["t_"] == square.tolist()
