"""The public functions: validate the arguments, find the group, hand the call to its backend.

Names and argument order follow ``ray.util.collective``. What every collective shares is said
here once; each function's docstring says only what is its own.

Arguments every collective takes:

- ``group_name``: the group (default ``"default"``); for the ``*_multigpu`` calls an ``nccl``
  group.
- ``op``: the reduction, a :class:`~ray_collective.ReduceOp` (``ray.util.collective``'s
  members are accepted by name); the reducing collectives only.
- ``async_op``: keyword-only; return a :class:`~ray_collective.Work` instead of blocking (its
  ``wait`` raises what the call would have raised).
- ``timeout``: keyword-only; seconds before a ``CollectiveTimeoutError`` (default: the
  group's).

Returns: None, or the Work of the call with ``async_op=True``.

Raises, whatever the collective:

- ``ArgumentTypeError``, ``ArgumentValueError``: bad arguments, before anything is sent (a
  ``TypeError``/``ValueError`` that is also the ``RuntimeError`` ``ray.util.collective``
  raises); the group stays usable.
- ``GroupNotInitializedError``: this process is not a member of ``group_name``.
- ``CollectiveError``: the call failed: ``CollectiveTimeoutError``,
  ``CollectiveMismatchError``, ``PeerDiedError``, ``GroupBrokenError``... (see
  ``ray_collective.errors``); the group is then broken.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .backends.base import CallViews
# The public functions of a group's life and the multi-GPU variants live in modules of their
# own; ``ray_collective.api`` names every public function.
from .api_groups import (create_collective_group, declare_collective_group,  # noqa: F401
                         destroy_collective_group, get_collective_group_size,
                         get_collective_trace, get_group_handle, get_rank, gloo_available,
                         grow_collective_group, init_collective_group, is_backend_available,
                         is_group_initialized, nccl_available, register_backend,
                         shrink_collective_group)
from .api_multigpu import (allgather_multigpu, allreduce_multigpu,  # noqa: F401
                           broadcast_multigpu, recv_multigpu, reduce_multigpu,
                           reducescatter_multigpu, send_multigpu, synchronize)
from .errors import ArgumentTypeError, ArgumentValueError
from .group import Group, Work, current_registry, find_group
from .reductions import check_op
from .tensors import TensorView, as_view, check_same_layout, tensor_layout
from .types import Collective, ReduceOp
from .validation import check_call_timeout, check_group_name, check_rank, check_reduce_op


# ---------------------------------------------------------------- argument checks

def _group(group_name: str) -> Group:
    return current_registry().get(check_group_name(group_name))


def _view(group: Group, tensor: Any, writable: bool, what: str) -> TensorView:
    view = as_view(tensor, writable=writable, what=what)
    if view.device != "cpu" and not group.membership.accepts_gpu_tensors:
        raise ArgumentTypeError(
            f"{what} is a GPU tensor ({view.kind} on {view.device}), but group "
            f"'{group.name}' runs on a CPU backend; create the group with "
            f"backend='nccl' for GPU tensors, or pass a CPU tensor")
    return view


def _views(group: Group, tensors: Any, writable: bool, what: str,
           like: Optional[TensorView] = None, like_name: str = "tensor") -> tuple:
    if not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{what} must be a list of tensors, not {type(tensors).__name__}")
    if len(tensors) != group.world_size:
        raise ArgumentValueError(
            f"{what} has {len(tensors)} tensors but group '{group.name}' has "
            f"{group.world_size} ranks; pass one tensor per rank")
    views = tuple(_view(group, t, writable, f"{what}[{i}]") for i, t in enumerate(tensors))
    check_same_layout(views, what, like, like_name)
    return views


# ---------------------------------------------------------------- calls of a known shape
#
# A program calls the same collective on arrays of the same shape again and again. Everything
# the API checks about such a call depends only on its shape (the numpy dtype, shape and
# strides, the op, the root, the group), so the checks run at a shape's first call, which
# keeps the call the backend prepared for the shape under the shape's key (Group.prepare),
# and its later calls go straight to it (Group.run): a few dictionary lookups instead of the
# full path. Only blocking calls with the group's own deadline on writable numpy arrays (and
# cupy arrays and torch tensors, for allreduce, reduce and broadcast) take it; for allgather,
# reducescatter, and gather and scatter at their root, every array of the list must be like
# the tensor (dtype, shape, strides), and for alltoall every entry of both lists like the
# first input, which is checked per call.

def _shape_key(collective: str, tensor: Any, op: Any, root: Any, tag: Any) -> Optional[Tuple]:
    """What identifies a call's shape for the known-shape path, or None when the call cannot
    take it (not a plain writable numpy array, a cupy array or a torch tensor, an op or root
    of another type). A cupy or torch key is longer than a numpy array's and names "cupy" or
    "torch" where the numpy key has its dtype, so the two never meet."""
    if type(op) is not ReduceOp or type(root) is not int:
        return None
    # Enum members hash in Python code; a member's id stands for it (each is a singleton).
    if type(tensor) is not np.ndarray:
        layout = tensor_layout(tensor)
        return None if layout is None else (collective, id(op), root) + layout
    if not tensor.flags.writeable:
        return None
    return (collective, id(op), root, tensor.dtype, tensor.shape, tensor.strides)


def _list_shape_key(collective: str, list_written: bool, arrays: Any, op: Any, root: Any,
                    tag: Any) -> Optional[Tuple]:
    """The key of an allgather or gather (``list_written``: the list receives), reducescatter
    or scatter call, ``arrays`` being ``(tensor, tensor_list)``, or None when it cannot take
    the known-shape path (see :func:`_shape_key`; a list entry unlike the tensor, or not
    writable where it is written). Gather and scatter use the list on their root only:
    elsewhere it may be None, and the prepared call ignores it."""
    tensor, tensors = arrays
    if type(tensor) is not np.ndarray:
        return None
    key = _shape_key(collective, tensor, op, root, tag)
    if key is not None and tensors is None and root != -1:
        return key + (None,)
    if key is None or type(tensors) not in (list, tuple):
        return None
    if not _entries_like(tensors, key[3], key[4], key[5], list_written):
        return None
    return key + (len(tensors),)


def _entries_like(entries: Any, dtype: np.dtype, shape: Tuple, strides: Tuple,
                  written: bool) -> bool:
    """Whether every entry of a list is a numpy array of ``dtype``, ``shape`` and ``strides``
    (and writable where the call writes it)."""
    for entry in entries:
        if (type(entry) is not np.ndarray or entry.dtype != dtype or entry.shape != shape
                or entry.strides != strides or (written and not entry.flags.writeable)):
            return False
    return True


def _exchange_key(arrays: Any, op: Any, root: Any, tag: Any) -> Optional[Tuple]:
    """The key of an alltoall, ``arrays`` being ``(inputs, outputs)`` (see :func:`_shape_key`),
    or None when it cannot take the known-shape path: a list that is not a list or tuple, an
    entry unlike the first input, an output not writable. An input may be read-only (it is
    only sent)."""
    inputs, outputs = arrays
    if type(inputs) not in (list, tuple) or type(outputs) not in (list, tuple) or not inputs:
        return None
    first = inputs[0]
    if type(first) is not np.ndarray:
        return None
    dtype, shape, strides = first.dtype, first.shape, first.strides
    if not (_entries_like(inputs, dtype, shape, strides, False)
            and _entries_like(outputs, dtype, shape, strides, True)):
        return None
    return ("alltoall", dtype, shape, strides, len(inputs), len(outputs))


def _point_to_point_key(collective: str, tensor: Any, op: Any, peer: Any,
                        tag: Any) -> Optional[Tuple]:
    """The key of a send or recv for the known-shape path (see :func:`_shape_key`); its
    peer and tag are part of it, so a key learnt once names a valid peer and tag. A send
    only reads its array, which may be read-only (as Ray hands arguments to an actor)."""
    if (type(tensor) is not np.ndarray or type(peer) is not int or type(tag) is not int
            or (collective == "recv" and not tensor.flags.writeable)):
        return None
    return (collective, peer, tag, tensor.dtype, tensor.shape, tensor.strides)


def _barrier_key(arrays: Any, op: Any, root: Any, tag: Any) -> Tuple:
    return ("barrier",)


# ---------------------------------------------------------------- the collectives as data

@dataclass(frozen=True)
class _Kind:
    """What one collective's calls differ in; :func:`_collective` does the rest.

    Attributes:
        collective: the operation.
        key: ``key(arrays, op, root, tag)``: the call's known-shape key, or None.
        single: the collective's name where ``key`` is :func:`_shape_key` (one tensor), which
            :func:`_collective` computes inline for a numpy array; ``""`` for the others.
        reduces: it takes an op, checked against the dtype.
        root: the name of its root (or peer) argument, ``""`` for none.
        tensor: when its tensor is written: ``"always"``, ``"never"``, ``"root"`` (on the
            root only), ``"others"`` (elsewhere); ``""`` for a call without one.
        entries: its list: ``"outputs"`` (written), ``"inputs"`` (read), ``""`` for none.
        list_at_root: the list is used on the root only (elsewhere it may be None).
        peer: a send or recv: ``root`` is its peer, and it is numbered per peer and tag.
    """

    collective: Collective
    key: Callable[[Any, Any, Any, Any], Optional[Tuple]]
    single: str = ""
    reduces: bool = False
    root: str = ""
    tensor: str = "always"
    entries: str = ""
    list_at_root: bool = False
    peer: bool = False


def _single(collective: Collective, **fields) -> _Kind:
    return _Kind(collective, functools.partial(_shape_key, collective.value), collective.value,
                 **fields)


def _listed(collective: Collective, entries: str, **fields) -> _Kind:
    return _Kind(collective, functools.partial(_list_shape_key, collective.value,
                                               entries == "outputs"), entries=entries,
                 **fields)


def _peer(collective: Collective, root: str, tensor: str) -> _Kind:
    return _Kind(collective, functools.partial(_point_to_point_key, collective.value),
                 root=root, tensor=tensor, peer=True)


_ALLREDUCE = _single(Collective.ALLREDUCE, reduces=True)
_REDUCE = _single(Collective.REDUCE, reduces=True, root="dst_rank", tensor="root")
_BROADCAST = _single(Collective.BROADCAST, root="src_rank", tensor="others")
_ALLGATHER = _listed(Collective.ALLGATHER, "outputs", tensor="never")
_REDUCESCATTER = _listed(Collective.REDUCESCATTER, "inputs", reduces=True)
_GATHER = _listed(Collective.GATHER, "outputs", root="dst_rank", tensor="never",
                  list_at_root=True)
_SCATTER = _listed(Collective.SCATTER, "inputs", root="src_rank", list_at_root=True)
_ALLTOALL = _Kind(Collective.ALLTOALL, _exchange_key, tensor="", entries="exchange")
_BARRIER = _Kind(Collective.BARRIER, _barrier_key, tensor="")
_SEND = _peer(Collective.SEND, "dst_rank", "never")
_RECV = _peer(Collective.RECV, "src_rank", "always")


def _collective(kind: _Kind, group_name: Any, arrays: Any, async_op: bool,
                timeout: Optional[float], op: Any = ReduceOp.SUM, root: Any = -1,
                tag: Any = 0) -> Optional[Work]:
    """Every collective: its known shape's prepared call run at once, or the full path (the
    arguments checked, the shape prepared or found, the call numbered and run). ``arrays``
    are the call's as ``PreparedCall.run`` takes them; ``root`` is the peer of a send or
    recv."""
    if not async_op and timeout is None and type(group_name) is str:
        if (kind.single and type(arrays) is np.ndarray and type(op) is ReduceOp
                and type(root) is int and arrays.flags.writeable):
            # _shape_key's numpy key, inline: the commonest call saves a Python call.
            key = (kind.single, id(op), root, arrays.dtype, arrays.shape, arrays.strides)
        else:
            key = kind.key(arrays, op, root, tag)
        known = None
        if key is not None:
            group = find_group(group_name)
            known = None if group is None else group.prepared.get(key)
        if known is not None and group.run(
                known, arrays, (kind.collective.value, root, tag) if kind.peer else None):
            return None
    else:
        key = None
    group = _group(group_name)
    if kind.reduces:
        op = check_reduce_op(op)
    if kind.root:
        root = check_rank(root, group.world_size, group.name, kind.root)
    if kind.peer:
        _check_peer(group, kind, root, tag)
    views = _call_views(kind, group, arrays, root)
    if kind.reduces:
        check_op(op, views.reference().dtype_name)
    timeout = check_call_timeout(timeout)
    if kind.peer:
        options = group.options(kind.collective, timeout, peer=root, tag=tag)
        seq_key = (kind.collective.value, root, tag)
    else:
        options = group.options(kind.collective, timeout, op=op, root=root)
        seq_key = ("", -1, 0)
    known = group.prepare(key, options, views)
    return group.submit(known, views.arrays(options.collective), async_op, seq_key)


def _check_peer(group: Group, kind: _Kind, peer: int, tag: Any) -> None:
    if peer == group.rank:
        raise ArgumentValueError(
            f"rank {group.rank} of group '{group.name}' cannot {kind.collective.value} "
            f"to itself ({kind.root}={peer}); copy the tensor locally instead")
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ArgumentValueError(f"tag must be an int >= 0, not {tag!r}")


def _call_views(kind: _Kind, group: Group, arrays: Any, root: int) -> CallViews:
    """The call's tensors checked, as ``kind`` says they are read and written."""
    if kind.entries == "exchange":
        inputs = _views(group, arrays[0], False, "input_tensor_list")
        return CallViews(inputs=inputs, outputs=_views(
            group, arrays[1], True, "output_tensor_list", like=inputs[0],
            like_name="input_tensor_list[0]"))
    if not kind.tensor:
        return CallViews()
    at_root = group.rank == root
    tensor, entries = arrays if kind.entries else (arrays, None)
    written = {"always": True, "never": False, "root": at_root, "others": not at_root}
    view = _view(group, tensor, written[kind.tensor], "tensor")
    if not kind.entries:
        return CallViews(view)
    listed = () if kind.list_at_root and not at_root else _views(
        group, entries, kind.entries == "outputs", "tensor_list", like=view)
    return CallViews(view, outputs=listed) if kind.entries == "outputs" else \
        CallViews(view, inputs=listed)


