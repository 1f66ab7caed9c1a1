"""The public functions of a group's life: join, declare, destroy, shrink and grow a group, ask
about one, and name the backends.

Names and argument order follow ``ray.util.collective``; the collectives themselves are in
``api.py``, their ``*_multigpu`` variants in ``api_multigpu.py``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Union

from .backends import BACKENDS
from .backends.base import BackendFactory
from .declared import declare_in_actors
from .elastic import grow_declared, grow_member, shrink_declared, shrink_member
from .errors import ArgumentTypeError, ArgumentValueError, GroupNotInitializedError
from .group import Group, current_registry
from .types import Backend
from .validation import (check_call_timeout, check_group_name, check_rank, check_world_size,
                         group_timeout)

_log = logging.getLogger(__name__)

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
    return current_registry().get(check_group_name(group_name))


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
    return current_registry().get(check_group_name(group_name)).trace()


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
