"""The benchmarks across nodes (``--nodes K``): the flags, the pinning of ranks to nodes, the
object-store peer, the page's part across nodes, and a tiny sweep on a local cluster of two.
"""

import json
import os

import pytest
import ray_collective as col

from benchmarks.cli import build_parser, options_from_arguments
from benchmarks.nodes import order_nodes, pinned, rank_nodes
from benchmarks.peers import CROSS_NODE_VARIABLE, PEERS
from benchmarks.report import format_progress, format_ranks, format_table
from benchmarks.report_page import BEGIN, END, markers, render, replace_between_markers
from benchmarks.rows import Row, summarize_point
from benchmarks.sweep import SweepOptions
from support.helpers import run_benchmark


MIB = 2**20

# ---------------------------------------------------------------- across nodes (--nodes K)

def test_nodes_flags_make_world_sizes_of_nodes_times_ranks_per_node():
    parser = build_parser()
    options = options_from_arguments(parser.parse_args(
        ["--nodes", "4", "--ranks-per-node", "2,4", "--baseline", "torch"]), parser)
    assert options.nodes == 4 and options.world_sizes == (8, 16)
    assert options.backends == ("ray", "ray-object-store", "torch", "gloo", "ray-plain")
    assert options.baseline == "torch"
    defaults = options_from_arguments(parser.parse_args(["--nodes", "2"]), parser)
    assert (defaults.world_sizes, defaults.baseline) == ((4,), "ray")
    chosen = options_from_arguments(parser.parse_args(
        ["--nodes", "3", "--ranks-per-node", "1", "--backends", "ray"]), parser)
    assert (chosen.world_sizes, chosen.backends) == ((3,), ("ray",))
    one_node = options_from_arguments(parser.parse_args([]), parser)
    assert one_node.nodes is None and one_node.world_sizes == (2, 4, 8)


