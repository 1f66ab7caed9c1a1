"""Tests of ray_collective.tensors: tensor views, reductions and the AVG finalisation.

References are independent of the code under test: numpy's own ``ufunc.reduce`` for the
combiners, torch's own bfloat16/float16 arithmetic for the rounding, and Python's exact
integers for the integer AVG truncation. cupy is not installed here: cupy recognition is tested
with a stand-in class whose ``__module__`` is ``"cupy"``; torch CUDA recognition runs only when
a GPU is present (no GPU coverage is claimed otherwise).
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
import zlib

import numpy as np
import pytest

from ray_collective.reductions import check_op, combiner, finalize_average
from ray_collective.tensors import SUPPORTED_DTYPES, TensorView, as_view, check_same_layout
from ray_collective.errors import ArgumentValueError, ReadOnlyTensorWarning
from ray_collective.types import ReduceOp
from support import extras

NUMPY_DTYPES = [d for d in SUPPORTED_DTYPES if d != "bfloat16"]
ALL_OPS = list(ReduceOp)
REFERENCE_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # combines as SUM; the division is finalize_average's
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def _torch():
    return extras.need("torch", "the torch tensor tests")


def _random(dtype_name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype_name)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # full range, so SUM and PRODUCT overflow and must wrap like numpy
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "f":
        out = (rng.standard_normal(n) * 10).astype(dtype)
        out[:4] = [np.nan, np.inf, -np.inf, -0.0]
        return out
    real = rng.standard_normal(n) * 10
    imag = rng.standard_normal(n) * 10
    out = (real + 1j * imag).astype(dtype)
    out[0] = complex(np.nan, 1.0)
    return out


# ---------------------------------------------------------------------------------------------
# combiner against numpy's own reduce, every dtype x op


@pytest.mark.parametrize("dtype_name, op", [
    (d, op) for d in NUMPY_DTYPES for op in ALL_OPS
    if not (op is ReduceOp.AVG and d == "bool")  # refused: test_avg_on_bool_raises
], ids=lambda x: x.name if isinstance(x, ReduceOp) else x)
def test_combiner_matches_numpy_reduce(dtype_name, op):
    rng = np.random.default_rng(zlib.crc32(f"{dtype_name}-{op.name}".encode()))  # reproducible
    ranks = [_random(dtype_name, 41, rng) for _ in range(4)]
    stack = np.stack(ranks)
    expected = REFERENCE_UFUNC[op].reduce(stack, axis=0, dtype=np.dtype(dtype_name))

    combine = combiner(op, dtype_name)
    acc = ranks[0].copy()
    for incoming in ranks[1:]:
        incoming = incoming.copy()
        incoming.flags.writeable = False  # combine may read straight out of a peer's buffer
        combine(acc, incoming)

    assert acc.dtype == np.dtype(dtype_name)
    np.testing.assert_array_equal(acc, expected)
    if dtype_name not in ("complex64", "complex128"):  # complex NaN payloads are not compared
        # numpy's reduce starts a SUM from +0.0, so it turns -0.0 + -0.0 into +0.0; pairwise
        # IEEE addition (and torch) keep -0.0 (test_combiner_keeps_negative_zero).
        same = acc.view(np.dtype(f"u{acc.itemsize}")) == expected.view(
            np.dtype(f"u{acc.itemsize}"))
        if acc.dtype.kind == "f":
            same |= (acc == 0) & (expected == 0)
        assert same.all(), f"results differ in their bits at {np.flatnonzero(~same)}"


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
def test_combiner_keeps_negative_zero(dtype_name):
    if dtype_name == "bfloat16":
        acc, incoming = np.array([0x8000, 0x8000], np.uint16), np.array([0x8000, 0], np.uint16)
        combiner(ReduceOp.SUM, dtype_name)(acc, incoming)
        assert acc.tolist() == [0x8000, 0]  # -0 + -0 = -0, -0 + +0 = +0 (round to nearest)
        return
    acc = np.array([-0.0, -0.0], dtype_name)
    combiner(ReduceOp.SUM, dtype_name)(acc, np.array([-0.0, 0.0], dtype_name))
    assert np.signbit(acc).tolist() == [True, False]


def test_combiner_integer_wraps_and_bool_semantics():
    acc = np.array([127, -128, 100], np.int8)
    combiner(ReduceOp.SUM, "int8")(acc, np.array([1, -1, 100], np.int8))
    assert acc.tolist() == [-128, 127, -56]
    acc = np.array([255, 0], np.uint8)
    combiner(ReduceOp.SUM, "uint8")(acc, np.array([1, 0], np.uint8))
    assert acc.tolist() == [0, 0]
    acc = np.array([True, True, False, False])
    combiner(ReduceOp.SUM, "bool")(acc, np.array([True, False, True, False]))
    assert acc.tolist() == [True, True, True, False]  # logical or
    acc = np.array([True, True, False, False])
    combiner(ReduceOp.PRODUCT, "bool")(acc, np.array([True, False, True, False]))
    assert acc.tolist() == [True, False, False, False]  # logical and


def test_combiner_nan_propagates_through_min_max():
    for op in (ReduceOp.MIN, ReduceOp.MAX):
        acc = np.array([np.nan, 1.0, 2.0], np.float32)
        combiner(op, "float32")(acc, np.array([0.0, np.nan, 3.0], np.float32))
        assert np.isnan(acc[0]) and np.isnan(acc[1])
        assert acc[2] == (2.0 if op is ReduceOp.MIN else 3.0)


def test_combiner_complex_min_max_follow_numpy_ordering():
    a = np.array([1 + 5j, 2 + 0j, 1 + 1j], np.complex64)
    b = np.array([1 + 2j, 1 + 9j, 1 + 1j], np.complex64)
    acc = a.copy()
    combiner(ReduceOp.MIN, "complex64")(acc, b)
    assert acc.tolist() == [1 + 2j, 1 + 9j, 1 + 1j]  # lexicographic (real, then imaginary)
    acc = a.copy()
    combiner(ReduceOp.MAX, "complex64")(acc, b)
    assert acc.tolist() == [1 + 5j, 2 + 0j, 1 + 1j]


@pytest.mark.parametrize("dtype_name", SUPPORTED_DTYPES)
def test_combiner_zero_length(dtype_name):
    wire = np.uint16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    for op in ALL_OPS:
        if op is ReduceOp.AVG and dtype_name == "bool":
            continue
        acc = np.empty(0, wire)
        combiner(op, dtype_name)(acc, np.empty(0, wire))
        assert acc.shape == (0,)
        if op is ReduceOp.AVG:
            finalize_average(acc, dtype_name, 3)


def test_combiner_rejects_length_mismatch():
    with pytest.raises(ValueError, match="shapes"):
        combiner(ReduceOp.SUM, "float32")(np.zeros(3, np.float32), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="shapes"):
        combiner(ReduceOp.SUM, "bfloat16")(np.zeros(3, np.uint16), np.zeros(2, np.uint16))


def test_avg_on_bool_raises():
    for call in (lambda: check_op(ReduceOp.AVG, "bool"),
                 lambda: combiner(ReduceOp.AVG, "bool"),
                 lambda: finalize_average(np.zeros(2, bool), "bool", 2)):
        with pytest.raises(TypeError, match="bool") as info:
            call()
        assert "SUM" in str(info.value)  # says which ops do work
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        check_op(op, "bool")


def test_check_op_rejects_bad_arguments():
    with pytest.raises(TypeError, match="ReduceOp"):
        check_op("sum", "float32")
    with pytest.raises(TypeError, match="float8"):
        check_op(ReduceOp.SUM, "float8")
    for dtype_name in SUPPORTED_DTYPES:
        for op in ALL_OPS:
            if not (op is ReduceOp.AVG and dtype_name == "bool"):
                check_op(op, dtype_name)


# ---------------------------------------------------------------------------------------------
# bfloat16 and float16 against torch's own arithmetic


_TORCH_BINARY = {
    ReduceOp.SUM: lambda a, b: a + b,
    ReduceOp.PRODUCT: lambda a, b: a * b,
    ReduceOp.MIN: lambda a, b: __import__("torch").minimum(a, b),
    ReduceOp.MAX: lambda a, b: __import__("torch").maximum(a, b),
}


def _bf16_bits(t) -> np.ndarray:
    torch = _torch()
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def _assert_same_as_torch(ours_bits: np.ndarray, torch_result, wire_to_float) -> None:
    theirs = torch_result.float().numpy()
    ours = wire_to_float(ours_bits)
    nan = np.isnan(theirs)
    # NaN must stay NaN; its bit pattern is unspecified (torch itself gives 0x7FC0 or 0xFFFF)
    assert np.array_equal(np.isnan(ours), nan)
    if torch_result.dtype == __import__("torch").bfloat16:
        theirs_bits = _bf16_bits(torch_result)
    else:
        theirs_bits = torch_result.numpy().view(np.uint16)
    mismatch = np.flatnonzero((ours_bits != theirs_bits) & ~nan)
    assert mismatch.size == 0, (
        f"{mismatch.size} results differ from torch, first at {mismatch[:5]}: "
        f"ours {ours_bits[mismatch[:5]]} torch {theirs_bits[mismatch[:5]]}")


def _bf16_as_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                         ids=lambda o: o.name)
def test_bfloat16_pairwise_matches_torch_exhaustively(op):
    """Every one of the 65536 bfloat16 bit patterns, against shuffled partners."""
    torch = _torch()
    rng = np.random.default_rng(op.value)
    a_bits = np.arange(1 << 16, dtype=np.uint16)
    for _ in range(3):
        b_bits = rng.permutation(a_bits)
        acc = a_bits.copy()
        combiner(op, "bfloat16")(acc, b_bits)
        ta = torch.from_numpy(a_bits.view(np.int16).copy()).view(torch.bfloat16)
        tb = torch.from_numpy(b_bits.view(np.int16).copy()).view(torch.bfloat16)
        _assert_same_as_torch(acc, _TORCH_BINARY[op](ta, tb), _bf16_as_float)


def test_bfloat16_rounding_ties_to_even():
    torch = _torch()
    # 1 + 2**-8 is halfway between 1 and the next bfloat16 (1 + 2**-7): ties go to the even one
    a = torch.tensor([1.0, 1.0 + 2**-7, 1.0, 3.3895313892515355e38, -0.0], dtype=torch.bfloat16)
    b = torch.tensor([2**-8, 2**-8, -2**-9, 3.3895313892515355e38, 0.0], dtype=torch.bfloat16)
    acc = _bf16_bits(a)
    combiner(ReduceOp.SUM, "bfloat16")(acc, _bf16_bits(b))
    values = _bf16_as_float(acc)
    assert values[0] == 1.0
    assert values[1] == 1.0 + 2**-6
    assert values[3] == np.inf  # overflow rounds to infinity
    assert np.array_equal(acc, _bf16_bits(a + b))


def test_bfloat16_multi_rank_long_matches_torch_sequence():
    """Several ranks, longer than one internal chunk, reduced in order as torch would."""
    torch = _torch()
    gen = torch.Generator().manual_seed(7)
    ranks = [(torch.randn(150_001, generator=gen) * 100).to(torch.bfloat16) for _ in range(4)]
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX):
        acc = _bf16_bits(ranks[0])
        expected = ranks[0].clone()
        for t in ranks[1:]:
            combiner(op, "bfloat16")(acc, _bf16_bits(t))
            expected = _TORCH_BINARY[op](expected, t)
        _assert_same_as_torch(acc, expected, _bf16_as_float)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                         ids=lambda o: o.name)
def test_float16_pairwise_matches_torch_exhaustively(op):
    torch = _torch()
    rng = np.random.default_rng(100 + op.value)
    a_bits = np.arange(1 << 16, dtype=np.uint16)
    b_bits = rng.permutation(a_bits)
    acc = a_bits.view(np.float16).copy()
    combiner(op, "float16")(acc, b_bits.view(np.float16))
    ta = torch.from_numpy(a_bits.view(np.float16).copy())
    tb = torch.from_numpy(b_bits.view(np.float16).copy())
    _assert_same_as_torch(acc.view(np.uint16), _TORCH_BINARY[op](ta, tb),
                          lambda bits: bits.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("world_size", [2, 3, 7, 100])
def test_bfloat16_and_float16_average_match_torch_division(world_size):
    torch = _torch()
    all_bits = np.arange(1 << 16, dtype=np.uint16)

    bits = all_bits.copy()
    finalize_average(bits, "bfloat16", world_size)
    t = torch.from_numpy(all_bits.view(np.int16).copy()).view(torch.bfloat16)
    _assert_same_as_torch(bits, t / world_size, _bf16_as_float)

    half = all_bits.view(np.float16).copy()
    finalize_average(half, "float16", world_size)
    _assert_same_as_torch(half.view(np.uint16), torch.from_numpy(all_bits.view(np.float16)) /
                          world_size, lambda b: b.view(np.float16).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# finalize_average


def _trunc_div(value: int, n: int) -> int:
    q = abs(value) // n
    return q if value >= 0 else -q


@pytest.mark.parametrize("dtype_name", ["int8", "int16", "int32", "int64",
                                        "uint8", "uint16", "uint32", "uint64"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 127, 128, 200, 255, 256, 300, 2**40])
def test_integer_average_truncates_toward_zero(dtype_name, world_size):
    info = np.iinfo(dtype_name)
    values = {info.min, info.min + 1, info.max, info.max - 1, 0, 1, 7, 255, 300, 2**40,
              -1, -2, -7, -8, -9, -255, -300, -2**40}
    values = sorted(v for v in values if info.min <= v <= info.max)
    array = np.array(values, dtype=dtype_name)
    finalize_average(array, dtype_name, world_size)
    assert array.dtype == np.dtype(dtype_name)
    assert array.tolist() == [_trunc_div(v, world_size) for v in values]


def test_integer_average_of_a_sum_like_c():
    acc = np.array([-7, 7, -6, -1, 5], np.int32)
    combine = combiner(ReduceOp.AVG, "int32")
    combine(acc, np.array([0, 0, 0, 0, 0], np.int32))
    finalize_average(acc, "int32", 2)
    assert acc.tolist() == [-3, 3, -3, 0, 2]  # not floor (-4) and not rounding (-4 / 4)


def test_int64_average_is_exact_at_the_extremes():
    big = np.array([2**63 - 1, -2**63, -2**63 + 1, 2**53 + 1], np.int64)
    finalize_average(big, "int64", 3)
    assert big.tolist() == [(2**63 - 1) // 3, -(2**63 // 3), -((2**63 - 1) // 3),
                            (2**53 + 1) // 3]
    ubig = np.array([2**64 - 1, 2**53 + 1], np.uint64)
    finalize_average(ubig, "uint64", 3)
    assert ubig.tolist() == [(2**64 - 1) // 3, (2**53 + 1) // 3]


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "complex64", "complex128"])
def test_float_average_divides_in_own_dtype(dtype_name):
    rng = np.random.default_rng(3)
    array = _random(dtype_name, 33, rng)
    expected = np.divide(array, np.array(6, dtype=dtype_name), dtype=dtype_name)
    finalize_average(array, dtype_name, 6)
    assert array.dtype == np.dtype(dtype_name)
    np.testing.assert_array_equal(array, expected)


def test_float_average_of_a_sum_matches_numpy_mean():
    ranks = [np.arange(5, dtype=np.float64) * k for k in range(1, 5)]
    acc = ranks[0].copy()
    for r in ranks[1:]:
        combiner(ReduceOp.AVG, "float64")(acc, r)
    finalize_average(acc, "float64", 4)
    np.testing.assert_allclose(acc, np.mean(np.stack(ranks), axis=0), rtol=0, atol=1e-15)


def test_float16_average_with_a_large_world_size():
    # 70000 is not a float16 (it overflows to inf): the division must not use it as one
    half = np.array([60000.0, -3.0, 0.0], np.float16)
    finalize_average(half, "float16", 70000)
    expected = (np.array([60000.0, -3.0, 0.0]) / 70000).astype(np.float16)
    assert expected[0] != 0
    np.testing.assert_array_equal(half, expected)


def test_overflow_and_nan_do_not_warn():
    """inf and NaN are results, as in torch: no RuntimeWarning from numpy's error state."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype_name in ("float16", "float32", "float64", "complex64"):
            acc = np.array([np.inf, 6e4, 0.0], dtype_name)
            for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX):
                combiner(op, dtype_name)(acc, np.array([-np.inf, 6e4, 0.0], dtype_name))
            finalize_average(acc, dtype_name, 3)
        bits = np.array([0x7F80, 0x7F7F, 0], np.uint16)  # inf, max, 0
        combiner(ReduceOp.SUM, "bfloat16")(bits, np.array([0xFF80, 0x7F7F, 0], np.uint16))
        assert np.isnan(_bf16_as_float(bits)[0]) and bits[1] == 0x7F80
        finalize_average(bits, "bfloat16", 3)


