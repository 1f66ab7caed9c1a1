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

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .backends import BACKENDS
from .backends.base import BackendFactory, CallViews
from .declared import declare_in_actors
from .elastic import grow_declared, grow_member, shrink_declared, shrink_member
from .errors import (ArgumentTypeError, ArgumentValueError, GroupNotInitializedError,
                     UnsupportedOperationError)
from .group import Group, Work, current_registry, find_group
from .reductions import check_op
from .tensors import TensorView, as_view, check_same_layout, tensor_layout
from .types import Backend, CallOptions, Collective, ReduceOp
from .validation import (check_call_timeout, check_group_name, check_rank, check_reduce_op,
                         check_world_size, group_timeout)

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------- argument helpers

def _check_rank(rank: Any, group: Group, what: str) -> int:
    return check_rank(rank, group.world_size, group.name, what)


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


def _options(group: Group, collective: Collective, timeout: Optional[float],
             **fields) -> CallOptions:
    return group.options(collective, check_call_timeout(timeout), **fields)


def _submit(group: Group, key: Optional[Tuple], options: CallOptions, views: CallViews,
            async_op: bool, seq_key: Tuple[str, int, int] = ("", -1, 0)) -> Optional[Work]:
    """Run a call by the full path: its shape prepared (or found) under ``key``, then
    numbered and run; a later blocking call of the shape finds it under ``key``."""
    known = group.prepare(key, options, views)
    return group.submit(known, views.arrays(options.collective), async_op, seq_key)


# ---------------------------------------------------------------- calls of a known shape
#
# A program calls the same collective on arrays of the same shape again and again. Everything
# the API checks about such a call depends only on its shape (the numpy dtype, shape and
# strides, the op, the root, the group), so the checks run at a shape's first call, which
# keeps the call the backend prepared for the shape under the shape's key (Group.prepare),
# and its later calls go straight to it (Group.run): a few dictionary lookups instead of the
# full path.
# Only blocking calls with the group's own deadline on writable numpy arrays (and cupy arrays
# and torch tensors, for allreduce, reduce and broadcast) take it; for
# allgather, reducescatter, and gather and scatter at their root, every array of the list must
# be like the tensor (dtype, shape, strides), and for alltoall every entry of both lists like
# the first input, which is checked per call.

_ALLREDUCE, _REDUCE, _BROADCAST = "allreduce", "reduce", "broadcast"
_ALLGATHER, _REDUCESCATTER, _GATHER, _SCATTER = "allgather", "reducescatter", "gather", "scatter"
_ALLTOALL = "alltoall"


def _shape_key(collective: str, tensor: Any, op: Any, root: Any) -> Optional[Tuple]:
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


def _list_shape_key(collective: str, tensor: Any, tensors: Any, op: Any,
                    list_written: bool, root: Any = -1) -> Optional[Tuple]:
    """The key of an allgather or gather (``list_written``: the list receives), reducescatter
    or scatter call, or None when it cannot take the known-shape path (see
    :func:`_shape_key`; a list entry unlike the tensor, or not writable where it is written).
    Gather and scatter use the list on their root only: elsewhere it may be None, and the
    runner ignores it."""
    if type(tensor) is not np.ndarray:
        return None
    key = _shape_key(collective, tensor, op, root)
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


def _exchange_key(inputs: Any, outputs: Any) -> Optional[Tuple]:
    """The key of an alltoall for the known-shape path (see :func:`_shape_key`), or None when
    it cannot take it: a list that is not a list or tuple, an entry unlike the first input,
    an output not writable. An input may be read-only (it is only sent)."""
    if type(inputs) not in (list, tuple) or type(outputs) not in (list, tuple) or not inputs:
        return None
    first = inputs[0]
    if type(first) is not np.ndarray:
        return None
    dtype, shape, strides = first.dtype, first.shape, first.strides
    if not (_entries_like(inputs, dtype, shape, strides, False)
            and _entries_like(outputs, dtype, shape, strides, True)):
        return None
    return (_ALLTOALL, dtype, shape, strides, len(inputs), len(outputs))


def _point_to_point_key(collective: str, tensor: Any, peer: Any, tag: Any) -> Optional[Tuple]:
    """The key of a send or recv for the known-shape path (see :func:`_shape_key`); its
    peer and tag are part of it, so a key learnt once names a valid peer and tag. A send
    only reads its array, which may be read-only (as Ray hands arguments to an actor)."""
    if (type(tensor) is not np.ndarray or type(peer) is not int or type(tag) is not int
            or (collective == "recv" and not tensor.flags.writeable)):
        return None
    return (collective, peer, tag, tensor.dtype, tensor.shape, tensor.strides)


