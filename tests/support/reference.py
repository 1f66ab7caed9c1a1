"""Reductions as numpy computes them, and how far a library's float reduction may be from
numpy's, derived from the dtype; plain numpy, so that the MPI oracle's processes use it too.

The average is this library's definition (the ``ray`` backend's, NCCL's): the sum divided once
by the number of ranks, floats with one rounded division in their dtype, integers truncated
toward zero.

A float sum of ``p`` tensors rounds at each of its ``p - 1`` additions, by at most half an ulp
of the partial sum, and the order of the additions is the algorithm's: ring, tree and numpy all
differ. Each computed sum is then within ``(p - 1) u sum(|x|)`` (``u`` half the dtype's epsilon,
first order) of the exact one, so two of them differ by at most ``(p - 1) eps sum(|x|)``; a
product by at most ``(p - 1) eps |product|``. An average, whether the sum divided by ``p`` or
(NCCL's way) each value scaled by ``1/p`` before the sum, by at most ``eps (sum(|x|) + |avg|)``.
The order does not matter at ``p <= 2`` (``a + b`` is ``b + a`` in IEEE arithmetic, and halving
is exact), nor for MIN, MAX and integers: those must agree bit for bit.
"""

from typing import Sequence

import numpy as np

ORDERED_OPS = ("SUM", "PRODUCT", "AVG")
"""The ops whose float result depends on the order the values are combined in."""
MARGIN = 1.01
"""Room for the second-order terms of the bounds (``(1 + u)^n - 1`` is a little over ``n u``)."""
_UFUNCS = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
           "MAX": np.maximum}


def average_of_sum(summed: np.ndarray, count: int) -> np.ndarray:
    """``summed`` divided by ``count`` as ReduceOp.AVG does.

    Args:
        summed: the sum, in the tensor's dtype.
        count: how many tensors were summed.

    Returns:
        The average in the same dtype (integers truncated toward zero, exactly).
    """
    if np.issubdtype(summed.dtype, np.integer):
        exact = np.sign(summed) * (np.abs(summed.astype(object)) // count)
        return np.asarray(exact).astype(summed.dtype)
    return (summed / summed.dtype.type(count)).astype(summed.dtype)


def reduce(arrays: Sequence[np.ndarray], op_name: str) -> np.ndarray:
    """What a reduction of ``arrays`` with ``op_name`` gives, computed by numpy on the stack.

    Args:
        arrays: one array per rank, all of one shape and dtype.
        op_name: ``"SUM"``, ``"PRODUCT"``, ``"MIN"``, ``"MAX"`` or ``"AVG"``.

    Returns:
        The reduction, in their dtype.
    """
    stacked = np.stack(arrays)
    reduced = _UFUNCS[op_name].reduce(stacked, axis=0, dtype=stacked.dtype)
    return average_of_sum(reduced, len(arrays)) if op_name == "AVG" else reduced


def rounding_bound(arrays: Sequence[np.ndarray], op_name: str) -> np.ndarray:
    """How far, elementwise, any order of reducing ``arrays`` may land from numpy's order.

    Args:
        arrays: one array per rank, all of one shape and dtype.
        op_name: the reduction.

    Returns:
        Zeros where the result is exact whatever the order (integers, MIN, MAX, two ranks or
        fewer); else the bound of the module's docstring, per element (for complex dtypes, of
        the real and of the imaginary part alike).

    Raises:
        ValueError: complex PRODUCT, which mixes the parts and has no bound derived here.
    """
    stacked = np.stack(arrays)
    p = len(arrays)
    if stacked.dtype.kind not in "fc" or op_name not in ORDERED_OPS or p <= 2:
        return np.zeros(stacked.shape[1:])
    if stacked.dtype.kind == "c" and op_name == "PRODUCT":
        raise ValueError("no rounding bound is derived here for complex products")
    eps = float(np.finfo(stacked.dtype).eps)
    magnitude = _magnitude(stacked)
    if op_name == "PRODUCT":
        return MARGIN * (p - 1) * eps * np.prod(magnitude, axis=0)
    total = magnitude.sum(axis=0)
    if op_name == "AVG":
        return MARGIN * eps * (total + _magnitude(reduce(arrays, "AVG")))
    return MARGIN * (p - 1) * eps * total


def _magnitude(values: np.ndarray) -> np.ndarray:
    # |real| + |imag| bounds each part's magnitude (imag is 0 for real dtypes)
    return np.abs(values.real).astype(np.float64) + np.abs(values.imag).astype(np.float64)


def assert_reduced(got: np.ndarray, arrays: Sequence[np.ndarray], op_name: str,
                   err_msg: str = "") -> None:
    """Assert that ``got`` is a reduction of ``arrays`` with ``op_name``: bit for bit where the
    order cannot matter, else within :func:`rounding_bound` of numpy's.

    Args:
        got: the library's result.
        arrays: every rank's input.
        op_name: the reduction.
        err_msg: what the failure message starts with.
    """
    expected = reduce(arrays, op_name)
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{err_msg}: {got.dtype}{got.shape} instead of {expected.dtype}{expected.shape}")
    bound = rounding_bound(arrays, op_name)
    if not bound.any():
        np.testing.assert_array_equal(got, expected, err_msg=err_msg)
        return
    for part in (np.real, np.imag) if expected.dtype.kind == "c" else (np.asarray,):
        off = np.abs(part(got).astype(np.float64) - part(expected).astype(np.float64))
        worst = np.argmax(off - bound) if off.size else 0
        assert np.all(off <= bound), (
            f"{err_msg}: element {worst} is {part(got).flat[worst]!r}, numpy's "
            f"{part(expected).flat[worst]!r}, more than the {op_name} rounding bound "
            f"{bound.flat[worst]:.3g} of {len(arrays)} {expected.dtype} values apart")
