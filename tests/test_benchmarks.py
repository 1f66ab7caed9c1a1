"""The benchmark harness: its formulas against hand-computed values, and the CLI on a tiny sweep.

The sweep runs ``python -m benchmarks`` as a subprocess, so its Ray instance starts and stops
there and never meets a Ray the rest of the suite may hold.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

import ray_collective as col
import numpy as np

from benchmarks.cli import build_parser, options_from_arguments, parse_size
from benchmarks.collectives import COLLECTIVES, message_layout
from benchmarks.harness import (Footprint, Row, SweepOptions, block_order, count_points,
                                split_iterations, summarize_point, unmeasured_rows,
                                unsupported_reason)
from benchmarks.mpi_job import decode_arguments, descendant_count, encode_arguments
from benchmarks.peers import PEERS, Mpi4pyPeer, make_buffers
from benchmarks.plain_ray import combine
from benchmarks.plots import write_plots
from benchmarks.report import ProgressBar, format_progress, format_size, format_table, to_json
from benchmarks.report_page import (BEGIN, END, point_table, ratio, render,
                                    replace_between_markers)
from benchmarks.harness import SweepResult
from benchmarks.worker import BlockSpec
from benchmarks.stats import (algorithm_bandwidth, bus_bandwidth, default_iteration_counts,
                              iteration_latencies, percentiles, speedup)

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.mark.parametrize("collective, world_size, factor", [
    ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 8, 1.75),
    ("reducescatter", 4, 0.75), ("allgather", 8, 0.875), ("allgather", 1, 0.0),
    ("broadcast", 64, 1.0), ("reduce", 3, 1.0), ("barrier", 4, 0.0),
    ("gather", 4, 0.75), ("scatter", 4, 0.75), ("alltoall", 8, 0.875), ("sendrecv", 2, 1.0),
])
def test_bus_factors_are_nccl_tests(collective, world_size, factor):
    assert COLLECTIVES[collective].bus_factor(world_size) == pytest.approx(factor)


def test_bandwidths_by_hand():
    # 64 MiB allreduce in 0.1 s at 4 ranks: algbw 0.671 GB/s, busbw x 2*3/4 = 1.007 GB/s.
    algbw = algorithm_bandwidth(64 * MIB, 0.1)
    assert algbw == pytest.approx(0.67108864)
    assert bus_bandwidth(algbw, COLLECTIVES["allreduce"].bus_factor(4)) == pytest.approx(
        1.00663296)
    with pytest.raises(ValueError):
        algorithm_bandwidth(8, 0.0)


def test_latency_is_the_slowest_rank_per_iteration_and_percentiles_interpolate():
    latencies = iteration_latencies([[1.0, 5.0, 2.0, 4.0], [3.0, 1.0, 2.5, 0.5]])
    assert latencies == [3.0, 5.0, 2.5, 4.0]
    # sorted 2.5, 3, 4, 5: p50 = 3.5; p75 = 4.25; p90 = 4.7; p95 = 4.85 (linear).
    assert percentiles(latencies) == pytest.approx(
        {"p50": 3.5, "p75": 4.25, "p90": 4.7, "p95": 4.85})
    with pytest.raises(ValueError):
        iteration_latencies([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError):
        percentiles([])


def test_speedup_is_baseline_over_backend():
    assert speedup(300e-6, 100e-6) == pytest.approx(3.0)
    assert speedup(None, 1.0) is None and speedup(1.0, None) is None


@pytest.mark.parametrize("collective, requested, world_size, itemsize, expected", [
    ("allreduce", 8, 4, 4, (2, 0, 8)),
    ("allreduce", 3, 4, 4, (1, 0, 4)),             # at least one element
    ("allgather", 64 * MIB, 4, 4, (4 * MIB, 4, 64 * MIB)),
    ("reducescatter", 8, 4, 4, (1, 4, 16)),        # one element per rank, 16 B moved
    ("reducescatter", 1000, 3, 4, (83, 3, 996)),   # rounded down to whole parts
    ("barrier", 4096, 4, 4, (0, 0, 0)),
    ("gather", 64, 4, 4, (4, 4, 64)),
    ("alltoall", 1024, 4, 4, (64, 4, 1024)),
    ("sendrecv", 1024, 4, 4, (256, 0, 1024)),
])
def test_message_layout(collective, requested, world_size, itemsize, expected):
    layout = message_layout(collective, requested, world_size, itemsize)
    assert (layout.elements_per_tensor, layout.list_length, layout.nbytes) == expected


def test_iteration_counts_and_blocks():
    assert default_iteration_counts(8).iterations == 200
    assert default_iteration_counts(MIB).iterations == 50
    assert default_iteration_counts(64 * MIB).iterations == 20
    assert split_iterations(10, 4) == [3, 3, 2, 2]
    assert split_iterations(2, 4) == [1, 1]
    assert block_order(["ray", "gloo"], 0) == ["ray", "gloo"]
    assert block_order(["ray", "gloo"], 1) == ["gloo", "ray"]
    overridden = SweepOptions(("allreduce",), ("ray",), (2,), (8,), iterations=3, warmup=0)
    assert (overridden.counts(64 * MIB).iterations, overridden.counts(8).warmup) == (3, 0)


def test_parse_size_and_options():
    assert [parse_size(text) for text in ("8", "1K", "64M", "1MiB", "2g")] == [
        8, 1024, 64 * MIB, MIB, 2 * 2**30]
    with pytest.raises(ValueError):
        parse_size("-1")
    parser = build_parser()
    options = options_from_arguments(parser.parse_args(
        ["--collective", "allreduce,broadcast", "--world-size", "2,4", "--bytes", "8,1M",
         "--backends", "gloo", "--baseline", "none"]), parser)
    assert options.collectives == ("allreduce", "broadcast")
    assert options.world_sizes == (2, 4) and options.sizes == (8, MIB)
    assert options.baseline is None
    defaults = options_from_arguments(parser.parse_args([]), parser)
    assert defaults.backends == ("ray", "gloo", "ray-plain", "mpi4py")
    assert defaults.baseline == "ray"    # the first backend listed
    assert count_points(options) == 2 * 2 * 2
    assert count_points(SweepOptions(("barrier", "allreduce"), ("ray",), (2, 4), (8, 16))) == 6
    for bad in (["--collective", "allscatter"], ["--world-size", "0"],
                ["--backends", "ray", "--baseline", "gloo"], ["--bytes", "8,8"],
                ["--backends", "ray,shmem"]):
        with pytest.raises(SystemExit):
            options_from_arguments(parser.parse_args(bad), parser)


def test_a_failed_backend_keeps_its_error_and_the_others_their_numbers():
    options = SweepOptions(("allreduce",), ("ray", "gloo"), (2,), (8,))
    rows = summarize_point(options, "allreduce", 2, 8,
                           {"ray": [[2e-6, 4e-6], [3e-6, 1e-6]]}, {"gloo": "boom"})
    ray_row, gloo_row = rows
    assert ray_row.latencies_s == (3e-6, 4e-6) and ray_row.p50_s == pytest.approx(3.5e-6)
    assert ray_row.busbw_gbps == pytest.approx(8 / 3.5e-6 / 1e9)
    assert ray_row.speedup is None and gloo_row.error == "boom"
    assert "gloo failed" in format_progress(rows)
    assert "error: boom" in format_table(rows)
    missing = unmeasured_rows(options, 4, rows, "actors did not start")
    assert [(row.world_size, row.backend, row.error) for row in missing] == [
        (4, "ray", "actors did not start"), (4, "gloo", "actors did not start")]


def test_table_and_json_carry_every_row():
    rows = [Row("allgather", 4, 64 * MIB, "float32", name, iterations=2, latencies_s=(1.0, 1.0),
                p50_s=p50, algbw_gbps=0.06, busbw_gbps=0.05, speedup=0.5 / p50,
                baseline="gloo") for name, p50 in (("ray", 0.25), ("gloo", 0.5))]
    table = format_table(rows)
    assert "64 MiB" in table and "250.00 ms" in table and "2x" in table
    assert "speed-up = gloo p50 / backend p50" in table
    document = json.loads(to_json(SweepResult(tuple(rows), {"ray": "2.60"}, ("a note",))))
    assert [row["backend"] for row in document["rows"]] == ["ray", "gloo"]
    assert document["notes"] == ["a note"] and format_size(3 * 1024) == "3 KiB"


def _ray_backend_unavailable_reason():
    if col.is_backend_available("ray"):
        return None
    return ("ray_collective's 'ray' backend is not available yet "
            "(is_backend_available('ray') is False), so there is nothing to compare with Gloo")


def test_unsupported_collectives_become_notes_not_errors():
    assert unsupported_reason("gloo", "alltoall", 4).startswith("not supported by this backend")
    assert unsupported_reason("ray", "alltoall", 4) is None
    assert unsupported_reason("mpi4py", "sendrecv", 1) == "a send/recv round trip needs 2 ranks"
    options = SweepOptions(("gather",), ("ray", "gloo"), (2,), (8,), baseline="ray")
    footprints = {"ray": Footprint(processes=0, setup_rss_bytes=2 * MIB,
                                   peak_rss_bytes=90 * MIB)}
    rows = summarize_point(options, "gather", 2, 8, {"ray": [[1e-4, 2e-4], [3e-4, 1e-4]]}, {},
                           {"gloo": "not supported by this backend (gloo has no gather)"},
                           footprints)
    ray_row, gloo_row = rows
    assert ray_row.speedup == pytest.approx(1.0) and ray_row.processes == 0
    assert ray_row.peak_rss_bytes == 90 * MIB and ray_row.error is None
    assert gloo_row.note.startswith("not supported") and gloo_row.error is None
    assert gloo_row.speedup is None
    table = format_table(rows)
    assert "note: not supported by this backend" in table and "90 MiB" in table
    assert "gloo n/a" in format_progress(rows)


def test_every_peer_has_a_unique_name_and_mpi_parts_are_one_array():
    assert list(PEERS) == ["ray", "gloo", "ray-plain", "mpi4py"]
    buffers = make_buffers(Mpi4pyPeer(), "alltoall", 64, 4, np.dtype("float32"))
    assert len(buffers.tensor_list) == len(buffers.output_list) == 4
    assert buffers.tensor_list[0].base.shape == (4, 4)
    assert buffers.output_list[3].base is not buffers.tensor_list[3].base


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "broadcast", "allgather",
                                        "reducescatter", "gather", "scatter", "alltoall"])
def test_plain_ray_hub_answers_like_numpy(collective):
    world_size, root = 3, 0
    tensors = [np.arange(4, dtype=np.float32) + 10 * rank for rank in range(world_size)]
    lists = [[np.full(2, 10 * rank + part, np.float32) for part in range(world_size)]
             for rank in range(world_size)]
    items = [[tensor] for tensor in tensors]    # data movement: lists of items to route
    contributions = {
        "allreduce": tensors, "reduce": tensors, "allgather": items, "gather": items,
        "broadcast": [items[0], None, None], "scatter": [lists[0], None, None],
        "reducescatter": lists, "alltoall": lists}[collective]
    answers = combine(collective, contributions)
    total = tensors[0] + tensors[1] + tensors[2]
    for rank, answer in enumerate(answers):
        if collective == "allreduce" or (collective == "reduce" and rank == root):
            np.testing.assert_array_equal(answer, total)
        elif collective in ("reduce", "gather") and rank != root:
            assert answer is None
        elif collective in ("allgather", "gather"):
            assert all(np.array_equal(a, b) for a, b in zip(answer, tensors))
        elif collective == "broadcast":
            assert answer is None if rank == root else np.array_equal(answer[0], tensors[0])
        elif collective == "reducescatter":
            np.testing.assert_array_equal(answer, sum(parts[rank] for parts in lists))
        elif collective == "scatter":
            np.testing.assert_array_equal(answer[0], lists[0][rank])
        else:
            assert all(np.array_equal(answer[source], lists[source][rank])
                       for source in range(world_size))
    if collective == "allreduce":
        assert answers[0] is answers[1]   # one answer, shared (put into the store once)


def test_process_counting_and_mpi_channel_arguments():
    # A process with one child: the count includes the root.
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; "
                              "time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while descendant_count(child.pid) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert descendant_count(child.pid) == 2
    finally:
        for pid in _descendants(child.pid):
            os.kill(pid, 9)
        child.wait(timeout=10)
    assert descendant_count(child.pid) == 0
    block = BlockSpec("allreduce", 8, "float32", warmup=1, iterations=2)
    assert decode_arguments(json.loads(json.dumps(encode_arguments(
        ["time_block", block, None])))) == ["time_block", block, None]


def _descendants(pid):
    """``pid``'s children's pids, deepest last, read from /proc (for cleaning up the test)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return [deeper for child in found for deeper in _descendants(child)] + found + [pid]


