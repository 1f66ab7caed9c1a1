"""A Ray instance whose node exports metrics on a Prometheus endpoint, a group of 2 members that
makes calls of known sizes and one that times out, and the endpoint scraped as Prometheus would;
prints one ``SUMMARY {json}`` line (tests/test_metrics.py asserts on it).

Run in a process of its own (``python -m support.metrics_job PORT``): the test session's Ray
exports no metrics.
"""

import json
import re
import sys
import time
import urllib.request

import numpy as np
import ray

import ray_collective as col
from support.paths import python_path

GROUP = "metered"
ALLREDUCES, BROADCASTS = 7, 3
ALLREDUCE_ELEMENTS, BROADCAST_ELEMENTS = 100, 10
"""float32 and int64: 400 and 80 bytes per call."""
SCRAPE_DEADLINE_S = 60.0
SAMPLE = re.compile(r'^(ray_collective_\w+)\{(.*)\} ([0-9.e+-]+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


@ray.remote(num_cpus=0)
class Member:
    def calls(self, rank):
        x = np.ones(ALLREDUCE_ELEMENTS, np.float32)
        y = np.arange(BROADCAST_ELEMENTS, dtype=np.int64)
        for _ in range(ALLREDUCES):
            col.allreduce(x, GROUP)
        for _ in range(BROADCASTS):
            col.broadcast(y, 0, GROUP)
        if rank == 0:                                # rank 1 never comes: a timeout
            try:
                col.allreduce(x, GROUP, timeout=0.5)
            except col.CollectiveTimeoutError:
                pass
        return True


def scrape(port):
    """``{"metric|collective or kind|le": value summed over the workers}`` of our metrics, and
    the counters' by rank too (``"rank R|metric|..."``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match:
            continue
        labels = dict(LABEL.findall(match.group(2)))
        if labels.get("group") != GROUP:
            continue
        key = f"{match.group(1)}|{labels.get('collective', labels.get('kind', ''))}" \
              f"|{labels.get('le', '')}"
        found[key] = found.get(key, 0.0) + float(match.group(3))
        if match.group(1).endswith("_total"):
            by_rank = f"rank {labels.get('rank')}|{key}"
            found[by_rank] = found.get(by_rank, 0.0) + float(match.group(3))
    return found


def main(port):
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR",
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 500},
             runtime_env={"env_vars": {"PYTHONPATH": python_path()}})
    members = [Member.remote() for _ in range(2)]
    col.declare_collective_group(members, group_name=GROUP)
    ray.get([m.calls.remote(rank) for rank, m in enumerate(members)], timeout=120)
    col.destroy_collective_group(GROUP)          # each member hands its last counts to Ray
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    found = {}
    while time.monotonic() < deadline:
        found = scrape(port)
        if found.get("ray_collective_errors_total|CollectiveTimeoutError|") and \
                found.get("ray_collective_calls_total|broadcast|", 0) >= 2 * BROADCASTS:
            break
        time.sleep(0.5)
    ray.shutdown()
    print("SUMMARY " + json.dumps(found))


if __name__ == "__main__":
    main(int(sys.argv[1]))
