"""What the observability tests share: running ``python -m ray_collective status`` as a user
would, and a hung call (every rank of a group but the last in an allreduce)."""

import json
import os
import subprocess
import sys
import time

import numpy as np

import ray_collective as col
from ray_collective.backends.ray import status
from support.paths import python_path

HUNG_TIMEOUT_S = 60.0
"""The hung call's deadline: longer than any wait of the tests (the last rank ends it)."""


def status_json(address, group=None, timeout=60):
    """``python -m ray_collective status [GROUP] --json --address ADDRESS`` in a process of its
    own; returns (its answer, its wall time in seconds)."""
    command = [sys.executable, "-m", "ray_collective", "status", "--json", "--address", address]
    started = time.monotonic()
    finished = subprocess.run(command + ([group] if group else []), capture_output=True,
                              text=True, timeout=timeout, check=False,
                              env=dict(os.environ, PYTHONPATH=python_path()))
    wall = time.monotonic() - started
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return json.loads(finished.stdout), wall


def allreduce_once(rank, group, timeout=HUNG_TIMEOUT_S):
    """One allreduce of 4 float64 on ``group``; returns its result."""
    x = np.full(4, float(rank))
    col.allreduce(x, group, timeout=timeout)
    return x


def wait_until_in_call(address, group, ranks, deadline_s=60.0):
    """Wait (reading the pages as status does, in this process) until every rank of ``ranks``
    is inside a call of ``group``."""
    deadline = time.monotonic() + deadline_s
    while True:
        groups = status.collect(address, group)["groups"]
        if groups and all(groups[0]["members"][r]["call"] is not None for r in ranks):
            return
        assert time.monotonic() < deadline, groups
        time.sleep(0.05)
