"""Collectives of picklable Python objects, as ``torch.distributed`` names them:
:func:`all_gather_object`, :func:`broadcast_object_list`, :func:`gather_object` and
:func:`scatter_object_list`.

Each is built on the array collectives of the API: the sender pickles its objects into a
``uint8`` array, the group moves bytes (first the sizes, then the bytes padded to the largest),
and the receiving rank's own call unpickles them, never the transport. Unpickling runs code
the sender chose, so these calls trust every member of the group, as torch's do: use them only
in a group whose members are your own processes. Each call is two or three collectives on
the group, so every rank must make the same object calls in the same order, as with arrays.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import numpy as np

from . import api
from .errors import ArgumentTypeError, ArgumentValueError
from .types import ReduceOp

_SIZE = np.dtype(np.int64)


def _pickled(obj: Any) -> np.ndarray:
    """``obj`` pickled into a ``uint8`` array."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise ArgumentTypeError(f"the object to send cannot be pickled: {err}") from err


def _padded(payload: np.ndarray, length: int) -> np.ndarray:
    """``payload`` led by its size (8 bytes) and padded with zeros to ``length`` + 8 bytes."""
    out = np.zeros(length + _SIZE.itemsize, np.uint8)
    out[:_SIZE.itemsize] = np.frombuffer(np.array([payload.size], _SIZE).tobytes(), np.uint8)
    out[_SIZE.itemsize:_SIZE.itemsize + payload.size] = payload
    return out


def _unpadded(buffer: np.ndarray) -> Any:
    """The object :func:`_padded` laid out in ``buffer``."""
    size = int(np.frombuffer(buffer[:_SIZE.itemsize].tobytes(), _SIZE)[0])
    return pickle.loads(buffer[_SIZE.itemsize:_SIZE.itemsize + size].tobytes())


def _largest(size: int, group_name: str) -> int:
    """The largest ``size`` of all ranks."""
    sizes = np.array([size], _SIZE)
    api.allreduce(sizes, group_name, ReduceOp.MAX)
    return int(sizes[0])


def _check_list(value: Any, what: str, length: Optional[int] = None) -> None:
    if not isinstance(value, list):
        raise ArgumentTypeError(f"{what} must be a list, not {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ArgumentValueError(f"{what} must hold {length} elements (one per rank), not "
                                 f"{len(value)}")


def all_gather_object(object_list: List[Any], obj: Any, group_name: str = "default") -> None:
    """Gather every rank's ``obj`` into ``object_list`` on every rank.

    Args:
        object_list: a list of the group's size; element i becomes rank i's object.
        obj: this rank's object (picklable).
        group_name: the group.

    Returns:
        None.

    Raises:
        ArgumentTypeError: ``object_list`` is no list, or ``obj`` cannot be pickled.
        ArgumentValueError: ``object_list`` does not hold one element per rank.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    world_size = api.get_collective_group_size(group_name)
    _check_list(object_list, "object_list", world_size)
    payload = _pickled(obj)
    length = _largest(payload.size, group_name)
    parts = [np.empty(length + _SIZE.itemsize, np.uint8) for _ in range(world_size)]
    api.allgather(parts, _padded(payload, length), group_name)
    object_list[:] = [_unpadded(part) for part in parts]


def broadcast_object_list(object_list: List[Any], src: int = 0,
                          group_name: str = "default") -> None:
    """Send the objects of ``object_list`` on rank ``src`` into ``object_list`` on every rank.

    Args:
        object_list: on ``src``, the picklable objects to send; elsewhere a list of the same
            length, overwritten with them.
        src: the sending rank.
        group_name: the group.

    Returns:
        None.

    Raises:
        ArgumentTypeError: ``object_list`` is no list, or an object cannot be pickled.
        ArgumentValueError: this rank's list is not as long as ``src``'s (raised on the
            ranks whose list differs, once the objects have arrived).
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    _check_list(object_list, "object_list")
    sending = api.get_rank(group_name) == src
    payload = _pickled(list(object_list)) if sending else np.empty(0, np.uint8)
    header = np.array([payload.size, len(object_list)], _SIZE)
    api.broadcast(header, src, group_name)
    size, count = int(header[0]), int(header[1])
    buffer = payload.copy() if sending else np.empty(size, np.uint8)
    api.broadcast(buffer, src, group_name)
    if count != len(object_list):
        raise ArgumentValueError(f"object_list holds {len(object_list)} elements here but "
                                 f"{count} on rank {src}; pass lists of one length")
    if not sending:
        object_list[:] = pickle.loads(buffer.tobytes())


def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None, dst: int = 0,
                  group_name: str = "default") -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on rank ``dst``.

    Args:
        obj: this rank's object (picklable).
        object_gather_list: on ``dst``, a list of the group's size, element i becoming rank
            i's object; elsewhere None (ignored).
        dst: the receiving rank.
        group_name: the group.

    Returns:
        None.

    Raises:
        ArgumentTypeError: ``obj`` cannot be pickled, or no list is given on ``dst``.
        ArgumentValueError: the list does not hold one element per rank.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    world_size = api.get_collective_group_size(group_name)
    receiving = api.get_rank(group_name) == dst
    if receiving:
        _check_list(object_gather_list, "object_gather_list", world_size)
    payload = _pickled(obj)
    length = _largest(payload.size, group_name)
    parts = [np.empty(length + _SIZE.itemsize, np.uint8) for _ in range(world_size)] \
        if receiving else None
    api.gather(parts, _padded(payload, length), dst, group_name)
    if receiving:
        object_gather_list[:] = [_unpadded(part) for part in parts]


def scatter_object_list(scatter_object_output_list: List[Any],
                        scatter_object_input_list: Optional[List[Any]] = None, src: int = 0,
                        group_name: str = "default") -> None:
    """Send ``scatter_object_input_list[i]`` from rank ``src`` to rank i, into
    ``scatter_object_output_list[0]``.

    Args:
        scatter_object_output_list: a list of at least one element; its first becomes this
            rank's object.
        scatter_object_input_list: on ``src``, one picklable object per rank; elsewhere None
            (ignored).
        src: the sending rank.
        group_name: the group.

    Returns:
        None.

    Raises:
        ArgumentTypeError: a list that is missing or no list, or an object that cannot be
            pickled.
        ArgumentValueError: an empty output list, or an input list on ``src`` that does not
            hold one object per rank.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    world_size = api.get_collective_group_size(group_name)
    _check_list(scatter_object_output_list, "scatter_object_output_list")
    if not scatter_object_output_list:
        raise ArgumentValueError("scatter_object_output_list must hold at least one element")
    sending = api.get_rank(group_name) == src
    payloads = []
    if sending:
        _check_list(scatter_object_input_list, "scatter_object_input_list", world_size)
        payloads = [_pickled(obj) for obj in scatter_object_input_list]
    length = np.array([max((p.size for p in payloads), default=0)], _SIZE)
    api.broadcast(length, src, group_name)
    part = np.empty(int(length[0]) + _SIZE.itemsize, np.uint8)
    api.scatter(part, [_padded(p, int(length[0])) for p in payloads] if sending else None,
                src, group_name)
    scatter_object_output_list[0] = _unpadded(part)
