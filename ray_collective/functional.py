"""Collectives that return their result as a new array, for arrays that cannot be written.

The collectives of :mod:`ray_collective` write their result into the caller's tensor, as
``ray.util.collective`` and ``torch.distributed`` do. JAX's arrays are immutable (and so are
``bytes`` and other read-only buffers): an in-place collective refuses them, and these calls
are their form. Each leaves its input as it is and returns a new array of the input's family:
a JAX array for a JAX array, a torch tensor for a torch tensor, a cupy array for a cupy array,
and a numpy array for anything else (numpy, buffers, other DLPack producers: convert it back
with the producer's ``from_dlpack``, which numpy arrays support).

Shapes follow ``jax.lax``'s collectives: :func:`allgather` stacks the ranks' arrays along a new
first axis; :func:`reducescatter` and :func:`alltoall` take an input whose first axis has one
entry per rank. A call copies what it must and no more: :func:`allreduce` and
:func:`broadcast` copy the input once (the collective then runs in place on the copy); the
others read the input where it is and write only their new output. A JAX array of the CPU is
read through DLPack; the result becomes a JAX array with ``jax.numpy.asarray`` (one more
copy, JAX's). JAX arrays on a GPU are not taken here.

Every call has the in-place collective's arguments (group, op, root, timeout), errors and
checks, and blocks until its result is ready.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import numpy as np

from ray_collective import api
from ray_collective.errors import ArgumentTypeError, ArgumentValueError
from ray_collective.tensors import as_view
from ray_collective.types import ReduceOp

__all__ = ["allreduce", "broadcast", "allgather", "reducescatter", "alltoall"]


def _readable(x: Any, what: str = "x") -> Tuple[str, Any]:
    """``x``'s family and an array a collective reads, sharing ``x``'s memory where it can."""
    view = as_view(x, writable=False, what=what)
    if view.kind in ("torch", "cupy") and view.tensor is x:
        return view.kind, x
    family = "jax" if type(x).__module__.split(".")[0] in ("jax", "jaxlib") else "numpy"
    if view.device != "cpu":
        raise ArgumentTypeError(
            f"{what} is a {type(x).__name__} on {view.device}; ray_collective.functional takes "
            f"CPU arrays and torch or cupy GPU tensors. Move it to the host first.")
    array = view.array.reshape(view.shape)
    if view.dtype_name == "bfloat16":  # its bits, as a uint16 array: give them their dtype
        array = array.view(_bfloat16_dtype(what))
    return family, array


def _bfloat16_dtype(what: str) -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        raise ArgumentTypeError(
            f"{what} is a bfloat16 array; its result is a numpy array of ml_dtypes' bfloat16, "
            f"and ml_dtypes (installed with JAX) is not installed. Install it, or cast the "
            f"array to float32 first.") from None
    return np.dtype(ml_dtypes.bfloat16)


def _copy(family: str, array: Any) -> Any:
    if family == "torch":
        return array.detach().clone(memory_format=sys.modules["torch"].contiguous_format)
    return array.copy()


def _empty(family: str, like: Any, shape: Tuple[int, ...]) -> Any:
    if family == "torch":
        return sys.modules["torch"].empty(shape, dtype=like.dtype, device=like.device)
    if family == "cupy":
        return sys.modules["cupy"].empty(shape, dtype=like.dtype)
    return np.empty(shape, like.dtype)


def _result(family: str, array: Any) -> Any:
    if family == "jax":
        import jax.numpy as jnp
        return jnp.asarray(array)
    return array


def _rows(array: Any, world_size: int, what: str) -> list:
    shape = tuple(array.shape)
    if not shape or shape[0] != world_size:
        raise ArgumentValueError(
            f"{what} has shape {shape}, but this call takes one entry per rank along its "
            f"first axis: shape ({world_size}, ...) for a group of {world_size} ranks.")
    return _entries(array)


def _entries(array: Any) -> list:
    """The entries along the first axis, each an array (``[i, ...]``: numpy gives a 0-d array,
    not a scalar, where ``[i]`` of a 1-d array would)."""
    return [array[i, ...] for i in range(array.shape[0])]


def _on_a_copy(x: Any, run: Callable[[Any], None]) -> Any:
    """``run`` (an in-place collective) on a copy of ``x``; the copy, in ``x``'s family."""
    family, array = _readable(x)
    result = _copy(family, array)
    run(result)
    return _result(family, result)


