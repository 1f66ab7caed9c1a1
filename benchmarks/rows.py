"""Summarizing a sweep: one ``Row`` per (collective, world size, size, backend, timing mode),
from the ranks' per-iteration durations (the slowest rank per iteration, its percentiles and
bandwidths, the speed-up against the baseline) and CPU times (per call, the busiest rank and
the median over ranks), the error text of a point that failed, and the
facts about the machine that go with the results.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .collectives import COLLECTIVES, message_layout
from .stats import (algorithm_bandwidth, bus_bandwidth, cpu_per_call, iteration_latencies,
                    percentiles, speedup)
from .sweep import SweepOptions, sweep_points
from .worker import BACK_TO_BACK

MAX_FAILURES_SHOWN = 3
"""Distinct failures named in a row's error; at 64 ranks the rest would drown the table."""


@dataclass(frozen=True)
class Row:
    """One (collective, world size, size, backend) result.

    Attributes:
        collective: the collective.
        world_size: number of ranks.
        nbytes: the size moved (nccl-tests "size", see ``collectives``).
        dtype: numpy dtype name.
        backend: the backend.
        timing: how its calls were timed, of ``worker.TIMINGS``.
        iterations: timed iterations that went into the numbers.
        latencies_s: each timed iteration's latency (slowest rank), in run order.
        p50_s, p75_s, p90_s, p95_s: latency percentiles in seconds (None on error).
        algbw_gbps: algorithm bandwidth at p50, GB/s (10^9 B/s).
        busbw_gbps: bus bandwidth at p50, GB/s.
        speedup: ``baseline p50 / this p50`` at the same timing mode (> 1: faster than the
            baseline), None when there is no baseline or either row failed.
        baseline: the backend ``speedup`` compares with.
        error: why the row has no numbers, or None.
        note: why the row was not measured although nothing failed (a collective the
            backend does not offer), or None.
        peak_rss_bytes: the largest peak resident memory of a process that ran a rank of
            this backend, by the end of this point (in-actor backends share the rank actors,
            so theirs is the actor's peak whatever backend caused it).
        setup_rss_bytes: the most a rank's resident memory grew while joining this backend's
            group (torch's import, for ``gloo``).
        processes: processes the backend started beyond the rank actors (a helper actor,
            ``mpiexec``'s job), counted after its group was formed.
        nodes: the nodes the ranks were spread over, or None (wherever Ray put them).
        cpu_per_call_by_rank_s: each rank's process CPU seconds (user + system) per timed
            call, the mean over the iterations (``worker``), in rank order; empty when not
            measured.
        cpu_per_call_max_s: the largest of them: what a call costs the busiest rank.
        cpu_per_call_median_s: their median over ranks.
    """

    collective: str
    world_size: int
    nbytes: int
    dtype: str
    backend: str
    timing: str = BACK_TO_BACK
    iterations: int = 0
    latencies_s: Tuple[float, ...] = ()
    p50_s: Optional[float] = None
    p75_s: Optional[float] = None
    p90_s: Optional[float] = None
    p95_s: Optional[float] = None
    algbw_gbps: Optional[float] = None
    busbw_gbps: Optional[float] = None
    speedup: Optional[float] = None
    baseline: Optional[str] = None
    error: Optional[str] = None
    note: Optional[str] = None
    peak_rss_bytes: Optional[int] = None
    setup_rss_bytes: Optional[int] = None
    processes: Optional[int] = None
    nodes: Optional[int] = None
    cpu_per_call_by_rank_s: Tuple[float, ...] = ()
    cpu_per_call_max_s: Optional[float] = None
    cpu_per_call_median_s: Optional[float] = None


@dataclass(frozen=True)
class Footprint:
    """What one backend costs the machine at one world size.

    Attributes:
        processes: processes it started beyond the rank actors.
        setup_rss_bytes: the largest growth of a rank's resident memory while joining.
        peak_rss_bytes: the largest peak resident memory of its rank processes so far.
    """

    processes: Optional[int] = None
    setup_rss_bytes: Optional[int] = None
    peak_rss_bytes: Optional[int] = None


@dataclass(frozen=True)
class SweepResult:
    """Everything one run measured.

    Attributes:
        rows: one per (world size, collective, size, backend), in sweep order.
        metadata: date, versions, machine, command and options (JSON-serializable).
        notes: things that went wrong outside the rows (a teardown that failed, ...).
    """

    rows: Tuple[Row, ...]
    metadata: dict
    notes: Tuple[str, ...] = ()


@dataclass(frozen=True)
class CallOutcome:
    """What every rank answered to one call.

    Attributes:
        results: each rank's return value, in rank order (complete only without error).
        error: the first failure, naming the ranks, or None.
        stuck: True when some ranks did not answer in time and may still be inside the call.
    """

    results: Tuple = ()
    error: Optional[str] = None
    stuck: bool = False


def describe_exception(exc: BaseException) -> str:
    """A one-line description of ``exc``, unwrapping Ray's task error to the rank's own.

    Args:
        exc: the exception.

    Returns:
        ``"TypeName: message"`` on one line, at most 300 characters.
    """
    cause = getattr(exc, "cause", None) or exc
    text = " ".join(f"{type(cause).__name__}: {cause}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,2`` or, for a contiguous run, ``ranks 0-63``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def summarize_failures(late: Sequence[int], ranks_by_failure: Dict[str, List[int]], method: str,
                       timeout_s: float) -> str:
    """One error text for a call some ranks failed or did not finish, at most a few causes.

    Args:
        late: the ranks that did not answer in time.
        ranks_by_failure: each distinct failure and the ranks that reported it.
        method: the call.
        timeout_s: its deadline.

    Returns:
        The text.
    """
    failures = [f"{ranks_phrase(late)} did not finish {method} within {timeout_s:g} s"
                ] if late else []
    failures.extend(f"{ranks_phrase(ranks)}: {failure}"
                    for failure, ranks in ranks_by_failure.items())
    shown = failures[:MAX_FAILURES_SHOWN]
    if len(failures) > len(shown):
        shown.append(f"and {len(failures) - len(shown)} more failures")
    return "; ".join(shown)


