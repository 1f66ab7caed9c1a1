"""Real groups of up to 400 ranks on one machine: join, collectives, memory, and a failure drill.

``python -m benchmarks.scale_real --ranks 64,128,256,400`` starts a one-node Ray with none of
the processes it has no use for (``start_one_node``: no log monitor, autoscaler monitor or
prestarted worker; docs/running-at-scale.md), or, with ``--nodes K``, a
``ray.cluster_utils.Cluster`` of K nodes on this machine, ranks spread round robin, and, for
each N in turn, adds rank actors (``num_cpus=0``, in waves, with a progress line) until there
are N, so that each N is measured beside no idle extra actor and what was measured is kept if
a larger N does not fit. At each N:

- the library is imported in every new actor first, timed apart from the join;
- **join and destroy**: every rank calls ``init_collective_group`` (imperative), timed on the
  driver from the first task submitted to the last answer, and inside each rank; then
  ``destroy_collective_group`` in every rank; then the same ranks declared as a group from the
  driver (``declare_collective_group``) and destroyed from it;
- **collectives**, back to back (one barrier, then the loop; per iteration the slowest rank):
  allreduce 8 B, 64 KiB and 1 MiB, broadcast 1 MiB, allgather 64 KiB, barrier (``--small``:
  the small ones only); before each, one call on rank-dependent data whose result every rank
  compares with numpy's;
- **memory and descriptors**: each rank's resident memory around the import and the join, and
  its open descriptors after the points; the machine's shared memory (``Shmem`` of
  ``/proc/meminfo``) and process count; the CPU that the idle actors use;
- **leftovers**: after every destroy, the group's keys in Ray's key-value store and the files
  and directories that appeared under the group directories.

With ``--drill``, at the largest N: every rank loops on allreduce, the driver SIGKILLs one of
them, and every survivor must raise ``PeerDiedError`` naming it; the survivors then destroy
their memberships, rebuild a group of N-1 ranks, check one allreduce and destroy it.

``make bench-400`` runs the two runs of the results page and draws its table and plot
(``--from-json``). Gloo (``ray.util.collective`` or ``torch.distributed``) is not run here: its
ranks load torch, which this machine cannot hold 400 times (``benchmarks/README.md``,
"Known limits").
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cli import module_parser
from .nodes import pick_nodes, pinned, start_local_cluster
from .plots import Line, draw
from .report import format_size
from .stats import iteration_latencies, percentiles
from .scale_rank import ScaleRank
from .worker import BACK_TO_BACK

POINTS = (("allreduce", 8), ("allreduce", 64 * 1024), ("allreduce", 2**20),
          ("broadcast", 2**20), ("allgather", 64 * 1024), ("barrier", 0))
"""(collective, bytes per rank) measured at every N."""

SMALL_POINTS = (("allreduce", 8), ("allgather", 64 * 1024), ("barrier", 0))
"""The points of ``--small``: no message above 164 B per rank at 400 ranks (the large points'
shared memory, about 4 MB per rank, does not fit beside 400 idle Ray actors here)."""

WAVE = 25
"""Actors created at once: Ray starts worker processes a few at a time on 2 cores anyway, and
a wave that waits for its actors keeps the progress line honest."""

RANK_OPTIONS = {"num_cpus": 0, "max_restarts": 0}
"""Rank actors take no CPU (400 of them share 2 cores) and never restart (a killed rank stays
dead, as the drill needs). They run one task at a time: an actor that is not inside a task
(or a threaded or async actor, whose main thread never is) wakes 100 times a second for Ray's
signal check (``CoreWorker.CheckSignal``), which took 0.34 of the 2 cores for 48 actors
holding a task with ``max_concurrency=2`` against 0.06 with the default."""


RAY_ENVIRONMENT = {"RAY_memory_usage_threshold": "0.98"}
"""Set for Ray's processes unless already set. Ray's memory monitor kills workers above 95 %
of the machine's memory by default; 400 ranks here sit at about 96 % (23.5 GiB), so the run
allows 98 % (docs/running-at-scale.md)."""

ONE_NODE_HEAD = {"include_dashboard": False, "include_log_monitor": False, "no_monitor": True,
                 "_system_config": {"worker_register_timeout_seconds": 600,
                                    "enable_worker_prestart": False,
                                    "prestart_worker_first_driver": False}}
"""The one node's Ray: what ``ray start --head --include-dashboard=false
--include-log-monitor=false --no-monitor`` starts, without the two processes a fixed one-node
run with ``log_to_driver=False`` has no use for, the log monitor and the autoscaler's monitor
(44 and 47 MiB of PSS; ``python -m benchmarks.scale_memory``, docs/running-at-scale.md), and
without prestarted workers: they start before the job's ``runtime_env``
(``WORKER_RUNTIME_ENV``) is known, so no rank can use them, and two of them stayed idle
through the run (85 MiB). Workers have 600 s to register, since hundreds start at once on 2
cores."""


WORKER_RUNTIME_ENV = {"env_vars": {"PYTHONOPTIMIZE": "2"}}
"""The job's workers (the rank actors) run Python with ``-OO``: without docstrings, 4.2 MiB less
private memory per rank (55.0 against 50.8 MiB joined, 32 actors; docs/running-at-scale.md),
1.6 GiB at 400 ranks. Only the workers: Ray's own Python processes (its dashboard) fail to
start with ``-OO``, and the ranks' code here needs neither ``assert`` nor docstrings."""