def test_progress_bar_counts_points_and_estimates_time_left():
    import io
    stream = io.StringIO()
    bar = ProgressBar(4, stream, width=8)
    bar.advance("allreduce 2 ranks 8 B: ray 1 ms")
    bar.advance("allreduce 2 ranks 1 KiB: ray 1 ms")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[##------] 1/4") and lines[1].startswith("[####----] 2/4")
    assert "left  allreduce 2 ranks 1 KiB" in lines[1]


def _rows_for_page():
    rows = []
    for world_size in (2, 4):
        for nbytes in (8, 1024):
            for backend, p50 in (("ray", 1e-4), ("gloo", 3e-4), ("mpi4py", 5e-5)):
                rows.append(dict(collective="allreduce", world_size=world_size, nbytes=nbytes,
                                 backend=backend, p50_s=p50 * world_size,
                                 busbw_gbps=nbytes / (p50 * world_size) / 1e9, error=None,
                                 note=None, processes=0, setup_rss_bytes=MIB,
                                 peak_rss_bytes=80 * MIB))
    return rows


def test_results_page_ratios_and_markers(tmp_path):
    rows = _rows_for_page()
    assert ratio(rows[0], rows[1]) == pytest.approx(3.0)
    table = point_table([row for row in rows if row["world_size"] == 2],
                        ["ray", "gloo", "mpi4py"])
    assert table[0].startswith("| size | ray p50 · busbw |")
    assert table[2].endswith("| 3.00× | 0.50× |")
    written = write_plots(rows, tmp_path / "plots")
    assert sorted(path.name for path in written) == [
        "busbw_allreduce_2ranks.png", "busbw_allreduce_4ranks.png",
        "latency_allreduce_2ranks.png", "latency_allreduce_4ranks.png",
        "time_allreduce_1KiB.png", "time_allreduce_8B.png"]
    document = {"metadata": {"date": "2026-11-22", "cpu_count": 2, "memory_gib": 23.5,
                             "ray": "2.60.0", "numpy": "2", "command": "python -m benchmarks",
                             "options": {"backends": ["ray", "gloo", "mpi4py"]},
                             "backend_versions": {"gloo": {"torch": "2.13"}}},
                "rows": rows, "notes": []}
    source = tmp_path / "run.json"
    source.write_text(json.dumps(document))
    generated = render([([source], tmp_path / "plots")], tmp_path)
    assert "**allreduce, 4 ranks**" in generated and 'src="plots/time_allreduce_8B.png"' in generated
    page = f"# Results\n{BEGIN}\nold\n{END}\ntail\n"
    assert replace_between_markers(page, generated) == f"# Results\n{generated}\ntail\n"
    with pytest.raises(ValueError):
        replace_between_markers("no markers", generated)


def _ray_backend_unavailable_reason():
    if col.is_backend_available("ray"):
        return None
    return ("ray_collective's 'ray' backend is not available yet "
            "(is_backend_available('ray') is False), so there is nothing to compare with Gloo")


def test_tiny_sweep_of_every_cpu_backend_writes_table_json_and_plots(tmp_path):
    reason = _ray_backend_unavailable_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch", reason="the gloo peer needs torch (pip install '.[bench]')")
    pytest.importorskip("mpi4py", reason="the mpi4py peer needs mpi4py and mpich")
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install '.[bench]')")
    out, plots = tmp_path / "tiny.json", tmp_path / "plots"
    command = [sys.executable, "-m", "benchmarks", "--collective", "allreduce,gather",
               "--backends", "ray,gloo,ray-plain,mpi4py", "--world-size", "2",
               "--bytes", "8,4K", "--iters", "3", "--warmup", "1", "--timeout", "60",
               "--json", str(out), "--plots", str(plots)]
    # The sweep starts a Ray of its own: it must not join a cluster the suite may point to.
    environment = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    completed = subprocess.run(command, cwd=REPO, env=environment, capture_output=True,
                               text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = document["rows"]
    backends = ["ray", "gloo", "ray-plain", "mpi4py"]
    assert [(row["collective"], row["nbytes"], row["backend"]) for row in rows] == [
        (collective, nbytes, backend) for collective in ("allreduce", "gather")
        for nbytes in (8, 4096) for backend in backends]
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["processes"] == {"ray": 0, "gloo": 0, "ray-plain": 1, "mpi4py": 4}[
            row["backend"]], row
        if row["backend"] == "gloo" and row["collective"] == "gather":
            assert row["note"].startswith("not supported by this backend")
            assert row["p50_s"] is None
            continue
        assert row["world_size"] == 2 and row["iterations"] == 3
        assert len(row["latencies_s"]) == 3 and min(row["latencies_s"]) > 0
        assert row["p50_s"] > 0 and row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0
        assert row["speedup"] > 0 and row["baseline"] == "ray"
        assert row["peak_rss_bytes"] > MIB
    metadata = document["metadata"]
    assert metadata["ray"] and metadata["cpu_count"] >= 1
    assert metadata["command"].startswith("python -m benchmarks --collective allreduce,gather")
    assert set(metadata["backend_versions"]) == set(backends)
    assert "speed-up = ray p50 / backend p50" in completed.stdout
    assert "[########################] 4/4" in completed.stderr    # the progress bar
    assert sorted(path.name for path in plots.iterdir()) == [
        "busbw_allreduce_2ranks.png", "busbw_gather_2ranks.png",
        "latency_allreduce_2ranks.png", "latency_gather_2ranks.png"]
