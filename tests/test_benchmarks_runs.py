"""The benchmarks run for real, small: the ``torch`` peer's collectives against numpy, a tiny
sweep of every CPU backend through ``python -m benchmarks`` (a subprocess, so its Ray instance
starts and stops there and never meets a Ray the rest of the suite may hold), the call
overhead, fault detection and the elastic benchmark.
"""

import json

import pytest
import ray_collective as col
import numpy as np

from benchmarks.peers import PEERS, make_buffers
from benchmarks.report_page import render
from support import extras
from support.helpers import run_benchmark, run_in, start_members


MIB = 2**20

TORCH_CHECKED = ("allreduce", "reduce", "broadcast", "allgather", "reducescatter", "gather",
                 "scatter", "alltoall", "sendrecv", "barrier")


def _pattern(rank, part, count):
    """What rank ``rank`` puts in part ``part`` of its input: distinct for every rank and part."""
    return np.arange(count, dtype=np.float32) + 10 * part + 100 * (rank + 1)


def _torch_peer_results(rank, address, world_size, gloo_group_first):
    """Inside a rank: each collective of the ``torch`` peer once on patterned inputs.

    With ``gloo_group_first`` the ``gloo`` peer joins first, so torch's default group exists
    already and the ``torch`` peer must make a group of its own. Returns whether the peer found
    no default group, and each collective's buffers afterwards as numpy arrays.
    """
    import torch.distributed as dist

    from benchmarks.peers import GlooPeer, TorchPeer
    joined = []
    if gloo_group_first:
        joined.append(GlooPeer())
        joined[-1].setup(world_size, rank, gloo_group_first, 60)
    made_default_group = not dist.is_initialized()
    peer = TorchPeer()
    peer.setup(world_size, rank, "unused", 60, address)
    joined.append(peer)
    results = {}
    for collective in TORCH_CHECKED:
        buffers = make_buffers(peer, collective, 64, world_size, np.dtype("float32"))
        if buffers.tensor is not None:
            count = buffers.tensor.numel()
            if collective in ("scatter", "reducescatter", "alltoall"):
                for part, tensor in enumerate(buffers.tensor_list):
                    tensor.numpy()[:] = _pattern(rank, part, count)
            elif rank == 0 or collective != "sendrecv":
                buffers.tensor.numpy()[:] = _pattern(rank, 0, count)
        peer.operation(collective, buffers)()
        results[collective] = {
            "tensor": None if buffers.tensor is None else buffers.tensor.numpy().copy(),
            "parts": [tensor.numpy().copy() for tensor in buffers.tensor_list],
            "output": [tensor.numpy().copy() for tensor in buffers.output_list]}
    for member in reversed(joined):
        member.teardown()
    return made_default_group, results


def test_torch_peer_runs_every_collective_like_numpy(ray_session):
    extras.need("torch", "the torch peer")
    from benchmarks.peers import store_address
    world_size = 2
    actors = start_members(ray_session, world_size)
    try:
        answers = run_in(ray_session, actors, _torch_peer_results, store_address(), world_size,
                         None)
        again = run_in(ray_session, actors, _torch_peer_results, store_address(), world_size,
                       "bench-test-gloo-first")
    finally:
        for actor in actors:
            ray_session.kill(actor)
    assert [made for made, _ in answers] == [True, True]
    assert [made for made, _ in again] == [False, False]   # a group of its own beside gloo's
    for made, results in again:
        np.testing.assert_array_equal(results["allreduce"]["tensor"],
                                      _pattern(0, 0, 16) + _pattern(1, 0, 16))
    ranks = range(world_size)
    total = sum(_pattern(rank, 0, 16) for rank in ranks)
    root = answers[0][1]
    np.testing.assert_array_equal(root["reduce"]["tensor"], total)
    for rank, (_, results) in enumerate(answers):
        np.testing.assert_array_equal(results["allreduce"]["tensor"], total)
        np.testing.assert_array_equal(results["broadcast"]["tensor"], _pattern(0, 0, 16))
        for source in ranks:
            np.testing.assert_array_equal(results["allgather"]["parts"][source],
                                          _pattern(source, 0, 8))
            np.testing.assert_array_equal(results["alltoall"]["output"][source],
                                          _pattern(source, rank, 8))
        np.testing.assert_array_equal(results["reducescatter"]["tensor"],
                                      sum(_pattern(source, rank, 8) for source in ranks))
        np.testing.assert_array_equal(results["scatter"]["tensor"], _pattern(0, rank, 8))
        np.testing.assert_array_equal(results["sendrecv"]["tensor"], _pattern(0, 0, 16))
        assert results["barrier"]["tensor"] is None
    for source in ranks:
        np.testing.assert_array_equal(root["gather"]["parts"][source], _pattern(source, 0, 8))