def _run_known_shape(group_name: Any, key: Optional[Tuple], arrays: Any,
                     channel: Optional[Tuple[str, int, int]] = None) -> bool:
    """Run the call through its shape's prepared call if the shape is known; False when it is
    not (or asynchronous calls are queued): nothing was done then. ``channel``: a send's or
    recv's ``(collective, peer, tag)``."""
    if key is None or type(group_name) is not str:
        return False
    group = find_group(group_name)
    if group is None:
        return False
    known = group.prepared.get(key)
    if known is None:
        return False
    return group.run(known, arrays, channel)


# ---------------------------------------------------------------- groups

# How long a driver-side destroy waits for busy members before removing the group anyway.
_LEAVE_TIMEOUT_S = 60.0

def init_collective_group(world_size: int, rank: int,
                          backend: Union[str, Backend, BackendFactory] = Backend.RAY,
                          group_name: str = "default", gloo_timeout: Optional[int] = None, *,
                          timeout: Optional[float] = None) -> None:
    """Join this process to a collective group; returns once every rank has joined.

    Args:
        world_size: number of ranks in the group, 1 to 65536 (``types.MAX_WORLD_SIZE``).
        rank: this process's rank, in [0, world_size).
        backend: ``"ray"`` (CPU; ``"gloo"`` is an alias), ``"nccl"`` (GPU), the name of a
            backend added with :func:`register_backend` (in this process), or a backend
            factory (``ray_collective.testing`` uses an in-process one).
        group_name: the group's name, unique within this process.
        gloo_timeout: accepted for compatibility with ``ray.util.collective``: the default
            deadline in milliseconds, used when ``timeout`` is not given; given with
            ``timeout``, the two must say the same deadline.
        timeout: the default deadline of every call on this group, in seconds (default 1800;
            one past a year, ``types.MAX_TIMEOUT_S``, is taken as a year).

    Returns:
        None.

    Raises:
        ValueError: world_size not in 1..65536 (``types.MAX_WORLD_SIZE``), rank out of range,
            a group name that is empty, longer than 256 bytes of UTF-8 or holds a control
            character, a timeout that is not a positive number, ``gloo_timeout`` and
            ``timeout`` that disagree.
        JoinMismatchError: (``ray`` backend) the ranks that came brought another world size,
            backend or forced algorithm, or claimed one rank twice; raised on each of them.
        GroupAlreadyInitializedError: this process already has a group of that name.
        BackendNotAvailableError: the backend cannot run in this process.
        CollectiveTimeoutError: the other ranks did not join in time.
    """
    check_world_size(world_size)
    check_rank(rank, world_size, check_group_name(group_name))
    timeout = group_timeout(timeout, gloo_timeout)
    factory = BACKENDS.resolve(backend)
    current_registry().create(group_name, world_size, rank, factory, timeout)


def declare_collective_group(actors: Sequence[Any], world_size: Optional[int] = None,
                             ranks: Optional[Sequence[int]] = None,
                             backend: Union[str, Backend] = Backend.RAY,
                             group_name: str = "default",
                             gloo_timeout: Optional[int] = None, *,
                             timeout: Optional[float] = None) -> None:
    """Declare, from the driver, that ``actors`` form a group; each joins it itself.

    Args:
        actors: the member actors.
        world_size: number of ranks; defaults to ``len(actors)``.
        ranks: the rank of each actor; defaults to ``0..len(actors)-1``.
        backend: ``"ray"`` or ``"nccl"``.
        group_name: the group's name.
        gloo_timeout: compatibility alias of ``timeout`` in milliseconds.
        timeout: the default deadline of every call on this group, in seconds.

    Returns:
        None.

    Raises:
        TypeError: an element of ``actors`` is not a Ray actor handle.
        ValueError: no actors, ranks not a permutation of ``0..world_size-1``, world_size not
            the number of actors or over 65536, bad timeout or name (as for
            :func:`init_collective_group`).
        BackendNotAvailableError: Ray is not initialized, or the backend cannot run in the
            actors (raised from the actor that failed).
        GroupAlreadyInitializedError: this driver already declared a group of that name.
        CollectiveTimeoutError: the actors did not all join within the timeout (the group is
            then removed again).
    """
    if not isinstance(actors, (list, tuple)) or not actors:
        raise ArgumentValueError("actors must be a non-empty list of Ray actor handles")
    world_size = check_world_size(len(actors) if world_size is None else world_size)
    if world_size != len(actors):
        raise ArgumentValueError(
            f"world_size={world_size} but {len(actors)} actors were given; every "
            f"rank must be one of the actors")
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    if sorted(ranks) != list(range(world_size)):
        raise ArgumentValueError(
            f"ranks must be a permutation of 0..{world_size - 1}, one per actor, "
            f"not {ranks!r}")
    check_group_name(group_name)
    timeout = group_timeout(timeout, gloo_timeout)
    strangers = [a for a in actors if not hasattr(a, "__ray_call__")]
    if strangers:
        raise ArgumentTypeError(
            f"actors must be Ray actor handles (made with ActorClass.remote()), "
            f"not {type(strangers[0]).__name__}: {strangers[0]!r}")
    factory = BACKENDS.resolve(backend)
    current_registry().declare(group_name, lambda: declare_in_actors(factory, actors, ranks,
                                                                     world_size, group_name,
                                                                     timeout))


