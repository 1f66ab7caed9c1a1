"""Element-wise reductions of the wire buffers, and the last step of an average.

Reductions (:func:`combiner`) follow numpy's ufuncs in the tensor's own dtype: SUM is
``np.add`` (integers wrap on overflow, bool SUM is logical or), PRODUCT is ``np.multiply``
(bool PRODUCT is logical and), MIN and MAX are ``np.minimum`` and ``np.maximum`` (NaN
propagates; complex numbers are ordered lexicographically, as numpy does). bfloat16 is reduced
in float32 and rounded back to bfloat16 to nearest, ties to even, after every pairwise step, so
one step agrees bit for bit with torch's own bfloat16 arithmetic (a NaN stays a NaN, but its bit
pattern is not specified: torch itself gives 0x7FC0 or 0xFFFF depending on the code path).
AVG combines as SUM and is divided once at the end by :func:`finalize_average`: floats and
complex numbers with a correctly rounded division, integers truncating toward zero (as C and
NCCL do); AVG is refused on bool.

:func:`combiner` is the reference every engine reduces by: the native core's kernels match it
bit for bit (``tests/test_native_kernels.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np

from ray_collective.errors import ArgumentTypeError
from ray_collective.tensors import SUPPORTED_DTYPES, SUPPORTED_TEXT, type_name
from ray_collective.types import ReduceOp

__all__ = ["check_op", "combiner", "finalize_average"]

_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)


def _quiet() -> np.errstate:
    """Overflow to inf and NaN from inf - inf are results, not errors (torch does not warn).

    A fresh context each time: one np.errstate instance cannot be entered twice at once.
    """
    return np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore")


# Elements per chunk when bfloat16 is widened to float32; bounds the scratch memory.
_BF16_CHUNK = 1 << 16


def check_op(op: ReduceOp, dtype_name: str) -> None:
    """Check that the reduce op ``op`` is defined on ``dtype_name``.

    Args:
        op: the reduce op.
        dtype_name: the tensor's dtype name (see ``SUPPORTED_DTYPES``).

    Raises:
        ArgumentTypeError: ``op`` is not a ReduceOp, ``dtype_name`` is not supported, or the op
            is AVG on bool.
    """
    if not isinstance(op, ReduceOp):
        raise ArgumentTypeError(
            f"op must be a ray_collective.ReduceOp, not {type_name(op)} ({op!r}).")
    if dtype_name not in _SUPPORTED_SET:
        raise ArgumentTypeError(f"dtype {dtype_name!r} is not supported. Supported dtypes: "
                                f"{SUPPORTED_TEXT}.")
    if op is ReduceOp.AVG and dtype_name == "bool":
        raise ArgumentTypeError(
            "ReduceOp.AVG is not defined on bool tensors. Use ReduceOp.SUM (logical or), "
            "PRODUCT (logical and), MIN or MAX, or cast the tensor to a numeric dtype first.")


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def _bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) into the float32 array ``out`` (exact)."""
    u = out.view(np.uint32)
    np.copyto(u, bits, casting="unsafe")
    np.left_shift(u, 16, out=u)
    return out


