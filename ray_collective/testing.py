"""Run the ranks of a group as threads of one process, with the real API and no Ray.

    def body(rank):
        x = np.full(4, rank, np.float32)
        col.allreduce(x)
        return x

    results = run_ranks(4, body)

Each rank's thread gets its own group registry and joins the group through the in-process
backend, so ``body`` calls ``ray_collective`` exactly as an actor would. Useful for testing code
that uses collectives, and how this project tests its own API.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Union

from . import api
from .backends.base import BackendFactory
from .backends.local import LocalBackendFactory
from .group import GroupRegistry, use_registry
from .transport.local import LocalFabric


class RanksFailed(Exception):
    """At least one rank raised; ``errors[rank]`` holds each rank's exception or None."""

    def __init__(self, errors: List[Optional[BaseException]]):
        self.errors = errors
        failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
        summary = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, err in failed)
        super().__init__(f"{len(failed)} of {len(errors)} ranks failed: {summary}")


def run_ranks(world_size: int, body: Callable[[int], Any], *, group_name: str = "default",
              timeout: float = 60.0, node_of: Optional[Sequence] = None,
              return_exceptions: bool = False,
              factory_of: Optional[Callable[[int], Union[str, BackendFactory]]] = None,
              join_timeout: Optional[float] = None) -> List[Any]:
    """Run ``body(rank)`` for every rank in its own thread (named ``rank-<rank>``), inside an
    initialized group.

    Args:
        world_size: number of ranks.
        body: called with the rank once the group is joined; its return value is collected.
        group_name: the name the group is joined under.
        timeout: the group's default call deadline in seconds.
        node_of: an optional pretend rank→node map (exercises the node-aware algorithms).
        return_exceptions: put each rank's exception in the result list instead of raising.
        factory_of: the backend each rank joins through (a factory, or the name of a
            registered backend); by default one in-process fabric for all ranks.
        join_timeout: seconds all threads may take together (default ``timeout`` + 30), so a
            hang surfaces as an error, not a stuck test.

    Returns:
        ``body``'s return value per rank (or the exception it raised).

    Raises:
        RanksFailed: some rank raised (unless ``return_exceptions``).
        TimeoutError: a rank thread did not finish within ``join_timeout``.
    """
    if factory_of is None:
        shared = LocalBackendFactory(LocalFabric(world_size, group_name), node_of)

        def factory_of(rank: int) -> BackendFactory:
            return shared
    join_timeout = timeout + 30.0 if join_timeout is None else join_timeout
    results: List[Any] = [None] * world_size
    errors: List[Optional[BaseException]] = [None] * world_size

    def rank_main(rank: int) -> None:
        with use_registry(GroupRegistry()):
            try:
                api.init_collective_group(world_size, rank, factory_of(rank), group_name,
                                          timeout=timeout)
                try:
                    results[rank] = body(rank)
                finally:
                    api.destroy_collective_group(group_name)
            except BaseException as err:  # reported per rank to the caller
                errors[rank] = err

    # Daemon threads: a hung rank fails the caller without keeping the interpreter alive.
    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True, name=f"rank-{rank}")
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    if hung:
        raise TimeoutError(f"{', '.join(hung)} did not finish within {join_timeout:g}s")
    if return_exceptions:
        return [errors[r] if errors[r] is not None else results[r] for r in range(world_size)]
    if any(err is not None for err in errors):
        raise RanksFailed(errors)
    return results