def summarize_point(options: SweepOptions, collective: str, world_size: int, requested_bytes: int,
                    durations: Dict[str, List[List[float]]], errors: Dict[str, str],
                    notes: Optional[Dict[str, str]] = None,
                    footprints: Optional[Dict[str, Footprint]] = None,
                    timing: str = BACK_TO_BACK,
                    cpu_seconds: Optional[Dict[str, List[float]]] = None) -> List[Row]:
    """The rows of one (collective, world size, size) point in one timing mode, one per backend.

    Args:
        options: the sweep (backends, dtype, baseline).
        collective: the collective.
        world_size: number of ranks.
        requested_bytes: the size asked for.
        durations: per backend that ran, for each rank, its seconds per timed iteration
            (all blocks concatenated, in the same order on every rank).
        errors: per backend that failed, why.
        notes: per backend that did not run the point by design, why.
        footprints: per backend, its processes and memory.
        timing: the timing mode the durations were taken in.
        cpu_seconds: per backend that ran, for each rank, its CPU seconds over all its timed
            calls (the rows of a backend without it carry no CPU figures).

    Returns:
        A row per backend of ``options.backends``, in that order, with the speed-up (against
        the baseline's row of the same mode) filled in.
    """
    nbytes = message_layout(collective, requested_bytes, world_size,
                            np.dtype(options.dtype).itemsize).nbytes
    factor = COLLECTIVES[collective].bus_factor(world_size)
    rows = {}
    notes = notes or {}
    footprints = footprints or {}
    cpu_seconds = cpu_seconds or {}
    for backend in options.backends:
        footprint = footprints.get(backend, Footprint())
        common = dict(collective=collective, world_size=world_size, nbytes=nbytes,
                      dtype=options.dtype, backend=backend, timing=timing,
                      processes=footprint.processes, nodes=options.nodes,
                      setup_rss_bytes=footprint.setup_rss_bytes,
                      peak_rss_bytes=footprint.peak_rss_bytes)
        if backend in notes:
            rows[backend] = Row(**common, note=notes[backend])
            continue
        if backend in errors or backend not in durations:
            rows[backend] = Row(**common, error=errors.get(backend, "did not run"))
            continue
        latencies = iteration_latencies(durations[backend])
        quantiles = percentiles(latencies)
        algbw = algorithm_bandwidth(nbytes, quantiles["p50"])
        rows[backend] = Row(**common, iterations=len(latencies), latencies_s=tuple(latencies),
                            p50_s=quantiles["p50"], p75_s=quantiles["p75"],
                            p90_s=quantiles["p90"], p95_s=quantiles["p95"], algbw_gbps=algbw,
                            busbw_gbps=bus_bandwidth(algbw, factor),
                            **_cpu_fields(cpu_seconds.get(backend), len(latencies)))
    baseline = rows.get(options.baseline) if options.baseline else None
    if baseline is None:
        return list(rows.values())
    return [replace(row, speedup=speedup(baseline.p50_s, row.p50_s), baseline=options.baseline)
            for row in rows.values()]


def _cpu_fields(cpu_seconds_by_rank: Optional[List[float]], iterations: int) -> dict:
    """A row's CPU figures from each rank's CPU seconds over ``iterations`` timed calls."""
    if not cpu_seconds_by_rank:
        return {}
    per_call = cpu_per_call(cpu_seconds_by_rank, iterations)
    return {"cpu_per_call_by_rank_s": tuple(per_call), "cpu_per_call_max_s": max(per_call),
            "cpu_per_call_median_s": float(np.median(per_call))}


def unmeasured_rows(options: SweepOptions, world_size: int, measured: Sequence[Row],
                    reason: str) -> List[Row]:
    """Error rows for the points of ``world_size`` that ``measured`` lacks.

    Args:
        options: the sweep.
        world_size: the world size that could not go on.
        measured: the rows so far.
        reason: why, for every row.

    Returns:
        One error row per timing mode and backend for each missing point, in sweep order.
    """
    done = {(row.collective, row.world_size, row.nbytes) for row in measured}
    itemsize = np.dtype(options.dtype).itemsize
    missing: List[Row] = []
    for collective in options.collectives:
        for requested_bytes in sweep_points(options, collective):
            nbytes = message_layout(collective, requested_bytes, world_size, itemsize).nbytes
            if (collective, world_size, nbytes) not in done:
                for timing in options.timings:
                    missing.extend(summarize_point(
                        options, collective, world_size, requested_bytes, {},
                        dict.fromkeys(options.backends, reason), timing=timing))
    return missing


def machine_metadata() -> dict:
    """Facts about this machine and its software for the report.

    Returns:
        Date (UTC), Python, platform, CPU cores (total and usable), memory and Ray version.
    """
    import ray
    page_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(page_bytes / 2**30, 1),
        "ray": ray.__version__,
        "numpy": np.__version__,
    }
