"""One rank of the benchmark: a Ray actor that hosts a peer per backend and times blocks.

Timing happens here, inside the rank, with ``time.perf_counter``, in one of two ways:

- ``back-to-back`` (``BACK_TO_BACK``): one barrier (the peer's own) at the start of the block,
  then the warm-up and timed calls in a loop with nothing between them, the way nccl-tests
  times and training loops call. An iteration's time on a rank is the interval between the
  completions of two consecutive calls (the first one starts when the last warm-up call
  returns), so the intervals add up to the loop's wall time and a rank that left the previous
  call early waits for the others inside the next one.
- ``barrier`` (``BARRIER``): the peer's barrier before every call, warm-up and timed alike,
  and ``perf_counter`` around the call alone: one isolated collective started together.
- ``paced`` (``PACED``): one barrier at the start of the block, then ``PACE_S`` of sleep
  before every call, warm-up and timed alike, and ``perf_counter`` around the call alone: a
  training step's compute between collectives, the rank idle meanwhile.

The driver takes, per iteration, the slowest rank's time (``stats.iteration_latencies``).

Beside the wall time each rank reads its own process's CPU time (``time.process_time``: user
plus system, every thread of the process) over exactly the timed region of either mode — the
timed loop back to back, each call alone with barriers — so a row can say how much of a core
one call costs a rank (``stats.cpu_per_call``). A rank that spins while it waits shows CPU time
close to its latency; one that sleeps in the kernel shows little. It counts the rank's process
only: Ray's own threads in an actor are in it, a helper process (``ray-plain``'s central
actor) is not.

The same class runs in a Ray actor (``ray``, ``torch``, ``gloo``, ``ray-plain``) and, as a
plain object, in each process of an ``mpiexec`` job (``mpi4py``, see ``mpi_worker``); its
answers are plain dicts and lists so that they cross either channel.
"""

from __future__ import annotations

import os
import resource
import time
from time import monotonic
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .peers import PEERS, Peer, make_buffers

BACK_TO_BACK = "back-to-back"
"""Timing mode: one barrier per block, then the calls in a loop, completion to completion."""

BARRIER = "barrier"
"""Timing mode: the peer's barrier before every call, which alone is timed."""

SPREAD_S = 0.05
"""How long every rank computes before a block's barrier, so that the kernel spreads the ranks
over the cores again. A backend whose ranks wait blocking on each other (torch's Gloo, in the
same actors) can leave two ranks' threads on one core: the kernel places a woken thread beside
its waker. The next block's spinning ranks then took turns on that core for several
milliseconds: allreduce 8 B at 2 ranks 9-15 us a call instead of 2.6 until the load balancer
moved one (2026-11-26, `/proc/thread-self/stat` sampled in both ranks), in 2-5 of every 8
blocks that followed a Gloo block. Measured again after this spread: see the results page."""


def spread_over_cores() -> None:
    """Keep this rank's thread busy for ``SPREAD_S`` (every rank does it at once), on the real
    clock (``monotonic``, imported apart: the timing tests replace this module's ``time``)."""
    end = monotonic() + SPREAD_S
    while monotonic() < end:
        pass

PACED = "paced"
"""Timing mode: one barrier per block, then ``PACE_S`` of sleep before every call, which alone
is timed."""

PACE_S = 0.005
"""The sleep before every call of a ``paced`` block."""

TIMINGS = (BACK_TO_BACK, BARRIER, PACED)
"""Every timing mode, the headline first."""


@dataclass(frozen=True)
class BlockSpec:
    """One block of iterations of one point, as the driver asks every rank to run it.

    Attributes:
        collective: a name of ``collectives.COLLECTIVES``.
        requested_bytes: the size asked for on the command line.
        dtype: numpy dtype name.
        warmup: untimed iterations first (timed the same way, their times dropped).
        iterations: timed iterations.
        timing: ``BACK_TO_BACK`` or ``BARRIER`` (see the module's docstring).
    """

    collective: str
    requested_bytes: int
    dtype: str
    warmup: int
    iterations: int
    timing: str = BACK_TO_BACK

    def point(self) -> Tuple[str, int, str]:
        """The (collective, size, dtype) this block belongs to: blocks of one point share buffers.

        Returns:
            The key.
        """
        return self.collective, self.requested_bytes, self.dtype


