"""Declarative collectives on ObjectRefs: a whole collective specified from the driver in one call.

``allreduce_refs([A.get_buffer.remote(), B.get_buffer.remote()], "g")`` runs an allreduce in the
members of a group the driver declared (``declare_collective_group``), on the tensors those refs
point to, and returns at once with one ObjectRef per rank to that rank's result. The driver
never holds a tensor and never blocks; the result refs can feed the next call.

How: one :func:`~ray_collective.batch.batch_remote` call over the members in rank order, through
the built-in ``__ray_call__`` (so the user's actor class needs no method for it). Each member gets
only its own ref (inside a list, so that Ray does not resolve it before the task runs), resolves
it with ``ray.get`` under the call's deadline, runs the ordinary imperative collective on the
group, and returns its result, which becomes the ref the driver got back. A member takes its
place in the group's call order when its task runs: for members that run their tasks one at a
time in submission order (a plain actor), declarative calls and the imperative calls the driver
asks of the members interleave in the order the driver made them.

A member that cannot get its tensor (the producer failed, the deadline passed, the value is not a
tensor) raises :class:`~ray_collective.errors.TensorRefError` and breaks the group, so the
others fail fast with it instead of waiting for their deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np

from . import api
from .batch import PerActor, batch_remote
from .errors import CollectiveError, GroupNotInitializedError, TensorRefError
from .group import current_registry
from .tensors import SUPPORTED_DTYPES, as_view
from .types import ReduceOp
from .validation import check_call_timeout, check_group_name, check_rank, check_reduce_op

__all__ = ["allreduce_refs", "reduce_refs", "broadcast_refs", "allgather_refs",
           "reducescatter_refs", "send_ref"]

_KINDS = ("numpy", "torch")
"""Tensor kinds a ``send_ref`` receiver can allocate, by their index in the shape message."""

_MAX_DIMS = 64
"""Dimensions a ``send_ref`` tensor may have: the shape message has a fixed length, so that the
receiver can post its receive before knowing the shape."""


@dataclass(frozen=True)
class _RefCall:
    """What every member of one declarative call runs (sent to the members)."""

    collective: str
    group_name: str
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    peer: int = -1
    tag: int = 0
    timeout: Optional[float] = None


# ------------------------------------------------------------------ driver side

def _members(group_name: str) -> tuple:
    """The actors of a group this driver declared, in rank order."""
    check_group_name(group_name)
    declared = current_registry().declared(group_name)
    if declared is None:
        raise GroupNotInitializedError(group_name)
    return declared.members


def _check_refs(tensor_refs: Any, members: tuple, what: str) -> List[Any]:
    import ray
    if not isinstance(tensor_refs, (list, tuple)):
        raise TypeError(f"{what}: tensor_refs must be a list of ObjectRefs, one per rank, not "
                        f"{type(tensor_refs).__name__}")
    if len(tensor_refs) != len(members):
        raise ValueError(f"{what}: tensor_refs has {len(tensor_refs)} refs but the group has "
                         f"{len(members)} ranks; give one ref per rank, in rank order")
    for rank, ref in enumerate(tensor_refs):
        if not isinstance(ref, ray.ObjectRef):
            raise TypeError(f"{what}: tensor_refs[{rank}] must be an ObjectRef (for example "
                            f"actor.get_buffer.remote()), not {type(ref).__name__}")
    return list(tensor_refs)


def _run_refs(collective: str, tensor_refs: Any, group_name: str, timeout: Any,
              op: Any = None, root: Optional[tuple] = None) -> List[Any]:
    """Check a declarative call, then submit it as one batch over the members in rank order.

    Args:
        collective: the imperative collective the members run.
        tensor_refs: one ObjectRef per rank; member i gets only ``tensor_refs[i]``.
        group_name: a group this driver declared.
        timeout: the call's deadline, or None for the group's.
        op: the reduction, for the reducing collectives.
        root: ``(argument name, rank)`` of the root, for the rooted collectives.

    Returns:
        The members' result refs, in rank order.
    """
    what = f"{collective}_refs"
    members = _members(group_name)
    refs = _check_refs(tensor_refs, members, what)
    call = _RefCall(collective, group_name,
                    op=ReduceOp.SUM if op is None else check_reduce_op(op),
                    root=0 if root is None else check_rank(root[1], len(members),
                                                                   group_name, root[0]),
                    timeout=check_call_timeout(timeout))
    boxed = PerActor([[ref] for ref in refs])
    return batch_remote(list(members)).__ray_call__.remote(_run_in_member, call, boxed)


def allreduce_refs(tensor_refs: Sequence[Any], group_name: str = "default",
                   op: ReduceOp = ReduceOp.SUM, *, timeout: Optional[float] = None) -> List[Any]:
    """Allreduce the tensors that ``tensor_refs`` point to, in the members; returns at once.

    Args:
        tensor_refs: ``tensor_refs[i]`` is an ObjectRef to rank i's tensor.
        group_name: a group this driver declared.
        op: the reduction.
        timeout: seconds each member may take to get its tensor and to run the collective
            (default: the group's).

    Returns:
        One ObjectRef per rank, in rank order, to the reduced tensor as that rank holds it.

    Raises:
        TypeError, ValueError: a list that is not one ObjectRef per rank, a bad op or timeout
            (nothing is submitted).
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    return _run_refs("allreduce", tensor_refs, group_name, timeout, op=op)


def reduce_refs(tensor_refs: Sequence[Any], dst_rank: int = 0, group_name: str = "default",
                op: ReduceOp = ReduceOp.SUM, *, timeout: Optional[float] = None) -> List[Any]:
    """Reduce the tensors that ``tensor_refs`` point to onto ``dst_rank``; returns at once.

    Args:
        tensor_refs: ``tensor_refs[i]`` is an ObjectRef to rank i's tensor.
        dst_rank: the rank that gets the result.
        group_name: a group this driver declared.
        op: the reduction.
        timeout: as for :func:`allreduce_refs`.

    Returns:
        One ObjectRef per rank, in rank order, to the reduced tensor for ``dst_rank`` and to
        each other rank's own tensor, unchanged, for the others.

    Raises:
        TypeError, ValueError: bad refs, ``dst_rank`` out of range, bad op or timeout.
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    return _run_refs("reduce", tensor_refs, group_name, timeout, op=op,
                     root=("dst_rank", dst_rank))


def broadcast_refs(tensor_refs: Sequence[Any], src_rank: int = 0, group_name: str = "default",
                   *, timeout: Optional[float] = None) -> List[Any]:
    """Broadcast ``src_rank``'s tensor into the tensors the other refs point to; returns at once.

    Args:
        tensor_refs: ``tensor_refs[i]`` is an ObjectRef to rank i's tensor (on ranks other than
            ``src_rank`` it gives the shape and dtype to receive into).
        src_rank: the rank whose tensor is sent.
        group_name: a group this driver declared.
        timeout: as for :func:`allreduce_refs`.

    Returns:
        One ObjectRef per rank, in rank order, to the broadcast tensor as that rank holds it.

    Raises:
        TypeError, ValueError: bad refs, ``src_rank`` out of range, bad timeout.
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    return _run_refs("broadcast", tensor_refs, group_name, timeout,
                     root=("src_rank", src_rank))


