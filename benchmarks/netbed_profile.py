"""Where a collective's bytes go on the network bed (``benchmarks.netbed``): for each algorithm
and size asked for, the time of a few calls and the bytes each node's link carried per call.

``python -m benchmarks.netbed_profile --nodes 4 --link 1gbit --collective broadcast --bytes 256M
--algorithms auto,hierarchical_pipeline`` brings up a bed of ``--nodes`` nodes of two ranks
each, runs itself as the driver in node 0's namespace and, per algorithm (``auto``: the
selector's choice; any other name is forced with ``RAY_COLLECTIVE_ALGORITHM`` in every rank
before its group forms), declares a group, makes one untimed call, then ``--iters`` calls back
to back on every rank (root rank 0), each rank's time divided by the calls, and reads every
node's ``eth0`` counters (``ip -s link`` in its namespace) before and after. A row gives the
slowest rank's time per call, its ratio to the link bound (``benchmarks.netbed_bench``), and
per node the bytes sent and received per call over the message's size: the busiest link's
share sets the bound an algorithm can reach. The bed is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import List, Optional

import numpy as np

from . import netbed, netbed_bench, netbed_faults
from .cli import module_parser, parse_size

AUTO = "auto"
CALL_TIMEOUT_S = 300.0


def _force(collective: str, forced: Optional[str]) -> None:
    """Inside a member: the algorithm the next group this rank forms runs (None: the
    selector's), read when the group forms."""
    from ray_collective.algorithms.selector import ENVIRONMENT_VARIABLE
    if forced is None:
        os.environ.pop(ENVIRONMENT_VARIABLE, None)
    else:
        os.environ[ENVIRONMENT_VARIABLE] = f"{collective}={forced}"


def _time_calls(group: str, collective: str, count: int, iterations: int) -> float:
    """Inside a member: an 8 B allreduce (the ranks start together), then ``iterations`` calls
    of ``collective`` back to back; seconds per call."""
    import ray_collective as col
    tensor = np.ones(count, np.float32)
    call = {"broadcast": lambda: col.broadcast(tensor, 0, group, timeout=CALL_TIMEOUT_S),
            "allreduce": lambda: col.allreduce(tensor, group, timeout=CALL_TIMEOUT_S)}[collective]
    col.allreduce(np.ones(2, np.float32), group, timeout=CALL_TIMEOUT_S)
    started = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - started) / max(iterations, 1)


def drive(name: str, nodes: int, collective: str, sizes: List[int], algorithms: List[str],
          iterations: int) -> List[dict]:
    """The driver, in node 0's namespace of bed ``name``: one row per size and algorithm."""
    import ray
    import ray_collective as col
    layout = netbed.Layout(name, nodes, (None,) * nodes)
    ray.init(address=layout.head_address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    members = netbed_faults.start_members(nodes)
    rows = []
    for nbytes, algorithm in ((n, a) for n in sizes for a in algorithms):
        group = f"profile-{algorithm}-{nbytes}"
        forced = None if algorithm == AUTO else algorithm
        ray.get([m.__ray_call__.remote(lambda _self, f=forced: _force(collective, f))
                 for m in members], timeout=CALL_TIMEOUT_S)
        col.declare_collective_group(members, backend="ray", group_name=group)
        # One untimed call alone, so that the counters see only the timed calls.
        ray.get([m.__ray_call__.remote(lambda _self: _time_calls(
            group, collective, max(nbytes // 4, 1), 1)) for m in members],
            timeout=CALL_TIMEOUT_S * 2)
        before = [netbed.link_bytes(layout, node) for node in range(nodes)]
        seconds = ray.get([m.__ray_call__.remote(lambda _self: _time_calls(
            group, collective, max(nbytes // 4, 1), iterations)) for m in members],
            timeout=CALL_TIMEOUT_S * (iterations + 2))
        after = [netbed.link_bytes(layout, node) for node in range(nodes)]
        col.destroy_collective_group(group)
        # Each timed call's warm-up allreduce of 8 B is noise beside the counters' megabytes.
        rows.append({"algorithm": algorithm, "nbytes": nbytes, "seconds_per_call": max(seconds),
                     "tx_per_call_over_size": [round((a["tx"] - b["tx"]) / iterations / nbytes,
                                                     3) for a, b in zip(after, before)],
                     "rx_per_call_over_size": [round((a["rx"] - b["rx"]) / iterations / nbytes,
                                                     3) for a, b in zip(after, before)]})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.netbed_profile``: see the module's docstring.

    Returns:
        The exit status.
    """
    parser = module_parser("benchmarks.netbed_profile", __doc__)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--collective", choices=("broadcast", "allreduce"), default="broadcast")
    parser.add_argument("--bytes", default="256M", help="sizes, comma-separated")
    parser.add_argument("--algorithms", default=AUTO)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", dest="json_path", type=pathlib.Path, default=None)
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    sizes = [parse_size(text) for text in arguments.bytes.split(",") if text]
    algorithms = [a for a in arguments.algorithms.split(",") if a]
    if arguments.driver is not None:
        rows = drive(arguments.driver, arguments.nodes, arguments.collective, sizes, algorithms,
                     arguments.iters)
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    reason = netbed.unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    env = netbed.checkout_environment()
    with netbed.Bed(arguments.nodes, arguments.link, env=env) as bed:
        done = bed.run([sys.executable, "-m", "benchmarks.netbed_profile", "--nodes",
                        str(arguments.nodes), "--collective", arguments.collective, "--bytes",
                        arguments.bytes, "--algorithms", arguments.algorithms, "--iters",
                        str(arguments.iters), "--driver", bed.layout.name],
                       timeout=CALL_TIMEOUT_S * (arguments.iters + 2) * len(algorithms)
                       * len(sizes))
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode or not lines:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        return 1
    rows = []
    for row in json.loads(lines[-1][len("ROWS "):]):
        bound = netbed_bench.link_bound_s(arguments.collective, row["nbytes"], arguments.nodes,
                                          arguments.link)
        rows.append(dict(row, link_bound_s=bound,
                         ratio_to_bound=row["seconds_per_call"] / bound if bound else None))
    for row in rows:
        ratio = row["ratio_to_bound"]
        print(f"{row['nbytes']:>10} {row['algorithm']:>22} "
              f"{row['seconds_per_call'] * 1e3:9.1f} ms"
              f"{f' ({ratio:.2f}x bound)' if ratio else ''}  tx/S {row['tx_per_call_over_size']}"
              f"  rx/S {row['rx_per_call_over_size']}")
    if arguments.json_path is not None:
        arguments.json_path.write_text(json.dumps({
            "command": " ".join(["python -m benchmarks.netbed_profile", *(argv or sys.argv[1:])]),
            "nodes": arguments.nodes, "ranks_per_node": netbed_faults.RANKS_PER_NODE,
            "link": arguments.link, "collective": arguments.collective, "rows": rows},
            indent=1) + "\n")
        print(f"wrote {arguments.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
