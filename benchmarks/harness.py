"""The sweep: actors per world size, a group per backend, interleaved blocks, one row per point.

For each world size the harness starts that many rank actors (``num_cpus=0``) and forms one
group per backend inside them, so every in-actor backend runs in the same processes; the
``mpi4py`` peer runs in an ``mpiexec`` job of its own (``mpi_job``), driven through the same
``call`` interface, ``ray-plain`` gets its central actor from the harness and ``torch`` the
address of its rendezvous store. With ``SweepOptions.nodes`` the rank actors are pinned to
the nodes of a local multi-node cluster, or of the ``--ray-address`` cluster, evenly
(``nodes``). For each (collective, size) it splits the timed iterations
into blocks and alternates the backends block by block — each (backend, timing mode) pair is
one unit when several timing modes are asked for — reversing the order every other block
(A B, B A, A B, ...), so that drift of a shared machine — other load, frequency, memory
pressure — falls on every backend alike.

Nothing waits forever: every call to the actors has a deadline. A backend that fails reports
the error in its rows and the sweep goes on; if a failure leaves ranks stuck inside a call, the
world's actors are replaced, the failed backend is skipped for the rest of that world size and
the others carry on. Actors are killed at the end, whatever happened.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .collectives import COLLECTIVES, message_layout
from .nodes import pick_nodes, pinned, rank_nodes, start_local_cluster
from .peers import PEERS, store_address
from .stats import (IterationCounts, algorithm_bandwidth, bus_bandwidth,
                    default_iteration_counts, iteration_latencies, percentiles, speedup)
from .worker import BACK_TO_BACK, BlockSpec, RankWorker

REWARM_ITERATIONS = 1
"""Untimed iterations at the start of every block after the first: the other backend ran in
between and left the caches, and perhaps the scheduler, to itself."""

GRACE_S = 10.0
"""How much longer than ``--timeout`` the driver waits on the actors, so that a library's own
timeout error, which says more, arrives before the driver gives up."""

TEARDOWN_TIMEOUT_S = 30.0
"""The longest leaving a group may take at the end of a world size."""

MAX_FAILURES_SHOWN = 3
"""Distinct failures named in a row's error; at 64 ranks the rest would drown the table."""


Unit = TypeVar("Unit")


class ActorStartError(RuntimeError):
    """The rank actors of a world size did not all come up."""


@dataclass(frozen=True)
class SweepOptions:
    """What to measure; every tuple is one axis of the sweep.

    Attributes:
        collectives: names of ``collectives.COLLECTIVES``.
        backends: names of ``peers.PEERS``, in the order the table shows them.
        world_sizes: rank counts.
        sizes: message sizes in bytes (nccl-tests "size"; barrier ignores them).
        dtype: numpy dtype name of the tensors.
        iterations: timed iterations per point; None: from the size
            (``stats.default_iteration_counts``).
        warmup: untimed iterations per point and backend; None: from the size.
        blocks: how many interleaved blocks the timed iterations are split into.
        baseline: the backend the speed-up is relative to (None: no speed-up column; the CLI
            defaults to the first of ``backends``).
        timeout_s: deadline of each step (actor start, group setup, one block), and the
            libraries' own per-call deadline.
        ray_address: a running Ray cluster to use; None starts a local one.
        timings: the timing modes, of ``worker.TIMINGS``, in the order the rows show them.
        nodes: spread each world's ranks evenly over this many nodes (``nodes.rank_nodes``),
            of a ``ray.cluster_utils.Cluster`` started on this machine or of the
            ``ray_address`` cluster; None: wherever Ray places them (one node, locally).
    """

    collectives: Tuple[str, ...]
    backends: Tuple[str, ...]
    world_sizes: Tuple[int, ...]
    sizes: Tuple[int, ...]
    dtype: str = "float32"
    iterations: Optional[int] = None
    warmup: Optional[int] = None
    blocks: int = 4
    baseline: Optional[str] = None
    timeout_s: float = 300.0
    ray_address: Optional[str] = None
    timings: Tuple[str, ...] = (BACK_TO_BACK,)
    nodes: Optional[int] = None

    def counts(self, nbytes: int) -> IterationCounts:
        """The warm-up and timed iterations for a point of ``nbytes``.

        Args:
            nbytes: the point's size.

        Returns:
            The overrides where given, else the size's defaults.
        """
        defaults = default_iteration_counts(nbytes)
        return IterationCounts(
            warmup=defaults.warmup if self.warmup is None else self.warmup,
            iterations=defaults.iterations if self.iterations is None else self.iterations)


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