def test_finalize_average_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        finalize_average(np.zeros(2, np.float32), "float32", 0)


# ---------------------------------------------------------------------------------------------
# as_view: numpy


def test_numpy_view_shares_memory_and_flattens_in_c_order():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = as_view(arr, writable=True)
    assert isinstance(view, TensorView)
    assert view.tensor is arr
    assert (view.kind, view.device, view.dtype_name, view.shape, view.count) == \
        ("numpy", "cpu", "float32", (2, 3), 6)
    assert view.wire_dtype == np.float32
    assert view.array.ndim == 1 and view.array.flags.c_contiguous
    assert np.shares_memory(view.array, arr)
    view.array[4] = 42.0
    assert arr[1, 1] == 42.0


@pytest.mark.parametrize("dtype_name", NUMPY_DTYPES)
def test_numpy_view_every_dtype(dtype_name):
    arr = np.zeros((3, 2), dtype=dtype_name)
    view = as_view(arr, writable=True)
    assert view.dtype_name == dtype_name and view.wire_dtype == np.dtype(dtype_name)
    view.array[-1] = 1
    assert arr[2, 1] == 1


def test_numpy_zero_length_and_zero_d():
    empty = np.zeros((0, 4), np.int32)
    view = as_view(empty, writable=True)
    assert view.count == 0 and view.shape == (0, 4) and view.array.shape == (0,)

    scalar = np.array(3.5, np.float64)
    view = as_view(scalar, writable=True)
    assert view.count == 1 and view.shape == () and view.array.shape == (1,)
    view.array[0] = -1.0
    assert scalar == -1.0


