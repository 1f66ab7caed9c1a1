"""What the flight recorder and the metrics cost per call: the 8-byte allreduce of a group of 1
and of 2 ranks (Ray actors on one node, ``ray`` backend), each rank a member of three groups
that differ only in what they record:

- ``plain``: no recorder, no metrics (``RAY_COLLECTIVE_TRACE_SIZE=0``);
- ``recorder``: the flight recorder (256 calls), metrics off (``RAY_COLLECTIVE_METRICS=0``);
- ``metrics``: the recorder and the metrics (the default).

Timed blocks of calls alternate between the three groups (interleaved, so that the machine's
load falls on all alike); each time is the median over the blocks, per call, and each ratio
the median of the ratios of the blocks timed one after the other (paired, steadier than the
ratio of medians on a loaded machine).

    python -m benchmarks.observing_cost [--calls 20000] [--blocks 15] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .cli import module_parser, print_and_save

SETTINGS = {"plain": {"RAY_COLLECTIVE_TRACE_SIZE": "0", "RAY_COLLECTIVE_METRICS": "0"},
            "recorder": {"RAY_COLLECTIVE_TRACE_SIZE": "256", "RAY_COLLECTIVE_METRICS": "0"},
            "metrics": {"RAY_COLLECTIVE_TRACE_SIZE": "256", "RAY_COLLECTIVE_METRICS": "1"}}


class Rank:
    """One member: joins the three groups of a world, then times blocks of calls."""

    def join(self, world: str, world_size: int, rank: int) -> bool:
        import ray_collective as col
        from ray_collective.metrics import exportable
        for setting, variables in SETTINGS.items():
            os.environ.update(variables)
            col.init_collective_group(world_size, rank, "ray", f"{world}-{setting}")
        return exportable()

    def block(self, group: str, calls: int) -> float:
        import ray_collective as col
        tensor = np.zeros(2, np.float32)
        col.allreduce(tensor, group)
        start = time.perf_counter()
        for _ in range(calls):
            col.allreduce(tensor, group)
        return (time.perf_counter() - start) / calls


def measure(ray, world_size: int, calls: int, blocks: int) -> Dict[str, object]:
    """Median seconds per call of each setting, over ``blocks`` interleaved blocks."""
    actor = ray.remote(num_cpus=0)(Rank)
    ranks = [actor.remote() for _ in range(world_size)]
    world = f"w{world_size}"
    exported = ray.get([r.join.remote(world, world_size, i) for i, r in enumerate(ranks)])
    times: Dict[str, List[float]] = {setting: [] for setting in SETTINGS}
    for block in range(blocks + 1):
        for setting in SETTINGS:
            per_rank = ray.get([r.block.remote(f"{world}-{setting}", calls) for r in ranks])
            if block:                                    # the first round warms up
                times[setting].append(max(per_rank))
    for r in ranks:
        ray.kill(r)
    medians = {setting: statistics.median(values) for setting, values in times.items()}
    return {"world_size": world_size, "exported": all(exported), "median_s": medians,
            "recorder_ratio": _paired(times["recorder"], times["plain"]),
            "metrics_ratio": _paired(times["metrics"], times["recorder"]),
            "blocks_s": times}


def _paired(slower: List[float], faster: List[float]) -> float:
    """The median ratio of blocks timed one after the other."""
    return statistics.median(a / b for a, b in zip(slower, faster))


def format_report(rows: Sequence[Dict[str, object]]) -> str:
    """The table, in microseconds per call."""
    lines = ["| ranks | plain | recorder | recorder + metrics | recorder / plain | "
             "metrics on / off |", "|---|---|---|---|---|---|"]
    for row in rows:
        m = row["median_s"]
        lines.append(f"| {row['world_size']} | {m['plain'] * 1e6:.2f} us | "
                     f"{m['recorder'] * 1e6:.2f} us | {m['metrics'] * 1e6:.2f} us | "
                     f"{row['recorder_ratio']:.3f} | {row['metrics_ratio']:.3f} |")
    if not all(row["exported"] for row in rows):
        lines.append("(Ray cannot export metrics here: the 'metrics' column counts nothing)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure both world sizes, print the table, optionally write the figures as JSON."""
    parser = module_parser("benchmarks.observing_cost", __doc__)
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed block")
    parser.add_argument("--blocks", type=int, default=15, help="timed blocks per setting")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        rows = [measure(ray, world_size, args.calls, args.blocks) for world_size in (1, 2)]
    finally:
        ray.shutdown()
    print_and_save(format_report(rows), rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