def _ranks_phrase(ranks: Sequence[int]) -> str:
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
    failures = [f"{_ranks_phrase(late)} did not finish {method} within {timeout_s:g} s"
                ] if late else []
    failures.extend(f"{_ranks_phrase(ranks)}: {failure}"
                    for failure, ranks in ranks_by_failure.items())
    shown = failures[:MAX_FAILURES_SHOWN]
    if len(failures) > len(shown):
        shown.append(f"and {len(failures) - len(shown)} more failures")
    return "; ".join(shown)


def split_iterations(iterations: int, blocks: int) -> List[int]:
    """Split ``iterations`` into at most ``blocks`` near-equal positive parts.

    Args:
        iterations: timed iterations, >= 1.
        blocks: wanted number of blocks, >= 1.

    Returns:
        The block lengths, larger ones first, summing to ``iterations``.

    Raises:
        ValueError: an argument below 1.
    """
    if iterations < 1 or blocks < 1:
        raise ValueError(f"need iterations >= 1 and blocks >= 1, not {iterations}, {blocks}")
    count = min(iterations, blocks)
    base, extra = divmod(iterations, count)
    return [base + 1 if index < extra else base for index in range(count)]


def block_order(units: Sequence[Unit], block_index: int) -> List[Unit]:
    """The order the units run in during block ``block_index``: reversed every other block.

    Args:
        units: what still runs: backends, or (backend, timing mode) pairs.
        block_index: 0-based block number.

    Returns:
        The order.
    """
    return list(units) if block_index % 2 == 0 else list(reversed(units))


def summarize_point(options: SweepOptions, collective: str, world_size: int, requested_bytes: int,
                    durations: Dict[str, List[List[float]]], errors: Dict[str, str],
                    notes: Optional[Dict[str, str]] = None,
                    footprints: Optional[Dict[str, Footprint]] = None,
                    timing: str = BACK_TO_BACK) -> List[Row]:
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
                            busbw_gbps=bus_bandwidth(algbw, factor))
    baseline = rows.get(options.baseline) if options.baseline else None
    if baseline is None:
        return list(rows.values())
    return [replace(row, speedup=speedup(baseline.p50_s, row.p50_s), baseline=options.baseline)
            for row in rows.values()]