def test_numpy_subclasses():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # np.matrix is discouraged
        m = np.asmatrix(np.arange(6.0).reshape(2, 3))
    view = as_view(m, writable=True)
    assert view.array.shape == (6,) and view.shape == (2, 3)
    view.array[5] = -1.0
    assert m[1, 2] == -1.0
    with pytest.raises(TypeError, match="masked"):
        as_view(np.ma.masked_array([1.0, 2.0], mask=[0, 1]), writable=False)


def test_numpy_read_only_array_is_written_through_with_one_warning(monkeypatch):
    monkeypatch.delenv("RAY_COLLECTIVE_READ_ONLY", raising=False)
    arr = np.arange(4, dtype=np.float32).reshape(2, 2)
    arr.flags.writeable = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        view = as_view(arr, writable=True, what="tensor_list[1]")
        as_view(arr, writable=True)
    assert [w.category for w in caught] == [ReadOnlyTensorWarning]
    assert "ray.get" in str(caught[0].message) and "RAY_COLLECTIVE_READ_ONLY=error" in str(
        caught[0].message)
    assert view.array.flags.writeable and view.array.shape == (4,) and view.shape == (2, 2)
    view.array[:] = [9, 8, 7, 6]  # what a backend does with the result
    np.testing.assert_array_equal(arr, [[9, 8], [7, 6]])
    assert not arr.flags.writeable  # the caller's array keeps its flag
    assert np.shares_memory(as_view(arr, writable=False).array, arr)  # reading is plain


