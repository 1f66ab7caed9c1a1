"""The numbers of a row: per-iteration latency across ranks, percentiles, bandwidths and the
CPU time a call costs each rank.

Bandwidths follow nccl-tests: ``algbw = size / time`` and ``busbw = algbw * factor`` with the
collective's factor (``collectives.CollectiveSpec.bus_factor``), in GB/s of 10^9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

PERCENTILES = (50, 75, 90, 95)
"""The latency percentiles every row carries."""


@dataclass(frozen=True)
class IterationCounts:
    """How many untimed and timed iterations one (backend, collective, size) point runs.

    Attributes:
        warmup: untimed iterations before the first timed block.
        iterations: timed iterations, spread over the interleaved blocks.
    """

    warmup: int
    iterations: int


# (largest size in bytes, counts): small messages are noisy and cheap, so they get many
# iterations; a 64 MiB collective on two cores takes a few hundred milliseconds, so it gets
# fewer. Large messages keep 5 warm-up iterations: a backend's shared-memory buffers grow to
# their steady size during the first calls, and on this VM the page faults of fresh memory
# made the first two or three 64 MiB calls up to three times slower than the rest.
#
# Up to 1 KiB a call takes a few microseconds here, so 200 iterations in 4 blocks made blocks
# of 150 us: one block run while the previous backend's threads were still winding down took
# the whole p50 with it (allreduce 8 B at 2 ranks, 2026-11-26: blocks of 2.8, 14.0, 12.6 and
# 3.1 us). 2000 iterations make such a burst a minority of every block.
_COUNTS_BY_SIZE = (
    (1024, IterationCounts(warmup=100, iterations=2000)),
    (64 * 1024, IterationCounts(warmup=20, iterations=200)),
    (1024 * 1024, IterationCounts(warmup=10, iterations=50)),
    (16 * 1024 * 1024, IterationCounts(warmup=5, iterations=30)),
)
_COUNTS_LARGE = IterationCounts(warmup=5, iterations=20)


def default_iteration_counts(nbytes: int) -> IterationCounts:
    """The warm-up and timed iteration counts for a message of ``nbytes``.

    Args:
        nbytes: the message size of the point.

    Returns:
        2000 timed iterations (100 warm-up) up to 1 KiB, 200 (20) up to 64 KiB, 50 (10) up
        to 1 MiB, 30 (5) up to 16 MiB, 20 (5) above.
    """
    for largest, counts in _COUNTS_BY_SIZE:
        if nbytes <= largest:
            return counts
    return _COUNTS_LARGE


def iteration_latencies(durations_by_rank: Sequence[Sequence[float]]) -> list:
    """The latency of each iteration: the slowest rank's time for it.

    A collective is complete only when every rank has its result, and a root that returns as
    soon as its sends are queued would flatter a backend timed on one rank alone.

    Args:
        durations_by_rank: for each rank, its seconds for each iteration, same length.

    Returns:
        For each iteration, the maximum over ranks, in seconds.

    Raises:
        ValueError: no ranks, or ranks that timed different numbers of iterations.
    """
    lengths = {len(durations) for durations in durations_by_rank}
    if len(lengths) != 1:
        raise ValueError(f"every rank must time the same iterations, got lengths {lengths}")
    return np.max(np.asarray(durations_by_rank, dtype=float), axis=0).tolist()


def cpu_per_call(cpu_seconds_by_rank: Sequence[float], iterations: int) -> List[float]:
    """Each rank's CPU time per call: its process's CPU seconds over the timed calls divided
    by their number (the mean over the iterations).

    Args:
        cpu_seconds_by_rank: for each rank, its CPU seconds over all its timed calls.
        iterations: how many calls each rank timed, > 0.

    Returns:
        Seconds of CPU per call, one per rank, in rank order.

    Raises:
        ValueError: no ranks, no iterations, or a negative CPU time.
    """
    if not cpu_seconds_by_rank or iterations <= 0:
        raise ValueError(f"need ranks and iterations, got {len(cpu_seconds_by_rank)} ranks "
                         f"and {iterations} iterations")
    if min(cpu_seconds_by_rank) < 0:
        raise ValueError(f"CPU time cannot be negative: {list(cpu_seconds_by_rank)}")
    return [seconds / iterations for seconds in cpu_seconds_by_rank]


def percentiles(latencies: Sequence[float]) -> dict:
    """The ``PERCENTILES`` of ``latencies`` (linear interpolation, as numpy's default).

    Args:
        latencies: seconds, at least one.

    Returns:
        ``{"p50": ..., "p75": ..., "p90": ..., "p95": ...}`` in seconds.

    Raises:
        ValueError: no latencies.
    """
    if len(latencies) == 0:
        raise ValueError("no latencies to summarize")
    values = np.percentile(np.asarray(latencies, dtype=float), PERCENTILES)
    return {f"p{q}": float(value) for q, value in zip(PERCENTILES, values)}


def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: the message size over the time, in GB/s (10^9 B/s).

    Args:
        nbytes: the row's size (see ``collectives``).
        seconds: the latency, > 0.

    Returns:
        GB/s.

    Raises:
        ValueError: a latency that is not positive.
    """
    if seconds <= 0:
        raise ValueError(f"latency must be positive, not {seconds}")
    return nbytes / seconds / 1e9


def bus_bandwidth(algbw: float, bus_factor: float) -> float:
    """nccl-tests' bus bandwidth: ``algbw`` times the collective's factor.

    Args:
        algbw: algorithm bandwidth, GB/s.
        bus_factor: the collective's factor at the row's world size.

    Returns:
        GB/s.
    """
    return algbw * bus_factor


def speedup(baseline_seconds: Optional[float], seconds: Optional[float]) -> Optional[float]:
    """How many times faster a row is than the baseline: ``baseline p50 / row p50``.

    The same number is the bus-bandwidth ratio ``row busbw / baseline busbw``, since both rows
    move the same bytes.

    Args:
        baseline_seconds: the baseline backend's p50 at the same point, or None.
        seconds: this row's p50, or None.

    Returns:
        The ratio (> 1: faster than the baseline), or None if either is missing.
    """
    if baseline_seconds is None or seconds is None or seconds <= 0:
        return None
    return baseline_seconds / seconds
