"""How long the survivors of a killed rank take to learn of it: one node, ``ray`` backend.

For each message size, ``--kills`` times: start ``--world-size`` fresh rank actors, declare a
group, let every rank call ``allreduce`` back to back, SIGKILL one rank (a different one each
time) from the driver, and record, on every survivor, the time from the kill to the
``PeerDiedError`` its call raised (wall clock, one machine). Printed per size: the number of
survivors, how many raised ``PeerDiedError`` naming the killed rank, and the p50 / p95 / max of
the detection time. The target of the "Faults" work: p95 at most 0.1 s on a node.

    python -m benchmarks.fault_detection [--world-size 4] [--kills 10] [--bytes 8,64M]
        [--json PATH]
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from benchmarks.nccl_overhead import parse_sizes

from .cli import module_parser, print_and_save

DETECTION_TARGET_S = 0.1


class FaultRank:
    """A rank actor that loops on allreduce until a call fails, and says how it failed."""

    def pid(self) -> int:
        return os.getpid()

    def loop(self, group: str, nbytes: int) -> tuple:
        import ray_collective as col
        tensor = np.ones(max(nbytes // 4, 1), np.float32)
        while True:
            try:
                col.allreduce(tensor, group, timeout=60.0)
            except col.CollectiveError as err:
                return time.time(), type(err).__name__, tuple(getattr(err, "dead_ranks", ()))


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(ray, world_size: int, nbytes: int, kills: int) -> Dict[str, object]:
    """Kill one rank ``kills`` times at ``nbytes``; the survivors' detection times."""
    import ray_collective as col
    actor = ray.remote(num_cpus=0)(FaultRank)
    delays: List[float] = []
    named = 0
    for trial in range(kills):
        ranks = [actor.remote() for _ in range(world_size)]
        pids = ray.get([r.pid.remote() for r in ranks])
        group = f"faults-{nbytes}-{trial}"
        col.declare_collective_group(ranks, group_name=group)
        loops = [r.loop.remote(group, nbytes) for r in ranks]
        time.sleep(1.0)
        victim = trial % world_size
        killed_at = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        for rank, ref in enumerate(loops):
            if rank == victim:
                continue
            raised_at, kind, dead = ray.get(ref, timeout=120)
            delays.append(raised_at - killed_at)
            named += kind == "PeerDiedError" and dead == (victim,)
        col.destroy_collective_group(group)
        for r in ranks:
            ray.kill(r)
    return {"bytes": nbytes, "world_size": world_size, "survivors": len(delays),
            "named_the_dead_rank": named, "p50_s": statistics.median(delays),
            "p95_s": percentile(delays, 0.95), "max_s": max(delays)}


def format_rows(rows: Sequence[Dict[str, object]]) -> str:
    """A markdown table of the measurements."""
    lines = ["| size | ranks | survivors | PeerDiedError naming it | p50 | p95 | max |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['bytes']} B | {row['world_size']} | {row['survivors']} | "
                     f"{row['named_the_dead_rank']} | {row['p50_s'] * 1e3:.0f} ms | "
                     f"{row['p95_s'] * 1e3:.0f} ms | {row['max_s'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, print the table, optionally write JSON; exit 1 if a p95 misses the target."""
    parser = module_parser("benchmarks.fault_detection", __doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--bytes", type=parse_sizes, default=parse_sizes("8,64M"))
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.kills < 1:
        parser.error("--world-size must be at least 2 and --kills at least 1")
    import ray
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        rows = [measure(ray, args.world_size, nbytes, args.kills) for nbytes in args.bytes]
    finally:
        ray.shutdown()
    print_and_save(format_rows(rows), rows, args.json)
    return 0 if all(row["p95_s"] <= DETECTION_TARGET_S for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