def test_numpy_read_only_array_strict_mode_refuses_it(monkeypatch):
    arr = np.arange(4, dtype=np.float32)
    arr.flags.writeable = False
    monkeypatch.setenv("RAY_COLLECTIVE_READ_ONLY", "error")
    with pytest.raises(ArgumentValueError, match="read-only") as info:
        as_view(arr, writable=True, what="tensor_list[1]")
    assert "copy" in str(info.value) and "tensor_list[1]" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    as_view(arr, writable=False)  # an input may still be read-only
    monkeypatch.setenv("RAY_COLLECTIVE_READ_ONLY", "sometimes")
    with pytest.raises(ValueError, match="write, error"):
        as_view(arr, writable=True)


def test_empty_read_only_array_needs_no_memory(monkeypatch):
    monkeypatch.delenv("RAY_COLLECTIVE_READ_ONLY", raising=False)
    arr = np.zeros(0, np.int16)
    arr.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReadOnlyTensorWarning)
        view = as_view(arr, writable=True)
    assert view.array.shape == (0,) and view.array.dtype == np.int16


@pytest.mark.parametrize("make", [lambda: np.arange(10, dtype=np.float32)[::2],
                                  lambda: np.arange(12, dtype=np.int64).reshape(3, 4).T,
                                  lambda: np.zeros((4, 4), np.float64)[:, 1:3]],
                         ids=["strided", "transposed", "column-slice"])