create_collective_group = declare_collective_group


def destroy_collective_group(group_name: str = "default") -> None:
    """Leave the group and release what this process holds for it.

    Called in a member, it destroys that member's membership. Called in the driver that
    declared the group, it makes every member leave and removes everything the group used.
    A process that is neither (never joined, or already left) is left as it is, with a logged
    warning, as in ``ray.util.collective``: cleanup code may destroy a group unconditionally.

    Args:
        group_name: the group.

    Returns:
        None.

    Raises:
        ArgumentValueError: ``group_name`` is not a non-empty string.
    """
    registry = current_registry()
    check_group_name(group_name)
    if registry.is_initialized(group_name):
        registry.destroy(group_name)
    elif registry.declared(group_name) is not None:
        registry.undeclare(group_name, _LEAVE_TIMEOUT_S)
    else:
        _log.warning("destroy_collective_group('%s'): this process is not a member of that "
                     "group and did not declare it; nothing to destroy", group_name)


def shrink_collective_group(group_name: str = "default",
                            timeout: Optional[float] = None) -> Union[int, Dict[int, int]]:
    """Go on without the members that failed: the group keeps its name, its world size becomes
    the number of survivors, and their ranks are renumbered densely in the old order.

    Called in every surviving member after a collective failed (``PeerDiedError``,
    ``PostOfficeDiedError``, ``CollectiveTimeoutError``, ``GroupBrokenError``): the survivors
    agree on one set, whatever error each saw, and form a fresh incarnation of the group (a
    new epoch: no message of the old one is taken for the new one's), and nothing of the old
    incarnation stays. Called on the driver for a group it declared: the same runs in every
    member actor. A call that was in progress when the failure struck has raised on every
    survivor; what its buffers hold is undefined. Backend ``ray`` only.

    Args:
        group_name: the group.
        timeout: seconds the shrink may take (default: the group's); a member that has not
            come by then, and is not known to have failed, is left out.

    Returns:
        In a member, its new rank; on the driver, ``{old rank: new rank}`` of the members that
        went on.

    Raises:
        ArgumentValueError: a bad name or timeout, before anything is sent.
        GroupNotInitializedError: this process neither is a member nor declared the group.
        RankExcludedError: the other members went on without this one (stopped, hung or
            named as failed when they agreed); its membership is released.
        PeerDiedError: a survivor died during the shrink: call it again.
        CollectiveTimeoutError: survivors did not join the new incarnation in time: call it
            again (the next shrink leaves them out).
        UnsupportedOperationError: the group's backend cannot shrink (``nccl``).
    """
    registry = current_registry()
    check_group_name(group_name)
    timeout = check_call_timeout(timeout)
    if registry.is_initialized(group_name):
        return shrink_member(registry, group_name, timeout).rank
    declared = registry.declared(group_name)
    if declared is None:
        raise GroupNotInitializedError(group_name)
    return shrink_declared(declared, timeout)