@pytest.mark.parametrize("bad, message", [
    (["--nodes", "0"], "must be >= 1"),
    (["--nodes", "2", "--ranks-per-node", "0"], "must be >= 1"),
    (["--nodes", "2", "--world-size", "4"], "give --ranks-per-node, not --world-size"),
    (["--ranks-per-node", "2"], "--ranks-per-node needs --nodes"),
    (["--nodes", "2", "--backends", "ray,mpi4py"], "--nodes cannot run mpi4py"),
    (["--nodes", "2", "--backends", "ray", "--baseline", "torch"], "not among --backends"),
])
def test_nodes_flags_refuse_what_cannot_run_across_nodes(bad, message, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        options_from_arguments(parser.parse_args(bad), parser)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_ranks_are_pinned_to_nodes_evenly_in_blocks():
    assert rank_nodes(4, 2) == (0, 0, 1, 1)
    assert rank_nodes(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert rank_nodes(16, 4) == tuple(rank // 4 for rank in range(16))
    assert rank_nodes(3, 1) == (0, 0, 0)
    for world_size, nodes in ((6, 4), (2, 4), (4, 0)):
        with pytest.raises(ValueError, match="cannot be spread evenly"):
            rank_nodes(world_size, nodes)


def _node(node_id, address="10.0.0.1", *resources):
    return {"NodeID": node_id, "NodeManagerAddress": address,
            "Resources": {"CPU": 1.0, **{name: 1.0 for name in resources}}}


def test_nodes_are_ordered_driver_first_and_a_local_cluster_by_its_node_resources():
    local = [_node("c", "127.0.0.1", "node2"), _node("a", "127.0.0.1", "node0"),
             _node("b", "127.0.0.1", "node1")]
    assert order_nodes(local, "a", 3) == ["a", "b", "c"]
    assert order_nodes(local, "a", 2) == ["a", "b"]
    other = [_node("z", "10.0.0.3"), _node("y", "10.0.0.2"), _node("x", "10.0.0.9")]
    assert order_nodes(other, "x", 3) == ["x", "y", "z"]   # driver's node, then by address
    assert order_nodes(local, "c", 2) == ["c", "a"]        # rank 0 stays on the driver's node
    with pytest.raises(RuntimeError, match="needs 4 nodes but the Ray cluster has 3 alive"):
        order_nodes(other, "x", 4)


def test_a_pinned_actor_may_run_on_its_node_only():
    pytest.importorskip("ray", reason="the strategy is Ray's")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    assert pinned(None) == {}
    strategy = pinned("ab" * 28)["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert (strategy.node_id, strategy.soft) == ("ab" * 28, False)


class _RecordingApi:
    """A stand-in for ``ray_collective`` that records the transport variable at group creation."""

    __version__ = "0.test"

    def __init__(self):
        self.seen = []

    def init_collective_group(self, world_size, rank, backend, group_name, timeout):
        self.seen.append((group_name, os.environ.get(CROSS_NODE_VARIABLE)))


@pytest.mark.parametrize("before", [None, "streams", "object_store"])
def test_object_store_peer_creates_its_group_with_the_object_store_transport(before,
                                                                             monkeypatch):
    if before is None:
        monkeypatch.delenv(CROSS_NODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(CROSS_NODE_VARIABLE, before)
    api = _RecordingApi()
    infos = []
    for name in ("ray-object-store", "ray"):
        peer = PEERS[name]()
        monkeypatch.setattr(peer, "module", lambda: api)
        infos.append(peer.setup(4, 1, f"bench-{name}", 5.0))
        assert os.environ.get(CROSS_NODE_VARIABLE) == before    # as it was, after the join
    # ray-object-store asks for the object store; ray for the library's default, whatever
    # the process's environment said.
    assert api.seen == [("bench-ray-object-store", "object_store"), ("bench-ray", None)]
    assert [info[CROSS_NODE_VARIABLE] for info in infos] == ["object_store", "default"]


def test_a_failed_join_still_restores_the_transport_variable(monkeypatch):
    monkeypatch.setenv(CROSS_NODE_VARIABLE, "streams")

    class _FailingApi(_RecordingApi):
        def init_collective_group(self, *args, **kwargs):
            raise RuntimeError("rendezvous failed")

    peer = PEERS["ray-object-store"]()
    monkeypatch.setattr(peer, "module", _FailingApi)
    with pytest.raises(RuntimeError, match="rendezvous failed"):
        peer.setup(2, 0, "bench-failing", 1.0)
    assert os.environ[CROSS_NODE_VARIABLE] == "streams"


def _nodes_document(nodes, ranks_per_node, date):
    """A fake ``--nodes`` result: ray 4x faster than torch at 8 B, half as fast at 1 MiB."""
    world_size = nodes * ranks_per_node
    p50s = {"ray": (1e-4, 2e-2), "ray-object-store": (2e-4, 3e-2), "torch": (4e-4, 1e-2)}
    rows = [dict(collective="allreduce", world_size=world_size, nodes=nodes, nbytes=nbytes,
                 backend=backend, timing="back-to-back", p50_s=p50s[backend][index],
                 busbw_gbps=nbytes / p50s[backend][index] / 1e9, error=None, note=None,
                 processes=nodes if backend.startswith("ray") else 0,
                 setup_rss_bytes=MIB, peak_rss_bytes=80 * MIB)
            for index, nbytes in enumerate((8, MIB)) for backend in p50s]
    return {"metadata": {"date": date, "cpu_count": 2, "memory_gib": 23.5, "ray": "2.60.0",
                         "numpy": "2", "local_cluster": True,
                         "command": f"python -m benchmarks --nodes {nodes}",
                         "options": {"backends": list(p50s), "nodes": nodes,
                                     "ray_address": None},
                         "backend_versions": {
                             "ray": {"ray_collective": "0.1.0", CROSS_NODE_VARIABLE: "default"},
                             "ray-object-store": {"ray_collective": "0.1.0",
                                                  CROSS_NODE_VARIABLE: "object_store"}}},
            "rows": rows, "notes": []}


def test_the_across_nodes_part_of_the_page_names_nodes_and_ranks(tmp_path):
    sources = []
    for nodes, ranks_per_node in ((2, 2), (4, 2)):
        path = tmp_path / f"nodes-{nodes}.json"
        path.write_text(json.dumps(_nodes_document(nodes, ranks_per_node, "2026-11-23")))
        sources.append(path)
    generated = render([(sources, None)], tmp_path, part="across-nodes")
    begin, end = markers("across-nodes")
    assert generated.startswith(begin) and generated.endswith(end)
    assert ("2026-11-23 on 2 cores / 23.5 GiB, 2 nodes of a ray.cluster_utils.Cluster on this "
            "machine, Ray 2.60.0, numpy 2, ray_collective 0.1.0:") in generated
    headings = [line.split("**")[1] for line in generated.splitlines() if line.startswith("**")]
    assert headings == ["allreduce, 2 nodes × 2 ranks, back to back",
                        "allreduce, 4 nodes × 2 ranks, back to back"]
    table = generated.split("**allreduce, 2 nodes × 2 ranks, back to back**")[1].splitlines()
    assert table[2] == ("| size | ray p50 · busbw | ray-object-store p50 · busbw | "
                        "torch p50 · busbw | ray vs ray-object-store | ray vs torch |")
    assert table[4].startswith("| 8 B | 100.0 µs · ") and table[4].endswith("| 2.00× | 4.00× |")
    assert table[5].endswith("| 1.50× | 0.50× |")
    assert "| 2×2 | ray | +2 |" in generated and "| 4×2 | torch | +0 |" in generated
    page = f"# Results\n{BEGIN}\none node\n{END}\n## Across nodes\n{begin}\nold\n{end}\ntail\n"
    written = replace_between_markers(page, generated, part="across-nodes")
    assert written == f"# Results\n{BEGIN}\none node\n{END}\n## Across nodes\n{generated}\ntail\n"
    with pytest.raises(ValueError, match="across-nodes:begin"):
        replace_between_markers(f"{BEGIN}\n{END}\n", generated, part="across-nodes")


def test_table_and_progress_name_nodes_and_ranks():
    rows = [Row("allreduce", 8, 8, "float32", "ray", iterations=2, latencies_s=(1e-3, 1e-3),
                p50_s=1e-3, nodes=4)]
    assert format_ranks(8, 4) == "4 nodes × 2 ranks" and format_ranks(8) == "8 ranks"
    assert "  4×2  " in format_table(rows).splitlines()[2]
    assert format_progress(rows).startswith("allreduce 4 nodes × 2 ranks 8 B: ray 1.00 ms")
    options = SweepOptions(("allreduce",), ("ray",), (4,), (8,), nodes=2)
    assert summarize_point(options, "allreduce", 4, 8, {"ray": [[1e-3]] * 4}, {})[0].nodes == 2


@pytest.mark.multinode
def test_a_tiny_sweep_across_two_nodes_of_a_local_cluster(tmp_path):
    assert col.is_backend_available("ray")
    out = tmp_path / "nodes.json"
    completed = run_benchmark("benchmarks", "--nodes", "2", "--ranks-per-node", "1",
                              "--backends", "ray", "--bytes", "8", "--iters", "2",
                              "--warmup", "1", "--timeout", "60", "--quiet", "--json", str(out))
    document = json.loads(out.read_text())
    [row] = document["rows"]
    # The harness refuses to time ranks that did not start on the node they were pinned to,
    # so a row without error is a rank on each of the cluster's two nodes.
    assert row["error"] is None, row["error"]
    assert (row["nodes"], row["world_size"], row["iterations"]) == (2, 2, 2)
    assert row["p50_s"] > 0 and len(row["latencies_s"]) == 2
    metadata = document["metadata"]
    assert metadata["local_cluster"] and len(set(metadata["node_ids"])) == 2
    assert metadata["options"]["nodes"] == 2
    assert metadata["backend_versions"]["ray"][CROSS_NODE_VARIABLE] == "default"
    assert [line.split()[:5] for line in completed.stdout.splitlines()
            if line.startswith("allreduce")] == [["allreduce", "2×1", "8", "B", "back-to-back"]]


def test_nccl_overhead_gives_no_bandwidth_verdict_at_one_rank():
    """At one rank NCCL's in-place allreduce moves nothing (1.8 µs for 8 B and for 256 MiB on
    an H200), so a bandwidth ratio there would only compare call costs."""
    from benchmarks.nccl_overhead import BANDWIDTH_SIZE, Point, report
    one = report([Point(8, 1.8e-6, 16.6e-6, 1), Point(BANDWIDTH_SIZE, 2.6e-6, 14.2e-6, 1)])
    assert "no bandwidth at one rank" in one and "of direct bandwidth" not in one
    assert "+14.8 µs per call: meets the 20 µs target" in one
    two = report([Point(BANDWIDTH_SIZE, 10e-3, 10.4e-3, 2)])
    assert "library at 96.2% of direct bandwidth: meets the 95% target" in two