def _from_rows(x: Any, group_name: str, result_shape: Callable[[tuple], tuple],
               run: Callable[[Any, list], None]) -> Any:
    """``run(result, rows)`` with ``x``'s entries along its first axis (one per rank) and a
    new ``result`` of ``result_shape(x.shape)``; the result, in ``x``'s family."""
    family, array = _readable(x)
    rows = _rows(array, api.get_collective_group_size(group_name), "x")
    result = _empty(family, array, result_shape(tuple(array.shape)))
    run(result, rows)
    return _result(family, result)


def allreduce(x: Any, group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
              timeout: Optional[float] = None) -> Any:
    """The elementwise reduction of every rank's ``x``, as a new array.

    Args:
        x: this rank's array (JAX, numpy, torch, cupy, DLPack, a buffer); left unchanged.
        group_name: the group.
        op: the reduction.
        timeout: seconds for this call, as the in-place collective's ``timeout``.

    Returns:
        A new array of ``x``'s family, shape and dtype.

    Raises:
        As :func:`ray_collective.allreduce`.
    """
    return _on_a_copy(x, lambda result: api.allreduce(result, group_name, op, timeout=timeout))


def broadcast(x: Any, src_rank: int = 0, group_name: str = "default", *,
              timeout: Optional[float] = None) -> Any:
    """Rank ``src_rank``'s ``x``, as a new array on every rank.

    Args:
        x: this rank's array (its values are used on ``src_rank`` only; shape and dtype must
            agree everywhere); left unchanged.
        src_rank: the rank whose array every rank gets.
        group_name: the group.
        timeout: seconds for this call.

    Returns:
        A new array of ``x``'s family, shape and dtype.

    Raises:
        As :func:`ray_collective.broadcast`.
    """
    return _on_a_copy(x, lambda result: api.broadcast(result, src_rank, group_name,
                                                      timeout=timeout))


def allgather(x: Any, group_name: str = "default", *, timeout: Optional[float] = None) -> Any:
    """Every rank's ``x``, stacked along a new first axis (rank ``i``'s at index ``i``).

    Args:
        x: this rank's array; left unchanged.
        group_name: the group.
        timeout: seconds for this call.

    Returns:
        A new array of shape ``(world_size, *x.shape)``.

    Raises:
        As :func:`ray_collective.allgather`.
    """
    family, array = _readable(x)
    world_size = api.get_collective_group_size(group_name)
    result = _empty(family, array, (world_size,) + tuple(array.shape))
    api.allgather(_entries(result), array, group_name, timeout=timeout)
    return _result(family, result)


def reducescatter(x: Any, group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
                  timeout: Optional[float] = None) -> Any:
    """This rank's entry of the reduction of every rank's ``x`` along its first axis.

    Args:
        x: this rank's array of shape ``(world_size, ...)``: entry ``j`` is its contribution to
            rank ``j``'s result; left unchanged.
        group_name: the group.
        op: the reduction.
        timeout: seconds for this call.

    Returns:
        A new array of shape ``x.shape[1:]``: the reduction over ranks of their ``x[rank]``.

    Raises:
        ArgumentValueError: ``x``'s first axis is not the group's size; otherwise as
            :func:`ray_collective.reducescatter`.
    """
    return _from_rows(x, group_name, lambda shape: shape[1:], lambda result, rows: (
        api.reducescatter(result, rows, group_name, op, timeout=timeout)))


def alltoall(x: Any, group_name: str = "default", *, timeout: Optional[float] = None) -> Any:
    """Exchange the entries of ``x``'s first axis: entry ``j`` goes to rank ``j``.

    Args:
        x: this rank's array of shape ``(world_size, ...)``; left unchanged.
        group_name: the group.
        timeout: seconds for this call.

    Returns:
        A new array of ``x``'s shape whose entry ``i`` is rank ``i``'s ``x[rank]``.

    Raises:
        ArgumentValueError: ``x``'s first axis is not the group's size; otherwise as
            :func:`ray_collective.alltoall`.
    """
    return _from_rows(x, group_name, lambda shape: shape, lambda result, rows: (
        api.alltoall(_entries(result), rows, group_name, timeout=timeout)))
