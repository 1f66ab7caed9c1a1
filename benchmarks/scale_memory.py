"""Where an idle rank's memory goes, and what Ray's settings change of it, measured by the kernel.

``python -m benchmarks.scale_memory --actors 8`` starts a local Ray the way
``benchmarks.scale_real`` does (its ``--setting``, default ``scale_real``: the settings
``make bench-400`` runs with), adds N :class:`~benchmarks.memory_probe.MemoryProbe` actors
(``num_cpus=0``, plain, as the ranks are) and takes all of them through the stages of a rank,
measuring every actor's USS, PSS and RSS (``/proc/PID/smaps_rollup``, the heap trimmed first)
and threads after each:

1. ``bare``: a Ray actor of a module that imports the standard library only;
2. ``numpy``: after ``import numpy``;
3. ``ray_collective``: after ``import ray_collective``;
4. ``joined``: after ``init_collective_group`` of all N (``ray`` backend, one node);
5. ``called``: after one allreduce of 8 B and a barrier (the first call maps its rings);
6. ``left``: after ``destroy_collective_group``.

At ``joined`` it also measures every one of Ray's own processes of this session (the driver's
process tree: GCS, raylet, the dashboard's agents, the log monitor, idle workers) and the
machine: ``MemAvailable`` and ``Shmem`` of ``/proc/meminfo`` against before ``ray.init``, and
the PSS of the session's whole process tree (what it costs the machine, whatever else runs
beside it). ``--compare SETTING,SETTING,...`` runs each setting in a fresh process (a fresh Ray)
in turn, ``--repeats`` rounds interleaved, and writes one JSON of all.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .cli import module_parser
from .memory_probe import MemoryProbe, process_memory, ray_processes, tree_pids
from .scale_real import (ONE_NODE_HEAD, RANK_OPTIONS, RAY_ENVIRONMENT, WAVE, WORKER_RUNTIME_ENV,
                         _meminfo)

RAY_INIT = {"address": "local", "num_cpus": os.cpu_count(), "include_dashboard": False,
            "log_to_driver": False,
            "_system_config": {"worker_register_timeout_seconds": 600}}
"""``ray.init``'s arguments of ``scale_real`` before it started its node itself (76e73a8), the
base the other settings change one thing of (``address="local"``: never a cluster that
another program on the machine started)."""


def _changed(environment: Optional[Dict[str, str]] = None, **init: Any) -> Dict[str, Any]:
    system_config = {**RAY_INIT["_system_config"], **init.pop("_system_config", {})}
    return {"environment": {**RAY_ENVIRONMENT, **(environment or {})},
            "init": {**RAY_INIT, **init, "_system_config": system_config}}


SETTINGS: Dict[str, Dict[str, Any]] = {
    "ray_init": _changed(),
    "scale_real": {"environment": RAY_ENVIRONMENT, "head": ONE_NODE_HEAD,
                   "init": {"log_to_driver": False, "runtime_env": WORKER_RUNTIME_ENV}},
    "dashboard_on": _changed(include_dashboard=True),
    "no_prestart": _changed(_system_config={"enable_worker_prestart": False,
                                            "prestart_worker_first_driver": False}),
    "no_log_or_autoscaler_monitor": {"environment": RAY_ENVIRONMENT, "head": ONE_NODE_HEAD,
                                     "init": {"log_to_driver": False}},
    "metrics_off": _changed({"RAY_enable_metrics_collection": "0"}),
    "workers_optimize_2": _changed(runtime_env=WORKER_RUNTIME_ENV),
    "object_store_256m": _changed(object_store_memory=256 * 2**20),
    "memory_monitor_off": _changed({"RAY_memory_monitor_refresh_ms": "0"}),
}
"""Each setting: environment variables set before Ray starts (Ray's processes read their
``RAY_*`` configuration from it, and its workers inherit it), ``ray.init``'s keyword arguments,
and, under ``head``, the head node's arguments of a one-node ``ray.cluster_utils.Cluster`` that
the driver then joins (what ``ray start --head`` takes, such as ``--include-log-monitor=false
--no-monitor``, which ``ray.init`` does not offer). ``scale_real`` is what
``benchmarks.scale_real`` (``make bench-400``) starts now: ``no_log_or_autoscaler_monitor`` and
``workers_optimize_2`` together; ``ray_init`` what it started before; each other one changes
one thing of ``ray_init``."""

STAGES = ("bare", "numpy", "ray_collective", "joined", "called", "left")

WATCHED_MODULES = ("ray_collective.backends.nccl", "ray_collective.sim",
                "ray_collective.transport.post_office", "ray_collective.transport.tcp",
                "ray_collective.transport.stream_carrier", "ray_collective.metrics",
                "ray_collective.batch", "ray_collective.refs", "ray_collective.declared",
                "benchmarks", "torch", "cupy")
"""Modules whose presence in a rank is reported (``lazy_loaded``): the ones the library imports
on first use (``tests/test_layers.py``, ``LAZY_MODULES``) and the cross-node path, which every
rank still imports."""


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def stage_summary(name: str, reports: List[dict]) -> dict:
    """Medians over the actors of one stage, in bytes (threads as counts), and which of
    ``WATCHED_MODULES`` the first actor had loaded."""
    modules = set(reports[0]["modules"])
    return {"stage": name, "actors": len(reports),
            **{f"{field}_p50": _median([r[field] for r in reports])
               for field in ("uss", "pss", "rss", "pss_shmem", "threads")},
            "modules": len(modules),
            "ray_collective_modules": sum(m.startswith("ray_collective") for m in modules),
            "lazy_loaded": [m for m in WATCHED_MODULES if m in modules],
            "thread_names": reports[0]["thread_names"]}


def run_setting(setting: str, actors: int, timeout_s: float) -> dict:
    """One fresh Ray with ``setting``, ``actors`` probes through every stage; the report."""
    chosen = SETTINGS[setting]
    os.environ.update(chosen["environment"])
    import ray
    before = _meminfo()
    cluster = None
    if "head" in chosen:
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": os.cpu_count(), **chosen["head"]})
        ray.init(address=cluster.address, **chosen["init"])
    else:
        ray.init(**chosen["init"])
    # Ray's processes settle (prestarted workers, agents) before anything is measured.
    time.sleep(5.0)
    report: Dict[str, Any] = {"setting": setting, "actors": actors,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "ray": ray.__version__, "stages": []}
    probe = ray.remote(**RANK_OPTIONS)(MemoryProbe)
    handles: List[Any] = []
    bare: List[dict] = []
    while len(handles) < actors:
        wave = [probe.remote() for _ in range(min(WAVE, actors - len(handles)))]
        bare += ray.get([a.measure.remote() for a in wave])
        handles += wave
    pids = [r["pid"] for r in bare]
    report["stages"].append(stage_summary("bare", bare))
    group = f"memory-{setting}"
    steps = {"numpy": lambda r, a: a.load.remote("numpy"),
             "ray_collective": lambda r, a: a.load.remote("ray_collective"),
             "joined": lambda r, a: a.join.remote(actors, r, group, timeout_s),
             "called": lambda r, a: a.call.remote(group, 2),
             "left": lambda r, a: a.leave.remote(group)}
    for stage in STAGES[1:]:
        reports = ray.get([steps[stage](r, a) for r, a in enumerate(handles)],
                          timeout=timeout_s * 4)
        report["stages"].append(stage_summary(stage, reports))
        if stage == "called":
            report["machine"] = machine_figures(before, pids)
            report["ray_processes"] = ray_process_summary(os.getpid(), pids)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    return report


def machine_figures(before: Dict[str, int], actor_pids: Sequence[int]) -> dict:
    """What the session costs the machine now, against ``before`` (``/proc/meminfo`` then):
    MemAvailable and Shmem moved, and the PSS summed over the driver's process tree (its Ray,
    its actors), split into the actors' and the rest."""
    now = _meminfo()
    tree = tree_pids(os.getpid())
    pss = {pid: process_memory(pid)["pss"] for pid in tree}
    actors = set(actor_pids)
    return {"mem_available_drop_bytes": before["MemAvailable"] - now["MemAvailable"],
            "shmem_added_bytes": now["Shmem"] - before["Shmem"],
            "tree_pss_bytes": sum(pss.values()),
            "actors_pss_bytes": sum(v for p, v in pss.items() if p in actors),
            "processes": len(tree)}


