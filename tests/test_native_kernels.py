"""The native reduction kernels agree with reductions.combiner, the reference, bit for bit.

Every dtype x op on random data, random bit patterns (NaNs with payloads, infinities,
subnormals), signed zeros, integer extremes and lengths 0, 1, odd and large. Where numpy gives a
NaN after SUM or PRODUCT ours must be a NaN too, its payload free (kernels.c says why); every
other result, MIN and MAX included, must have numpy's exact bits.
"""

import zlib

import numpy as np
import pytest

from ray_collective import native
from ray_collective.reductions import combiner
from ray_collective.tensors import SUPPORTED_DTYPES
from ray_collective.types import ReduceOp

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native core not built: {native.import_error()}")

if native.available():
    from ray_collective.native import _core
    from ray_collective.native.codes import (DTYPE_CODES, NO_OP, PRODUCT_FUSED, dtype_code,
                                             op_code)

OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
LENGTHS = (0, 1, 7, 1000, 100_003)
FLOATS = ("float16", "float32", "float64")
COMPLEX = ("complex64", "complex128")


def wire(name):
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def specials(name):
    """Values that break naive kernels, as wire arrays."""
    with np.errstate(all="ignore"):  # inf * 1j and the like are meant
        return _specials(name)


def _specials(name):
    if name == "bool":
        return np.array([0, 1], np.uint8).view(np.bool_)
    if name == "bfloat16":
        return np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001,
                         0x8001, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x0080], np.uint16)
    dtype = np.dtype(name)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, info.max, 0, 1, info.max // 2 + 1, info.min + 1]
                        + ([-1, -2] if dtype.kind == "i" else [2, 3]), dtype)
    finfo = np.finfo(dtype)  # of the components, for complex dtypes
    real = finfo.dtype
    base = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, finfo.max, -finfo.max,
                     finfo.tiny, finfo.smallest_subnormal, -finfo.smallest_subnormal, 1.0,
                     -1.0, 0.5], real)
    if dtype.kind == "c":
        re, im = np.meshgrid(base, base)
        return (re.ravel() + 1j * im.ravel()).astype(dtype)
    return base


def data(name, length, rng):
    """A random wire array of ``length`` that mixes random values, random bit patterns and
    the special values."""
    dtype = wire(name)
    if length == 0:
        return np.empty(0, dtype)
    if name == "bool":
        return rng.integers(0, 2, length).astype(np.bool_)
    bits = rng.integers(0, 256, length * dtype.itemsize, dtype=np.uint8).view(dtype)
    values = bits.copy()
    if dtype.kind in "fc":
        # Random bit patterns are mostly huge or tiny: add ordinary values too.
        normal = (rng.standard_normal(length) * 100).astype(dtype)
        if dtype.kind == "c":
            normal = normal + 1j * (rng.standard_normal(length) * 100).astype(dtype)
        values = np.where(rng.random(length) < 0.5, bits, normal)
    elif name == "bfloat16":
        ordinary = (rng.standard_normal(length).astype(np.float32).view(np.uint32) >> 16)
        values = np.where(rng.random(length) < 0.5, bits, ordinary.astype(np.uint16))
    special = specials(name)
    pick = rng.random(length) < 0.2
    values[pick] = rng.choice(special, pick.sum())
    return values


def nan_mask(array, name):
    if name == "bfloat16":
        return (array & 0x7FFF) > 0x7F80
    if array.dtype.kind == "c":
        parts = array.view(np.float32 if name == "complex64" else np.float64)
        return np.isnan(parts)
    if array.dtype.kind == "f":
        return np.isnan(array)
    return np.zeros(array.shape, bool)


def bits_of(array, name):
    if array.dtype.kind == "c":
        return array.view(np.uint32 if name == "complex64" else np.uint64)
    if array.dtype.kind in "fc" or array.dtype.itemsize > 1:
        return array.view(f"u{array.dtype.itemsize}")
    return array.view(np.uint8)


def assert_bitwise(ours, reference, name, op):
    same = bits_of(ours, name) == bits_of(reference, name)
    if op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        same |= nan_mask(ours, name) & nan_mask(reference, name)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{name} {op.name}: {bad.size} elements differ, first at {bad[0]}: "
                           f"ours {ours[bad[0] // (2 if ours.dtype.kind == 'c' else 1)]!r}, "
                           f"numpy's {reference[bad[0] // (2 if ours.dtype.kind == 'c' else 1)]!r}")


