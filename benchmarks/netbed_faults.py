"""Cut cables on the network bed (``benchmarks.netbed``): how soon the ranks on other nodes name
a node whose link went down, over many cuts in a row, and what is left afterwards.

``python -m benchmarks.netbed_faults --cuts 20 --json benchmarks/results/netbed-cuts.json``
brings up a bed of two nodes of two ranks each (1 Gbit/s links), runs itself as the driver in
node 0's namespace, and for each cut: declares a group, has every rank loop on allreduce
(alternately 8 B and 64 MiB), cuts node 1's cable once every rank has finished a call, records
what each rank raises and how many seconds after the cut, plugs the cable back once node 0's
ranks have raised, collects node 1's ranks and destroys the group. At the end it checks that
every member actor still answers, and (outside the bed) that nothing of the bed is left.

The scenario functions are shared with the tests (``tests/support/netbed_job.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import List, Optional

import numpy as np

from . import netbed
from .cli import module_parser

RANKS_PER_NODE = 2
CALL_TIMEOUT_S = 60.0
"""The collectives' own deadline: far above the detection bound, so that an error before it
is the failure detection's, not the deadline's."""
OUTCOME_TIMEOUT_S = 90.0
SIZES = (8, 64 << 20)
RAY_LOST_PREFIX = "ray: "
"""Begins the error of a cut node's rank whose outcome Ray lost (:func:`_far_outcome`)."""


class Member:
    """A rank's actor, with nothing collective about it: groups are formed around it."""

    def pid(self) -> int:
        return os.getpid()


def start_members(nodes: int, actor_class=Member) -> list:
    """Rank r's actor, pinned to node r // RANKS_PER_NODE (by its ``node<k>`` resource)."""
    import ray
    members = [ray.remote(num_cpus=0, resources={f"node{r // RANKS_PER_NODE}": 1})(actor_class)
               .remote() for r in range(nodes * RANKS_PER_NODE)]
    ray.get([m.pid.remote() for m in members])
    return members


def _outcome(err: Exception) -> tuple:
    named = getattr(err, "dead_ranks", None) or getattr(err, "served_ranks", ())
    return type(err).__name__, str(err), time.time(), list(named)


def loop_until_error(group: str, count: int, marker: str) -> tuple:
    """Inside a member: allreduce ``count`` float32 back to back until a call fails, creating
    the file ``marker`` once the first call has returned.

    Returns:
        (error class, message, wall clock, ranks named).
    """
    import ray_collective as col
    tensor = np.ones(count, np.float32)
    calls = 0
    while True:
        try:
            col.allreduce(tensor, group, timeout=CALL_TIMEOUT_S)
        except col.CollectiveError as err:
            return _outcome(err)
        calls += 1
        if calls == 1:
            open(marker, "w").close()


def one_call(group: str) -> tuple:
    """Inside a member: one allreduce of 8 B; its outcome as :func:`loop_until_error`'s
    (error class None when it returned)."""
    import ray_collective as col
    try:
        col.allreduce(np.ones(2, np.float32), group, timeout=CALL_TIMEOUT_S)
    except col.CollectiveError as err:
        return _outcome(err)
    return None, "", time.time(), []


def wait_for_files(paths: List[str], seconds: float) -> None:
    """Return once every file of ``paths`` exists.

    Raises:
        TimeoutError: not within ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(path) for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no first call finished within {seconds} s: {paths}")
        time.sleep(0.05)


def _far_outcome(ref) -> tuple:
    """A cut node's rank's outcome; Ray's own error where the driver's connection to its actor
    broke with the cable (the rank's own error is then lost with the task's result)."""
    import ray
    try:
        return ray.get(ref, timeout=OUTCOME_TIMEOUT_S)
    except ray.exceptions.ActorUnavailableError as err:
        return f"{RAY_LOST_PREFIX}{type(err).__name__}", str(err), time.time(), []


def wait_for_members(members: list, seconds: float = OUTCOME_TIMEOUT_S) -> None:
    """Return once every member actor answers again (Ray reconnects to a cut node's actors a
    moment after the cable is back).

    Raises:
        TimeoutError: some member did not answer within ``seconds``.
    """
    import ray
    deadline = time.monotonic() + seconds
    waiting = list(members)
    while waiting:
        try:
            ray.get(waiting[0].pid.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            waiting.pop(0)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a member did not answer within {seconds} s") from None
            time.sleep(0.2)


def collect(refs: list, cut_at: float, layout: netbed.Layout) -> dict:
    """Node 0's ranks' outcomes, then (the cable plugged back once they have all raised) node
    1's: errors, messages, ranks named, seconds after the cut, by rank."""
    import ray
    near = ray.get(refs[:RANKS_PER_NODE], timeout=OUTCOME_TIMEOUT_S)
    netbed.set_link(layout, 1, up=True)
    outcomes = near + [_far_outcome(ref) for ref in refs[RANKS_PER_NODE:]]
    return {"errors": [kind for kind, *_ in outcomes],
            "messages": [message for _, message, *_ in outcomes],
            "named": [named for *_, named in outcomes],
            "seconds_after_cut": [at - cut_at for _, _, at, _ in outcomes]}