@dataclass(frozen=True)
class TimedCalls:
    """What a rank measured over one block's timed calls.

    Attributes:
        durations: seconds of each timed iteration (see the module's docstring).
        cpu_s: this process's CPU seconds (user + system) over the same timed region.
    """

    durations: List[float]
    cpu_s: float


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


def time_back_to_back(barrier: Callable[[], Any], call: Callable[[], Any], warmup: int,
                      iterations: int) -> TimedCalls:
    """One barrier, then ``warmup`` + ``iterations`` calls in a loop; completion to completion.

    Args:
        barrier: the peer's barrier.
        call: one collective.
        warmup: calls whose times are dropped.
        iterations: calls timed.

    Returns:
        For each timed call, the seconds from the previous call's return (the last warm-up
        call's, or the barrier's without warm-up) to its own; and the CPU seconds from that
        first start to the last call's return.
    """
    spread_over_cores()
    barrier()
    for _ in range(warmup):
        call()
    cpu_start = time.process_time()
    stamps = [time.perf_counter()]
    for _ in range(iterations):
        call()
        stamps.append(time.perf_counter())
    cpu_s = time.process_time() - cpu_start
    return TimedCalls([end - start for start, end in zip(stamps, stamps[1:])], cpu_s)


def time_with_barriers(barrier: Callable[[], Any], call: Callable[[], Any], warmup: int,
                       iterations: int) -> TimedCalls:
    """The peer's barrier before every call, then ``perf_counter`` around the call alone.

    Args:
        barrier: the peer's barrier.
        call: one collective.
        warmup: calls (each after a barrier) whose times are dropped.
        iterations: calls timed.

    Returns:
        The seconds of each timed call, and the CPU seconds of the timed calls alone (the
        barriers left out).
    """
    spread_over_cores()
    for _ in range(warmup):
        barrier()
        call()
    durations = []
    cpu_s = 0.0
    for _ in range(iterations):
        barrier()
        cpu_start = time.process_time()
        start = time.perf_counter()
        call()
        durations.append(time.perf_counter() - start)
        cpu_s += time.process_time() - cpu_start
    return TimedCalls(durations, cpu_s)


def _pause() -> None:
    """A ``paced`` block's sleep before each call."""
    time.sleep(PACE_S)


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

    def ready(self) -> dict:
        """Answer once the actor is up.

        Returns:
            ``{"rank": this rank, "node_id": the Ray node it runs on (hex)}``.
        """
        import ray
        return {"rank": self._rank, "node_id": ray.get_runtime_context().get_node_id()}

    def setup(self, backend: str, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """Join ``backend``'s group as this rank.

        Args:
            backend: a name of ``peers.PEERS``.
            group_name: the group's name, unique in the run.
            timeout_s: the library's deadline per call.
            shared: what the driver made for the whole group (``Peer.setup``), else None.

        Returns:
            ``{"info": the peer's facts for the metadata (library versions),
            "rss_added_bytes": how much this process's resident memory grew while joining}``.

        Raises:
            Exception: whatever the peer raises.
        """
        resident_before = resident_bytes()
        peer = PEERS[backend]()
        info = peer.setup(self._world_size, self._rank, group_name, timeout_s, shared)
        self._peers[backend] = peer
        return {"info": info, "rss_added_bytes": max(0, resident_bytes() - resident_before)}

    def time_block(self, backend: str, block: BlockSpec) -> dict:
        """Run ``block.warmup`` untimed then ``block.iterations`` timed collectives.

        Args:
            backend: a backend set up by ``setup``.
            block: what to run, and how to time it (``block.timing``).

        Returns:
            ``{"durations": this rank's seconds for each timed iteration,
            "cpu_s": this process's CPU seconds over the timed calls,
            "peak_rss_bytes": this process's peak resident memory so far}``.

        Raises:
            KeyError: the backend was not set up here.
            ValueError: an unknown timing mode.
            Exception: whatever the peer raises.
        """
        if block.timing not in TIMINGS:
            raise ValueError(f"unknown timing {block.timing!r}, expected one of {TIMINGS}")
        peer = self._peers[backend]
        call = self._bind(backend, peer, block).call
        if block.timing == PACED:
            peer.barrier()
            timed = time_with_barriers(_pause, call, block.warmup, block.iterations)
        else:
            timer = time_with_barriers if block.timing == BARRIER else time_back_to_back
            timed = timer(peer.barrier, call, block.warmup, block.iterations)
        return {"durations": timed.durations, "cpu_s": timed.cpu_s,
                "peak_rss_bytes": peak_resident_bytes()}

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