def test_numpy_non_contiguous(make):
    with pytest.raises(ValueError, match="contiguous") as info:
        as_view(make(), writable=False, what="tensor")
    assert "np.ascontiguousarray" in str(info.value)


@pytest.mark.parametrize("obj, key", [
    ([1.0, 2.0], "list"),
    ((1, 2), "tuple"),
    (np.float32(1.0), "numpy scalar"),
    (3.0, "float"),
    ("abc", "str"),
    (None, "NoneType"),
], ids=["list", "tuple", "numpy-scalar", "float", "str", "None"])
def test_not_a_tensor(obj, key):
    with pytest.raises(TypeError) as info:
        as_view(obj, writable=False, what="tensor")
    message = str(info.value)
    assert key in message
    assert "numpy.ndarray" in message and "torch.Tensor" in message


@pytest.mark.parametrize("arr, name", [
    (np.array([object(), None], dtype=object), "object"),
    (np.array(["a", "b"]), "<U1"),
    (np.zeros(2, np.longdouble), "longdouble"),
    (np.zeros(2, "datetime64[s]"), "datetime64"),
    (np.zeros(2, [("x", np.float32), ("y", np.int32)]), "x"),
], ids=["object", "str", "longdouble", "datetime", "structured"])
def test_numpy_unsupported_dtype(arr, name):
    if name == "longdouble" and np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("longdouble is float64 on this platform")
    with pytest.raises(TypeError, match="dtype") as info:
        as_view(arr, writable=False)
    message = str(info.value)
    assert "float32" in message and "bfloat16" in message  # names the supported ones