def grow_collective_group(group_name: str = "default", *, world_size: Optional[int] = None,
                          actors: Optional[Sequence[Any]] = None,
                          timeout: Optional[float] = None) -> int:
    """Take new ranks into the group: its members and the new ranks form a fresh incarnation
    of ``world_size`` ranks; the members keep their ranks.

    In every member, with ``world_size``; meanwhile each new actor calls
    ``init_collective_group(world_size, rank, backend="ray", group_name=...)`` with the new
    ranks (the old size to ``world_size - 1``). On the driver for a group it declared, with
    ``actors``: they join as the next ranks (through ``__ray_call__``, as
    ``declare_collective_group`` joins them). Backend ``ray`` only.

    Args:
        group_name: the group.
        world_size: in a member, the size once grown (more than now); on the driver, optional,
            the current size plus ``len(actors)``.
        actors: on the driver, the new member actors, in the order of their new ranks.
        timeout: seconds the grow may take (default: the group's).

    Returns:
        The new world size.

    Raises:
        ArgumentValueError, ArgumentTypeError: a bad name, timeout or world size, ``actors``
            in a member, no ``actors`` on the driver, or an actor that is a member already;
            before anything is sent.
        GroupNotInitializedError: this process neither is a member nor declared the group.
        PeerDiedError: a member is dead: shrink the group first.
        CollectiveTimeoutError: ranks (members or new ones) did not come in time.
        UnsupportedOperationError: the group's backend cannot grow (``nccl``).
    """
    registry = current_registry()
    check_group_name(group_name)
    timeout = check_call_timeout(timeout)
    if registry.is_initialized(group_name):
        if actors is not None:
            raise ArgumentValueError("grow_collective_group in a member takes world_size, not "
                                     "actors (only the driver that declared the group can "
                                     "pass actors)")
        if world_size is None:
            raise ArgumentValueError("grow_collective_group in a member needs world_size: "
                                     "the group's size once grown")
        return grow_member(registry, group_name, check_world_size(world_size),
                           timeout).world_size
    declared = registry.declared(group_name)
    if declared is None:
        raise GroupNotInitializedError(group_name)
    if not isinstance(actors, (list, tuple)) or not actors:
        raise ArgumentValueError("grow_collective_group on the driver needs actors: a "
                                 "non-empty list of the new member actors")
    strangers = [a for a in actors if not hasattr(a, "__ray_call__")]
    if strangers:
        raise ArgumentTypeError(f"actors must be Ray actor handles, not "
                                f"{type(strangers[0]).__name__}: {strangers[0]!r}")
    if len(set(actors)) < len(actors) or set(actors) & set(declared.members):
        raise ArgumentValueError(f"actors must be new to group '{group_name}': an actor is a "
                                 f"member already, or given twice")
    new_size = len(declared.members) + len(actors)
    if world_size is not None and world_size != new_size:
        raise ArgumentValueError(
            f"world_size={world_size}, but group '{group_name}' has {len(declared.members)} "
            f"members and {len(actors)} actors were given: {new_size} ranks")
    check_world_size(new_size)
    return grow_declared(declared, actors, timeout)


def is_group_initialized(group_name: str = "default") -> bool:
    """Whether this process is a member of ``group_name``.

    Args:
        group_name: the group.

    Returns:
        True if it is.
    """
    return current_registry().is_initialized(group_name)


def get_group_handle(group_name: str = "default") -> Group:
    """This process's membership of ``group_name``.

    Args:
        group_name: the group.

    Returns:
        The :class:`~ray_collective.group.Group`: its ``name``, ``rank``, ``world_size``,
        ``timeout`` (seconds) and ``membership`` (this rank's membership on its
        backend).

    Raises:
        GroupNotInitializedError: this process is not a member of ``group_name``.
    """
    return _group(group_name)


def get_rank(group_name: str = "default") -> int:
    """This process's rank in the group.

    Args:
        group_name: the group.

    Returns:
        The rank, or -1 if this process is not a member (as in ``ray.util.collective``).
    """
    registry = current_registry()
    return registry.get(group_name).rank if registry.is_initialized(group_name) else -1


def get_collective_group_size(group_name: str = "default") -> int:
    """The number of ranks in the group.

    Args:
        group_name: the group.

    Returns:
        The world size, or -1 if this process is not a member.
    """
    registry = current_registry()
    return registry.get(group_name).world_size if registry.is_initialized(group_name) else -1