class RankPool:
    """The rank actors of one world size.

    Args:
        world_size: number of actors to start.
        timeout_s: how long they may take to come up.
        node_ids: the nodes to spread the ranks over (``nodes.rank_nodes``: rank r on
            ``node_ids[r // (world_size // len(node_ids))]``), or None: wherever Ray likes.

    Raises:
        ActorStartError: the actors were not all up in time, or not on their nodes (they are
            killed first).
        ValueError: ``world_size`` is not a multiple of the node count.
    """

    def __init__(self, world_size: int, timeout_s: float,
                 node_ids: Optional[Sequence[str]] = None) -> None:
        import ray
        placement = ([node_ids[node] for node in rank_nodes(world_size, len(node_ids))]
                     if node_ids else [None] * world_size)
        actor_class = ray.remote(RankWorker)
        self._actors = [actor_class.options(num_cpus=0, **pinned(node)).remote(world_size, rank)
                        for rank, node in enumerate(placement)]
        outcome = self.call("ready", timeout_s=timeout_s)
        if not outcome.error and node_ids:
            misplaced = [rank for rank, (node, answer) in enumerate(zip(placement,
                                                                        outcome.results))
                         if answer["node_id"] != node]
            if misplaced:
                outcome = replace(outcome, error=f"{_ranks_phrase(misplaced)} did not start "
                                                 f"on the node they were pinned to")
        if outcome.error:
            self.kill()
            raise ActorStartError(f"{world_size} rank actors did not start: {outcome.error}")

    def call(self, method: str, *args, timeout_s: float) -> CallOutcome:
        """Call ``method(*args)`` on every rank at once and wait for all, with a deadline.

        Args:
            method: a method of ``RankWorker``.
            *args: its arguments, the same for every rank.
            timeout_s: the deadline.

        Returns:
            The outcome; never raises for a rank's failure.
        """
        import ray
        refs = [getattr(actor, method).remote(*args) for actor in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        finished = set(ready)
        results = []
        ranks_by_failure: Dict[str, List[int]] = {}
        for rank, ref in enumerate(refs):
            if ref in finished:
                try:
                    results.append(ray.get(ref, timeout=0))
                except Exception as exc:  # a rank's failure becomes the row's error
                    ranks_by_failure.setdefault(describe_exception(exc), []).append(rank)
        late = [rank for rank, ref in enumerate(refs) if ref not in finished]
        error = summarize_failures(late, ranks_by_failure, method, timeout_s)
        return CallOutcome(results=tuple(results), error=error or None, stuck=bool(late))

    def kill(self) -> None:
        """Kill every actor of the pool (without restart); safe to call twice."""
        import ray
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []


def unsupported_reason(backend: str, collective: str, world_size: int) -> Optional[str]:
    """Why ``backend`` does not run ``collective`` at ``world_size``, or None if it does.

    Args:
        backend: a name of ``peers.PEERS``.
        collective: a name of ``collectives.COLLECTIVES``.
        world_size: number of ranks.

    Returns:
        The row's note, or None.
    """
    if collective in PEERS[backend].unsupported:
        return f"not supported by this backend ({backend} has no {collective})"
    if collective == "sendrecv" and world_size < 2:
        return "a send/recv round trip needs 2 ranks"
    return None


def alive_actor_count() -> int:
    """How many actors of this job are alive or on their way, from the GCS's actor table.

    Ray's public state API needs the dashboard, which the harness does not start; the actor
    table is what it reads. Each actor is one process. Actors still being created count: a
    group may start helpers (the ``ray`` backend's post office on each node) without waiting
    for them, and they would otherwise be counted for the next backend set up.

    Returns:
        The count.
    """
    import ray
    from ray._private import state
    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return sum(1 for actor in state.actors(job_id=job_id).values()
               if actor["State"] != "DEAD")


class WorldSession:
    """One world size: its pool, the groups formed in it, and which backends have failed.

    Args:
        options: the sweep.
        world_size: number of ranks.
        notes: where to record problems that belong to no row.
        node_ids: the nodes to spread the ranks over (``RankPool``), or None.
    """

    def __init__(self, options: SweepOptions, world_size: int, notes: List[str],
                 node_ids: Optional[Sequence[str]] = None) -> None:
        self._options = options
        self._node_ids = node_ids
        self._world_size = world_size
        self._notes = notes
        self._failed: Dict[str, str] = {}
        self._generation = 0
        self._pool: Optional[RankPool] = None
        self._mpi_job = None
        self._hubs: Dict[str, object] = {}
        self._footprints: Dict[str, Footprint] = {}
        self.backend_info: Dict[str, dict] = {}

    def start(self) -> None:
        """Start the actors and set up every backend that has not failed.

        Raises:
            ActorStartError: the actors did not start.
        """
        self._generation += 1
        self._pool = RankPool(self._world_size, self._options.timeout_s, self._node_ids)
        for backend in self._options.backends:
            if backend not in self._failed:
                self._setup(backend)

    def close(self) -> None:
        """Leave every group, last joined first (errors become notes), stop the helpers and
        kill the actors.

        Leaving in reverse keeps a group made on top of another's (``gloo``'s torch subgroup
        on the ``torch`` peer's default group) from outliving it.
        """
        if self._pool is None:
            return
        for backend in reversed(self._live_backends()):
            outcome = self._runner(backend).call(
                "teardown", backend, timeout_s=min(TEARDOWN_TIMEOUT_S, self._options.timeout_s))
            if outcome.error:
                self._notes.append(f"{backend} teardown at world size {self._world_size}: "
                                   f"{outcome.error}")
        self._stop_helpers()
        self._pool.kill()
        self._pool = None

    def measure(self, collective: str, requested_bytes: int) -> List[Row]:
        """Time one (collective, size) point on every backend and timing mode, interleaved
        block by block.

        Args:
            collective: the collective.
            requested_bytes: the size asked for.

        Returns:
            One row per timing mode and backend of the sweep, mode by mode.

        Raises:
            ActorStartError: the actors had to be replaced and the new ones did not start.
        """
        counts = self._options.counts(requested_bytes)
        durations: Dict[Tuple[str, str], List[List[float]]] = {}
        errors: Dict[str, str] = {}
        notes = {backend: reason for backend in self._options.backends
                 if (reason := unsupported_reason(backend, collective, self._world_size))}
        blocks = split_iterations(counts.iterations, self._options.blocks)
        for index, iterations in enumerate(blocks):
            running = [(backend, timing) for timing in self._options.timings
                       for backend in self._live_backends()
                       if backend not in errors and backend not in notes]
            for backend, timing in block_order(running, index):
                if backend in errors:
                    continue
                block = BlockSpec(collective=collective, requested_bytes=requested_bytes,
                                  dtype=self._options.dtype, iterations=iterations,
                                  warmup=counts.warmup if index == 0 else REWARM_ITERATIONS,
                                  timing=timing)
                outcome = self._runner(backend).call(
                    "time_block", backend, block, timeout_s=self._options.timeout_s + GRACE_S)
                if outcome.error:
                    errors[backend] = outcome.error
                    if outcome.stuck:
                        self._replace_pool(backend, outcome.error)
                    continue
                per_rank = durations.setdefault((backend, timing),
                                                [[] for _ in outcome.results])
                for rank_durations, answer in zip(per_rank, outcome.results):
                    rank_durations.extend(answer["durations"])
                self._record_peak(backend, max(answer["peak_rss_bytes"]
                                               for answer in outcome.results))
        errors.update({backend: reason for backend, reason in self._failed.items()
                       if backend not in errors})
        rows: List[Row] = []
        for timing in self._options.timings:
            rows.extend(summarize_point(
                self._options, collective, self._world_size, requested_bytes,
                {backend: values for (backend, of_timing), values in durations.items()
                 if of_timing == timing and backend not in errors},
                errors, notes, self._footprints, timing))
        return rows

    def _record_peak(self, backend: str, peak_rss_bytes: int) -> None:
        footprint = self._footprints.get(backend, Footprint())
        self._footprints[backend] = replace(
            footprint, peak_rss_bytes=max(peak_rss_bytes, footprint.peak_rss_bytes or 0))

    def _live_backends(self) -> List[str]:
        return [backend for backend in self._options.backends if backend not in self._failed]

    def _runner(self, backend: str):
        """Where ``backend``'s ranks run: the ``mpiexec`` job or the rank actors."""
        return self._mpi_job if PEERS[backend].runs_in_mpiexec else self._pool

    def _setup(self, backend: str) -> None:
        from .mpi_job import MpiJob
        from .plain_ray import PlainRayHub
        peer_class = PEERS[backend]
        group_name = f"bench-{backend}-w{self._world_size}-g{self._generation}"
        actors_before = alive_actor_count()
        shared = None
        try:
            if peer_class.runs_in_mpiexec:
                self._stop_mpi_job()
                self._mpi_job = MpiJob(self._world_size, self._options.timeout_s)
            if peer_class.needs_hub:
                import ray
                head = self._node_ids[0] if self._node_ids else None
                shared = ray.remote(PlainRayHub).options(num_cpus=0, **pinned(head)).remote(
                    self._world_size, self._options.timeout_s)
                self._hubs[backend] = shared
            if peer_class.needs_store_address:
                shared = store_address()
        except Exception as exc:  # a backend that cannot start fails its rows, not the sweep
            self._failed[backend] = f"could not start: {describe_exception(exc)}"
            return
        outcome = self._runner(backend).call("setup", backend, group_name,
                                             self._options.timeout_s, shared,
                                             timeout_s=self._options.timeout_s + GRACE_S)
        if outcome.error:
            self._failed[backend] = f"group setup failed: {outcome.error}"
            if outcome.stuck:
                self._replace_pool(backend, outcome.error)
            return
        processes = (self._mpi_job.process_count() if peer_class.runs_in_mpiexec
                     else alive_actor_count() - actors_before)
        self._footprints[backend] = Footprint(
            processes=processes,
            setup_rss_bytes=max(answer["rss_added_bytes"] for answer in outcome.results))
        self.backend_info[backend] = outcome.results[0]["info"]

    def _stop_mpi_job(self) -> None:
        if self._mpi_job is not None:
            self._mpi_job.kill()
            self._mpi_job = None

    def _stop_helpers(self) -> None:
        """Stop the ``mpiexec`` job and kill the hub actors, whatever state they are in."""
        import ray
        self._stop_mpi_job()
        for hub in self._hubs.values():
            ray.kill(hub, no_restart=True)
        self._hubs = {}

    def _replace_pool(self, backend: str, reason: str) -> None:
        """Ranks are stuck in ``backend``: give it up for this world size.

        An ``mpiexec`` job is simply killed; stuck rank actors are replaced by fresh ones
        and every other backend set up again in them.
        """
        self._failed[backend] = (f"skipped for the rest of world size {self._world_size} after: "
                                 f"{reason}")
        if PEERS[backend].runs_in_mpiexec:
            self._notes.append(f"world size {self._world_size}: stopped the mpiexec job "
                               f"because it did not answer ({reason})")
            self._stop_mpi_job()
            return
        self._notes.append(f"world size {self._world_size}: restarted the actors because "
                           f"{backend} left ranks stuck ({reason})")
        self._stop_helpers()
        self._pool.kill()
        self.start()


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


def sweep_points(options: SweepOptions, collective: str) -> Tuple[int, ...]:
    """The sizes swept for ``collective``: barrier moves nothing, so it has one point of 0 B.

    Args:
        options: the sweep.
        collective: the collective.

    Returns:
        The requested sizes.
    """
    return options.sizes if COLLECTIVES[collective].has_payload else (0,)


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


def count_points(options: SweepOptions) -> int:
    """How many (world size, collective, size) points the sweep measures.

    Args:
        options: the sweep.

    Returns:
        The count.
    """
    return len(options.world_sizes) * sum(len(sweep_points(options, collective))
                                          for collective in options.collectives)


def run_sweep(options: SweepOptions, command: str,
              on_rows: Callable[[List[Row]], None] = lambda rows: None) -> SweepResult:
    """Run the whole sweep; starts (and at the end shuts down) Ray unless it is running, and
    with ``options.nodes`` and no ``options.ray_address`` a local cluster of that many nodes.

    Args:
        options: what to measure.
        command: the command line, for the metadata.
        on_rows: called with each point's rows as soon as they are measured (progress).

    Returns:
        The rows, metadata and notes.

    Raises:
        RuntimeError: the cluster has fewer live nodes than ``options.nodes``.
    """
    import ray
    started_ray = not ray.is_initialized()
    cluster = None
    if started_ray:
        address = options.ray_address or "local"
        if options.nodes is not None and options.ray_address is None:
            cluster = start_local_cluster(options.nodes)
            address = cluster.address
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    rows: List[Row] = []
    notes: List[str] = []
    backend_info: Dict[str, dict] = {}
    try:
        placement = None if options.nodes is None else pick_nodes(options.nodes)
        metadata = {**machine_metadata(), "command": command, "options": asdict(options),
                    "node_ids": placement, "local_cluster": cluster is not None}
        for world_size in options.world_sizes:
            session = WorldSession(options, world_size, notes, placement)
            try:
                session.start()
                for collective in options.collectives:
                    for requested_bytes in sweep_points(options, collective):
                        point_rows = session.measure(collective, requested_bytes)
                        rows.extend(point_rows)
                        on_rows(point_rows)
            except ActorStartError as exc:
                notes.append(f"world size {world_size} stopped: {exc}")
                rows.extend(unmeasured_rows(options, world_size, rows, str(exc)))
            finally:
                session.close()
                backend_info.update(session.backend_info)
    finally:
        if started_ray:
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    metadata["backend_versions"] = backend_info
    return SweepResult(rows=tuple(rows), metadata=metadata, notes=tuple(notes))
