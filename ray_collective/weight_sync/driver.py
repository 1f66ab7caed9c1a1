"""Weight syncs formed and changed from the driver, around actors that know nothing of them.

As ``declare_collective_group`` does, the driver sends the members the code to run through
Ray's built-in ``__ray_call__``: joining (``join_member``, also what ``init_weight_sync`` runs
in a member), leaving, and the steps of a change of subscribers between versions:

- **settle**: every member first makes its groups whole: a member that knows the last sync
  failed shrinks them (the others do the same), then one barrier on the control group finds a
  member that died since, and the survivors shrink again without it;
- **add**: the members grow every group by the new subscribers, which join as the next ranks;
  each new subscriber receives the whole model at its first sync;
- **remove**: the leaving subscribers leave every group, then the others shrink them out.

The driver's record (:class:`DeclaredWeightSync`) keeps the member actors; one found dead when
it settles is dropped from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .. import api
from ..backends.base import BackendFactory
from ..elastic import DRIVER_MARGIN_S
from ..errors import (ArgumentTypeError, ArgumentValueError, CollectiveTimeoutError,
                      GroupAlreadyInitializedError, UnsupportedOperationError, WeightSyncError,
                      WeightSyncNotInitializedError)
from ..group import GroupRegistry, current_registry
from ..types import Backend
from ..validation import check_call_timeout, check_group_name, group_timeout
from .agreement import PUBLISHER, SUBSCRIBER
from .config import SyncConfig, check_bucket_bytes, control_group, runs_on_gpu
from .member import WeightSyncMember

# --------------------------------------------------------------------- in a member


def join_member(config: SyncConfig, ranks: Dict[str, Tuple[int, int]],
                backend: Union[str, Backend, BackendFactory], cupy: Any = None
                ) -> WeightSyncMember:
    """Join this process to every group of its weight sync and register its membership.

    Args:
        config: the member's place in the sync.
        ranks: ``{group: (rank, world size)}`` for each of ``config.groups``.
        backend: the collectives' backend.
        cupy: on the nccl backend, the CuPy module (default: imported on first use).

    Returns:
        The membership.

    Raises:
        GroupAlreadyInitializedError: this process is in a weight sync of that name already.
        CollectiveTimeoutError, BackendNotAvailableError: from joining a group (the groups
            joined before are left again).
    """
    registry = current_registry()
    if config.name in registry.weight_syncs:
        raise GroupAlreadyInitializedError(config.name)
    member = WeightSyncMember(config, cupy)
    registry.weight_syncs[config.name] = member
    try:
        for group in config.groups:
            rank, world = ranks[group]
            api.init_collective_group(world, rank, backend, group, timeout=config.timeout)
    except BaseException:
        leave_member(registry, config.name)
        raise
    return member


def leave_member(registry: GroupRegistry, name: str) -> bool:
    """Leave weight sync ``name`` (every group of it) if this process is a member."""
    member = registry.weight_syncs.pop(name, None)
    if member is None:
        return False
    member.close()
    for group in member.config.groups:
        if registry.is_initialized(group):
            registry.destroy(group)
    return True


def _in_member(name: str) -> WeightSyncMember:
    member = current_registry().weight_syncs.get(name)
    if member is None:
        raise WeightSyncNotInitializedError(name, f"this actor is no member of weight sync "
                                                  f"'{name}' (it left, or was left out)")
    return member


def _join_in_actor(actor: Any, config: SyncConfig, ranks: Dict[str, Tuple[int, int]],
                   backend: Union[str, Backend]) -> None:
    join_member(config, ranks, backend)


def _leave_in_actor(actor: Any, name: str) -> bool:
    return leave_member(current_registry(), name)


def _settle_in_actor(actor: Any, name: str, timeout: float) -> Dict[str, int]:
    member = _in_member(name)
    with member.lock:
        return member.settle(timeout)


def _grow_in_actor(actor: Any, name: str, added: int, timeout: float) -> None:
    member = _in_member(name)
    with member.lock:
        member.grow(added, timeout)


def _shrink_in_actor(actor: Any, name: str, timeout: float) -> None:
    member = _in_member(name)
    with member.lock:
        member.shrink_out(timeout)


# --------------------------------------------------------------------- on the driver


@dataclass
class DeclaredWeightSync:
    """The driver's record of a weight sync it declared: its member actors by index."""

    name: str
    publishers: List[Any]
    subscribers: Dict[int, Any]
    backend: Union[str, Backend]
    timeout: float
    bucket_bytes: int
    next_index: int = field(default=0)

    def members(self) -> List[Tuple[Any, int, int]]:
        """``(actor, role, index)`` of every member, publishers first."""
        return ([(a, PUBLISHER, i) for i, a in enumerate(self.publishers)]
                + [(a, SUBSCRIBER, i) for i, a in sorted(self.subscribers.items())])