def native_combine(op, name, acc, incoming):
    _core.combine(dtype_code(name), op_code(op, name), acc, incoming)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_every_dtype_and_op_matches_the_reference_bit_for_bit(name, op, length):
    rng = np.random.default_rng(zlib.crc32(f"{name} {op.name} {length}".encode()))
    acc, incoming = data(name, length, rng), data(name, length, rng)
    reference = acc.copy()
    combiner(op, name)(reference, incoming)
    ours = acc.copy()
    native_combine(op, name, ours, incoming)
    assert_bitwise(ours, reference, name, op)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_every_pair_of_special_values(name, op):
    special = specials(name)
    acc, incoming = [a.ravel().copy() for a in np.meshgrid(special, special)]
    reference = acc.copy()
    combiner(op, name)(reference, incoming)
    native_combine(op, name, acc, incoming)
    assert_bitwise(acc, reference, name, op)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("name", ("float16", "bfloat16"))
def test_every_16_bit_pattern_against_random_partners(name, op):
    """Each of the 65536 patterns meets 64 random ones: every rounding case of the conversion
    back to 16 bits (ties, subnormals, overflow to infinity) comes up many times."""
    rng = np.random.default_rng(16)
    every = np.tile(np.arange(1 << 16, dtype=np.uint16), 64)
    partners = rng.integers(0, 1 << 16, every.size, dtype=np.uint16)
    dtype = wire(name)
    acc, incoming = every.view(dtype).copy(), partners.view(dtype)
    reference = acc.copy()
    combiner(op, name)(reference, incoming)
    native_combine(op, name, acc, incoming)
    assert_bitwise(acc, reference, name, op)


def test_complex_product_follows_numpy_on_this_cpu():
    """Numpy fuses the complex multiply-add where its SIMD loops can (x86 with FMA3); the op code
    follows it, so PRODUCT matches either way, and the other formula would not."""
    for name in COMPLEX:
        x = 1 + 2.0 ** -(np.finfo(np.dtype(name)).nmant // 2 + 1)
        a = np.full(16, complex(x, 1.0), name)
        reference = a.copy()
        combiner(ReduceOp.PRODUCT, name)(reference, a)
        ours = a.copy()
        native_combine(ReduceOp.PRODUCT, name, ours, a)
        np.testing.assert_array_equal(ours.view(f"u{ours.itemsize // 2}"),
                                      reference.view(f"u{ours.itemsize // 2}"))
        other = a.copy()
        other_code = 1 if op_code(ReduceOp.PRODUCT, name) == PRODUCT_FUSED else PRODUCT_FUSED
        _core.combine(dtype_code(name), other_code, other, a)
        assert other[0] != reference[0]


def test_the_dtype_table_agrees_with_the_kernels_item_sizes():
    assert list(DTYPE_CODES) == list(SUPPORTED_DTYPES)
    for name, code in DTYPE_CODES.items():
        assert _core.itemsize(code) == wire(name).itemsize
    assert _core.itemsize(len(SUPPORTED_DTYPES)) == 0 and _core.itemsize(-1) == 0


def test_avg_combines_as_sum_and_is_refused_on_bool():
    assert op_code(ReduceOp.AVG, "float32") == op_code(ReduceOp.SUM, "float32")
    with pytest.raises(TypeError):
        op_code(ReduceOp.AVG, "bool")


def test_bad_arguments_are_refused():
    f32 = DTYPE_CODES["float32"]
    sum_ = op_code(ReduceOp.SUM, "float32")
    with pytest.raises(ValueError, match="cannot combine"):
        _core.combine(f32, sum_, np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="cannot combine"):
        _core.combine(f32, sum_, np.zeros(2, np.float32), np.zeros(1, np.float64))
    with pytest.raises(ValueError, match="no reduction"):
        _core.combine(99, sum_, np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="no reduction"):
        _core.combine(f32, PRODUCT_FUSED, np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="no reduction"):
        _core.combine(f32, NO_OP, np.zeros(3, np.float32), np.zeros(3, np.float32))
    unaligned = np.zeros(13, np.uint8)[1:].view(np.float32)
    with pytest.raises(ValueError, match="unaligned"):
        _core.combine(f32, sum_, unaligned, np.zeros(3, np.float32))
    read_only = np.zeros(3, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _core.combine(f32, sum_, read_only, np.zeros(3, np.float32))
