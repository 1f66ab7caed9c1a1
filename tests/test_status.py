"""``python -m ray_collective status`` on a hung group of this session's Ray instance: a group of
4 where rank 3 never calls, read by the command as a user runs it (a process of its own, from
the driver's machine): the three ranks in the allreduce, rank 3 idle, ``waiting_for == [3]``,
answered within 2 s; the table says the same. The 2-node version is in
tests/test_status_nodes.py."""

import os
import subprocess
import sys

import ray_collective as col
from ray_collective.backends.ray import status
from support.helpers import run_in
from support.observing import allreduce_once, status_json, wait_until_in_call
from support.paths import python_path

GROUP = "status-hung"


def _address(ray):
    return ray.get_runtime_context().gcs_address


def test_status_names_the_rank_that_never_calls(ray_session, members, record_property):
    actors = members[:4]
    address = _address(ray_session)
    col.declare_collective_group(actors, group_name=GROUP)
    try:
        hung = [actor.__ray_call__.remote(lambda _self, r=rank: allreduce_once(r, GROUP))
                for rank, actor in enumerate(actors[:3])]
        wait_until_in_call(address, GROUP, [0, 1, 2])
        answer, wall = status_json(address, GROUP)
        table = subprocess.run([sys.executable, "-m", "ray_collective", "status", GROUP,
                                "--address", address], capture_output=True, text=True,
                               timeout=60, env=dict(os.environ, PYTHONPATH=python_path()), check=True).stdout
        # rank 3 comes at last: the call completes on every rank, the members stay usable
        last = actors[3].__ray_call__.remote(lambda _self: allreduce_once(3, GROUP))
        results = ray_session.get(hung + [last], timeout=120)
    finally:
        col.destroy_collective_group(GROUP)
    record_property("status_wall_s", round(wall, 3))
    record_property("status_took_s", answer["took_s"])
    (group,) = answer["groups"]
    assert (group["name"], group["backend"], group["world_size"]) == (GROUP, "ray", 4)
    assert group["waiting_for"] == [3]
    assert [m["rank"] for m in group["members"]] == [0, 1, 2, 3]
    pids = run_in(ray_session, actors, lambda rank: __import__("os").getpid())
    assert [m["pid"] for m in group["members"]] == pids
    for member in group["members"][:3]:
        assert member["call"]["collective"] == "allreduce" and member["call"]["seq"] == 0
        assert member["call"]["since_s"] >= 0
        assert member["actor"].startswith("Member ")
    assert group["members"][3]["call"] is None
    assert answer["took_s"] < 2.0
    assert "waiting for ranks [3]" in table and "allreduce #0" in table
    for result in results:
        assert list(result) == [6.0] * 4


def test_status_of_a_group_that_is_not_there(ray_session):
    answer = status.collect(_address(ray_session), "no-such-group")
    assert answer == {"groups": []}
    assert "no ray_collective group" in status.format_table(answer)


def test_status_without_a_cluster_says_so():
    finished = subprocess.run([sys.executable, "-m", "ray_collective", "status", "--address",
                               "127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=python_path()))
    assert finished.returncode != 0


def test_an_unknown_command_prints_the_usage():
    finished = subprocess.run([sys.executable, "-m", "ray_collective", "stats"],
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=python_path()))
    assert finished.returncode == 2 and "usage" in finished.stderr