def _check_actors(actors: Any, what: str) -> List[Any]:
    if not isinstance(actors, (list, tuple)) or not actors:
        raise ArgumentValueError(f"{what} must be a non-empty list of Ray actor handles")
    strangers = [a for a in actors if not hasattr(a, "__ray_call__")]
    if strangers:
        raise ArgumentTypeError(f"{what} must be Ray actor handles (made with "
                                f"ActorClass.remote()), not {type(strangers[0]).__name__}: "
                                f"{strangers[0]!r}")
    if len(set(actors)) < len(actors):
        raise ArgumentValueError(f"{what} names an actor twice")
    return list(actors)


def _check_elastic(record: DeclaredWeightSync, what: str) -> None:
    if runs_on_gpu(record.backend):
        raise UnsupportedOperationError(
            f"weight sync '{record.name}' runs on the 'nccl' backend, whose groups cannot "
            f"shrink or grow (CuPy exposes neither ncclCommShrink nor grow), so subscribers "
            f"cannot be {what}: destroy the weight sync and declare it again with the "
            f"subscribers you want")


def _record(name: str) -> DeclaredWeightSync:
    record = current_registry().declared_weight_syncs.get(check_group_name(name))
    if record is None:
        raise WeightSyncNotInitializedError(
            name, f"this driver did not declare weight sync '{name}'; call "
                  f"declare_weight_sync first")
    return record


def _get_all(refs: list, timeout: float, what: str, name: str) -> list:
    import ray
    ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout + DRIVER_MARGIN_S)
    if waiting:
        raise CollectiveTimeoutError(control_group(name), -1, what, -1,
                                     [refs.index(r) for r in waiting], timeout)
    return ray.get(refs)


def declare_weight_sync(publishers: Sequence[Any], subscribers: Sequence[Any],
                        name: str = "weights", backend: Union[str, Backend] = "ray",
                        timeout: Optional[float] = None, *,
                        bucket_bytes: Optional[int] = None) -> None:
    """Form a weight sync from the driver: ``publishers`` send, ``subscribers`` receive.

    Args:
        publishers: the actors that publish (trainer ranks), in publisher-index order.
        subscribers: the actors that receive (inference engines), in subscriber-index order.
        name: the weight sync's name.
        backend: the collectives' backend: ``"ray"`` (CPU tensors) or ``"nccl"`` (GPU
            tensors; the subscribers cannot then be changed, see ``add_weight_subscribers``).
        timeout: the default deadline of every step of a sync, in seconds (default 1800).
        bucket_bytes: the bucket size (default: chosen by the model's size).

    Returns:
        None, once every member has joined.

    Raises:
        ArgumentValueError, ArgumentTypeError: bad actors (none, not handles, one twice or in
            both roles), name, timeout or bucket size.
        GroupAlreadyInitializedError: this driver declared a weight sync of that name.
        CollectiveTimeoutError: members did not join in time (those that did leave again).
    """
    publishers = _check_actors(publishers, "publishers")
    subscribers = _check_actors(subscribers, "subscribers")
    if set(publishers) & set(subscribers):
        raise ArgumentValueError("an actor cannot be both a publisher and a subscriber")
    check_group_name(name)
    timeout = group_timeout(timeout, None)
    bucket = check_bucket_bytes(bucket_bytes)
    registry = current_registry()
    if name in registry.declared_weight_syncs:
        raise GroupAlreadyInitializedError(name)
    record = DeclaredWeightSync(name, publishers, dict(enumerate(subscribers)), backend,
                                timeout, bucket, len(subscribers))
    refs = []
    for actor, role, index in record.members():
        config = SyncConfig(name, role, index, len(publishers), timeout, bucket,
                            runs_on_gpu(backend))
        refs.append(actor.__ray_call__.remote(_join_in_actor, config,
                                              config.fresh_ranks(len(subscribers)), backend))
    try:
        _get_all(refs, timeout, "declare_weight_sync", name)
    except BaseException:
        _leave_all(record, timeout)
        raise
    registry.declared_weight_syncs[name] = record


def _leave_all(record: DeclaredWeightSync, timeout: float) -> None:
    import ray
    refs = [a.__ray_call__.remote(_leave_in_actor, record.name) for a, _, _ in record.members()]
    ray.wait(refs, num_returns=len(refs), timeout=timeout)