def allgather_refs(tensor_refs: Sequence[Any], group_name: str = "default", *,
                   timeout: Optional[float] = None) -> List[Any]:
    """Gather every rank's tensor to every rank; returns at once.

    Args:
        tensor_refs: ``tensor_refs[i]`` is an ObjectRef to rank i's tensor; all of the same
            shape and dtype.
        group_name: a group this driver declared.
        timeout: as for :func:`allreduce_refs`.

    Returns:
        One ObjectRef per rank, in rank order, each to the list of every rank's tensor (entry
        i is rank i's).

    Raises:
        TypeError, ValueError: bad refs or timeout.
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    return _run_refs("allgather", tensor_refs, group_name, timeout)


def reducescatter_refs(tensor_refs: Sequence[Any], group_name: str = "default",
                       op: ReduceOp = ReduceOp.SUM, *, timeout: Optional[float] = None
                       ) -> List[Any]:
    """Reduce the ranks' tensors and give rank i the i-th part of the result; returns at once.

    Args:
        tensor_refs: ``tensor_refs[i]`` is an ObjectRef to rank i's input: either a list of
            one tensor per rank (as the imperative ``reducescatter`` takes), or one tensor
            whose first dimension splits evenly into one block per rank.
        group_name: a group this driver declared.
        op: the reduction.
        timeout: as for :func:`allreduce_refs`.

    Returns:
        One ObjectRef per rank, in rank order, to that rank's reduced part.

    Raises:
        TypeError, ValueError: bad refs, op or timeout.
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    return _run_refs("reducescatter", tensor_refs, group_name, timeout, op=op)