def start_one_node() -> Any:
    """A one-node ``ray.cluster_utils.Cluster`` of this machine's cores, started with
    ``ONE_NODE_HEAD`` (``shutdown()`` it at the end)."""
    from ray.cluster_utils import Cluster
    return Cluster(initialize_head=True,
                   head_node_args={"num_cpus": os.cpu_count(), **ONE_NODE_HEAD})


def _meminfo() -> Dict[str, int]:
    """``/proc/meminfo``, each field in bytes."""
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields


def machine_shmem_bytes() -> int:
    """``Shmem`` of ``/proc/meminfo``: shared memory in use on the machine, in bytes."""
    return _meminfo()["Shmem"]


def process_count() -> int:
    """Processes on the machine now."""
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def _latency_row(collective: str, nbytes: int, durations: Sequence[Sequence[float]]) -> dict:
    latencies = iteration_latencies(durations)
    summary = percentiles(latencies)
    return {"collective": collective, "bytes": nbytes, "iterations": len(latencies),
            "p50_s": summary["p50"], "p95_s": summary["p95"]}


def group_dir_entries() -> set:
    """Every file and directory under this machine's group directories now."""
    from ray_collective.backends.ray.private_dirs import session_directory
    from ray_collective.backends.ray.environment import runtime as _runtime
    entries = set()
    for root, dirs, files in os.walk(session_directory(_runtime()[2]) or os.devnull):
        entries.update(os.path.join(root, name) for name in dirs + files)
    return entries


def _leftovers(group_name: str, entries_before: set) -> dict:
    """What a destroyed group left: its keys in the store, and the files and directories that
    appeared under the group directories since ``entries_before``."""
    from ray.experimental import internal_kv

    from ray_collective.backends.ray import rendezvous
    from ray_collective.backends.key_value import NAMESPACE
    from ray_collective.backends.ray.environment import runtime as _runtime
    prefix = rendezvous.group_prefix(_runtime()[0], group_name)
    keys = internal_kv._internal_kv_list(prefix.encode(), namespace=NAMESPACE)
    return {"kv_keys": len(keys), "group_dir_entries": len(group_dir_entries() - entries_before)}


def _median(values: Sequence[float]) -> float:
    return float(np.median(values))


