"""Shared test helpers: reference reductions computed by numpy alone."""

import numpy as np

import ray_collective as col

UFUNCS = {col.ReduceOp.SUM: np.add, col.ReduceOp.PRODUCT: np.multiply,
          col.ReduceOp.MIN: np.minimum, col.ReduceOp.MAX: np.maximum}


def numpy_reduce(arrays, op):
    """What an allreduce of ``arrays`` with ``op`` must give, computed by numpy on the stack."""
    stacked = np.stack(arrays)
    if op is col.ReduceOp.AVG:
        summed = np.add.reduce(stacked, axis=0, dtype=stacked.dtype)
        if np.issubdtype(stacked.dtype, np.integer):
            return (np.sign(summed) * (np.abs(summed.astype(object)) // len(arrays))).astype(
                stacked.dtype)
        return (summed / stacked.dtype.type(len(arrays))).astype(stacked.dtype)
    return UFUNCS[op].reduce(stacked, axis=0, dtype=stacked.dtype)


def rank_data(rank, shape, dtype, op=col.ReduceOp.SUM, seed=0):
    """Rank ``rank``'s deterministic input: small values, so products and sums stay exact."""
    rng = np.random.default_rng(seed * 1000 + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    low, high = (1, 3) if op is col.ReduceOp.PRODUCT else (-20, 20)
    if dtype.kind == "u":
        low = max(low, 0)
    values = rng.integers(low, high, shape)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(low, high, shape)).astype(dtype)
    return values.astype(dtype)
