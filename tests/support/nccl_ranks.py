"""Run the ranks of an NCCL group as threads of this process, without Ray.

Built on ``ray_collective.testing.run_ranks``: each rank (thread ``rank-<rank>``) gets its own
group registry and joins through an :class:`NcclBackendFactory` that shares one
:class:`InProcessRendezvous` and one NCCL library: the recording stand-in of ``nccl_standin``
in CI, CuPy's real one in the GPU tests.
"""

from typing import Any, Callable, List, Optional, Sequence

from ray_collective.backends.nccl import (InProcessRendezvous, NcclBackendFactory, NcclLibrary,
                                          NcclOptions)
from ray_collective.testing import run_ranks


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

    def factory_of(rank: int) -> NcclBackendFactory:
        return NcclBackendFactory(rendezvous=rendezvous, devices=devices_of(rank),
                                  library=library, options=options)

    return run_ranks(world_size, body, group_name=group_name, timeout=timeout,
                     return_exceptions=True, factory_of=factory_of, join_timeout=join_timeout)


def values_of(results: List[Any]) -> List[Any]:
    """``results`` with every rank's exception raised."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
