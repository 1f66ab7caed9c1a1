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

What a sweep measures and the blocks of a point are planned in ``sweep``; the rows are
summarized in ``rows``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .nodes import pick_nodes, pinned, rank_nodes, start_local_cluster
from .peers import PEERS, store_address
from .rows import (CallOutcome, Footprint, Row, SweepResult, describe_exception, machine_metadata,
                   ranks_phrase, summarize_failures, summarize_point, unmeasured_rows)
from .sweep import SweepOptions, block_order, split_iterations, sweep_points
from .worker import BlockSpec, RankWorker

REWARM_ITERATIONS = 1
"""Untimed iterations at the start of every block after the first: the other backend ran in
between and left the caches, and perhaps the scheduler, to itself."""

GRACE_S = 10.0
"""How much longer than ``--timeout`` the driver waits on the actors, so that a library's own
timeout error, which says more, arrives before the driver gives up."""

TEARDOWN_TIMEOUT_S = 30.0
"""The longest leaving a group may take at the end of a world size."""


class ActorStartError(RuntimeError):
    """The rank actors of a world size did not all come up."""


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
                outcome = replace(outcome, error=f"{ranks_phrase(misplaced)} did not start "
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
        cpu_seconds: Dict[Tuple[str, str], List[float]] = {}
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
                cpu_seconds[(backend, timing)] = [
                    total + answer["cpu_s"] for total, answer in zip(
                        cpu_seconds.get((backend, timing), [0.0] * len(outcome.results)),
                        outcome.results)]
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
                errors, notes, self._footprints, timing,
                {backend: values for (backend, of_timing), values in cpu_seconds.items()
                 if of_timing == timing}))
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
