"""One rank of the benchmark: a Ray actor that hosts a peer per backend and times blocks.

Timing happens here, inside the rank, with ``time.perf_counter`` around each call: before every
timed call the peer's own barrier lines the ranks up, so each iteration measures one isolated
collective rather than a pipeline of back-to-back ones. The driver takes, per iteration, the
slowest rank's time (``stats.iteration_latencies``).

The same class runs in a Ray actor (``ray``, ``gloo``, ``ray-plain``) and, as a plain object,
in each process of an ``mpiexec`` job (``mpi4py``, see ``mpi_worker``); its answers are plain
dicts and lists so that they cross either channel.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .peers import PEERS, Peer, make_buffers


@dataclass(frozen=True)
class BlockSpec:
    """One block of iterations of one point, as the driver asks every rank to run it.

    Attributes:
        collective: a name of ``collectives.COLLECTIVES``.
        requested_bytes: the size asked for on the command line.
        dtype: numpy dtype name.
        warmup: untimed iterations first (each after a barrier, like the timed ones).
        iterations: timed iterations.
    """

    collective: str
    requested_bytes: int
    dtype: str
    warmup: int
    iterations: int

    def point(self) -> Tuple[str, int, str]:
        """The (collective, size, dtype) this block belongs to: blocks of one point share buffers.

        Returns:
            The key.
        """
        return self.collective, self.requested_bytes, self.dtype


@dataclass(frozen=True)
class _BoundPoint:
    """One point's collective, bound to the buffers it owns."""

    point: Tuple[str, int, str]
    call: Callable[[], Any]


def resident_bytes() -> int:
    """This process's resident memory now, from ``/proc/self/statm`` (0 where there is none).

    Returns:
        Bytes.
    """
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started (``ru_maxrss``, KiB on Linux).

    Returns:
        Bytes.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RankWorker:
    """A rank's actor body (wrapped with ``ray.remote`` by the harness, ``num_cpus=0``).

    Args:
        world_size: number of ranks of this world.
        rank: this actor's rank.
    """

    def __init__(self, world_size: int, rank: int) -> None:
        self._world_size = world_size
        self._rank = rank
        self._peers: Dict[str, Peer] = {}
        self._bound: Dict[str, _BoundPoint] = {}

    def ready(self) -> int:
        """Answer once the actor is up.

        Returns:
            This rank.
        """
        return self._rank

    def setup(self, backend: str, group_name: str, timeout_s: float, hub: Any = None) -> dict:
        """Join ``backend``'s group as this rank.

        Args:
            backend: a name of ``peers.PEERS``.
            group_name: the group's name, unique in the run.
            timeout_s: the library's deadline per call.
            hub: the central actor of a peer that needs one (``ray-plain``), else None.

        Returns:
            ``{"info": the peer's facts for the metadata (library versions),
            "rss_added_bytes": how much this process's resident memory grew while joining}``.

        Raises:
            Exception: whatever the peer raises.
        """
        resident_before = resident_bytes()
        peer = PEERS[backend]()
        info = peer.setup(self._world_size, self._rank, group_name, timeout_s, hub)
        self._peers[backend] = peer
        return {"info": info, "rss_added_bytes": max(0, resident_bytes() - resident_before)}

    def time_block(self, backend: str, block: BlockSpec) -> List[float]:
        """Run ``block.warmup`` untimed then ``block.iterations`` timed collectives.

        Args:
            backend: a backend set up by ``setup``.
            block: what to run.

        Returns:
            ``{"durations": this rank's seconds for each timed iteration,
            "peak_rss_bytes": this process's peak resident memory so far}``.

        Raises:
            KeyError: the backend was not set up here.
            Exception: whatever the peer raises.
        """
        peer = self._peers[backend]
        call = self._bind(backend, peer, block).call
        for _ in range(block.warmup):
            peer.barrier()
            call()
        durations = []
        for _ in range(block.iterations):
            peer.barrier()
            start = time.perf_counter()
            call()
            durations.append(time.perf_counter() - start)
        return {"durations": durations, "peak_rss_bytes": peak_resident_bytes()}

    def teardown(self, backend: str) -> None:
        """Leave ``backend``'s group and drop its buffers.

        Args:
            backend: a backend set up by ``setup``.

        Raises:
            Exception: whatever the peer raises.
        """
        self._bound.pop(backend, None)
        peer = self._peers.pop(backend)
        peer.teardown()

    def _bind(self, backend: str, peer: Peer, block: BlockSpec) -> _BoundPoint:
        """The peer's buffers and bound call for the block's point, made on its first block.

        Only the latest point of each backend is kept, so a sweep of sizes never holds two
        64 MiB layouts per backend.
        """
        bound: Optional[_BoundPoint] = self._bound.get(backend)
        if bound is None or bound.point != block.point():
            self._bound.pop(backend, None)
            buffers = make_buffers(peer, block.collective, block.requested_bytes,
                                   self._world_size, np.dtype(block.dtype))
            bound = _BoundPoint(block.point(), peer.operation(block.collective, buffers))
            self._bound[backend] = bound
        return bound