def cut_during(members: list, layout: netbed.Layout, nbytes: int, name: str) -> dict:
    """Cut node 1's cable while every rank loops on allreduce of ``nbytes``; see
    :func:`collect`. The group is destroyed afterwards."""
    import ray_collective as col
    group = f"netbed-{name}"
    col.declare_collective_group(members, backend="ray", group_name=group)
    markers = [f"{layout.directory}/{name}-{rank}.started" for rank in range(len(members))]
    refs = [m.__ray_call__.remote(
        lambda _self, r=rank: loop_until_error(group, max(nbytes // 4, 2), markers[r]))
        for rank, m in enumerate(members)]
    wait_for_files(markers, OUTCOME_TIMEOUT_S)
    cut_at = time.time()
    netbed.set_link(layout, 1, up=False)
    result = collect(refs, cut_at, layout)
    col.destroy_collective_group(group)
    wait_for_members(members)
    return result


def drive(name: str, nodes: int, cuts: int) -> dict:
    """The driver, in node 0's namespace of bed ``name``: ``cuts`` cuts, sizes alternating."""
    import ray
    layout = netbed.Layout(name, nodes, (None,) * nodes)
    ray.init(address=layout.head_address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    members = start_members(nodes)
    pids = ray.get([m.pid.remote() for m in members])
    runs = []
    for cut in range(cuts):
        nbytes = SIZES[cut % len(SIZES)]
        runs.append(dict(cut_during(members, layout, nbytes, f"cut{cut}"), nbytes=nbytes))
        print(f"cut {cut}: {nbytes} B, errors {runs[-1]['errors']}, seconds after the cut "
              f"{[round(t, 2) for t in runs[-1]['seconds_after_cut']]}", file=sys.stderr,
              flush=True)
    return {"runs": runs, "pids_before": pids,
            "pids_after": ray.get([m.pid.remote() for m in members], timeout=OUTCOME_TIMEOUT_S)}


def summarize(runs: List[dict]) -> dict:
    """Per size: the survivors' seconds after the cut (max per cut), and whether every
    survivor named exactly node 1's ranks."""
    by_size: dict = {}
    for run in runs:
        entry = by_size.setdefault(str(run["nbytes"]), {"worst_s": [], "named_node": []})
        entry["worst_s"].append(max(run["seconds_after_cut"][:RANKS_PER_NODE]))
        entry["named_node"].append(all(
            named == list(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE))
            for named in run["named"][:RANKS_PER_NODE]))
    for entry in by_size.values():
        entry.update(median_s=statistics.median(entry["worst_s"]), max_s=max(entry["worst_s"]))
    return by_size


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.netbed_faults``: see the module's docstring.

    Returns:
        The exit status.
    """
    parser = module_parser("benchmarks.netbed_faults", __doc__)
    parser.add_argument("--cuts", type=int, default=20)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--json", dest="json_path", type=pathlib.Path, default=None)
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.driver is not None:
        print("SUMMARY " + json.dumps(drive(arguments.driver, 2, arguments.cuts)), flush=True)
        return 0
    reason = netbed.unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    env = netbed.checkout_environment()
    started = time.monotonic()
    with netbed.Bed(2, arguments.link, env=env) as bed:
        name = bed.layout.name
        done = bed.run([sys.executable, "-m", "benchmarks.netbed_faults", "--cuts",
                        str(arguments.cuts), "--driver", name],
                       timeout=OUTCOME_TIMEOUT_S * 3 * arguments.cuts)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY ")]
    print("\n".join(line for line in done.stderr.splitlines() if line.startswith("cut ")),
          file=sys.stderr)
    if done.returncode or not lines:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        return 1
    found = json.loads(lines[-1][len("SUMMARY "):])
    result = {"command": " ".join(["python -m benchmarks.netbed_faults", *(argv or sys.argv[1:])]),
              "link": arguments.link, "cuts": arguments.cuts,
              "wall_s": time.monotonic() - started, "summary": summarize(found["runs"]),
              "members_alive_and_same": found["pids_before"] == found["pids_after"],
              "left_after_down": netbed.leftovers(name), **found}
    print(json.dumps({key: result[key] for key in ("summary", "members_alive_and_same",
                                                   "left_after_down", "wall_s")}, indent=1))
    if arguments.json_path is not None:
        arguments.json_path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {arguments.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