def ray_process_summary(driver: int, actor_pids: Sequence[int]) -> List[dict]:
    """Ray's own processes of this session by kind: count and summed USS, PSS, RSS, threads."""
    kinds: Dict[str, dict] = {}
    for row in ray_processes(driver, exclude=actor_pids):
        entry = kinds.setdefault(row["kind"], {"kind": row["kind"], "count": 0, "uss": 0,
                                               "pss": 0, "rss": 0, "threads": 0})
        entry["count"] += 1
        for field in ("uss", "pss", "rss", "threads"):
            entry[field] += row[field]
    return sorted(kinds.values(), key=lambda e: -e["pss"])


def compare(settings: Sequence[str], actors: int, repeats: int, timeout_s: float) -> dict:
    """Every setting in a fresh process, ``repeats`` rounds interleaved; their reports."""
    runs = []
    for round_ in range(repeats):
        for setting in settings:
            with tempfile.NamedTemporaryFile(suffix=".json") as sink:
                subprocess.run([sys.executable, "-m", "benchmarks.scale_memory", "--actors",
                                str(actors), "--setting", setting, "--json", sink.name,
                                "--timeout", str(timeout_s)], check=True)
                run = json.load(open(sink.name))
            run["round"] = round_
            runs.append(run)
            print(f"{setting} round {round_}: {_one_line(run)}", file=sys.stderr, flush=True)
    return {"actors": actors, "repeats": repeats, "runs": runs}


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _one_line(run: dict) -> str:
    machine = run["machine"]
    return (f"MemAvailable -{_mib(machine['mem_available_drop_bytes'])} MiB, tree PSS "
            f"{_mib(machine['tree_pss_bytes'])} MiB, shmem +{_mib(machine['shmem_added_bytes'])}")


