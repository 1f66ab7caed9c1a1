"""Metrics through Ray's metrics API, read from the node's Prometheus endpoint the way
Prometheus would (tests/support/metrics_job.py, a Ray instance of its own): a group of 2 makes 7
allreduces of 400 B and 3 broadcasts of 80 B, and rank 0 one allreduce that times out. The
endpoint shows every call and its bytes per collective (summed over the two workers), the
timeout among the errors by kind, and the latency histogram's count (fewer calls than the
flight recorder holds: every call is observed)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from support import extras
from support.paths import python_path

# The job that makes the metrics defines its actors at its top, with Ray's decorator.
pytest.importorskip("ray", reason="the metrics job runs on Ray")
from support.metrics_job import (ALLREDUCE_ELEMENTS, ALLREDUCES, BROADCAST_ELEMENTS,  # noqa: E402
                                 BROADCASTS)

pytestmark = pytest.mark.ray


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def scraped():
    extras.need("prometheus_client", "Ray's metrics agent (the node's metrics endpoint)")
    env = dict(os.environ, PYTHONPATH=python_path())
    finished = subprocess.run([sys.executable, "-m", "support.metrics_job", str(_free_port())],
                              capture_output=True, text=True, timeout=300, env=env, check=False)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert finished.returncode == 0 and lines, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(lines[-1][len("SUMMARY "):])


def test_calls_and_bytes_per_collective(scraped):
    allreduces = 2 * ALLREDUCES + 1                  # and rank 0's that timed out
    assert scraped["ray_collective_calls_total|allreduce|"] == allreduces
    assert scraped["ray_collective_bytes_total|allreduce|"] == allreduces * ALLREDUCE_ELEMENTS * 4
    assert scraped["ray_collective_calls_total|broadcast|"] == 2 * BROADCASTS
    assert scraped["ray_collective_bytes_total|broadcast|"] == 2 * BROADCASTS * BROADCAST_ELEMENTS * 8


def test_errors_are_counted_by_kind(scraped):
    errors = {key: value for key, value in scraped.items()
              if key.startswith("ray_collective_errors_total|")}
    assert errors == {"ray_collective_errors_total|CollectiveTimeoutError|": 1}


def test_the_latency_histogram_observes_every_call(scraped):
    assert scraped["ray_collective_call_seconds_count|allreduce|"] == 2 * ALLREDUCES + 1
    assert scraped["ray_collective_call_seconds_count|broadcast|"] == 2 * BROADCASTS
    # the timed-out call took its 0.5 s deadline: it is above the 0.3 s bucket
    assert scraped["ray_collective_call_seconds_bucket|allreduce|0.3"] <= 2 * ALLREDUCES
    assert scraped["ray_collective_call_seconds_sum|allreduce|"] >= 0.5


def test_every_counter_is_labelled_by_rank(scraped):
    """Rank 0 made every call rank 1 made, and the one that timed out."""
    assert scraped["rank 0|ray_collective_calls_total|allreduce|"] == ALLREDUCES + 1
    assert scraped["rank 1|ray_collective_calls_total|allreduce|"] == ALLREDUCES
    assert scraped["rank 1|ray_collective_calls_total|broadcast|"] == BROADCASTS
    assert scraped["rank 0|ray_collective_errors_total|CollectiveTimeoutError|"] == 1
    assert not [key for key in scraped if key.startswith("rank None")]
