"""Elastic groups: a shrink goes on without the members that failed, a grow takes new ranks in;
inside the members, and from the driver for a group it declared.

Inside a member, the group's backend agrees with the other members on the group's next
incarnation and joins it (``Membership.shrink``, ``Membership.grow``: the ``ray`` backend's is
``backends/ray/elastic.py``), and the group moves to it (``Group.reincarnate``): new rank and
world size, sequence numbers from zero, no broken state, no known shapes; the old membership is
released. A member the others left out gets ``RankExcludedError``, and its membership is
destroyed.

From the driver, for a group it declared: the same runs inside each member through Ray's
``__ray_call__`` (as ``declare_collective_group`` joins them), and new actors join as the next
ranks with the factory the members' backend gives for them (``Membership.prepare_grow``); the
driver's record of the group (its members, in rank order) follows.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Sequence, Tuple

from .backends.base import BackendFactory, Reformed
from .declared import ActorGroup, join_in_actor
from .errors import (ArgumentValueError, CollectiveError, CollectiveTimeoutError,
                     GroupNotInitializedError, PeerDiedError, RankExcludedError)
from .group import GroupRegistry, current_registry

DRIVER_MARGIN_S = 5.0
"""How much longer than the members' own deadline the driver waits for their answers (their
tasks may start late on a loaded machine)."""


# ---------------------------------------------------------------------- in a member


def shrink_member(registry: GroupRegistry, group_name: str, timeout: Optional[float],
                  failures: Sequence[BaseException] = ()) -> Reformed:
    """Shrink ``group_name`` in this member (see ``api.shrink_collective_group``).

    Args:
        registry: this process's (or thread's) groups.
        group_name: the group; this process must be a member.
        timeout: seconds the shrink may take; None for the group's default.
        failures: what the driver saw (member actors found dead), besides what broke the
            group here.

    Returns:
        This member's place in the new incarnation.

    Raises:
        GroupNotInitializedError: not a member.
        RankExcludedError: the others went on without this member (its membership is gone).
        CollectiveError: the shrink failed (see the backend's ``shrink``); the group is left
            as it was, for another try.
    """
    group = registry.get(group_name)
    deadline = group.timeout if timeout is None else timeout
    try:
        return group.reincarnate(
            lambda membership, cause: membership.shrink([cause, *failures], deadline))
    except RankExcludedError:
        registry.destroy(group_name)
        raise


def grow_member(registry: GroupRegistry, group_name: str, world_size: int,
                timeout: Optional[float]) -> Reformed:
    """Grow ``group_name`` to ``world_size`` ranks in this member (see
    ``api.grow_collective_group``).

    Args:
        registry: this process's (or thread's) groups.
        group_name: the group; this process must be a member.
        world_size: the size once grown (already checked as a world size).
        timeout: seconds the grow may take; None for the group's default.

    Returns:
        This member's place in the new incarnation (its rank is unchanged).

    Raises:
        GroupNotInitializedError: not a member.
        ArgumentValueError: ``world_size`` is not larger than the group, before anything is
            sent.
        CollectiveError: the grow failed; the group is left as it was.
    """
    group = registry.get(group_name)
    if world_size <= group.world_size:
        raise ArgumentValueError(
            f"grow_collective_group: world_size={world_size}, but group '{group_name}' "
            f"(rank {group.rank}) has {group.world_size} ranks already; ask for more")
    deadline = group.timeout if timeout is None else timeout
    return group.reincarnate(lambda membership, _: membership.grow(world_size, deadline))


def _shrink_in_actor(actor: Any, group_name: str, timeout: Optional[float],
                     failures: Sequence[BaseException]) -> Tuple[int, Tuple[int, ...]]:
    """Run inside a member actor: shrink; (its new rank, the old ranks kept)."""
    reformed = shrink_member(current_registry(), group_name, timeout, failures)
    return reformed.rank, reformed.kept


def _prepare_grow_in_actor(actor: Any, group_name: str, world_size: int) -> BackendFactory:
    """Run inside a member actor: decide the grow; the factory the new ranks join with."""
    return current_registry().get(group_name).membership.prepare_grow(world_size)


def _grow_in_actor(actor: Any, group_name: str, world_size: int,
                   timeout: Optional[float]) -> int:
    """Run inside a member actor: grow; the new world size."""
    return grow_member(current_registry(), group_name, world_size, timeout).world_size


# ---------------------------------------------------------------------- from the driver


def shrink_declared(declared: ActorGroup, timeout: Optional[float]) -> Dict[int, int]:
    """Shrink a group this driver declared: every member runs the shrink; those that went on
    become the group's members.

    Args:
        declared: the group.
        timeout: seconds the members' shrink may take; None for the group's default.

    Returns:
        ``{old rank: new rank}`` of the members that went on.

    Raises:
        CollectiveError: a member's shrink failed (the first such error); the group is left as
            it was, for another try.
        PeerDiedError: a member the shrink kept died before it answered (its new rank is
            named): the group went on with it, and must shrink again.
        CollectiveTimeoutError: members that went on did not answer in time (it names them).
    """
    import ray
    limit = declared.timeout if timeout is None else timeout
    members = declared.members
    # Members the driver saw die (the last shrink's): named, so that none waits for them.
    seen = [PeerDiedError(declared.name, -1, "shrink_collective_group", -1, declared.lost,
                          "seen dead by the driver")] if declared.lost else []
    refs = [member.__ray_call__.remote(_shrink_in_actor, declared.name, timeout, seen)
            for member in members]
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending, new_ranks, kept = refs, {}, None
    deadline = time.monotonic() + limit + DRIVER_MARGIN_S
    # The members left out may never answer (a stopped one): wait for those that went on.
    while pending and (kept is None or any(rank_of[ref] in kept for ref in pending)):
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            waiting = [rank_of[ref] for ref in pending if kept is None or rank_of[ref] in kept]
            raise CollectiveTimeoutError(declared.name, -1, "shrink_collective_group", -1,
                                         waiting, limit)
        try:
            new_rank, kept = ray.get(ready[0])
        except (RankExcludedError, GroupNotInitializedError, ray.exceptions.RayActorError):
            continue  # left out, no longer a member, or dead
        new_ranks[rank_of[ready[0]]] = new_rank
    if kept is None:
        raise CollectiveError(f"shrink_collective_group('{declared.name}'): no member of the "
                              f"group went on (every one is dead or was left out)")
    lost = [old for old in kept if old not in new_ranks]
    declared.reform([members[old] for old in kept], [kept.index(old) for old in lost])
    if lost:
        raise PeerDiedError(declared.name, -1, "shrink_collective_group", -1,
                            [kept.index(old) for old in lost],
                            f"ranks {lost} before the shrink: they came to it, then died")
    return {old: new_ranks[old] for old in kept}


def grow_declared(declared: ActorGroup, actors: Sequence[Any],
                  timeout: Optional[float]) -> int:
    """Grow a group this driver declared by ``actors``, which join as its next ranks.

    Args:
        declared: the group.
        actors: the new members, in the order of their new ranks (already checked).
        timeout: seconds the grow may take; None for the group's default.

    Returns:
        The new world size.

    Raises:
        PeerDiedError: rank 0's actor is dead (shrink the group first).
        CollectiveError: a member's or a new actor's part failed (the first error); the group
            is left as it was.
        CollectiveTimeoutError: some did not answer in time (it names their new ranks).
    """
    import ray
    limit = declared.timeout if timeout is None else timeout
    members, name = declared.members, declared.name
    world_size = len(members) + len(actors)
    try:
        factory = ray.get(members[0].__ray_call__.remote(_prepare_grow_in_actor, name,
                                                         world_size), timeout=limit)
    except ray.exceptions.RayActorError:
        raise PeerDiedError(name, -1, "grow_collective_group", -1, [0],
                            "its actor is dead; shrink the group first") from None
    refs = [member.__ray_call__.remote(_grow_in_actor, name, world_size, timeout)
            for member in members]
    refs += [actor.__ray_call__.remote(join_in_actor, factory, name, world_size,
                                       len(members) + i, declared.timeout)
             for i, actor in enumerate(actors)]
    ready, pending = ray.wait(refs, num_returns=len(refs),
                              timeout=limit + DRIVER_MARGIN_S)
    ray.get(ready)  # the first failure, if any, raises here
    if pending:
        raise CollectiveTimeoutError(name, -1, "grow_collective_group", -1,
                                     [refs.index(ref) for ref in pending], limit)
    declared.reform(list(members) + list(actors))
    return world_size