def test_torch_peer_needs_the_store_address_on_rank_0s_node(ray_session):
    extras.need("torch", "the torch peer")
    with pytest.raises(ValueError, match="needs the store address"):
        PEERS["torch"]().setup(2, 1, "unused", 1.0, None)
    elsewhere = "tcp://192.0.2.1:29500"    # TEST-NET-1: never this machine's address
    with pytest.raises(RuntimeError, match="rank 0 runs on node .* is on the driver's node"):
        PEERS["torch"]().setup(2, 0, "unused", 1.0, elsewhere)


@pytest.mark.ray
def test_tiny_sweep_of_every_cpu_backend_in_both_timings_writes_table_json_and_plots(tmp_path):
    assert col.is_backend_available("ray")
    extras.need("torch", "the torch and gloo peers")
    extras.need_mpiexec("the mpi4py peer")
    extras.need("matplotlib", "plots")
    out, plots = tmp_path / "tiny.json", tmp_path / "plots"
    backends = ["ray", "torch", "gloo", "ray-plain", "mpi4py"]
    completed = run_benchmark("benchmarks", "--collective", "allreduce,gather",
                              "--backends", ",".join(backends), "--world-size", "2",
                              "--timing", "both", "--bytes", "8,4K", "--iters", "3",
                              "--warmup", "1", "--timeout", "60", "--json", str(out),
                              "--plots", str(plots))
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert [(row["collective"], row["nbytes"], row["timing"], row["backend"]) for row in rows] == [
        (collective, nbytes, timing, backend) for collective in ("allreduce", "gather")
        for nbytes in (8, 4096) for timing in ("back-to-back", "barrier")
        for backend in backends]
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["processes"] == {"ray": 0, "torch": 0, "gloo": 0, "ray-plain": 1,
                                    "mpi4py": 4}[row["backend"]], row
        assert row["peak_rss_bytes"] > MIB and row["setup_rss_bytes"] is not None
        if row["backend"] == "gloo" and row["collective"] == "gather":
            assert row["note"].startswith("not supported by this backend")
            assert row["p50_s"] is None
            continue
        assert row["world_size"] == 2 and row["iterations"] == 3
        assert len(row["latencies_s"]) == 3 and min(row["latencies_s"]) > 0
        assert row["p50_s"] > 0 and row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0
        assert row["speedup"] > 0 and row["baseline"] == "ray"
        # Every backend, mpi4py included, reports each rank's CPU time per call.
        assert len(row["cpu_per_call_by_rank_s"]) == 2 and min(row["cpu_per_call_by_rank_s"]) > 0
        assert row["cpu_per_call_max_s"] == max(row["cpu_per_call_by_rank_s"])
        assert row["cpu_per_call_max_s"] >= row["cpu_per_call_median_s"] > 0
    for timing in ("back-to-back", "barrier"):
        ray_rows = [row for row in rows if row["backend"] == "ray" and row["timing"] == timing]
        assert all(row["speedup"] == pytest.approx(1.0) for row in ray_rows)
    metadata = document["metadata"]
    assert metadata["ray"] and metadata["cpu_count"] >= 1
    assert metadata["options"]["timings"] == ["back-to-back", "barrier"]
    assert metadata["command"].startswith("python -m benchmarks --collective allreduce,gather")
    assert set(metadata["backend_versions"]) == set(backends)
    assert metadata["backend_versions"]["torch"]["torch"].startswith("2.")
    assert "speed-up = ray p50 / backend p50 in the same timing mode" in completed.stdout
    assert "timing back-to-back: one barrier, then the calls in a loop" in completed.stdout
    assert not [line for line in completed.stdout.splitlines()
                if line.startswith("note:")]    # no teardown or restart trouble
    assert "[########################] 4/4" in completed.stderr    # the progress bar
    assert "back-to-back: ray " in completed.stderr and "; barrier: ray " in completed.stderr
    assert sorted(path.name for path in plots.iterdir()) == [
        "busbw_allreduce_2ranks.png", "busbw_gather_2ranks.png",
        "latency_allreduce_2ranks.png", "latency_gather_2ranks.png"]
    page = render([([out], plots)], tmp_path)
    assert "**allreduce, 2 ranks, back to back**" in page
    assert "**gather, 2 ranks, barrier before every call**" in page
    assert "| size | ray p50 · busbw | torch p50 · busbw | gloo p50 · busbw |" in page
    assert "| ray vs ray-plain | ray vs MPICH |" in page
    assert "| size | ray CPU/call | torch CPU/call | gloo CPU/call |" in page


