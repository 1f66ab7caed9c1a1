"""Groups declared from the driver: the members join and leave by code the driver sends them.

``declare_collective_group`` runs the ordinary join inside each actor through Ray's built-in
``__ray_call__`` (so the user's actor class needs no method for it), all actors at once, and
waits for all of them. Destroying the group from the driver runs the ordinary leave the same
way, skipping members that are dead or stay busy, then lets the backend remove what is left.
Works for any backend whose factory can be sent to the actors. A shrink or a grow from the
driver (``elastic``) changes the members; :meth:`ActorGroup.reform` records them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from .backends.base import BackendFactory
from .errors import CollectiveTimeoutError
from .group import DeclaredGroup, current_registry


def join_in_actor(actor, factory: BackendFactory, group_name: str, world_size: int, rank: int,
                  timeout: float) -> int:
    """Run inside a member actor: join the declared group through the process's registry."""
    current_registry().create(group_name, world_size, rank, factory, timeout)
    return rank


def _leave_in_actor(actor, group_name: str) -> bool:
    """Run inside a member actor: destroy its membership of ``group_name`` if it has one."""
    registry = current_registry()
    if not registry.is_initialized(group_name):
        return False
    registry.destroy(group_name)
    return True


class ActorGroup(DeclaredGroup):
    """A group declared from this driver over ``actors``.

    Args:
        name: the group's name.
        actors: the member actors.
        ranks: the rank of each actor.
        clean_up: removes what the backend keeps outside the members, after they left.
        timeout: the group's default deadline, in seconds.
    """

    def __init__(self, name: str, actors: Sequence, ranks: Sequence[int],
                 clean_up: Optional[Callable[[], None]], timeout: float):
        self.name = name
        self.actors = tuple(actors)
        self.members = tuple(actor for _, actor in sorted(zip(ranks, actors),
                                                          key=lambda pair: pair[0]))
        self._clean_up = clean_up
        self.timeout = timeout
        self.lost: Tuple[int, ...] = ()

    def reform(self, members: Sequence, lost: Sequence[int] = ()) -> None:
        """Record the members after a shrink or a grow: ``members[r]`` is rank r, and the
        ranks in ``lost`` died as they joined (the next shrink tells the others)."""
        self.actors = self.members = tuple(members)
        self.lost = tuple(lost)

    def destroy(self, timeout: float) -> None:
        import ray
        refs = [actor.__ray_call__.remote(_leave_in_actor, self.name) for actor in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if self._clean_up is not None:
            self._clean_up()


def declare_in_actors(factory: BackendFactory, actors: Sequence, ranks: Sequence[int],
                      world_size: int, group_name: str, timeout: float) -> ActorGroup:
    """Join ``actors[i]`` as rank ``ranks[i]`` of a group on ``factory``'s backend (driver side).

    Args:
        factory: the backend (its :meth:`~BackendFactory.prepare_declaration` says what the
            members join with).
        actors: the member actors.
        ranks: the rank of each actor.
        world_size: ranks in the group.
        group_name: the group's name.
        timeout: seconds the members may take to join.

    Returns:
        The declared group.

    Raises:
        CollectiveTimeoutError: some actors did not join in time (it names their ranks).
        Exception: an actor's own failure to join (for example a dead actor, or a backend
            that cannot run there); the members that did join leave again.
    """
    import ray
    declaration = factory.prepare_declaration(group_name)
    group = ActorGroup(group_name, actors, ranks, declaration.clean_up, timeout)
    refs = [actor.__ray_call__.remote(join_in_actor, declaration.member_factory, group_name,
                                      world_size, rank, timeout)
            for actor, rank in zip(actors, ranks)]
    ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout + 5)
    try:
        ray.get(ready)
    except BaseException:
        group.destroy(timeout)
        raise
    if waiting:
        late = [ranks[refs.index(ref)] for ref in waiting]
        group.destroy(timeout)
        raise CollectiveTimeoutError(group_name, -1, "declare_collective_group", -1, late,
                                     timeout)
    return group