# ---------------------------------------------------------------- collectives

def allreduce(tensor: Any, group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
              async_op: bool = False, timeout: Optional[float] = None) -> Optional[Work]:
    """Reduce ``tensor`` elementwise across the group; every rank gets the result in place.

    Args:
        tensor: numpy array or torch tensor, contiguous; overwritten with the result.
        group_name, op, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError, GroupNotInitializedError, CollectiveError: as
            every collective.
    """
    return _collective(_ALLREDUCE, group_name, tensor, async_op, timeout, op)


def reduce(tensor: Any, dst_rank: int = 0, group_name: str = "default",
           op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
           timeout: Optional[float] = None) -> Optional[Work]:
    """Reduce ``tensor`` elementwise across the group onto ``dst_rank``.

    Args:
        tensor: the contribution; on ``dst_rank`` overwritten with the result, elsewhere unchanged.
        dst_rank: the rank that receives the result.
        group_name, op, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments (including dst_rank out of range).
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_REDUCE, group_name, tensor, async_op, timeout, op, dst_rank)


def broadcast(tensor: Any, src_rank: int = 0, group_name: str = "default", *,
              async_op: bool = False, timeout: Optional[float] = None) -> Optional[Work]:
    """Copy ``tensor`` from ``src_rank`` into ``tensor`` on every other rank.

    Args:
        tensor: the data on ``src_rank``; overwritten elsewhere.
        src_rank: the rank whose tensor is sent.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments (including src_rank out of range).
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_BROADCAST, group_name, tensor, async_op, timeout, root=src_rank)


