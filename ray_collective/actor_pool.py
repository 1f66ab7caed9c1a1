"""``ray.util.ActorPool`` with a batch call over all its actors (imported only when used)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ray.util import ActorPool as RayActorPool

from .batch import BatchRemoteHandle


class ActorPool(RayActorPool):
    """``ray.util.ActorPool`` that can also call one method on all its actors at once.

    Everything ``ray.util.ActorPool`` does works the same (``map``, ``submit``, ``get_next``,
    ``push``, ``pop_idle``, ...); :meth:`batch_remote` adds the batch call.

    Args:
        actors: the actor handles of the pool.
    """

    def __init__(self, actors: Sequence[Any]):
        super().__init__(list(actors))
        self._members = list(actors)

    def push(self, actor: Any) -> None:
        """Add an actor to the pool (``ray.util.ActorPool.push``); batches include it."""
        super().push(actor)
        self._members.append(actor)

    def pop_idle(self) -> Optional[Any]:
        """Remove an idle actor from the pool (``ray.util.ActorPool.pop_idle``); batches no
        longer include it."""
        actor = super().pop_idle()
        if actor is not None:
            self._members.remove(actor)
        return actor

    def batch_remote(self) -> BatchRemoteHandle:
        """A :class:`~ray_collective.batch.BatchRemoteHandle` over every actor of the pool.

        Returns:
            The handle. Busy and idle actors alike are called; a call queues behind any task
            the pool already gave that actor, and does not change which actors the pool counts
            as idle.

        Raises:
            ValueError: the pool has no actors.
        """
        return BatchRemoteHandle(self._members)