def send_ref(tensor_ref: Any, src_rank: int, dst_rank: int, group_name: str = "default", *,
             tag: int = 0, timeout: Optional[float] = None) -> Any:
    """Send the tensor ``tensor_ref`` points to from ``src_rank`` to ``dst_rank``; returns at
    once.

    ``src_rank`` resolves the ref and sends; ``dst_rank`` receives into a tensor of the same
    kind (numpy or torch), dtype and shape, which it learns from a small message ``src_rank``
    sends first. Only those two members take part.

    Args:
        tensor_ref: an ObjectRef to the tensor, resolved on ``src_rank``.
        src_rank: the sending rank.
        dst_rank: the receiving rank (not ``src_rank``).
        group_name: a group this driver declared.
        tag: the message tag (as for the imperative ``send``/``recv``).
        timeout: as for :func:`allreduce_refs`.

    Returns:
        An ObjectRef to the tensor as received on ``dst_rank``.

    Raises:
        TypeError, ValueError: a ref that is not an ObjectRef, ranks out of range or equal,
            bad tag or timeout.
        GroupNotInitializedError: this driver declared no group ``group_name``.
    """
    import ray
    members = _members(group_name)
    if not isinstance(tensor_ref, ray.ObjectRef):
        raise TypeError(f"send_ref: tensor_ref must be an ObjectRef, not "
                        f"{type(tensor_ref).__name__}")
    src_rank = check_rank(src_rank, len(members), group_name, "src_rank")
    dst_rank = check_rank(dst_rank, len(members), group_name, "dst_rank")
    if src_rank == dst_rank:
        raise ValueError(f"send_ref: src_rank and dst_rank are both {src_rank}; a rank does "
                         f"not send to itself")
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"send_ref: tag must be an int >= 0, not {tag!r}")
    timeout = check_call_timeout(timeout)
    sender = _RefCall("send", group_name, peer=dst_rank, tag=tag, timeout=timeout)
    receiver = _RefCall("recv", group_name, peer=src_rank, tag=tag, timeout=timeout)
    pair = [members[src_rank], members[dst_rank]]
    _, received = batch_remote(pair).__ray_call__.remote(
        _run_in_member, PerActor([sender, receiver]), PerActor([[tensor_ref], []]))
    return received


# ------------------------------------------------------------------ member side

def _run_in_member(actor: Any, call: _RefCall, boxed_ref: List[Any]) -> Any:
    """Run inside a member (through ``__ray_call__``): resolve its tensor, run the collective.

    Returns:
        This rank's result (see the driver-side function of ``call.collective``).
    """
    group = current_registry().get(call.group_name)
    tensor = _resolve(group, call, boxed_ref[0]) if boxed_ref else None
    return _COLLECTIVES[call.collective](group, call, tensor)


def _resolve(group: Any, call: _RefCall, ref: Any) -> Any:
    """The member's tensor, writable; on failure the group is broken and TensorRefError
    raised."""
    import ray
    deadline = group.timeout if call.timeout is None else call.timeout
    try:
        value = ray.get(ref, timeout=deadline)
        return _writable(value, group.world_size if call.collective == "reducescatter" else 0)
    except CollectiveError:
        raise
    except ray.exceptions.GetTimeoutError:
        detail = f"its ref was not ready after {deadline:g}s"
    except ray.exceptions.RayError as err:
        detail = f"the task that makes it failed: {type(err).__name__}: {err}"
    except (TypeError, ValueError) as err:
        detail = str(err)
    raise _break_group(group, call, detail)


def _break_group(group: Any, call: _RefCall, detail: str) -> TensorRefError:
    """Break the group with this member's TensorRefError, so that the others fail fast; the
    caller raises the returned error."""
    what = "send_ref" if call.collective in ("send", "recv") else f"{call.collective}_refs"
    error = TensorRefError(call.group_name, group.rank, what, detail)
    group.fail(error)
    return error