def get_collective_trace(group_name: str = "default") -> List[dict]:
    """This rank's last calls on the group, from its flight recorder, oldest first.

    Each rank keeps its last ``RAY_COLLECTIVE_TRACE_SIZE`` calls (256 unless set; 0 keeps none)
    of each group; an error that breaks the group carries the same list (its ``trace``).

    Args:
        group_name: the group.

    Returns:
        One dict per call, with ``seq``, ``collective``, ``dtype``, ``shape``, ``nbytes``,
        ``algorithm``, ``peers``, ``start`` and ``end`` (Unix time, seconds), ``duration_s``
        and ``outcome`` (``"ok"`` or the error's class name).

    Raises:
        GroupNotInitializedError: this process is not a member of ``group_name``.
    """
    return _group(group_name).trace()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Add a backend of your own, to be named by ``backend=name`` in this process.

    A declared group sends the factory to its members, so registering in the driver is
    enough there; a member that calls :func:`init_collective_group` itself must register the
    name in its own process first (at import of the module that defines the backend). The
    built-in ``"ray"`` and ``"nccl"`` are registered the same way.

    Args:
        name: the backend's name (case-insensitive).
        factory: a :class:`~ray_collective.backends.base.BackendFactory`; the memberships it
            creates declare what they can run (``collectives``, ``accepts_gpu_tensors``,
            ``multi_gpu_arguments``).

    Returns:
        None.

    Raises:
        ArgumentTypeError: ``name`` is not a string, or ``factory`` not a BackendFactory.
        ArgumentValueError: the name is empty, an alias of a built-in backend, or taken.
    """
    BACKENDS.register(name, factory)


def is_backend_available(backend: Union[str, Backend]) -> bool:
    """Whether ``backend`` can run in this process.

    Args:
        backend: a backend name.

    Returns:
        True if groups can be created with it here; False for a name no backend has (as in
        ``ray.util.collective``).
    """
    try:
        factory = BACKENDS.resolve(backend)
    except (TypeError, ValueError):
        return False
    return factory.available()


def nccl_available() -> bool:
    """Whether the NCCL backend can run in this process: CuPy imports and NCCL loads.

    Returns:
        True if they do (creating a group also needs a visible GPU).
    """
    return is_backend_available(Backend.NCCL)


def gloo_available() -> bool:
    """Whether ``backend="gloo"`` works here (it names this library's native CPU backend).

    Returns:
        True if it can run; no Gloo library is needed either way.
    """
    return is_backend_available("gloo")


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
    known = None if async_op or timeout is not None else _shape_key(
        _ALLREDUCE, tensor, op, -1)
    if _run_known_shape(group_name, known, tensor):
        return None
    group = _group(group_name)
    op = check_reduce_op(op)
    view = _view(group, tensor, True, "tensor")
    check_op(op, view.dtype_name)
    options = _options(group, Collective.ALLREDUCE, timeout, op=op)
    return _submit(group, known, options, CallViews(view), async_op)


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
    known = None if async_op or timeout is not None else _shape_key(
        _REDUCE, tensor, op, dst_rank)
    if _run_known_shape(group_name, known, tensor):
        return None
    group = _group(group_name)
    op = check_reduce_op(op)
    dst_rank = _check_rank(dst_rank, group, "dst_rank")
    view = _view(group, tensor, group.rank == dst_rank, "tensor")
    check_op(op, view.dtype_name)
    options = _options(group, Collective.REDUCE, timeout, op=op, root=dst_rank)
    return _submit(group, known, options, CallViews(view), async_op)


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
    known = None if async_op or timeout is not None else _shape_key(
        _BROADCAST, tensor, ReduceOp.SUM, src_rank)
    if _run_known_shape(group_name, known, tensor):
        return None
    group = _group(group_name)
    src_rank = _check_rank(src_rank, group, "src_rank")
    view = _view(group, tensor, group.rank != src_rank, "tensor")
    options = _options(group, Collective.BROADCAST, timeout, root=src_rank)
    return _submit(group, known, options, CallViews(view), async_op)


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
    known = None if async_op or timeout is not None else _list_shape_key(
        _ALLGATHER, tensor, tensor_list, ReduceOp.SUM, True)
    if _run_known_shape(group_name, known, (tensor, tensor_list)):
        return None
    group = _group(group_name)
    view = _view(group, tensor, False, "tensor")
    outputs = _views(group, tensor_list, True, "tensor_list", like=view)
    options = _options(group, Collective.ALLGATHER, timeout)
    return _submit(group, known, options, CallViews(view, outputs=outputs), async_op)


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
    known = None if async_op or timeout is not None else _list_shape_key(
        _REDUCESCATTER, tensor, tensor_list, op, False)
    if _run_known_shape(group_name, known, (tensor, tensor_list)):
        return None
    group = _group(group_name)
    op = check_reduce_op(op)
    view = _view(group, tensor, True, "tensor")
    inputs = _views(group, tensor_list, False, "tensor_list", like=view)
    check_op(op, view.dtype_name)
    options = _options(group, Collective.REDUCESCATTER, timeout, op=op)
    return _submit(group, known, options, CallViews(view, inputs=inputs), async_op)


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
    known = None if async_op or timeout is not None else _list_shape_key(
        _GATHER, tensor, tensor_list, ReduceOp.SUM, True, dst_rank)
    if _run_known_shape(group_name, known, (tensor, tensor_list)):
        return None
    group = _group(group_name)
    dst_rank = _check_rank(dst_rank, group, "dst_rank")
    view = _view(group, tensor, False, "tensor")
    outputs = (_views(group, tensor_list, True, "tensor_list", like=view)
               if group.rank == dst_rank else ())
    options = _options(group, Collective.GATHER, timeout, root=dst_rank)
    return _submit(group, known, options, CallViews(view, outputs=outputs), async_op)


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
    known = None if async_op or timeout is not None else _list_shape_key(
        _SCATTER, tensor, tensor_list, ReduceOp.SUM, False, src_rank)
    if _run_known_shape(group_name, known, (tensor, tensor_list)):
        return None
    group = _group(group_name)
    src_rank = _check_rank(src_rank, group, "src_rank")
    view = _view(group, tensor, True, "tensor")
    inputs = (_views(group, tensor_list, False, "tensor_list", like=view)
              if group.rank == src_rank else ())
    options = _options(group, Collective.SCATTER, timeout, root=src_rank)
    return _submit(group, known, options, CallViews(view, inputs=inputs), async_op)


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
    known = None if async_op or timeout is not None else _exchange_key(
        input_tensor_list, output_tensor_list)
    if _run_known_shape(group_name, known, (input_tensor_list, output_tensor_list)):
        return None
    group = _group(group_name)
    inputs = _views(group, input_tensor_list, False, "input_tensor_list")
    outputs = _views(group, output_tensor_list, True, "output_tensor_list", like=inputs[0],
                     like_name="input_tensor_list[0]")
    options = _options(group, Collective.ALLTOALL, timeout)
    return _submit(group, known, options, CallViews(inputs=inputs, outputs=outputs), async_op)


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
    known = None if async_op or timeout is not None else _BARRIER_KEY
    if _run_known_shape(group_name, known, None):
        return None
    group = _group(group_name)
    options = _options(group, Collective.BARRIER, timeout)
    return _submit(group, known, options, CallViews(), async_op)


_BARRIER_KEY = ("barrier",)


def _point_to_point(collective: Collective, tensor: Any, peer: int, group_name: str, tag: int,
                    async_op: bool, timeout: Optional[float]) -> Optional[Work]:
    channel = (collective.value, peer, tag)
    known = None if async_op or timeout is not None else _point_to_point_key(
        collective.value, tensor, peer, tag)
    if _run_known_shape(group_name, known, tensor, channel):
        return None
    group = _group(group_name)
    what = "dst_rank" if collective is Collective.SEND else "src_rank"
    peer = _check_rank(peer, group, what)
    if peer == group.rank:
        raise ArgumentValueError(
            f"rank {group.rank} of group '{group.name}' cannot {collective.value} "
            f"to itself ({what}={peer}); copy the tensor locally instead")
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ArgumentValueError(f"tag must be an int >= 0, not {tag!r}")
    view = _view(group, tensor, collective is Collective.RECV, "tensor")
    options = _options(group, collective, timeout, peer=peer, tag=tag)
    return _submit(group, known, options, CallViews(view), async_op, channel)


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
    return _point_to_point(Collective.SEND, tensor, dst_rank, group_name, tag, async_op, timeout)


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
    return _point_to_point(Collective.RECV, tensor, src_rank, group_name, tag, async_op, timeout)


# ---------------------------------------------------------------- multi-GPU variants

def _multigpu_group(name: str, group_name: str) -> Tuple[Group, Any]:
    """The group of a ``*_multigpu`` call and the argument checks its membership brings."""
    group = _group(group_name)
    gpu = group.membership.multi_gpu_arguments()
    if gpu is None:
        raise UnsupportedOperationError(
            f"{name} needs a group on the 'nccl' backend (or another backend with the "
            f"multi-GPU calls), one tensor per GPU of this process; group '{group.name}' (rank "
            f"{group.rank}) runs on a backend without them. Use "
            f"{name.replace('_multigpu', '')} with one tensor instead.")
    return group, gpu


def _submit_multigpu(group: Group, prepared: Any, async_op: bool,
                     seq_key: Tuple[str, int, int] = ("", -1, 0)) -> Optional[Work]:
    """Run a ``*_multigpu`` call (prepared per call: its tensors are in its record)."""
    return group.submit(group.unshared(prepared, None), None, async_op, seq_key)


def _point_to_point_multigpu(collective: Collective, tensor: Any, peer: int, peer_index: int,
                             group_name: str, n_elements: int, async_op: bool,
                             timeout: Optional[float]) -> Optional[Work]:
    sending = collective is Collective.SEND
    name = "send_multigpu" if sending else "recv_multigpu"
    group, gpu = _multigpu_group(name, group_name)
    peer = _check_rank(peer, group, "dst_rank" if sending else "src_rank")
    if peer == group.rank:
        raise ArgumentValueError(
            f"rank {group.rank} of group '{group.name}' cannot {name} to itself; "
            f"copy between this process's GPUs directly instead (cupy: "
            f"dst.data.copy_from_device(src.data, nbytes); torch: dst.copy_(src))")
    peer_index = gpu.index(peer_index, "dst_gpu_index" if sending else "src_gpu_index")
    view, count = gpu.tensor(tensor, n_elements)
    options = _options(group, collective, timeout, peer=peer)
    prepared = gpu.call(options, device_tensors=(view,), peer_index=peer_index,
                        n_elements=count)
    return _submit_multigpu(group, prepared, async_op, (name, peer, 0))


def allreduce_multigpu(tensor_list: List[Any], group_name: str = "default",
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Allreduce across every GPU of every rank; ``tensor_list`` has one tensor per local GPU.

    Every GPU of the group ends with the reduction of all of them (AVG divides by the number
    of GPUs in the group).

    Args:
        tensor_list: one GPU tensor per device of this process, in the order of the group's
            devices; each is overwritten with the result.
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the result is in place (the Work of the call with ``async_op=True``).

    Raises:
        UnsupportedOperationError: the group's backend has no multi-GPU calls.
        GroupNotInitializedError: no such group here.
        ArgumentTypeError, ArgumentValueError: bad arguments (one tensor per GPU, same shape and
            dtype).
        CollectiveError: timeout, dead peer or broken group.
    """
    group, gpu = _multigpu_group("allreduce_multigpu", group_name)
    op = check_reduce_op(op)
    views = gpu.tensors(tensor_list, "tensor_list")
    check_op(op, views[0].dtype_name)
    options = _options(group, Collective.ALLREDUCE, timeout, op=op)
    prepared = gpu.call(options, device_tensors=views)
    return _submit_multigpu(group, prepared, async_op)


def reduce_multigpu(tensor_list: List[Any], dst_rank: int = 0, dst_tensor: int = 0,
                    group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
                    async_op: bool = False, timeout: Optional[float] = None
                    ) -> Optional[Work]:
    """Reduce across every GPU of every rank onto ``tensor_list[dst_tensor]`` of ``dst_rank``.

    Args:
        tensor_list: one GPU tensor per device of this process; only the destination GPU's
            tensor is overwritten.
        dst_rank: the receiving rank.
        dst_tensor: index of the receiving GPU tensor on ``dst_rank``.
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the result is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("reduce_multigpu", group_name)
    op = check_reduce_op(op)
    dst_rank = _check_rank(dst_rank, group, "dst_rank")
    dst_tensor = gpu.index(dst_tensor, "dst_tensor")
    views = gpu.tensors(tensor_list, "tensor_list")
    check_op(op, views[0].dtype_name)
    options = _options(group, Collective.REDUCE, timeout, op=op, root=dst_rank)
    prepared = gpu.call(options, device_tensors=views, root_index=dst_tensor)
    return _submit_multigpu(group, prepared, async_op)


def broadcast_multigpu(tensor_list: List[Any], src_rank: int = 0, src_tensor: int = 0,
                       group_name: str = "default", *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Broadcast ``tensor_list[src_tensor]`` of ``src_rank`` to every GPU of every rank.

    Args:
        tensor_list: one GPU tensor per device of this process; all but the source are
            overwritten.
        src_rank: the sending rank.
        src_tensor: index of the sending GPU tensor on ``src_rank``.
        group_name: the group (an ``nccl`` group).

    Returns:
        None, once the result is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("broadcast_multigpu", group_name)
    src_rank = _check_rank(src_rank, group, "src_rank")
    src_tensor = gpu.index(src_tensor, "src_tensor")
    views = gpu.tensors(tensor_list, "tensor_list")
    options = _options(group, Collective.BROADCAST, timeout, root=src_rank)
    prepared = gpu.call(options, device_tensors=views, root_index=src_tensor)
    return _submit_multigpu(group, prepared, async_op)


def allgather_multigpu(output_tensor_lists: List[List[Any]], input_tensor_list: List[Any],
                       group_name: str = "default", *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Allgather the tensors of every GPU of every rank into each GPU's output list.

    Args:
        output_tensor_lists: per local GPU, a list with one tensor per GPU in the group (all on
            that local GPU); entry ``r * k + i`` receives GPU ``i`` of rank ``r``.
        input_tensor_list: one GPU tensor per device of this process.
        group_name: the group (an ``nccl`` group).

    Returns:
        None, once the results are in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("allgather_multigpu", group_name)
    inputs = gpu.tensors(input_tensor_list, "input_tensor_list")
    outputs = gpu.tensor_lists(output_tensor_lists, "output_tensor_lists", inputs,
                               "input_tensor_list")
    options = _options(group, Collective.ALLGATHER, timeout)
    prepared = gpu.call(options, device_tensors=inputs, device_lists=outputs)
    return _submit_multigpu(group, prepared, async_op)


def reducescatter_multigpu(output_tensor_list: List[Any], input_tensor_lists: List[List[Any]],
                           group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
                           async_op: bool = False, timeout: Optional[float] = None
                           ) -> Optional[Work]:
    """Reduce-scatter across every GPU of every rank.

    GPU ``i`` of rank ``r`` receives the reduction of entry ``r * k + i`` of every GPU's input
    list.

    Args:
        output_tensor_list: one GPU tensor per device of this process, receiving its part.
        input_tensor_lists: per local GPU, a list with one tensor per GPU in the group (all on
            that local GPU).
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the results are in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("reducescatter_multigpu", group_name)
    op = check_reduce_op(op)
    outputs = gpu.tensors(output_tensor_list, "output_tensor_list")
    inputs = gpu.tensor_lists(input_tensor_lists, "input_tensor_lists", outputs,
                              "output_tensor_list")
    check_op(op, outputs[0].dtype_name)
    options = _options(group, Collective.REDUCESCATTER, timeout, op=op)
    prepared = gpu.call(options, device_tensors=outputs, device_lists=inputs)
    return _submit_multigpu(group, prepared, async_op)


def send_multigpu(tensor: Any, dst_rank: int, dst_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None) -> Optional[Work]:
    """Send a GPU tensor to GPU ``dst_gpu_index`` of ``dst_rank``.

    Args:
        tensor: the GPU tensor, on one of this process's GPUs in the group.
        dst_rank: the receiving rank (not this rank).
        dst_gpu_index: the receiving GPU's index on that rank.
        group_name: the group (an ``nccl`` group).
        n_elements: elements to send from the start of the tensor (0: all).

    Returns:
        None, once the data has left.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _point_to_point_multigpu(Collective.SEND, tensor, dst_rank, dst_gpu_index,
                                    group_name, n_elements, async_op, timeout)


def recv_multigpu(tensor: Any, src_rank: int, src_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None) -> Optional[Work]:
    """Receive into a GPU tensor from GPU ``src_gpu_index`` of ``src_rank``.

    Args:
        tensor: the GPU tensor to fill, on one of this process's GPUs in the group.
        src_rank: the sending rank (not this rank).
        src_gpu_index: the sending GPU's index on that rank.
        group_name: the group (an ``nccl`` group).
        n_elements: elements to receive into the start of the tensor (0: all).

    Returns:
        None, once the data is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _point_to_point_multigpu(Collective.RECV, tensor, src_rank, src_gpu_index,
                                    group_name, n_elements, async_op, timeout)


def synchronize(gpu_id: int) -> None:
    """Wait until all work queued on GPU ``gpu_id``, collectives included, has finished.

    Args:
        gpu_id: the GPU's index among the devices this process sees.

    Returns:
        None.

    Raises:
        BackendNotAvailableError: no GPU backend (such as 'nccl': CuPy with NCCL) can run in
            this process.
        ValueError: ``gpu_id`` is not a visible GPU.
    """
    BACKENDS.synchronize(gpu_id)