class Run:
    """The driver's side: the actors, and one method per measurement."""

    def __init__(self, ray, actors: List[Any], pids: List[int], timeout_s: float,
                 warmup: int, iterations: int, points: Sequence[Tuple[str, int]] = POINTS,
                 nodes: int = 1):
        self.ray, self.actors, self.pids = ray, actors, pids
        self.timeout_s, self.warmup, self.iterations = timeout_s, warmup, iterations
        self.points = points
        self.nodes = nodes

    def _all(self, refs: List[Any]) -> List[Any]:
        return self.ray.get(refs, timeout=self.timeout_s * 4)

    def holding_cpu_cores(self, seconds: float = 5.0) -> float:
        """The CPU the actors use while every one of them is inside a task that sleeps (as
        a rank is through a collective): Ray's threads that go on running beside a task."""
        holds = [a.hold.remote(seconds + 3.0) for a in self.actors]
        time.sleep(2.0)
        cores = actor_cpu_cores(self.pids, seconds)
        self._all(holds)
        return cores

    def task_round_s(self, members: List[Any]) -> float:
        """Seconds for a task that does nothing to run on every one of ``members``, timed as
        the join and the destroy are: what Ray alone takes to reach them all."""
        start = time.perf_counter()
        self._all([a.ready.remote() for a in members])
        return time.perf_counter() - start

    def imperative(self, size: int, group_name: str) -> dict:
        members = self.actors[:size]
        shm_before, procs_before = machine_shmem_bytes(), process_count()
        entries_before = group_dir_entries()
        # A fresh actor's first join would also import the library: 64 processes doing that
        # at once on 2 cores take seconds, which is no cost of joining.
        start = time.perf_counter()
        loads = self._all([a.load_library.remote() for a in members])
        import_s = time.perf_counter() - start
        task_round_before_join_s = self.task_round_s(members)
        start = time.perf_counter()
        joins = self._all([a.join.remote(size, r, group_name, self.timeout_s)
                           for r, a in enumerate(members)])
        join_s = time.perf_counter() - start
        # Over several nodes the join returns before the post offices are up: points timed
        # meanwhile would share the cores with their start (allreduce 8 B: 63.5 ms right
        # after the join at 64 ranks over 8 nodes, 34-36 ms ten seconds later).
        post_offices_up_s = (wait_for_post_offices(self.ray, self.nodes, self.timeout_s)
                             if self.nodes > 1 else None)
        added = [j["rss_after"] - j["rss_before"] for j in joins]
        imported = [load["rss_after"] - load["rss_before"] for load in loads]
        result = {"join_s": join_s, "import_s": import_s, "post_offices_up_s": post_offices_up_s,
                  "task_round_before_join_s": task_round_before_join_s,
                  "rss_added_by_import_p50_bytes": _median(imported),
                  "join_in_rank_p50_s": _median([j["seconds"] for j in joins]),
                  "join_in_rank_max_s": max(j["seconds"] for j in joins),
                  "rss_before_p50_bytes": _median([j["rss_before"] for j in joins]),
                  "rss_added_p50_bytes": _median(added),
                  "rss_added_max_bytes": max(added),
                  "shmem_added_bytes": machine_shmem_bytes() - shm_before,
                  "processes_added": process_count() - procs_before,
                  "points": [], "wrong": []}
        for collective, nbytes in self.points:
            _progress(f"{size} ranks: {collective} {nbytes} B")
            result["wrong"] += [w for w in self._all(
                [a.check.remote(group_name, collective, nbytes) for a in members]) if w]
            durations = self._all([a.time_loop.remote(group_name, collective, nbytes,
                                                       self.warmup, self.iterations)
                                   for a in members])
            result["points"].append(_latency_row(collective, nbytes, durations))
            after = self._all([a.release_memory.remote() for a in members])
            result["rss_after_points_p50_bytes"] = _median([a["rss_bytes"] for a in after])
            result["open_fds_max"] = max(a["open_fds"] for a in after)
        result["shmem_in_use_bytes"] = machine_shmem_bytes() - shm_before
        result["task_round_before_destroy_s"] = self.task_round_s(members)
        start = time.perf_counter()
        leaves = self._all([a.leave.remote(group_name) for a in members])
        result["destroy_s"] = time.perf_counter() - start
        result["destroy_in_rank_p50_s"] = _median(leaves)
        result["destroy_in_rank_max_s"] = max(leaves)
        result["after_destroy"] = _leftovers(group_name, entries_before)
        result["processes_after_destroy"] = process_count() - procs_before
        return result

    def declarative(self, size: int, group_name: str) -> dict:
        import ray_collective as col
        members = self.actors[:size]
        entries_before = group_dir_entries()
        start = time.perf_counter()
        col.declare_collective_group(members, size, list(range(size)), backend="ray",
                                     group_name=group_name, timeout=self.timeout_s)
        join_s = time.perf_counter() - start
        wrong = [w for w in self._all([a.check.remote(group_name, "allreduce", 8)
                                       for a in members]) if w]
        start = time.perf_counter()
        col.destroy_collective_group(group_name)
        return {"join_s": join_s, "destroy_s": time.perf_counter() - start, "wrong": wrong,
                "after_destroy": _leftovers(group_name, entries_before)}

    def drill(self, size: int, group_name: str) -> dict:
        """Kill one of ``size`` looping ranks; the survivors must name it, then rebuild."""
        members = self.actors[:size]
        entries_before = group_dir_entries()
        self._all([a.join.remote(size, r, group_name, self.timeout_s)
                   for r, a in enumerate(members)])
        victim = size // 2 + 1
        loops = [a.allreduce_until_error.remote(group_name) for a in members]
        time.sleep(3.0)
        killed_at = time.time()
        os.kill(self.pids[victim], signal.SIGKILL)
        survivors = [r for r in range(size) if r != victim]
        ready, _ = self.ray.wait([loops[r] for r in survivors], num_returns=len(survivors),
                                 timeout=60)
        outcomes = self.ray.get(ready)
        seconds = [o["at"] - killed_at for o in outcomes]
        result = {"world_size": size, "victim": victim, "survivors_answered": len(outcomes),
                  "survivors": len(survivors),
                  "types": sorted({o["type"] for o in outcomes}),
                  "naming_victim": sum(victim in o["dead_ranks"] for o in outcomes),
                  "raise_after_kill_p50_s": _median(seconds) if seconds else None,
                  "raise_after_kill_max_s": max(seconds) if seconds else None,
                  "calls_before_p50": _median([o["calls"] for o in outcomes]),
                  "example": outcomes[0]["message"] if outcomes else None}
        rest = [members[r] for r in survivors]
        self._all([a.leave.remote(group_name) for a in rest])
        result["after_destroy"] = _leftovers(group_name, entries_before)
        rebuilt = group_name + "-rebuilt"
        start = time.perf_counter()
        self._all([a.join.remote(len(rest), r, rebuilt, self.timeout_s)
                   for r, a in enumerate(rest)])
        result["rebuild_join_s"] = time.perf_counter() - start
        result["rebuild_wrong"] = [w for w in self._all(
            [a.check.remote(rebuilt, "allreduce", 64 * 1024) for a in rest]) if w]
        self._all([a.leave.remote(rebuilt) for a in rest])
        result["rebuild_after_destroy"] = _leftovers(rebuilt, entries_before)
        return result


