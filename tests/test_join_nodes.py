"""The join benchmark across nodes (``benchmarks.join_nodes``): its summary, and a real run on
a two-node local cluster (in a subprocess, since a cluster cannot share the suite's Ray)."""

import json
import subprocess
import sys

import pytest

from benchmarks.join_nodes import summary
from support.helpers import run_benchmark
from support.paths import REPO_DIR


def test_summary_is_the_median_per_transport():
    repeats = {"streams": [{"join_s": 3.0, "join_and_call_s": 4.0},
                           {"join_s": 1.0, "join_and_call_s": 9.0},
                           {"join_s": 2.0, "join_and_call_s": 5.0}],
               "object_store": []}
    assert summary(repeats) == {"streams": {"join_s": 2.0, "join_and_call_s": 5.0}}


@pytest.mark.multinode
def test_a_two_node_run_joins_over_both_transports_and_checks_the_first_call(tmp_path):
    out = tmp_path / "join.json"
    completed = run_benchmark("benchmarks.join_nodes", "--nodes", "2", "--ranks-per-node", "1",
                              "--repeats", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert set(report["repeats"]) == {"streams", "object_store"}
    for rows in report["repeats"].values():
        assert len(rows) == 2
        assert all(0 < row["join_s"] <= row["join_and_call_s"] for row in rows)
    assert "streams " in completed.stdout and "object_store " in completed.stdout


@pytest.mark.parametrize("arguments", [["--nodes", "1"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(arguments):
    completed = subprocess.run([sys.executable, "-m", "benchmarks.join_nodes", *arguments],
                               cwd=REPO_DIR, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "need --nodes >= 2" in completed.stderr