def allgather(tensor_list: List[Any], tensor: Any, group_name: str = "default", *,
              async_op: bool = False, timeout: Optional[float] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank.

    Args:
        tensor_list: one tensor per rank, each shaped like ``tensor``; filled with rank i's
            tensor at index i.
        tensor: this rank's contribution.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments (list length not the world size,
            shapes or dtypes that differ).
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_ALLGATHER, group_name, (tensor, tensor_list), async_op, timeout)


def reducescatter(tensor: Any, tensor_list: List[Any], group_name: str = "default",
                  op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
                  timeout: Optional[float] = None) -> Optional[Work]:
    """Reduce ``tensor_list`` elementwise across ranks; rank i gets the reduction of entry i.

    Args:
        tensor: overwritten with the reduction of every rank's ``tensor_list[rank]``.
        tensor_list: one tensor per rank, each shaped like ``tensor``.
        group_name, op, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_REDUCESCATTER, group_name, (tensor, tensor_list), async_op, timeout,
                       op)


def gather(tensor_list: Optional[List[Any]], tensor: Any, dst_rank: int = 0,
           group_name: str = "default", *, async_op: bool = False,
           timeout: Optional[float] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list`` on ``dst_rank``.

    Args:
        tensor_list: on ``dst_rank``, one tensor per rank shaped like ``tensor``, filled with
            rank i's tensor at index i; ignored elsewhere (may be None).
        tensor: this rank's contribution.
        dst_rank: the rank that receives.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_GATHER, group_name, (tensor, tensor_list), async_op, timeout,
                       root=dst_rank)


def scatter(tensor: Any, tensor_list: Optional[List[Any]], src_rank: int = 0,
            group_name: str = "default", *, async_op: bool = False,
            timeout: Optional[float] = None) -> Optional[Work]:
    """Send ``tensor_list[i]`` from ``src_rank`` into ``tensor`` on rank i.

    Args:
        tensor: overwritten with this rank's part.
        tensor_list: on ``src_rank``, one tensor per rank shaped like ``tensor``; ignored
            elsewhere (may be None).
        src_rank: the rank that sends.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_SCATTER, group_name, (tensor, tensor_list), async_op, timeout,
                       root=src_rank)