def _progress(text: str) -> None:
    print(f"\r[{time.strftime('%H:%M:%S')}] {text:<70}", end="", file=sys.stderr, flush=True)


def start_actors(ray, count: int, node_ids: Sequence[Optional[str]], actors: List[Any],
                 pids: List[int]) -> float:
    """Add rank actors to ``actors`` (and their pids to ``pids``) until there are ``count``,
    ``WAVE`` at a time, actor i pinned to node ``node_ids[i % len(node_ids)]`` (so that the
    first N of them spread over every node); returns the seconds it took."""
    actor_class = ray.remote(**RANK_OPTIONS)(ScaleRank)
    start = time.perf_counter()
    while len(actors) < count:
        wave = [actor_class.options(**pinned(node_ids[i % len(node_ids)])).remote()
                for i in range(len(actors), min(len(actors) + WAVE, count))]
        pids += [r["pid"] for r in ray.get([a.ready.remote() for a in wave])]
        actors += wave
        elapsed = time.perf_counter() - start
        _progress(f"actors {len(actors)}/{count}, {elapsed:.0f} s, "
                  f"{machine_memory_used_bytes() / 2**30:.1f} GiB in use")
    print(file=sys.stderr)
    return time.perf_counter() - start


def actor_cpu_cores(pids: Sequence[int], seconds: float = 5.0) -> float:
    """The CPU the processes ``pids`` use together (Ray's own threads, if none of them runs
    code of its own), in cores, over ``seconds``."""
    def cpu_ticks() -> int:
        total = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                continue
        return total

    before = cpu_ticks()
    time.sleep(seconds)
    return (cpu_ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds


def wait_for_post_offices(ray, count: int, timeout_s: float) -> float:
    """Wait until ``count`` of the library's post offices (one per node of a group spanning
    nodes) are registered and answer; returns the seconds it took.

    Raises:
        TimeoutError: fewer were up after ``timeout_s`` seconds.
    """
    from ray_collective.backends.ray.post_offices import POST_OFFICE_NAME_PREFIX
    from ray_collective.backends.key_value import NAMESPACE
    start = time.perf_counter()
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(POST_OFFICE_NAME_PREFIX)]
        if len(names) >= count:
            ray.get([ray.get_actor(name, namespace=NAMESPACE).__ray_ready__.remote()
                     for name in names], timeout=timeout_s)
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{len(names)} of {count} post offices up after {timeout_s} s")
        time.sleep(0.1)