def test_call_overhead_reports_world_size_one_and_plan_choice_per_world_size(tmp_path, capsys):
    from benchmarks import call_overhead
    out = tmp_path / "overhead.json"
    assert call_overhead.main(["--ranks", "8,64", "--calls", "20", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    one = figures["world_size_one"]
    assert one["allreduce_s"] > 0 and one["np_add_s"] > 0
    rows = figures["plan_choice"]
    assert [(r["ranks"], r["nodes"]) for r in rows] == [(8, 1), (64, 8)]
    # recursive doubling inside a node: 3 rounds of one send and one receive at rank 0; across
    # 8 nodes the hierarchy adds rounds, so the replay grows while the choice is one lookup.
    assert rows[0]["messages"] == 6 and rows[1]["messages"] > rows[0]["messages"]
    assert all(r["choice_s"] > 0 and r["call_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "| 64 | 8 |" in out and "choice below the whole call at every world size: " in out
    with pytest.raises(SystemExit):
        call_overhead.main(["--ranks", "1"])


def test_a_cached_plan_is_found_by_one_lookup_whatever_the_world_size():
    from benchmarks.call_overhead import InstantTransport
    from ray_collective.backends.base import CallViews
    from ray_collective.engine.cpu import TransportMembership
    from ray_collective.group import Group
    from ray_collective.tensors import as_view
    from ray_collective.types import CallOptions, Collective
    for world_size in (8, 4096):
        transport = InstantTransport(0, world_size)
        backend = TransportMembership("g", transport,
                                      node_of=[r // 8 for r in range(world_size)],
                                      forced={})
        group = Group("g", world_size, 0, backend, 60.0, trace_size=0)
        views = CallViews(as_view(np.zeros(2, np.float32), writable=True))
        options = CallOptions(Collective.ALLREDUCE, timeout=60.0)
        first = group.prepare(None, options, views)
        for _ in range(4):
            group.submit(first, views.arrays(options.collective), False)
        assert group.prepare(None, options, views) is first and len(group.prepared) == 1


def test_fault_detection_kills_a_rank_and_every_survivor_names_it(ray_session):
    from benchmarks.fault_detection import format_rows, measure, percentile
    row = measure(ray_session, 3, 8, 1)
    assert row["survivors"] == 2 and row["named_the_dead_rank"] == 2
    assert 0 < row["p50_s"] <= row["p95_s"] <= row["max_s"] < 10.0
    assert "| 8 B | 3 | 2 | 2 |" in format_rows([row])
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)


def test_elastic_benchmark_kills_shrinks_and_grows_back_with_correct_sums(ray_session):
    from benchmarks.elastic import format_rows, measure
    row = measure(ray_session, 3, 1, 2)
    assert row["all_correct"] and row["errors"] == {"PeerDiedError": 4}
    for what in ("kill_to_correct_allreduce", "grow_by_one"):
        assert 0 < row[what]["p50_s"] <= row[what]["p95_s"] <= row[what]["max_s"] < 30.0
    assert len(row["raw"]["kill_to_correct_allreduce_s"]) == 2
    assert "| 3 | 1 | 2 |" in format_rows([row])