def _settle(record: DeclaredWeightSync, timeout: float) -> Dict[str, int]:
    """Settle every member (see the module docstring), drop the dead from the record; the
    groups' sizes."""
    import ray
    members = record.members()
    refs = [a.__ray_call__.remote(_settle_in_actor, record.name, timeout) for a, _, _ in members]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout + DRIVER_MARGIN_S)
    if waiting:
        raise CollectiveTimeoutError(control_group(record.name), -1, "settle", -1,
                                     [refs.index(r) for r in waiting], timeout)
    sizes = None
    for (actor, role, index), ref in zip(members, refs):
        try:
            sizes = ray.get(ref)
        except ray.exceptions.RayActorError:
            if role == PUBLISHER:
                raise WeightSyncError(record.name, "the driver", None,
                                      f"publisher {index} is dead; a weight sync cannot go on "
                                      f"without a publisher: destroy it and declare it again")
            del record.subscribers[index]
    if sizes is None:
        raise WeightSyncError(record.name, "the driver", None, "no member answered")
    return sizes


def add_weight_subscribers(name: str, actors: Sequence[Any],
                           timeout: Optional[float] = None) -> None:
    """Add subscribers to a weight sync this driver declared, between versions; each
    receives the whole model at its first sync.

    Args:
        name: the weight sync.
        actors: the new subscriber actors.
        timeout: seconds the change may take (default: the sync's).

    Returns:
        None.

    Raises:
        ArgumentValueError, ArgumentTypeError: bad actors (one that is a member already).
        WeightSyncNotInitializedError: this driver did not declare ``name``.
        UnsupportedOperationError: the sync runs on the ``nccl`` backend (before anything is
            sent).
        WeightSyncError, CollectiveError: the change failed (a publisher is dead, a member
            did not answer in time).
    """
    record = _record(name)
    _check_elastic(record, "added")
    actors = _check_actors(actors, "actors")
    if set(actors) & {a for a, _, _ in record.members()}:
        raise ArgumentValueError(f"an actor in actors is a member of weight sync '{name}' "
                                 f"already")
    timeout = check_call_timeout(timeout) or record.timeout
    sizes = _settle(record, timeout)
    members = record.members()
    refs = [a.__ray_call__.remote(_grow_in_actor, name, len(actors), timeout)
            for a, _, _ in members]
    publishers = len(record.publishers)
    for i, actor in enumerate(actors):
        config = SyncConfig(name, SUBSCRIBER, record.next_index + i, publishers,
                            record.timeout, record.bucket_bytes)
        ranks = {g: (sizes[g] + i, sizes[g] + len(actors)) for g in config.groups}
        refs.append(actor.__ray_call__.remote(_join_in_actor, config, ranks, record.backend))
    _get_all(refs, timeout, "add_weight_subscribers", name)
    for i, actor in enumerate(actors):
        record.subscribers[record.next_index + i] = actor
    record.next_index += len(actors)


def remove_weight_subscribers(name: str, actors: Sequence[Any],
                              timeout: Optional[float] = None) -> None:
    """Remove subscribers from a weight sync this driver declared, between versions.

    Args:
        name: the weight sync.
        actors: subscriber actors of the sync (at least one subscriber stays).
        timeout: seconds the change may take (default: the sync's).

    Returns:
        None.

    Raises:
        ArgumentValueError, ArgumentTypeError: an actor that is no subscriber, or all of them.
        WeightSyncNotInitializedError: this driver did not declare ``name``.
        UnsupportedOperationError: the sync runs on the ``nccl`` backend (before anything is
            sent).
        WeightSyncError, CollectiveError: the change failed.
    """
    record = _record(name)
    _check_elastic(record, "removed")
    actors = _check_actors(actors, "actors")
    index_of = {a: i for i, a in record.subscribers.items()}
    strangers = [a for a in actors if a not in index_of]
    if strangers:
        raise ArgumentValueError(f"{strangers[0]!r} is not a subscriber of weight sync "
                                 f"'{name}'")
    if len(actors) == len(record.subscribers):
        raise ArgumentValueError(f"removing every subscriber of weight sync '{name}' leaves "
                                 f"none; destroy_weight_sync instead")
    timeout = check_call_timeout(timeout) or record.timeout
    _settle(record, timeout)
    import ray   # after the checks: a refused call needs no Ray
    leaving = [a for a in actors if a in record.subscribers.values()]
    ray.get([a.__ray_call__.remote(_leave_in_actor, name) for a in leaving])
    for actor in actors:
        record.subscribers.pop(index_of[actor], None)
    _get_all([a.__ray_call__.remote(_shrink_in_actor, name, timeout)
              for a, _, _ in record.members()], timeout, "remove_weight_subscribers", name)


def destroy_declared(registry: GroupRegistry, name: str) -> None:
    """Make every member of a declared weight sync leave, and forget it."""
    record = registry.declared_weight_syncs.pop(name)
    _leave_all(record, record.timeout)