def machine_memory_used_bytes() -> int:
    """Total minus available memory of the machine, in bytes."""
    fields = _meminfo()
    return fields["MemTotal"] - fields["MemAvailable"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the measurements of the module's docstring and write them as JSON."""
    parser = module_parser("benchmarks.scale_real", __doc__)
    parser.add_argument("--ranks", default="64,128,256,400",
                        help="world sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="the groups' deadline per call, seconds")
    parser.add_argument("--small", action="store_true",
                        help="only the small-message points (allreduce 8 B, allgather 64 KiB, "
                             "barrier)")
    parser.add_argument("--drill", action="store_true",
                        help="kill one rank at the largest N and rebuild without it")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes of a ray.cluster_utils.Cluster started on this machine, "
                             "ranks spread over them round robin (default: one node, a "
                             "plain local Ray)")
    parser.add_argument("--json", required=True, action="append",
                        help="where to write the results; with --from-json, the results to "
                             "read (repeat it to put several runs' world sizes side by side)")
    parser.add_argument("--plot", help="PNG of time against N (optional)")
    parser.add_argument("--from-json", action="store_true",
                        help="run nothing: print the results already in --json as the "
                             "results page's table (and plot them with --plot)")
    args = parser.parse_args(argv)
    if args.from_json:
        report = merged_reports(args.json)
        print(markdown(report))
        if args.plot:
            write_plot(report, args.plot)
        return 0
    sizes = sorted({int(s) for s in args.ranks.split(",")})
    if sizes[0] < 2:
        parser.error("--ranks: every world size must be at least 2")

    import ray
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    cluster = start_local_cluster(args.nodes) if args.nodes > 1 else start_one_node()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=WORKER_RUNTIME_ENV)
    node_ids: List[Optional[str]] = list(pick_nodes(args.nodes)) if args.nodes > 1 else [None]
    report: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv),
        "ray": ray.__version__, "cores": os.cpu_count(), "nodes": args.nodes,
        "memory_before_actors_bytes": machine_memory_used_bytes(), "sizes": []}
    # Actors are added as N grows, so that each N is measured beside no idle extra actors
    # (each idle Ray actor costs its node CPU time) and what was measured is kept if a
    # larger N does not fit.
    run = Run(ray, [], [], args.timeout, args.warmup, args.iterations,
              SMALL_POINTS if args.small else POINTS, args.nodes)
    for size in sizes:
        try:
            start_s = start_actors(ray, size, node_ids, run.actors, run.pids)
            row = {"world_size": size, "actors_start_s": start_s,
                   "memory_in_use_bytes": machine_memory_used_bytes(),
                   "idle_actor_cpu_cores": actor_cpu_cores(run.pids),
                   "holding_actor_cpu_cores": run.holding_cpu_cores(),
                   "imperative": run.imperative(size, f"imperative-{size}"),
                   "declarative": run.declarative(size, f"declarative-{size}")}
        except Exception as err:  # noqa: BLE001 - recorded: what broke at this N is a result
            error = f"{type(err).__name__}: {err}"[:2000]
            report["failed"] = {"world_size": size, "error": error,
                                "memory_in_use_bytes": machine_memory_used_bytes()}
            print(f"\nN={size} failed: {report['failed']['error']}", file=sys.stderr)
            break
        report["sizes"].append(row)
        _write(args.json[0], report)
        _summary(row)
    if args.drill and report["sizes"] and "failed" not in report:
        _progress(f"drill at {sizes[-1]} ranks")
        report["drill"] = run.drill(sizes[-1], f"drill-{sizes[-1]}")
        print(file=sys.stderr)
        print("DRILL", json.dumps(report["drill"]), flush=True)
    _write(args.json[0], report)
    if args.plot:
        write_plot(report, args.plot)
    ray.shutdown()
    cluster.shutdown()
    return 0