def markdown_stages(run: dict) -> str:
    """The stage table of one run: medians per actor, MiB."""
    lines = ["| stage | USS | PSS | RSS | threads | ray_collective modules |",
             "|---|---|---|---|---|---|"]
    for stage in run["stages"]:
        lines.append(f"| {stage['stage']} | {_mib(stage['uss_p50'])} | "
                     f"{_mib(stage['pss_p50'])} | {_mib(stage['rss_p50'])} | "
                     f"{stage['threads_p50']:.0f} | {stage['ray_collective_modules']} |")
    lines += ["", "| Ray's process | count | USS | PSS | RSS | threads |",
              "|---|---|---|---|---|---|"]
    for entry in run["ray_processes"]:
        lines.append(f"| {entry['kind']} | {entry['count']} | {_mib(entry['uss'])} | "
                     f"{_mib(entry['pss'])} | {_mib(entry['rss'])} | {entry['threads']} |")
    return "\n".join(lines)


def markdown_compare(result: dict) -> str:
    """Each setting's medians over the rounds: MemAvailable drop, tree PSS, Ray's processes'
    PSS, and an actor's PSS once joined, MiB."""
    by_setting: Dict[str, List[dict]] = {}
    for run in result["runs"]:
        by_setting.setdefault(run["setting"], []).append(run)
    lines = [f"| setting ({result['actors']} actors, median of {result['repeats']}) | "
             "MemAvailable drop | session PSS | Ray's processes PSS | actor PSS (joined) |",
             "|---|---|---|---|---|"]
    for setting, runs in by_setting.items():
        joined = [next(s for s in r["stages"] if s["stage"] == "called") for r in runs]
        lines.append(
            f"| {setting} | "
            f"{_mib(_median([r['machine']['mem_available_drop_bytes'] for r in runs]))} | "
            f"{_mib(_median([r['machine']['tree_pss_bytes'] for r in runs]))} | "
            f"{_mib(_median([r['machine']['tree_pss_bytes'] - r['machine']['actors_pss_bytes'] for r in runs]))} | "
            f"{_mib(_median([j['pss_p50'] for j in joined]))} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the stages of the module's docstring (or compare settings) and write JSON."""
    parser = module_parser("benchmarks.scale_memory", __doc__)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--setting", default="scale_real", choices=sorted(SETTINGS),
                        help="how Ray is started (default: as make bench-400 starts it)")
    parser.add_argument("--compare", help="settings to compare, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.compare:
        names = args.compare.split(",")
        unknown = [n for n in names if n not in SETTINGS]
        if unknown:
            parser.error(f"--compare: unknown settings {unknown}; known: {sorted(SETTINGS)}")
        result = compare(names, args.actors, args.repeats, args.timeout)
        print(markdown_compare(result))
    else:
        result = run_setting(args.setting, args.actors, args.timeout)
        print(markdown_stages(result))
    with open(args.json, "w") as sink:
        json.dump(result, sink, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
