"""Elastic groups: how soon the survivors of a killed rank run a correct allreduce
again, and how long a grow by one fresh actor takes.

    python -m benchmarks.elastic [--ranks 8,64] [--nodes 1] [--kills 10] [--json PATH]

For each N, N rank actors (``num_cpus=0``; with ``--nodes K``, on a ``ray.cluster_utils``
cluster of K nodes on this machine, N/K consecutive ranks a node) join a group. Then
``--kills`` times:

- **kill**: every rank loops on an allreduce of 8 B; the driver SIGKILLs one rank (another one
  each time); each survivor, once its call fails, calls ``shrink_collective_group`` and then
  allreduces its new rank + 1, checking the sum against the survivors' count. Recorded: from
  the kill to the *last* survivor's first correct allreduce (wall clock; one machine), and per
  survivor the moments its call failed and its shrink returned.
- **grow**: a fresh actor is started (on the dead rank's node) and, once it answers, the driver
  asks the members to grow by one and the new actor to join as the last rank; recorded: from
  that request to the last rank's first correct allreduce in the grown group.

Printed per N: p50 / p95 / max of both, and the machine's memory. The targets: kill to first
correct allreduce at most 1 s at 64 ranks on one node, 2 s at 4 x 8 over nodes (p95); a grow
by one at most 1 s once the actor is up.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .cli import module_parser, print_and_save
from .fault_detection import percentile
from .nodes import local_cluster_driver, pick_nodes, pinned

GROUP = "elastic-bench"
CALL_TIMEOUT_S = 60.0
TARGETS_S = {"kill_one_node": 1.0, "kill_nodes": 2.0, "grow": 1.0}


class ElasticRank:
    """A rank that loops on allreduce until a call fails, shrinks, and checks its next one."""

    def pid(self) -> int:
        return os.getpid()

    def resident_bytes(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def join(self, world_size: int, rank: int) -> float:
        import ray_collective as col
        col.init_collective_group(world_size, rank, "ray", GROUP, timeout=CALL_TIMEOUT_S)
        return self.checked()[0]

    def loop_then_shrink(self) -> Dict[str, object]:
        import ray_collective as col
        tensor = np.ones(2, np.float32)
        while True:
            try:
                col.allreduce(tensor, GROUP)
            except col.CollectiveError as err:
                failed_at, kind = time.time(), type(err).__name__
                break
        col.shrink_collective_group(GROUP, timeout=CALL_TIMEOUT_S)
        shrunk_at = time.time()
        correct_at, correct = self.checked()
        return {"error": kind, "failed_at": failed_at, "shrunk_at": shrunk_at,
                "correct_at": correct_at, "correct": correct}

    def grow(self, world_size: int) -> tuple:
        import ray_collective as col
        col.grow_collective_group(GROUP, world_size=world_size, timeout=CALL_TIMEOUT_S)
        return self.checked()

    def join_grown(self, world_size: int, rank: int) -> tuple:
        import ray_collective as col
        col.init_collective_group(world_size, rank, "ray", GROUP, timeout=CALL_TIMEOUT_S)
        return self.checked()

    def checked(self) -> tuple:
        """One allreduce of (rank + 1): (when it returned, whether it summed to w(w+1)/2)."""
        import ray_collective as col
        world_size = col.get_collective_group_size(GROUP)
        tensor = np.full(2, col.get_rank(GROUP) + 1, np.float32)
        col.allreduce(tensor, GROUP)
        return time.time(), bool(tensor[0] == world_size * (world_size + 1) / 2)

    def leave(self) -> None:
        import ray_collective as col
        col.destroy_collective_group(GROUP)


def _memory_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _summary(values: Sequence[float]) -> Dict[str, float]:
    return {"p50_s": percentile(values, 0.5), "p95_s": percentile(values, 0.95),
            "max_s": max(values)}


def measure(ray, world_size: int, nodes: int, kills: int) -> Dict[str, object]:
    """``kills`` kill-and-shrink rounds, each followed by a grow, on a group of ``world_size``."""
    node_ids = pick_nodes(nodes) if nodes > 1 else [None]
    per_node = world_size // len(node_ids)
    actor = ray.remote(num_cpus=0, max_restarts=0)(ElasticRank)
    available_before = _memory_available()
    started = time.monotonic()
    members = [actor.options(**pinned(node_ids[r // per_node])).remote()
               for r in range(world_size)]
    nodes_of = [node_ids[r // per_node] for r in range(world_size)]
    pids = ray.get([m.pid.remote() for m in members])
    actors_up_s = time.monotonic() - started
    ray.get([m.join.remote(world_size, r) for r, m in enumerate(members)])
    joined_s = time.monotonic() - started - actors_up_s
    resident = ray.get([m.resident_bytes.remote() for m in members])
    available_after = _memory_available()
    to_correct: List[float] = []
    survivors_seen: List[Dict[str, float]] = []
    grows: List[float] = []
    errors: Dict[str, int] = {}
    all_correct = True
    for trial in range(kills):
        victim = (1 + 5 * trial) % world_size
        loops = [m.loop_then_shrink.remote() for m in members]
        time.sleep(1.0)  # every rank is in its loop of allreduces
        killed_at = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        outcomes = ray.get([ref for r, ref in enumerate(loops) if r != victim], timeout=300)
        to_correct.append(max(o["correct_at"] for o in outcomes) - killed_at)
        for o in outcomes:
            errors[o["error"]] = errors.get(o["error"], 0) + 1
            all_correct &= o["correct"]
            survivors_seen.append({"failed_s": o["failed_at"] - killed_at,
                                   "shrunk_s": o["shrunk_at"] - killed_at})
        node = nodes_of.pop(victim)
        members.pop(victim)
        pids.pop(victim)
        fresh = actor.options(**pinned(node)).remote()
        pid = ray.get(fresh.pid.remote())  # the new actor is up
        asked_at = time.time()
        refs = [m.grow.remote(world_size) for m in members]
        refs.append(fresh.join_grown.remote(world_size, world_size - 1))
        done = ray.get(refs, timeout=300)
        grows.append(max(at for at, _ in done) - asked_at)
        all_correct &= all(ok for _, ok in done)
        members.append(fresh)
        pids.append(pid)
        nodes_of.append(node)
    ray.get([m.leave.remote() for m in members])
    for m in members:
        ray.kill(m)
    return {
        "world_size": world_size, "nodes": len(node_ids), "kills": kills,
        "kill_to_correct_allreduce": _summary(to_correct),
        "survivor_failed": _summary([s["failed_s"] for s in survivors_seen]),
        "survivor_shrunk": _summary([s["shrunk_s"] for s in survivors_seen]),
        "grow_by_one": _summary(grows), "errors": errors, "all_correct": all_correct,
        "actors_up_s": actors_up_s, "join_s": joined_s,
        "rank_resident_mb_median": float(np.median(resident)) / 2**20,
        "memory_taken_by_ranks_gb": (available_before - available_after) / 2**30,
        "memory_available_gb": available_after / 2**30,
        "raw": {"kill_to_correct_allreduce_s": to_correct, "grow_by_one_s": grows}}


def format_rows(rows: Sequence[Dict[str, object]]) -> str:
    """A markdown table of the measurements."""
    lines = ["| ranks | nodes | kills | kill -> first correct allreduce p50 / p95 / max | "
             "survivors failed (p50) / shrunk (p95) | grow by one p50 / p95 / max | errors | "
             "correct |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        kill, grow = row["kill_to_correct_allreduce"], row["grow_by_one"]
        lines.append(
            f"| {row['world_size']} | {row['nodes']} | {row['kills']} | "
            f"{kill['p50_s']:.2f} / {kill['p95_s']:.2f} / {kill['max_s']:.2f} s | "
            f"{row['survivor_failed']['p50_s']:.2f} / {row['survivor_shrunk']['p95_s']:.2f} s | "
            f"{grow['p50_s']:.2f} / {grow['p95_s']:.2f} / {grow['max_s']:.2f} s | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(row['errors'].items()))} | "
            f"{row['all_correct']} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, print the table, optionally write JSON; exit 1 if a p95 misses its target."""
    parser = module_parser("benchmarks.elastic", __doc__)
    parser.add_argument("--ranks", default="8,64",
                        help="comma-separated world sizes (default 8,64)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.ranks.split(",")]
    if args.kills < 1 or any(n < 2 or n % args.nodes for n in sizes):
        parser.error("--kills must be at least 1, and each N at least 2 and a multiple of "
                     "--nodes")
    import ray
    rows = []
    if args.nodes > 1:
        with local_cluster_driver(args.nodes):
            rows = [measure(ray, n, args.nodes, args.kills) for n in sizes]
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        try:
            rows = [measure(ray, n, 1, args.kills) for n in sizes]
        finally:
            ray.shutdown()
    print_and_save(format_rows(rows), rows, args.json)
    kill_target = TARGETS_S["kill_nodes" if args.nodes > 1 else "kill_one_node"]
    met = all(row["kill_to_correct_allreduce"]["p95_s"] <= kill_target
              and row["grow_by_one"]["p95_s"] <= TARGETS_S["grow"] and row["all_correct"]
              for row in rows)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
