"""Join time of a group that spans nodes: direct streams against the object store, interleaved.

``python -m benchmarks.join_nodes --nodes 4 --ranks-per-node 2 --repeats 5 [--json PATH]``
starts a local cluster of that many nodes (``nodes.start_local_cluster``) with the rank actors
pinned to them in blocks, then, in every repeat, creates one group with each cross-node
transport in turn (the order alternating from one repeat to the next), every member calling
``init_collective_group`` with ``RAY_COLLECTIVE_CROSS_NODE`` set in its own process, and times:

- **join**: the slowest member's ``init_collective_group``;
- **join and first call**: the slowest member's join followed by one 4-element allreduce,
  checked (over streams the first message to another node opens a stream; over the object
  store it waits for the nodes' post offices to start).

Then it destroys the group. It prints the medians; ``--json`` keeps every repeat.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ray_collective.backends.ray.environment import CROSS_NODE_TRANSPORTS, CROSS_NODE_VARIABLE

from .cli import module_parser, print_and_save
from .nodes import local_cluster_driver, pick_nodes, pinned, rank_nodes

ALLREDUCE_ELEMENTS = 4


class JoinRank:
    """One member: joins a group over a given cross-node transport and leaves it."""

    def __init__(self):
        import ray_collective  # noqa: F401  (the import is not part of the join)

    def join(self, world_size: int, rank: int, group: str, transport: str) -> Tuple[float, float]:
        """Join ``group`` over ``transport``, then allreduce once; (join s, join + call s).

        Raises:
            AssertionError: the allreduce's result is wrong.
        """
        import numpy as np

        import ray_collective as col
        previous = os.environ.get(CROSS_NODE_VARIABLE)
        os.environ[CROSS_NODE_VARIABLE] = transport
        try:
            started = time.perf_counter()
            col.init_collective_group(world_size, rank, backend="ray", group_name=group)
            joined = time.perf_counter() - started
        finally:
            if previous is None:
                del os.environ[CROSS_NODE_VARIABLE]
            else:
                os.environ[CROSS_NODE_VARIABLE] = previous
        tensor = np.full(ALLREDUCE_ELEMENTS, rank + 1, np.int64)
        col.allreduce(tensor, group)
        called = time.perf_counter() - started
        assert (tensor == world_size * (world_size + 1) // 2).all(), tensor
        return joined, called

    def leave(self, group: str) -> None:
        """Destroy this member's part of ``group``."""
        import ray_collective as col
        col.destroy_collective_group(group)


def summary(repeats: Dict[str, List[dict]]) -> Dict[str, dict]:
    """Per transport: the medians of the join and of the join and first call, in seconds.

    Args:
        repeats: per transport, one ``{"join_s", "join_and_call_s"}`` per repeat.
    """
    return {transport: {key: statistics.median(r[key] for r in rows)
                        for key in ("join_s", "join_and_call_s")}
            for transport, rows in repeats.items() if rows}


def measure(nodes: int, ranks_per_node: int, repeats: int) -> dict:
    """Start the cluster and the members, time ``repeats`` joins per transport, stop it all.

    Returns:
        ``{"date", "nodes", "ranks_per_node", "repeats": {transport: [...]}, "median": ...}``.
    """
    import ray
    world_size = nodes * ranks_per_node
    with local_cluster_driver(nodes):
        node_ids = pick_nodes(nodes)
        member = ray.remote(num_cpus=0)(JoinRank)
        actors = [member.options(**pinned(node_ids[node])).remote()
                  for node in rank_nodes(world_size, nodes)]
        ray.get([actor.__ray_ready__.remote() for actor in actors])
        results: Dict[str, List[dict]] = {transport: [] for transport in CROSS_NODE_TRANSPORTS}
        for repeat in range(repeats):
            order = CROSS_NODE_TRANSPORTS if repeat % 2 == 0 else CROSS_NODE_TRANSPORTS[::-1]
            for transport in order:
                group = f"join-{transport}-{repeat}"
                times = ray.get([actor.join.remote(world_size, rank, group, transport)
                                 for rank, actor in enumerate(actors)])
                ray.get([actor.leave.remote(group) for actor in actors])
                results[transport].append({"join_s": max(t[0] for t in times),
                                           "join_and_call_s": max(t[1] for t in times)})
        return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes": nodes,
                "ranks_per_node": ranks_per_node, "repeats": results,
                "median": summary(results)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run from the command line; returns the exit status."""
    parser = module_parser("benchmarks.join_nodes", __doc__)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write every repeat to this file")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 1 or args.repeats < 1:
        parser.error("need --nodes >= 2, --ranks-per-node >= 1 and --repeats >= 1")
    report = measure(args.nodes, args.ranks_per_node, args.repeats)
    print_and_save("\n".join(
        f"{transport:13s} join {median['join_s']:.3f} s, join and first allreduce "
        f"{median['join_and_call_s']:.3f} s (medians of {args.repeats})"
        for transport, median in report["median"].items()), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