def alltoall(output_tensor_list: List[Any], input_tensor_list: List[Any],
             group_name: str = "default", *, async_op: bool = False,
             timeout: Optional[float] = None) -> Optional[Work]:
    """Send ``input_tensor_list[j]`` to rank j; receive rank i's into ``output_tensor_list[i]``.

    Args:
        output_tensor_list: one tensor per rank, filled.
        input_tensor_list: one tensor per rank, all shaped like the outputs.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments.
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_ALLTOALL, group_name, (input_tensor_list, output_tensor_list),
                       async_op, timeout)


def barrier(group_name: str = "default", *, async_op: bool = False,
            timeout: Optional[float] = None) -> Optional[Work]:
    """Block until every rank of the group has called ``barrier``.

    Args:
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_BARRIER, group_name, None, async_op, timeout)


def send(tensor: Any, dst_rank: int, group_name: str = "default", tag: int = 0, *,
         async_op: bool = False, timeout: Optional[float] = None) -> Optional[Work]:
    """Send ``tensor`` to ``dst_rank``, which receives it with a ``recv`` of the same tag.

    Args:
        tensor: the data.
        dst_rank: the receiving rank (not this rank).
        tag: sends and recvs with the same tag between two ranks match in order.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments (including a send to itself).
        GroupNotInitializedError, CollectiveError: as every collective.
    """
    return _collective(_SEND, group_name, tensor, async_op, timeout, root=dst_rank, tag=tag)


def recv(tensor: Any, src_rank: int, group_name: str = "default", tag: int = 0, *,
         async_op: bool = False, timeout: Optional[float] = None) -> Optional[Work]:
    """Receive into ``tensor`` what ``src_rank`` sends with the same tag.

    Args:
        tensor: overwritten with the data; must match the sent tensor's shape and dtype.
        src_rank: the sending rank (not this rank).
        tag: see :func:`send`.
        group_name, async_op, timeout: as every collective (see
            :mod:`ray_collective.api`).

    Returns:
        None, or a Work with ``async_op=True``.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad arguments (including a recv from itself).
        GroupNotInitializedError, CollectiveError: as every collective; a sent tensor of
            another shape or dtype raises ``CollectiveMismatchError``.
    """
    return _collective(_RECV, group_name, tensor, async_op, timeout, root=src_rank, tag=tag)
