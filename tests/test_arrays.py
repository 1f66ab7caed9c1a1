"""Arrays the library knows only by their protocols (ray_collective.array_protocols) and the
collectives that return new arrays (ray_collective.functional), JAX's above all.

References: numpy over the same memory (what a view must share), numpy's own reductions of
the ranks' inputs, and JAX's own bfloat16 arithmetic. The whole contract of every collective
over a DLPack-only producer and over memoryviews is in tests/test_contract.py and
tests/test_ray_backend.py; here the parts that differ: what is taken, what is refused, and
what a producer's memory becomes.
"""

from __future__ import annotations

import array
import gc
import mmap
import weakref

import numpy as np
import pytest

import ray_collective as col
from ray_collective import functional
from ray_collective.array_protocols import view_of_protocol
from ray_collective.tensors import as_view
from ray_collective.testing import run_ranks
from support import extras
from support.contract import DLPackOnly

jax = extras.need("jax", "JAX arrays are the immutable DLPack producer these tests use")
jnp = jax.numpy
ml_dtypes = pytest.importorskip("ml_dtypes", reason="installed with jax")


class LegacyDLPack:
    """A producer of DLPack capsules older than 1.0 (no read-only flag), as many still are."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class OnDevice:
    """A DLPack producer that says its memory is on device ``device_type``; never exported."""

    def __init__(self, device_type: int):
        self.device_type = device_type

    def __dlpack__(self, **kwargs):
        raise AssertionError("a GPU or foreign device array must not be exported as CPU memory")

    def __dlpack_device__(self):
        return (self.device_type, 0)


# ------------------------------------------------------------------ what is taken, no copy


@pytest.mark.parametrize("make", [
    DLPackOnly, memoryview, lambda a: memoryview(a).cast("B").cast(a.dtype.char, a.shape)],
    ids=["dlpack", "memoryview", "recast-memoryview"])
def test_a_protocol_view_shares_the_producers_memory(make):
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = as_view(make(source), writable=True)
    assert (view.dtype_name, view.shape, view.device) == ("float32", (3, 4), "cpu")
    assert view.array.shape == (12,) and np.shares_memory(view.array, source)
    view.array[5] = -1.0
    assert source[1, 1] == -1.0


@pytest.mark.parametrize("obj, dtype, values", [
    (bytearray(b"\x01\x02\x03"), "uint8", [1, 2, 3]),
    (array.array("d", [1.5, -2.0]), "float64", [1.5, -2.0]),
    (array.array("i", [7, -8]), "int32", [7, -8]),
    (memoryview(np.array([True, False])), "bool", [True, False]),
    (memoryview(np.array([1 + 2j], np.complex64)), "complex64", [1 + 2j]),
    (memoryview(np.array([0.5], np.float16)), "float16", [0.5]),
])
def test_buffers_give_their_dtype_and_values(obj, dtype, values):
    view = as_view(obj, writable=True)
    assert view.dtype_name == dtype and view.kind == "buffer"
    np.testing.assert_array_equal(view.array, np.array(values, dtype))


def test_an_mmap_is_written_in_place():
    with mmap.mmap(-1, 16) as memory:
        view = as_view(memory, writable=True)
        view.array[:4] = [1, 2, 3, 4]
        assert memory[:4] == b"\x01\x02\x03\x04"
        del view


def test_jax_arrays_are_read_through_dlpack_bit_for_bit():
    x = jnp.linspace(-3, 3, 7, dtype=jnp.float32)
    view = as_view(x, writable=False)
    assert (view.kind, view.dtype_name, view.shape) == ("dlpack", "float32", (7,))
    np.testing.assert_array_equal(view.array, np.asarray(x))
    b = jnp.asarray([1.0, -2.5, 3.140625, 1e30], jnp.bfloat16)
    bits = as_view(b, writable=False)
    assert (bits.dtype_name, bits.wire_dtype) == ("bfloat16", np.dtype(np.uint16))
    np.testing.assert_array_equal(bits.array, np.asarray(b).view(np.uint16))


def test_the_view_keeps_the_producers_memory_alive():
    source = np.arange(1000, dtype=np.int64)
    producer = DLPackOnly(source)
    alive = weakref.ref(source)
    view = as_view(producer, writable=False)
    del producer, source
    gc.collect()
    assert alive() is not None  # the capsule behind the view still holds it
    np.testing.assert_array_equal(view.array, np.arange(1000))
    del view
    gc.collect()
    assert alive() is None  # and lets it go with the last array made from it


def test_numpy_arrays_of_ml_dtypes_bfloat16_travel_as_their_bits():
    values = np.array([1.0, 0.5, -3.0], ml_dtypes.bfloat16)
    view = as_view(values, writable=True)
    assert (view.kind, view.dtype_name, view.wire_dtype) == ("numpy", "bfloat16",
                                                            np.dtype(np.uint16))
    assert np.shares_memory(view.array, values)


# ------------------------------------------------------------------ what is refused


@pytest.mark.parametrize("obj, why", [
    (jnp.ones(3), "older than 1.0"),
    (LegacyDLPack(np.ones(3)), "older than 1.0"),
    (b"abcd", "buffer is read-only"),
    (memoryview(bytearray(4)).toreadonly(), "buffer is read-only"),
])
def test_read_only_memory_is_refused_where_a_result_is_written(obj, why):
    as_view(obj, writable=False)  # read: taken
    with pytest.raises(col.ArgumentValueError, match=why) as refused:
        as_view(obj, writable=True, what="tensor")
    assert "ray_collective.functional" in str(refused.value)


def test_a_versioned_read_only_export_is_refused_where_written():
    frozen = np.arange(3.0)
    frozen.flags.writeable = False  # numpy marks its DLPack 1.0 export read-only
    with pytest.raises(col.ArgumentValueError, match="marked read-only"):
        as_view(DLPackOnly(frozen), writable=True)


@pytest.mark.parametrize("obj", [DLPackOnly(np.arange(12.0).reshape(3, 4)[:, ::2]),
                                 DLPackOnly(np.arange(12.0).reshape(3, 4).T)])
def test_non_contiguous_dlpack_memory_is_refused(obj):
    with pytest.raises(col.ArgumentValueError, match="non-contiguous"):
        as_view(obj, writable=False)


def test_non_contiguous_buffers_and_unknown_formats_are_refused():
    strided = memoryview(np.arange(6, dtype=np.float64))[::2]
    with pytest.raises(col.ArgumentValueError, match="non-contiguous memoryview"):
        as_view(strided, writable=False)
    with pytest.raises(col.ArgumentTypeError, match="buffer format"):
        as_view(memoryview(np.zeros(2, "S3")), writable=False)


@pytest.mark.parametrize("dtype, match", [("float8_e4m3fn", "float8_e4m3fn of 8 bits"),
                                          ("int4", "could not be exported through DLPack")])
def test_dtypes_outside_the_librarys_are_refused_naming_them(dtype, match):
    with pytest.raises(col.ArgumentTypeError, match=match):
        as_view(jnp.zeros(3, getattr(jnp, dtype)), writable=False)


def test_foreign_devices_are_refused_and_cuda_needs_a_gpu_library(monkeypatch):
    with pytest.raises(col.ArgumentTypeError, match="Metal device"):
        view_of_protocol(OnDevice(8), False, "tensor")
    import ray_collective.array_protocols as protocols
    monkeypatch.setattr(protocols, "_importable", lambda name: None)
    with pytest.raises(col.ArgumentTypeError, match="cupy or torch with CUDA"):
        view_of_protocol(OnDevice(2), False, "tensor")


def test_cuda_memory_goes_to_the_gpu_librarys_view(monkeypatch):
    """A CUDA DLPack producer becomes the cupy array over its memory (stood in for here: no
    GPU), whose view a GPU backend takes."""
    import ray_collective.array_protocols as protocols

    class CupyArray:  # what tests/test_tensors.py uses to stand in for cupy
        __module__ = "cupy"
        dtype = np.dtype(np.float32)
        shape = (4,)
        flags = type("Flags", (), {"c_contiguous": True})()
        device = type("Device", (), {"id": 1})()

    seen = []
    fake_cupy = type("cupy", (), {"from_dlpack": staticmethod(
        lambda obj: seen.append(obj) or CupyArray())})
    monkeypatch.setattr(protocols, "_importable", lambda name: fake_cupy)
    producer = OnDevice(2)
    view = view_of_protocol(producer, True, "tensor")
    assert seen == [producer]
    assert (view.kind, view.device, view.array) == ("cupy", "cuda:1", None)


def test_numpy_and_torch_never_reach_the_protocols():
    """The per-call cost of the known types stays a type check: they never load the module."""
    import subprocess
    import sys
    code = ("import sys, numpy as np, torch, ray_collective.tensors as t\n"
            "t.as_view(np.zeros(3), writable=True); t.as_view(torch.zeros(3), writable=True)\n"
            "print('ray_collective.array_protocols' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------ functional, over ranks


def test_in_place_collectives_refuse_jax_arrays_on_every_rank_before_anything_is_sent():
    def body(rank):
        with pytest.raises(col.ArgumentValueError, match="functional") as refused:
            col.allreduce(jnp.ones(3), "arrays")
        x = np.full(2, rank + 1.0)
        col.allreduce(x, "arrays")  # the group is intact: nothing was sent
        return str(refused.value), x

    for message, x in run_ranks(2, body, group_name="arrays"):
        assert "read-only jaxlib" in message
        np.testing.assert_array_equal(x, [3.0, 3.0])


def _inputs(rank, world_size, dtype=np.float32):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((world_size, 5)).astype(dtype)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_functional_collectives_on_jax_match_numpy_and_leave_inputs_alone(world_size):
    inputs = [_inputs(r, world_size) for r in range(world_size)]

    def body(rank):
        x = jnp.asarray(inputs[rank])
        before = np.array(x)
        out = {
            "allreduce": functional.allreduce(x[0], "arrays", col.ReduceOp.MAX),
            "broadcast": functional.broadcast(x, world_size - 1, "arrays"),
            "allgather": functional.allgather(x[-1], "arrays"),
            "reducescatter": functional.reducescatter(x, "arrays"),
            "alltoall": functional.alltoall(x, "arrays"),
            "scalar": functional.allgather(x[0, 0], "arrays"),
        }
        np.testing.assert_array_equal(np.asarray(x), before)
        assert all(isinstance(v, jax.Array) for v in out.values())
        return {k: np.asarray(v) for k, v in out.items()}

    stacked = np.stack(inputs)
    for rank, got in enumerate(run_ranks(world_size, body, group_name="arrays")):
        np.testing.assert_array_equal(got["allreduce"], stacked[:, 0].max(axis=0))
        np.testing.assert_array_equal(got["broadcast"], inputs[-1])
        np.testing.assert_array_equal(got["allgather"], stacked[:, -1])
        np.testing.assert_allclose(got["reducescatter"], stacked[:, rank].sum(axis=0),
                                   rtol=1e-6)
        np.testing.assert_array_equal(got["alltoall"], stacked[:, rank])
        np.testing.assert_array_equal(got["scalar"], stacked[:, 0, 0])


def test_functional_bfloat16_sums_as_jax_rounds_each_step():
    values = [jnp.asarray([1.0, 0.00390625, 256.0, -7.5], jnp.bfloat16) * (r + 1)
              for r in range(2)]

    def body(rank):
        return np.asarray(functional.allreduce(values[rank], "arrays"))

    expected = np.asarray(values[0] + values[1])  # JAX's own bfloat16 addition
    for got in run_ranks(2, body, group_name="arrays"):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_functional_keeps_torch_and_numpy_families_and_checks_the_first_axis():
    torch = extras.need("torch", "the torch family of ray_collective.functional")

    def body(rank):
        t = functional.allreduce(torch.full((2,), float(rank)), "arrays")
        n = functional.allgather(memoryview(np.array([rank], np.int64)), "arrays")
        with pytest.raises(col.ArgumentValueError, match=r"shape \(2, \.\.\.\)"):
            functional.reducescatter(np.zeros((3, 2)), "arrays")
        return type(t).__name__, t.tolist(), type(n).__name__, n.tolist()

    for got in run_ranks(2, body, group_name="arrays"):
        assert got == ("Tensor", [1.0, 1.0], "ndarray", [[0], [1]])