def _writable(value: Any, parts: int) -> Any:
    """A tensor (or list of tensors) the collective may write into; a read-only numpy array
    (as the object store hands out) is copied. ``parts``: reducescatter's rank count, whose
    input may be a list."""
    if parts and isinstance(value, (list, tuple)):
        if len(value) != parts:
            raise ValueError(f"its input list has {len(value)} tensors for a group of {parts} "
                             f"ranks")
        return [_writable(item, 0) for item in value]
    as_view(value, writable=False, what="the tensor its ref points to")
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    return value


def _empty_like(tensor: Any) -> Any:
    if isinstance(tensor, np.ndarray):
        return np.empty_like(tensor)
    import torch
    return torch.empty_like(tensor)


def _run_allreduce(group: Any, call: _RefCall, tensor: Any) -> Any:
    api.allreduce(tensor, call.group_name, call.op, timeout=call.timeout)
    return tensor


def _run_reduce(group: Any, call: _RefCall, tensor: Any) -> Any:
    api.reduce(tensor, call.root, call.group_name, call.op, timeout=call.timeout)
    return tensor


def _run_broadcast(group: Any, call: _RefCall, tensor: Any) -> Any:
    api.broadcast(tensor, call.root, call.group_name, timeout=call.timeout)
    return tensor


def _run_allgather(group: Any, call: _RefCall, tensor: Any) -> Any:
    gathered = [_empty_like(tensor) for _ in range(group.world_size)]
    api.allgather(gathered, tensor, call.group_name, timeout=call.timeout)
    return gathered


def _run_reducescatter(group: Any, call: _RefCall, tensor: Any) -> Any:
    if isinstance(tensor, list):
        parts = tensor
    else:
        blocks = tensor.shape[0] if tensor.ndim else 0
        if blocks % group.world_size:
            raise _break_group(group, call, f"its tensor of shape {tuple(tensor.shape)} does not "
                                            f"split into {group.world_size} equal blocks along "
                                            f"the first dimension; pass a list of one tensor per "
                                            f"rank instead")
        step = blocks // group.world_size
        parts = [tensor[i * step:(i + 1) * step] for i in range(group.world_size)]
    result = _empty_like(parts[group.rank])
    api.reducescatter(result, parts, call.group_name, call.op, timeout=call.timeout)
    return result


def _shape_message(tensor: Any) -> np.ndarray:
    view = as_view(tensor, writable=False)
    if view.kind not in _KINDS or len(view.shape) > _MAX_DIMS:
        raise TypeError(f"send_ref sends numpy arrays and CPU torch tensors of at most "
                        f"{_MAX_DIMS} dimensions, not a {view.kind} tensor of shape "
                        f"{view.shape}")
    message = np.zeros(3 + _MAX_DIMS, dtype=np.int64)
    message[:3] = (_KINDS.index(view.kind), SUPPORTED_DTYPES.index(view.dtype_name),
                   len(view.shape))
    message[3:3 + len(view.shape)] = view.shape
    return message


def _tensor_from_shape_message(message: np.ndarray) -> Any:
    kind = _KINDS[int(message[0])]
    dtype_name = SUPPORTED_DTYPES[int(message[1])]
    shape = tuple(int(d) for d in message[3:3 + int(message[2])])
    if kind == "numpy":
        return np.empty(shape, dtype=dtype_name)
    import torch
    return torch.empty(shape, dtype=getattr(torch, dtype_name))


def _run_send(group: Any, call: _RefCall, tensor: Any) -> None:
    try:
        message = _shape_message(tensor)
    except TypeError as err:
        raise _break_group(group, call, str(err)) from None
    api.send(message, call.peer, call.group_name, call.tag, timeout=call.timeout)
    api.send(tensor, call.peer, call.group_name, call.tag, timeout=call.timeout)


def _run_recv(group: Any, call: _RefCall, _tensor: None) -> Any:
    message = np.empty(3 + _MAX_DIMS, dtype=np.int64)
    api.recv(message, call.peer, call.group_name, call.tag, timeout=call.timeout)
    received = _tensor_from_shape_message(message)
    api.recv(received, call.peer, call.group_name, call.tag, timeout=call.timeout)
    return received


_COLLECTIVES = {
    "allreduce": _run_allreduce,
    "reduce": _run_reduce,
    "broadcast": _run_broadcast,
    "allgather": _run_allgather,
    "reducescatter": _run_reducescatter,
    "send": _run_send,
    "recv": _run_recv,
}
"""The member-side step of each declarative call, by ``_RefCall.collective``."""