def test_numpy_non_native_byte_order():
    arr = np.zeros(3, dtype=np.dtype(np.float32).newbyteorder("S"))
    with pytest.raises(TypeError, match="byte order"):
        as_view(arr, writable=False)


# ---------------------------------------------------------------------------------------------
# as_view: torch (CPU)


_TORCH_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                 "complex128"]


@pytest.mark.parametrize("dtype_name", _TORCH_DTYPES)
def test_torch_view_every_dtype_shares_memory(dtype_name):
    torch = _torch()
    t = torch.zeros((2, 3), dtype=getattr(torch, dtype_name))
    view = as_view(t, writable=True)
    assert (view.kind, view.device, view.dtype_name, view.shape, view.count) == \
        ("torch", "cpu", dtype_name, (2, 3), 6)
    assert view.tensor is t
    assert view.array.ndim == 1 and view.array.dtype == view.wire_dtype
    if dtype_name == "bfloat16":
        assert view.wire_dtype == np.uint16
        view.array[5] = 0x4040  # bfloat16 bits of 3.0
        assert t[1, 2].item() == 3.0
    else:
        assert view.wire_dtype == np.dtype(dtype_name)
        view.array[5] = 1
        assert t[1, 2].item() == 1


def test_torch_view_requires_grad_and_parameter():
    torch = _torch()
    t = torch.ones(4, requires_grad=True)
    view = as_view(t, writable=True)
    view.array[0] = 5.0
    assert t[0].item() == 5.0 and t.requires_grad
    p = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    view = as_view(p, writable=True)
    assert view.dtype_name == "bfloat16" and view.tensor is p
    view.array[:] = 0x3F80  # 1.0
    assert p.detach().float().tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_torch_zero_length_and_zero_d():
    torch = _torch()
    view = as_view(torch.zeros(0, 3), writable=True)
    assert view.count == 0 and view.array.shape == (0,) and view.shape == (0, 3)
    t = torch.tensor(2.5, dtype=torch.bfloat16)
    view = as_view(t, writable=True)
    assert view.shape == () and view.count == 1 and view.array.shape == (1,)
    view.array[0] = 0xC000  # -2.0
    assert t.item() == -2.0


