"""The driver of the network-bed tests (tests/test_netbed.py), run inside the head node's
namespace of a bed (``benchmarks.netbed``): two nodes of two ranks each, rank r on node r // 2;
prints one ``SUMMARY {json}`` line.

``python -m support.netbed_job BED NODES``. What it records (the cut scenarios are
``benchmarks.netbed_faults``'s, which runs them many times in a row):

- ``crossing``: one allreduce of 64 MiB float32, checked against numpy, and how many bytes each
  node's link (``eth0`` in its namespace) and its token bucket carried meanwhile;
- ``cut_8B`` / ``cut_64MiB``: every rank loops on allreduce of that size; once every rank has
  finished a call (each writes a marker file), node 1's cable is cut (``eth0`` down in its
  namespace): what each rank raises, the ranks it names, and how many seconds after the cut;
  the cable is plugged back once node 0's ranks have raised;
- ``cut_before``: the cable cut between calls, then every rank calls allreduce 8 B;
- ``flap``: node 1's cable out for 2 s while every rank loops on checked allreduces of 64 MiB:
  each rank's outcome, every result right or the error and the ranks it names;
- ``regroup``: after the cable is back, a new group of the same members, one allreduce checked
  against numpy;
- ``shrink``: node 1's cable cut during a loop of 8 B allreduces; once node 0's ranks have
  raised, the cable is plugged back and node 0's ranks shrink the group to themselves
  (``shrink_collective_group`` in each) and run an allreduce in it, checked against numpy.
"""

import json
import os
import sys
import time

import numpy as np
import ray

import ray_collective as col
from benchmarks import netbed, netbed_faults
from benchmarks.netbed_faults import CALL_TIMEOUT_S, OUTCOME_TIMEOUT_S, RANKS_PER_NODE
from support.helpers import Member, numpy_reduce, rank_data

CROSSING_BYTES = 64 << 20
SIZES = {"cut_8B": 8, "cut_64MiB": 64 << 20}
FLAP_S = 2.0
FLAP_CALLS = 8
"""At 1 Gbit/s a 64 MiB allreduce between two nodes takes about 0.6 s: the flap falls inside
the loop."""


def _checked_allreduce(rank: int, group: str, world_size: int, count: int) -> bool:
    tensor = rank_data(rank, count, "float32")
    col.allreduce(tensor, group, timeout=CALL_TIMEOUT_S)
    expected = numpy_reduce([rank_data(r, count, "float32") for r in range(world_size)],
                            col.ReduceOp.SUM)
    return bool(np.allclose(tensor, expected, rtol=1e-5, atol=1e-3))


def _all_checked(members: list, group: str, count: int) -> list:
    col.declare_collective_group(members, backend="ray", group_name=group)
    return ray.get([m.__ray_call__.remote(
        lambda _self, r=r: _checked_allreduce(r, group, len(members), count))
        for r, m in enumerate(members)], timeout=OUTCOME_TIMEOUT_S)


def cut_before(members: list, layout) -> dict:
    group = "netbed-cut-before"
    assert all(_all_checked(members, group, 2))
    cut_at = time.time()
    netbed.set_link(layout, 1, up=False)
    refs = [m.__ray_call__.remote(lambda _self: netbed_faults.one_call(group)) for m in members]
    result = netbed_faults.collect(refs, cut_at, layout)
    col.destroy_collective_group(group)
    netbed_faults.wait_for_members(members)
    return result


