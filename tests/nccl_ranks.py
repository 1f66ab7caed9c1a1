"""Run the ranks of an NCCL group as threads of this process, without Ray.

Each rank gets its own group registry and joins through an :class:`NcclBackendFactory` that
shares one :class:`InProcessRendezvous` and one NCCL library: the recording stand-in of
``nccl_standin.py`` in CI, CuPy's real one in the GPU tests.
"""

import threading
import time
from typing import Any, Callable, List, Optional, Sequence

from ray_collective import api
from ray_collective.backends.nccl import (InProcessRendezvous, NcclBackendFactory, NcclLibrary,
                                          NcclOptions)
from ray_collective.group import GroupRegistry, use_registry


def run_nccl_ranks(library: NcclLibrary, world_size: int, body: Callable[[int], Any], *,
                   devices_of: Callable[[int], Sequence[int]] = lambda rank: [rank],
                   group_name: str = "default", timeout: float = 10.0,
                   join_timeout: float = 30.0, options: Optional[NcclOptions] = None,
                   rendezvous: Optional[InProcessRendezvous] = None) -> List[Any]:
    """Run ``body(rank)`` in one thread per rank, each joined to an NCCL group over ``library``.

    Returns each rank's return value, or the exception it raised; a rank still running after
    ``join_timeout`` seconds fails the calling test.
    """
    rendezvous = rendezvous if rendezvous is not None else InProcessRendezvous()

    results: List[Any] = [None] * world_size

    def rank_main(rank: int) -> None:
        with use_registry(GroupRegistry()):
            try:
                factory = NcclBackendFactory(rendezvous=rendezvous, devices=devices_of(rank),
                                             library=library, options=options)
                api.init_collective_group(world_size, rank, factory, group_name,
                                          timeout=timeout)
                try:
                    results[rank] = body(rank)
                finally:
                    api.destroy_collective_group(group_name)
            except BaseException as err:  # handed back to the test
                results[rank] = err

    # Daemon threads, named as the stand-in logs them: a hung rank fails the test without
    # keeping the interpreter alive.
    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True,
                                name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    assert not hung, f"{hung} still running after {join_timeout:g}s"
    return results


def values_of(results: List[Any]) -> List[Any]:
    """``results`` with every rank's exception raised."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