def test_torch_combine_in_place_through_views():
    """End to end: a bfloat16 SUM written through the view lands in the caller's tensor."""
    torch = _torch()
    a = torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16)
    b = torch.tensor([0.5, 0.25, 3.0], dtype=torch.bfloat16)
    expected = a + b
    combiner(ReduceOp.SUM, "bfloat16")(as_view(a, writable=True).array,
                                       as_view(b, writable=False).array)
    assert torch.equal(a, expected)


@pytest.mark.parametrize("make", [lambda torch: torch.arange(12.0).reshape(3, 4).t(),
                                  lambda torch: torch.arange(10)[::2],
                                  lambda torch: torch.zeros(4, 4, dtype=torch.bfloat16)[:, 1:3]],
                         ids=["transposed", "strided", "bfloat16-slice"])
def test_torch_non_contiguous(make):
    torch = _torch()
    with pytest.raises(ValueError, match="contiguous") as info:
        as_view(make(torch), writable=True, what="tensor_list[2]")
    assert ".contiguous()" in str(info.value) and "tensor_list[2]" in str(info.value)


def test_torch_unsupported_dtype_layout_device():
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        chalf = torch.zeros(2, dtype=torch.complex32)
    with pytest.raises(TypeError, match="complex32"):
        as_view(chalf, writable=False)
    with pytest.raises(TypeError, match="float8_e4m3fn") as info:
        as_view(torch.zeros(2, dtype=torch.float8_e4m3fn), writable=False)
    assert "bfloat16" in str(info.value)
    with pytest.raises(TypeError, match="layout"):
        as_view(torch.zeros(3, 3).to_sparse(), writable=False)
    with pytest.raises(TypeError, match="meta"):
        as_view(torch.zeros(3, device="meta"), writable=False)


def test_torch_lazy_conjugate_view():
    torch = _torch()
    t = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
    with pytest.raises(ValueError, match="resolve_conj"):
        as_view(t, writable=False)
    view = as_view(t.resolve_conj(), writable=False)
    assert view.array.tolist() == [1 - 2j, 3 + 1j]


def test_torch_cuda_tensor_is_recognised():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: torch CUDA recognition is not exercised")
    t = torch.zeros(2, 3, dtype=torch.bfloat16, device="cuda:0")
    view = as_view(t, writable=True)
    assert (view.kind, view.device, view.array, view.dtype_name, view.shape) == \
        ("torch", "cuda:0", None, "bfloat16", (2, 3))
    assert view.wire_dtype == np.uint16