def _f32_to_bf16(values: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """Round float32 ``values`` to bfloat16 bits in ``out``: to nearest, ties to even.

    ``scratch`` is a uint32 array of the same length (it may not alias ``values``). A NaN stays
    a (quiet) NaN with its sign kept.
    """
    u = values.view(np.uint32)
    np.right_shift(u, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    scratch += 0x7FFF
    scratch += u  # wraps only for NaNs, which are overwritten below
    np.right_shift(scratch, 16, out=scratch)
    np.copyto(out, scratch, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)


def _check_lengths(acc: np.ndarray, incoming: np.ndarray) -> None:
    if acc.shape != incoming.shape:
        raise ValueError(f"cannot combine arrays of shapes {acc.shape} and {incoming.shape}")


def _bf16_combiner(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], None]:
    def combine(acc: np.ndarray, incoming: np.ndarray) -> None:
        _check_lengths(acc, incoming)
        n = acc.shape[0]
        if n == 0:
            return
        size = min(n, _BF16_CHUNK)
        fa = np.empty(size, np.float32)
        fb = np.empty(size, np.float32)
        with _quiet():
            for start in range(0, n, size):
                stop = min(start + size, n)
                a_bits = acc[start:stop]
                m = stop - start
                a = _bf16_to_f32(a_bits, fa[:m])
                b = _bf16_to_f32(incoming[start:stop], fb[:m])
                ufunc(a, b, out=a)
                _f32_to_bf16(a, a_bits, b.view(np.uint32))

    return combine


@lru_cache(maxsize=None)
def combiner(op: ReduceOp, dtype_name: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """Return ``combine(acc, incoming)``, which reduces ``incoming`` into ``acc`` in place.

    The reduction is numpy's ufunc for ``op`` in the tensor's own dtype (SUM ``np.add``,
    PRODUCT ``np.multiply``, MIN ``np.minimum``, MAX ``np.maximum``; AVG combines as SUM, the
    division is :func:`finalize_average`'s). For bfloat16 the arrays hold bit patterns (uint16):
    each step is computed in float32 and rounded back to nearest, ties to even, as torch does.

    Args:
        op: the reduce op.
        dtype_name: the tensor's dtype name (see ``SUPPORTED_DTYPES``).

    Returns:
        A function of two 1-D arrays of the wire dtype and the same length (possibly zero) that
        writes ``op(acc, incoming)`` into ``acc``; ``incoming`` may be read-only.

    Raises:
        TypeError: as :func:`check_op` (AVG on bool, an unsupported dtype).
    """
    check_op(op, dtype_name)
    ufunc = _UFUNCS[op]
    if dtype_name == "bfloat16":
        return _bf16_combiner(ufunc)

    if np.dtype(dtype_name).kind in "fc":
        def combine(acc: np.ndarray, incoming: np.ndarray) -> None:
            _check_lengths(acc, incoming)
            with _quiet():
                ufunc(acc, incoming, out=acc)
    else:
        def combine(acc: np.ndarray, incoming: np.ndarray) -> None:
            _check_lengths(acc, incoming)
            ufunc(acc, incoming, out=acc)

    return combine


def finalize_average(array: np.ndarray, dtype_name: str, world_size: int) -> None:
    """Divide a summed ``array`` by ``world_size`` in place: the last step of ReduceOp.AVG.

    Floats and complex numbers are divided in their own dtype with one correctly rounded
    division (float16 through float32, bfloat16 bit patterns through float32 and rounded back
    to nearest, ties to even). Signed and unsigned integers are divided exactly and truncated
    toward zero, as C and NCCL do (``-7 / 2 == -3``), with no trip through float64, so int64
    and uint64 extremes are exact.

    Args:
        array: the flat wire array (uint16 bit patterns for bfloat16), modified in place.
        dtype_name: the tensor's dtype name.
        world_size: the number of ranks whose values were summed (at least 1).

    Raises:
        TypeError: AVG is not defined on ``dtype_name`` (bool), or the dtype is unsupported.
        ValueError: ``world_size`` is less than 1.
    """
    check_op(ReduceOp.AVG, dtype_name)
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size!r}")
    if n == 1 or array.size == 0:
        return
    with _quiet():
        _divide(array, dtype_name, n)


def _divide(array: np.ndarray, dtype_name: str, n: int) -> None:
    if dtype_name == "bfloat16":
        for start in range(0, array.shape[0], _BF16_CHUNK):
            bits = array[start:start + _BF16_CHUNK]
            values = _bf16_to_f32(bits, np.empty(bits.shape[0], np.float32))
            np.divide(values, np.float32(n), out=values)
            _f32_to_bf16(values, bits, np.empty(bits.shape[0], np.uint32))
        return
    if dtype_name == "float16":
        values = array.astype(np.float32)
        np.divide(values, np.float32(n), out=values)
        np.copyto(array, values, casting="same_kind")
        return
    kind = array.dtype.kind
    if kind in "fc":
        np.divide(array, array.dtype.type(n) if kind == "f" else n, out=array)
        return
    info = np.iinfo(array.dtype)
    if n > info.max:
        # |quotient| < 2: only the most negative value divided by exactly -min gives -1.
        if kind == "i":
            result = np.where(array <= -n, -1, 0).astype(array.dtype)
            np.copyto(array, result)
        else:
            array[...] = 0
        return
    if kind == "u":
        np.floor_divide(array, n, out=array)
        return
    # Signed: floor division, then add one where the quotient was rounded down from a negative
    # non-integer (the remainder of a negative dividend is non-zero).
    adjust = (array < 0) & (np.remainder(array, n) != 0)
    np.floor_divide(array, n, out=array)
    np.add(array, adjust, out=array, casting="unsafe")