def write_plot(report: dict, path: str) -> Optional[pathlib.Path]:
    """Time against N, log-log: every collective's p50 and the joins; None (and no file)
    with fewer than two world sizes."""
    lines: Dict[Line, List[Tuple[float, float]]] = {}

    def add(label: str, size: int, seconds: Optional[float]) -> None:
        if seconds:
            lines.setdefault((label, BACK_TO_BACK), []).append((size, seconds))

    sizes = [row["world_size"] for row in report["sizes"]]
    for row in report["sizes"]:
        size = row["world_size"]
        for point in row["imperative"]["points"]:
            add(f"{point['collective']} {format_size(point['bytes'])}".replace(" 0 B", ""),
                size, point["p50_s"])
        add("join (imperative)", size, row["imperative"]["join_s"])
        add("join (declared)", size, row["declarative"]["join_s"])
    return draw(pathlib.Path(path), "ray backend, one node, 2 cores", "ranks",
                "seconds (p50)", lines, sizes, [str(n) for n in sizes], log_x=True)


def merged_reports(paths: Sequence[str]) -> dict:
    """The world sizes of several runs' JSON files in one report, in order of size (the drill
    of the last file that has one)."""
    reports = []
    for path in paths:
        with open(path) as source:
            reports.append(json.load(source))
    merged = dict(reports[-1])
    merged["sizes"] = sorted((row for report in reports for row in report["sizes"]),
                             key=lambda row: row["world_size"])
    drills = [report["drill"] for report in reports if "drill" in report]
    if drills:
        merged["drill"] = drills[-1]
    return merged


