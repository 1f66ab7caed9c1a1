"""The network bed (``benchmarks.netbed``): two Ray nodes, each in a network namespace of its own
behind a 1 Gbit/s link, two ranks each; its driver (tests/support/netbed_job.py) runs in node
0's namespace and reports what it saw as JSON, the assertions live here.

- The bed adds nothing to this machine's own network stack, and a bed whose owner died
  (SIGKILL) is found and removed by the next ``remove_stale`` (as every ``up`` does).
- A group's traffic between nodes crosses the links: each node's ``eth0`` and its token bucket
  carry at least what the allreduce must send.
- A cable cut (``eth0`` down in node 1's namespace) during an allreduce of 8 B and of 64 MiB,
  and between calls: every rank on node 0 raises ``PeerDiedError`` naming node 1's ranks
  within ``DETECTION_BOUND_S``, long before the call's deadline; node 1's ranks raise too.
- A cable out for 2 s during a loop of 64 MiB allreduces: every rank ends with right results,
  or with ``PeerDiedError`` naming ranks; none hangs.
- With the cable back, a new group of the same members works, and the ranks on node 0 shrink
  a group the cut broke to themselves, and it works; once the bed is closed nothing of it is
  left (namespaces, directory, processes).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks import netbed, netbed_faults
from ray_collective.transport import tcp
from support.paths import python_path

# The bed's job drives Ray actors from its top.
pytest.importorskip("ray", reason="the network bed's jobs run on Ray")
from support import netbed_job  # noqa: E402

pytestmark = [pytest.mark.netbed]

JOB_TIMEOUT_S = 300
RATE = "1gbit"
DETECTION_BOUND_S = tcp.LINK_TIMEOUT_S + 2 * tcp.KEEPALIVE_S
"""A stream whose peer's kernel acknowledges nothing fails after ``LINK_TIMEOUT_S`` (data in
flight) or, idle, after its first unanswered keepalive probe (``KEEPALIVE_S``) plus that
timeout; one more interval of slack for the rank to read the failure and raise."""
CUT_SCENARIOS = ["cut_8B", "cut_64MiB", "cut_before"]
CUT_NODE_RANKS = [2, 3]


@pytest.fixture(scope="module")
def available():
    reason = netbed.unavailable()
    if reason:
        pytest.skip(reason)


def _root_network():
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True,
                                      text=True, check=True).stdout)
    addresses = json.loads(subprocess.run(["ip", "-j", "addr", "show"], capture_output=True,
                                          text=True, check=True).stdout)
    return (sorted(link["ifname"] for link in links),
            sorted(a.get("local") for entry in addresses for a in entry["addr_info"]))


def test_a_crashed_bed_is_found_and_removed_and_the_host_stack_is_untouched(available):
    before = _root_network()
    crashed = subprocess.run(
        [sys.executable, "-c",
         "import os, signal; from benchmarks import netbed; "
         "layout = netbed.bring_up(2, [None, '1gbit'], os.getpid(), start_ray=False); "
         "print(layout.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=python_path()))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    name = crashed.stdout.strip()
    found = netbed.beds()
    assert sorted(found[name]["namespaces"]) == [f"{name}-n0", f"{name}-n1", f"{name}-sw"]
    assert _root_network() == before
    assert name in netbed.remove_stale()
    assert netbed.leftovers(name) == []
    assert _root_network() == before


@pytest.fixture(scope="module")
def summary(available):
    env = dict(os.environ, PYTHONPATH=python_path())
    with netbed.Bed(2, RATE, env=env) as bed:
        name = bed.layout.name
        finished = bed.run([sys.executable, "-m", "support.netbed_job", name, "2", RATE],
                           timeout=JOB_TIMEOUT_S)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert finished.returncode == 0 and lines, finished.stdout[-5000:] + finished.stderr[-5000:]
    found = json.loads(lines[-1][len("SUMMARY "):])
    found["left"] = netbed.leftovers(name)
    return found


@pytest.mark.multinode
def test_traffic_between_nodes_crosses_the_links(summary):
    crossing = summary["crossing"]
    assert crossing["correct"] == [True] * 4
    # The node leaders exchange the 64 MiB (at least half of it each way, whatever the
    # algorithm); the bucket on each node's link passed it.
    for delta in crossing["delta"]:
        assert delta["tx"] >= netbed_job.CROSSING_BYTES // 2, delta
        assert delta["rx"] >= netbed_job.CROSSING_BYTES // 2, delta
        assert delta["tbf_sent"] >= netbed_job.CROSSING_BYTES // 2, delta


@pytest.mark.multinode
@pytest.mark.parametrize("scenario", CUT_SCENARIOS)
def test_a_cut_link_is_named_on_the_other_node_within_the_bound(summary, scenario):
    seen = summary[scenario]
    near = slice(0, netbed_job.RANKS_PER_NODE)
    assert seen["errors"][near] == ["PeerDiedError"] * 2, seen["messages"]
    assert seen["named"][near] == [CUT_NODE_RANKS] * 2, seen["messages"]
    # The near rank that found the cut says why; its node-mate may have the same error as that
    # rank's report ("reported by rank r"), whichever of them came first.
    assert any("is unreachable" in m for m in seen["messages"][near]), seen["messages"]
    assert max(seen["seconds_after_cut"][near]) < DETECTION_BOUND_S, seen
    assert DETECTION_BOUND_S < netbed_job.CALL_TIMEOUT_S / 4


@pytest.mark.multinode
@pytest.mark.parametrize("scenario", CUT_SCENARIOS)
def test_the_cut_nodes_ranks_raise_too(summary, scenario):
    seen = summary[scenario]
    far = slice(netbed_job.RANKS_PER_NODE, None)
    assert all(error is not None for error in seen["errors"][far]), seen["messages"]
    assert max(seen["seconds_after_cut"][far]) < netbed_job.CALL_TIMEOUT_S, seen


@pytest.mark.multinode
def test_a_flapping_link_gives_right_results_or_names_the_cut_node(summary):
    for outcome in summary["flap"]["outcomes"]:
        kind, detail = outcome
        if kind == "ok":
            assert detail is True, summary["flap"]
        elif not kind.startswith(netbed_faults.RAY_LOST_PREFIX):
            assert kind == "PeerDiedError" and detail, summary["flap"]


@pytest.mark.multinode
def test_a_new_group_works_once_the_link_is_back(summary):
    assert summary["regroup"]["correct"] == [True] * 4


@pytest.mark.multinode
def test_the_survivors_of_a_cut_shrink_to_a_group_that_works(summary):
    seen = summary["shrink"]
    assert seen["errors"][:netbed_job.RANKS_PER_NODE] == ["PeerDiedError"] * 2, seen
    assert seen["named"][:netbed_job.RANKS_PER_NODE] == [CUT_NODE_RANKS] * 2, seen
    assert seen["survivors"] == [[0, 2, True], [1, 2, True]], seen


@pytest.mark.multinode
def test_nothing_is_left_of_the_bed(summary):
    assert summary["left"] == []