# ---------------------------------------------------------------------------------------------
# as_view: cupy (stand-in class; cupy itself is not installed here)


class _FakeCupyArray:
    """Only what as_view reads from a cupy.ndarray; not a test of cupy itself."""

    def __init__(self, shape, dtype, device_id=0, contiguous=True):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)
        self.device = types.SimpleNamespace(id=device_id)


_FakeCupyArray.__module__ = "cupy"


def test_cupy_stand_in_is_recognised():
    view = as_view(_FakeCupyArray((4, 2), np.float16, device_id=1), writable=True)
    assert (view.kind, view.device, view.array, view.dtype_name, view.shape, view.count) == \
        ("cupy", "cuda:1", None, "float16", (4, 2), 8)
    assert view.wire_dtype == np.float16


def test_cupy_stand_in_errors():
    with pytest.raises(ValueError, match="contiguous"):
        as_view(_FakeCupyArray((4,), np.float32, contiguous=False), writable=True)
    with pytest.raises(TypeError, match="object"):
        as_view(_FakeCupyArray((4,), object), writable=True)


# ---------------------------------------------------------------------------------------------
# check_same_layout


def test_check_same_layout_accepts_matching_and_empty():
    check_same_layout([], "tensor_list")
    views = [as_view(np.zeros((2, 3), np.float32), writable=True) for _ in range(3)]
    check_same_layout(views, "tensor_list")


def test_check_same_layout_shape_and_dtype():
    base = as_view(np.zeros((2, 3), np.float32), writable=True)
    other_shape = as_view(np.zeros((3, 2), np.float32), writable=True)
    other_dtype = as_view(np.zeros((2, 3), np.float64), writable=True)
    with pytest.raises(ValueError) as info:
        check_same_layout([base, base, other_shape, other_dtype], "tensor_list")
    message = str(info.value)
    assert "tensor_list[2]" in message and "(3, 2)" in message and "(2, 3)" in message
    with pytest.raises(ValueError, match=r"tensor_list\[1\] has dtype 'float64'.*'float32'"):
        check_same_layout([base, other_dtype], "tensor_list")


def test_check_same_layout_mixes_cpu_kinds_but_not_gpu_kinds_or_devices():
    torch = _torch()
    numpy_view = as_view(np.zeros(3, np.float32), writable=True)
    torch_view = as_view(torch.zeros(3), writable=True)
    check_same_layout([numpy_view, torch_view], "tensor_list")  # as Gloo accepts them
    check_same_layout([torch_view, numpy_view], "tensor_list", numpy_view)
    with pytest.raises(ValueError, match="dtype 'float64'.*dtype 'float32'"):
        check_same_layout([torch_view, as_view(np.zeros(3), writable=True)], "tensor_list")
    gpu0 = as_view(_FakeCupyArray((3,), np.float32, 0), writable=True)
    gpu1 = as_view(_FakeCupyArray((3,), np.float32, 1), writable=True)
    with pytest.raises(ValueError, match="device 'cuda:1'.*device 'cuda:0'"):
        check_same_layout([gpu0, gpu1], "output_list")
    torch_gpu0 = TensorView(tensor=None, array=None, dtype_name="float32",
                            wire_dtype=np.dtype(np.float32), shape=(3,), device="cuda:0",
                            kind="torch")
    with pytest.raises(ValueError, match="kind 'torch'.*kind 'cupy'"):
        check_same_layout([gpu0, torch_gpu0], "output_list")


# ---------------------------------------------------------------------------------------------
# layering: torch is never imported by the module


def test_module_does_not_import_torch_or_cupy():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None\n"
            "import numpy as np\n"
            "import ray_collective.tensors as t\n"
            "v = t.as_view(np.zeros(3), writable=True)\n"
            "assert v.kind == 'numpy'\n"
            "try:\n"
            "    t.as_view([1, 2], writable=True)\n"
            "except TypeError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('no TypeError')\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=None)
    code = ("import sys, ray_collective.tensors\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