def markdown(report: dict) -> str:
    """The results page's tables of a run: one column per N."""
    rows = report["sizes"]
    header = "| | " + " | ".join(f"{row['world_size']} ranks" for row in rows) + " |"
    lines = [header, "|---" * (len(rows) + 1) + "|"]

    def line(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(row) for row in rows) + " |")

    def ms(seconds: Optional[float]) -> str:
        return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"

    line("actors started (s)", lambda r: f"{r['actors_start_s']:.0f}")
    line("Ray's idle actors, CPU (cores)", lambda r: f"{r['idle_actor_cpu_cores']:.2f}")
    line("Ray's actors inside a task, CPU (cores)",
         lambda r: (f"{r['holding_actor_cpu_cores']:.2f}" if "holding_actor_cpu_cores" in r
                    else "not measured"))
    line("join, imperative (s)", lambda r: f"{r['imperative']['join_s']:.2f}")
    line("join, declared (s)", lambda r: f"{r['declarative']['join_s']:.2f}")
    if any(r["imperative"].get("post_offices_up_s") is not None for r in rows):
        line("post offices answering, after the join (s)",
             lambda r: (f"{r['imperative']['post_offices_up_s']:.2f}"
                        if r["imperative"].get("post_offices_up_s") is not None else "–"))
    line("destroy, imperative / declared (s)",
         lambda r: f"{r['imperative']['destroy_s']:.2f} / {r['declarative']['destroy_s']:.2f}")
    if any("task_round_before_join_s" in r["imperative"] for r in rows):
        line("a task doing nothing on every rank, before the join / the destroy (s)",
             lambda r: (f"{r['imperative']['task_round_before_join_s']:.2f} / "
                        f"{r['imperative']['task_round_before_destroy_s']:.2f}"
                        if "task_round_before_join_s" in r["imperative"] else "not measured"))
        line("join / destroy inside a rank, p50 and most (s)",
             lambda r: (f"{r['imperative']['join_in_rank_p50_s']:.2f}, "
                        f"{r['imperative']['join_in_rank_max_s']:.2f} / "
                        f"{r['imperative']['destroy_in_rank_p50_s']:.2f}, "
                        f"{r['imperative']['destroy_in_rank_max_s']:.2f}"
                        if "destroy_in_rank_p50_s" in r["imperative"] else "not measured"))
    def point_cell(row: dict, collective: str, nbytes: int) -> str:
        for point in row["imperative"]["points"]:
            if (point["collective"], point["bytes"]) == (collective, nbytes):
                return f"{ms(point['p50_s'])} ({ms(point['p95_s'])})"
        return "not run"

    for collective, nbytes in POINTS:
        label = f"{collective} {format_size(nbytes)}".replace(" 0 B", "")
        line(f"{label}, p50 (p95)",
             lambda r, c=collective, n=nbytes: point_cell(r, c, n))
    line("results differing from numpy",
         lambda r: str(len(r["imperative"]["wrong"]) + len(r["declarative"]["wrong"])))
    line("memory per rank: import / join (MiB)",
         lambda r: f"{r['imperative']['rss_added_by_import_p50_bytes'] / 2**20:.1f} / "
                   f"{r['imperative']['rss_added_p50_bytes'] / 2**20:.1f}")
    line("shared memory in use, peak seen (MiB)",
         lambda r: f"{max(0, r['imperative']['shmem_in_use_bytes']) / 2**20:.0f}")
    line("open descriptors per rank, most",
         lambda r: str(r["imperative"].get("open_fds_max", "–")))
    line("processes on the machine, added while joined",
         lambda r: str(r["imperative"]["processes_added"]))
    line("left after destroy: keys, files (imperative; declared)",
         lambda r: f"{r['imperative']['after_destroy']['kv_keys']}, "
                   f"{r['imperative']['after_destroy']['group_dir_entries']}; "
                   f"{r['declarative']['after_destroy']['kv_keys']}, "
                   f"{r['declarative']['after_destroy']['group_dir_entries']}")
    return "\n".join(lines)


def _write(path: str, report: dict) -> None:
    with open(path, "w") as sink:
        json.dump(report, sink, indent=1)


def _summary(row: dict) -> None:
    imperative = row["imperative"]
    print(file=sys.stderr)
    print(f"N={row['world_size']}: join {imperative['join_s']:.2f} s (declared "
          f"{row['declarative']['join_s']:.2f} s), destroy {imperative['destroy_s']:.2f} s "
          f"(declared {row['declarative']['destroy_s']:.2f} s), memory added p50 "
          f"{imperative['rss_added_p50_bytes'] / 2**20:.1f} MiB by joining and "
          f"{imperative.get('rss_added_by_import_p50_bytes', 0) / 2**20:.1f} MiB by the "
          f"import, wrong "
          f"{len(imperative['wrong']) + len(row['declarative']['wrong'])}", flush=True)
    for point in imperative["points"]:
        print(f"   {point['collective']:>9} {point['bytes']:>8} B  p50 "
              f"{point['p50_s'] * 1e3:8.2f} ms  p95 {point['p95_s'] * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
