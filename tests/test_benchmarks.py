"""The benchmark harness: its formulas against hand-computed values, and the CLI on a tiny sweep.

The sweep runs ``python -m benchmarks`` as a subprocess, so its Ray instance starts and stops
there and never meets a Ray the rest of the suite may hold.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import ray_collective as col
from benchmarks.cli import build_parser, options_from_arguments, parse_size
from benchmarks.collectives import COLLECTIVES, message_layout
from benchmarks.harness import (Row, SweepOptions, block_order, split_iterations,
                                summarize_point, unmeasured_rows)
from benchmarks.report import format_progress, format_size, format_table, to_json
from benchmarks.harness import SweepResult
from benchmarks.stats import (algorithm_bandwidth, bus_bandwidth, default_iteration_counts,
                              iteration_latencies, percentiles, speedup)

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.mark.parametrize("collective, world_size, factor", [
    ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 8, 1.75),
    ("reducescatter", 4, 0.75), ("allgather", 8, 0.875), ("allgather", 1, 0.0),
    ("broadcast", 64, 1.0), ("reduce", 3, 1.0), ("barrier", 4, 0.0),
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
    for bad in (["--collective", "allscatter"], ["--world-size", "0"],
                ["--backends", "ray", "--baseline", "gloo"], ["--bytes", "8,8"]):
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


def test_tiny_sweep_on_actors_writes_rows_for_both_backends(tmp_path):
    reason = _ray_backend_unavailable_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch", reason="the gloo peer needs torch (pip install '.[bench]')")
    out = tmp_path / "tiny.json"
    command = [sys.executable, "-m", "benchmarks", "--collective", "allreduce,allgather",
               "--backends", "ray,gloo", "--world-size", "2", "--bytes", "8,4K",
               "--iters", "3", "--warmup", "1", "--timeout", "60", "--quiet", "--json", str(out)]
    # The sweep starts a Ray of its own: it must not join a cluster the suite may point to.
    environment = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    completed = subprocess.run(command, cwd=REPO, env=environment, capture_output=True,
                               text=True, timeout=170)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert [(row["collective"], row["nbytes"], row["backend"]) for row in rows] == [
        ("allreduce", 8, "ray"), ("allreduce", 8, "gloo"),
        ("allreduce", 4096, "ray"), ("allreduce", 4096, "gloo"),
        ("allgather", 8, "ray"), ("allgather", 8, "gloo"),
        ("allgather", 4096, "ray"), ("allgather", 4096, "gloo")]
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["world_size"] == 2 and row["iterations"] == 3
        assert len(row["latencies_s"]) == 3 and min(row["latencies_s"]) > 0
        assert row["p50_s"] > 0 and row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0
        assert row["speedup"] > 0 and row["baseline"] == "gloo"
    metadata = document["metadata"]
    assert metadata["ray"] and metadata["cpu_count"] >= 1
    assert metadata["command"].startswith("python -m benchmarks --collective allreduce,allgather")
    assert set(metadata["backend_versions"]) == {"ray", "gloo"}
    assert "speed-up = gloo p50 / backend p50" in completed.stdout