def crossing(members: list, layout) -> dict:
    group = "netbed-crossing"
    before = [netbed.link_bytes(layout, node) for node in range(layout.nodes)]
    correct = _all_checked(members, group, CROSSING_BYTES // 4)
    after = [netbed.link_bytes(layout, node) for node in range(layout.nodes)]
    col.destroy_collective_group(group)
    return {"correct": correct,
            "delta": [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]}


def regroup(members: list) -> dict:
    group = "netbed-regroup"
    correct = _all_checked(members, group, 1000)
    col.destroy_collective_group(group)
    return {"correct": correct}


def _shrink_and_check(group: str) -> list:
    """Inside a survivor: shrink ``group``, then one checked allreduce in what it became:
    [new rank, new world size, result right]."""
    rank = col.shrink_collective_group(group, timeout=CALL_TIMEOUT_S)
    world_size = col.get_collective_group_size(group)
    return [rank, world_size, _checked_allreduce(rank, group, world_size, 1000)]


def shrink(members: list, layout) -> dict:
    """Node 1's cable cut during 8 B allreduces; with it back, node 0's ranks shrink the group
    to themselves and allreduce in it (``netbed_faults.collect``: node 0's outcomes, then
    the cable, then node 1's)."""
    group = "netbed-shrink"
    col.declare_collective_group(members, backend="ray", group_name=group)
    markers = [f"{layout.directory}/shrink-{r}.started" for r in range(len(members))]
    refs = [m.__ray_call__.remote(
        lambda _self, r=r: netbed_faults.loop_until_error(group, 2, markers[r]))
        for r, m in enumerate(members)]
    netbed_faults.wait_for_files(markers, OUTCOME_TIMEOUT_S)
    cut_at = time.time()
    netbed.set_link(layout, 1, up=False)
    cut = netbed_faults.collect(refs, cut_at, layout)
    survivors = ray.get([m.__ray_call__.remote(lambda _self: _shrink_and_check(group))
                         for m in members[:RANKS_PER_NODE]], timeout=OUTCOME_TIMEOUT_S)
    col.destroy_collective_group(group)
    netbed_faults.wait_for_members(members)
    return {"errors": cut["errors"], "named": cut["named"], "survivors": survivors}


def _checked_loop(rank: int, group: str, world_size: int, count: int, calls: int,
                  marker: str) -> tuple:
    """Inside a member: ``calls`` allreduces of ``count`` float32, each checked against numpy,
    ``marker`` created once the first has returned: ("ok", every result right) or the first
    error's (class, ranks named)."""
    expected = numpy_reduce([rank_data(r, count, "float32") for r in range(world_size)],
                            col.ReduceOp.SUM)
    right = True
    for call in range(calls):
        tensor = rank_data(rank, count, "float32")
        try:
            col.allreduce(tensor, group, timeout=CALL_TIMEOUT_S)
        except col.CollectiveError as err:
            return type(err).__name__, list(getattr(err, "dead_ranks", ()) or ())
        right = right and bool(np.allclose(tensor, expected, rtol=1e-5, atol=1e-3))
        if call == 0:
            open(marker, "w").close()
    return "ok", right


def flap(members: list, layout) -> dict:
    """Node 1's cable out for FLAP_S while every rank runs FLAP_CALLS checked allreduces of
    64 MiB: what each rank ends with."""
    group = "netbed-flap"
    col.declare_collective_group(members, backend="ray", group_name=group)
    markers = [f"{layout.directory}/flap-{r}.started" for r in range(len(members))]
    refs = [m.__ray_call__.remote(lambda _self, r=r: _checked_loop(
        r, group, len(members), CROSSING_BYTES // 4, FLAP_CALLS, markers[r]))
        for r, m in enumerate(members)]
    netbed_faults.wait_for_files(markers, OUTCOME_TIMEOUT_S)
    netbed.set_link(layout, 1, up=False)
    time.sleep(FLAP_S)  # the flap's length is the scenario, not a wait for an event
    netbed.set_link(layout, 1, up=True)
    outcomes = []
    for ref in refs:
        try:
            outcomes.append(list(ray.get(ref, timeout=OUTCOME_TIMEOUT_S)))
        except ray.exceptions.ActorUnavailableError as err:
            outcomes.append([f"{netbed_faults.RAY_LOST_PREFIX}{type(err).__name__}", []])
    col.destroy_collective_group(group)
    netbed_faults.wait_for_members(members)
    return {"outcomes": outcomes}


def main(name: str, nodes: int, rate: str) -> dict:
    layout = netbed.Layout(name, nodes, (rate,) * nodes)
    ray.init(address=layout.head_address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    members = netbed_faults.start_members(nodes, Member)
    summary = {"crossing": crossing(members, layout)}
    for scenario, nbytes in SIZES.items():
        summary[scenario] = netbed_faults.cut_during(members, layout, nbytes, scenario)
    summary["cut_before"] = cut_before(members, layout)
    summary["flap"] = flap(members, layout)
    summary["regroup"] = regroup(members)
    summary["shrink"] = shrink(members, layout)
    return summary


if __name__ == "__main__":
    print("SUMMARY " + json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])), flush=True)
