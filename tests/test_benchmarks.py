"""The benchmark harness: its formulas against hand-computed values, the timing loops against a
recorded clock, the ``torch`` peer's collectives against numpy, and the CLI on a tiny sweep.

The sweep runs ``python -m benchmarks`` as a subprocess, so its Ray instance starts and stops
there and never meets a Ray the rest of the suite may hold.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

import ray_collective as col
import numpy as np

from benchmarks.cli import build_parser, options_from_arguments, parse_size
from benchmarks.collectives import COLLECTIVES, message_layout
from benchmarks.harness import unsupported_reason
from benchmarks.mpi_job import decode_arguments, descendant_count, encode_arguments
from benchmarks.nodes import order_nodes, pinned, rank_nodes
from benchmarks.peers import CROSS_NODE_VARIABLE, PEERS, Mpi4pyPeer, make_buffers
from benchmarks.plain_ray import combine
from benchmarks.plots import write_plots
from benchmarks.report import (ProgressBar, format_progress, format_ranks, format_size,
                               format_table, row_timing, to_json)
from benchmarks.report_page import (BEGIN, END, markers, point_table, ratio, render,
                                    replace_between_markers)
from benchmarks.report_page import main as page_main
from benchmarks.rows import Footprint, Row, SweepResult, summarize_point, unmeasured_rows
from benchmarks.sweep import SweepOptions, block_order, count_points, split_iterations
from benchmarks import worker
from benchmarks.worker import BACK_TO_BACK, BARRIER, PACED, BlockSpec, RankWorker
from support import extras
from support.helpers import run_benchmark, run_in, start_members
from benchmarks.stats import (algorithm_bandwidth, bus_bandwidth, cpu_per_call,
                              default_iteration_counts, iteration_latencies, percentiles,
                              speedup)

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
    assert default_iteration_counts(8).iterations == 2000
    assert default_iteration_counts(64 * 1024).iterations == 200
    assert default_iteration_counts(MIB).iterations == 50
    assert default_iteration_counts(64 * MIB).iterations == 20
    assert split_iterations(10, 4) == [3, 3, 2, 2]
    assert split_iterations(2, 4) == [1, 1]
    assert block_order(["ray", "gloo"], 0) == ["ray", "gloo"]
    assert block_order(["ray", "gloo"], 1) == ["gloo", "ray"]
    overridden = SweepOptions(("allreduce",), ("ray",), (2,), (8,), iterations=3, warmup=0)
    assert (overridden.counts(64 * MIB).iterations, overridden.counts(8).warmup) == (3, 0)


class _RecordedClock:
    """A ``perf_counter`` and ``process_time`` that move only when the fake barrier or call
    runs, and a log of both.

    The barrier takes 100 s (7 s of CPU) and call i (from 0) takes i + 1 s, half of it CPU, so a
    time that contains a barrier, or the wrong call, shows at once.
    """

    def __init__(self):
        self.now, self.cpu, self.calls, self.events = 0.0, 0.0, 0, []

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.cpu

    def barrier(self):
        self.events.append("barrier")
        self.now += 100.0
        self.cpu += 7.0

    def call(self):
        self.events.append("call")
        self.calls += 1
        self.now += float(self.calls)
        self.cpu += self.calls / 2


def test_back_to_back_times_completion_to_completion_after_one_barrier(monkeypatch):
    clock = _RecordedClock()
    monkeypatch.setattr(worker, "time", clock)
    timed = worker.time_back_to_back(clock.barrier, clock.call, warmup=2, iterations=3)
    assert clock.events == ["barrier"] + ["call"] * 5
    assert timed.durations == [3.0, 4.0, 5.0]      # calls 3-5; the warm-up's 1 + 2 s left out
    assert timed.cpu_s == 6.0                      # (3 + 4 + 5) / 2: no barrier, no warm-up
    clock = _RecordedClock()
    monkeypatch.setattr(worker, "time", clock)
    timed = worker.time_back_to_back(clock.barrier, clock.call, warmup=0, iterations=2)
    assert timed.durations == [1.0, 2.0]   # without warm-up the first starts at the barrier
    assert timed.cpu_s == 1.5


def test_barrier_mode_times_each_call_alone_after_its_own_barrier(monkeypatch):
    clock = _RecordedClock()
    monkeypatch.setattr(worker, "time", clock)
    timed = worker.time_with_barriers(clock.barrier, clock.call, warmup=1, iterations=2)
    assert clock.events == ["barrier", "call"] * 3
    assert timed.durations == [2.0, 3.0]
    assert timed.cpu_s == 2.5                      # (2 + 3) / 2: the barriers' 21 s left out


def test_paced_mode_sleeps_before_each_call_after_one_barrier_and_times_the_call_alone(
        monkeypatch):
    clock = _RecordedClock()
    monkeypatch.setattr(worker, "time", clock)

    class Peer:
        def barrier(self):
            clock.barrier()

    rank = RankWorker(2, 0)
    rank._peers["ray"] = Peer()
    monkeypatch.setattr(rank, "_bind", lambda backend, peer, block: worker._BoundPoint(
        block.point(), clock.call))
    monkeypatch.setattr(worker, "_pause", lambda: clock.events.append("pause"))
    answer = rank.time_block("ray", BlockSpec("allreduce", 8, "float32", warmup=1,
                                              iterations=2, timing=PACED))
    assert clock.events == ["barrier"] + ["pause", "call"] * 3
    assert answer["durations"] == [2.0, 3.0]       # the calls alone, the warm-up left out
    parser = build_parser()
    assert options_from_arguments(parser.parse_args(["--timing", "paced"]),
                                  parser).timings == (PACED,)


def test_cpu_time_per_call_is_each_ranks_mean_then_the_busiest_and_the_median():
    assert cpu_per_call([2.0, 4.0, 3.0], 4) == [0.5, 1.0, 0.75]
    for bad in (([], 4), ([1.0], 0), ([1.0, -0.1], 2)):
        with pytest.raises(ValueError):
            cpu_per_call(*bad)
    options = SweepOptions(("allreduce",), ("ray", "gloo", "mpi4py"), (4,), (8,))
    # Two timed iterations per rank; ray's ranks spent 2, 8, 4 and 6 ms of CPU over them.
    rows = summarize_point(options, "allreduce", 4, 8,
                           {"ray": [[1e-3, 1e-3]] * 4, "gloo": [[2e-3, 2e-3]] * 4,
                            "mpi4py": [[1e-5, 1e-5]] * 4}, {},
                           cpu_seconds={"ray": [2e-3, 8e-3, 4e-3, 6e-3],
                                        "mpi4py": [2e-5, 2e-5, 2e-5, 4e-5]})
    ray_row, gloo_row, mpi_row = rows
    assert ray_row.cpu_per_call_by_rank_s == pytest.approx((1e-3, 4e-3, 2e-3, 3e-3))
    assert ray_row.cpu_per_call_max_s == pytest.approx(4e-3)
    assert ray_row.cpu_per_call_median_s == pytest.approx(2.5e-3)
    assert mpi_row.cpu_per_call_max_s == pytest.approx(2e-5)
    assert mpi_row.cpu_per_call_median_s == pytest.approx(1e-5)
    assert gloo_row.cpu_per_call_max_s is None and gloo_row.cpu_per_call_by_rank_s == ()
    table = format_table(rows).splitlines()
    assert "CPU/call max  CPU/call med" in table[0]
    assert re.search(r" 4\.00 ms +2\.50 ms ", table[2])
    assert re.search(r" 20\.0 µs +10\.0 µs ", table[4])
    assert any(line.startswith("CPU/call: a rank process's CPU time") for line in table)
    assert json.loads(to_json(SweepResult(tuple(rows), {})))["rows"][0][
        "cpu_per_call_max_s"] == pytest.approx(4e-3)


def test_a_rank_refuses_an_unknown_timing_mode():
    with pytest.raises(ValueError, match="unknown timing 'sometimes'"):
        RankWorker(2, 0).time_block("ray", BlockSpec("allreduce", 8, "float32", warmup=0,
                                                     iterations=1, timing="sometimes"))


def test_rows_of_each_timing_mode_compare_with_the_baseline_of_the_same_mode():
    options = SweepOptions(("allreduce",), ("ray", "torch"), (2,), (8,), baseline="ray",
                           timings=(BACK_TO_BACK, BARRIER))
    back_to_back = summarize_point(options, "allreduce", 2, 8,
                                   {"ray": [[1e-4], [2e-4]], "torch": [[4e-4], [1e-4]]}, {},
                                   timing=BACK_TO_BACK)
    barrier = summarize_point(options, "allreduce", 2, 8,
                              {"ray": [[3e-4], [1e-4]], "torch": [[1.5e-4], [1e-4]]}, {},
                              timing=BARRIER)
    assert [(row.timing, row.backend) for row in back_to_back + barrier] == [
        (BACK_TO_BACK, "ray"), (BACK_TO_BACK, "torch"), (BARRIER, "ray"), (BARRIER, "torch")]
    assert back_to_back[1].speedup == pytest.approx(0.5)    # ray 200 µs / torch 400 µs
    assert barrier[1].speedup == pytest.approx(2.0)         # ray 300 µs / torch 150 µs
    progress = format_progress(back_to_back + barrier)
    assert progress == ("allreduce 2 ranks 8 B: back-to-back: ray 200.0 µs, torch 400.0 µs "
                        "(0.50x); barrier: ray 300.0 µs, torch 150.0 µs (2.00x)")
    assert format_progress(barrier) == "allreduce 2 ranks 8 B: ray 300.0 µs, torch 150.0 µs (2.00x)"
    table = format_table(back_to_back + barrier)
    assert "timing back-to-back: one barrier, then the calls in a loop" in table
    assert "timing barrier: the backend's barrier before every call" in table
    missing = unmeasured_rows(options, 4, [], "actors did not start")
    assert [(row.timing, row.backend) for row in missing] == [
        (BACK_TO_BACK, "ray"), (BACK_TO_BACK, "torch"), (BARRIER, "ray"), (BARRIER, "torch")]
    assert row_timing({"backend": "ray"}) == BARRIER     # a file from before the modes


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
    assert defaults.backends == ("ray", "torch", "gloo", "ray-plain", "mpi4py")
    assert defaults.baseline == "ray"    # the first backend listed
    assert defaults.timings == (BACK_TO_BACK,)
    assert options_from_arguments(parser.parse_args(["--timing", "both"]), parser).timings == (
        BACK_TO_BACK, BARRIER)
    assert options_from_arguments(parser.parse_args(["--timing", "barrier"]),
                                  parser).timings == (BARRIER,)
    assert count_points(options) == 2 * 2 * 2
    assert count_points(SweepOptions(("barrier", "allreduce"), ("ray",), (2, 4), (8, 16))) == 6
    for bad in (["--collective", "allscatter"], ["--world-size", "0"],
                ["--backends", "ray", "--baseline", "gloo"], ["--bytes", "8,8"],
                ["--backends", "ray,shmem"], ["--timing", "sometimes"]):
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
    assert list(PEERS) == ["ray", "ray-object-store", "torch", "gloo", "ray-plain", "mpi4py"]
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
    block = BlockSpec("allreduce", 8, "float32", warmup=1, iterations=2, timing=BARRIER)
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
    # Every column is the peer's p50 over ray's (MPICH's named after it): above 1, ray is faster.
    assert table[0].endswith("| ray vs gloo | ray vs MPICH |")
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
    # Rows without a timing mode come from the harness that timed every call after a barrier.
    assert "**allreduce, 4 ranks, barrier before every call**" in generated
    assert "back to back" not in generated and "(plots/time_allreduce_8B.png)" in generated
    assert "(p50 latency · bus bandwidth; ray vs X = X p50 / ray p50)" in generated
    assert "CPU" not in generated       # rows from before CPU time was measured
    assert "Timing barrier: the backend's barrier before every call" in generated
    page = f"# Results\n{BEGIN}\nold\n{END}\ntail\n"
    assert replace_between_markers(page, generated) == f"# Results\n{generated}\ntail\n"
    with pytest.raises(ValueError):
        replace_between_markers("no markers", generated)


def test_the_results_page_and_the_readme_are_made_from_the_result_files():
    from benchmarks import page
    for path, names in ((page.PAGE, list(page.PARTS)), (page.FRONT_PAGE, page.FRONT_PAGE_PARTS)):
        _, changed = page.regenerate(path, page.RESULTS, names)
        assert not changed, f"{path.name}: {changed} differ from the files: python -m benchmarks.page"
    text = page.PAGE.read_text()
    assert len(text.splitlines()) <= 300
    # Every file the page or the results' README names is there, and every file there is named.
    listed = (page.RESULTS / "README").read_text()
    for name in re.findall(r"results/([\w./-]+\.(?:json|md|png))", text):
        assert (page.RESULTS / name).is_file(), name
    for path in page.RESULTS.iterdir():
        if path.is_file() and path.name != "README":
            assert path.name in listed, f"{path.name} is not in benchmarks/results/README"


def _rows_in_both_modes():
    """The page's rows in both timing modes: back to back twice as fast as the barrier rows,
    and ray 2x faster in them only (4x its barrier time)."""
    rows = [dict(row, timing="barrier") for row in _rows_for_page()]
    return rows + [dict(row, timing="back-to-back",
                        p50_s=row["p50_s"] / (4 if row["backend"] == "ray" else 2))
                   for row in _rows_for_page()]


def _page_source(directory, rows, date):
    """A sweep's JSON file of ``rows`` (backends ray, gloo, mpi4py), written in ``directory``."""
    document = {"metadata": {"date": date, "cpu_count": 2, "memory_gib": 23.5,
                             "ray": "2.60.0", "numpy": "2", "command": "python -m benchmarks",
                             "options": {"backends": ["ray", "gloo", "mpi4py"]}},
                "rows": rows, "notes": []}
    source = directory / "both.json"
    source.write_text(json.dumps(document))
    return source


def test_the_brief_page_has_one_table_of_the_headline_mode_and_latency_plots(tmp_path):
    rows = _rows_in_both_modes()
    rows[-1] = dict(rows[-1], p50_s=None, error="rank 1: PeerDiedError")
    source = _page_source(tmp_path, rows, "2026-11-26")
    plots = tmp_path / "plots"
    write_plots(rows, plots)
    generated = render([([source], plots)], tmp_path, brief=True)
    assert generated.startswith(BEGIN) and generated.endswith(END)
    lines = generated.splitlines()
    header = lines.index("| collective | ranks | size | ray p50 | ray vs gloo | ray vs MPICH |")
    table = lines[header + 2:header + 6]
    # back to back only: ray 50 µs against gloo's 300 µs (6x), MPICH's 50 µs (1x); MPICH
    # failed at the last point.
    assert table == ["| allreduce | 2 | 8 B | 50.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 2 | 1 KiB | 50.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 4 | 8 B | 100.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 4 | 1 KiB | 100.0 µs | 6.00× | - |"]
    assert lines[header + 6] == ""
    # Back to back is the page's timing, said once on the page, not per table.
    assert "Timing" not in generated and "barrier before" not in generated
    assert ("- Run 2026-11-26 on 2 cores / 23.5 GiB, Ray 2.60.0, numpy 2, : `python -m benchmarks`"
            in lines)
    assert "failed: 1 point(s) where a backend failed" in generated
    [images] = [line for line in lines if line.startswith("![")]   # one line, side by side
    assert re.findall(r"\]\(([^)]+)\)", images) == [
        "plots/latency_allreduce_2ranks.png", "plots/latency_allreduce_4ranks.png"]
    assert "bus bandwidth and time against ranks too: `plots/`)" in images
    assert page_main(["--brief", f"{source}={plots}"]) == 0   # the command line takes it too


def test_results_page_and_plots_show_both_timing_modes(tmp_path):
    rows = _rows_in_both_modes()
    # CPU per call in the back-to-back rows only: the busiest rank 80 %, the median 50 % of p50.
    rows = [dict(row, cpu_per_call_max_s=row["p50_s"] * 0.8,
                 cpu_per_call_median_s=row["p50_s"] * 0.5) if row["timing"] == "back-to-back"
            else row for row in rows]
    source = _page_source(tmp_path, rows, "2026-11-23")
    generated = render([([source], None)], tmp_path)
    headings = [line.split("**")[1] for line in generated.splitlines() if line.startswith("**")]
    assert headings == ["allreduce, 2 ranks, back to back",
                        "allreduce, 2 ranks, barrier before every call",
                        "allreduce, 4 ranks, back to back",
                        "allreduce, 4 ranks, barrier before every call"]
    assert ("Timing back-to-back: one barrier, then the calls in a loop; an iteration is the "
            "time from one call's return to the next's; barrier:") in generated
    tables = generated.split("**allreduce, 2 ranks, ")
    assert tables[1].splitlines()[4].startswith("| 8 B | 50.0 µs · ")   # back to back
    assert tables[1].splitlines()[4].endswith("| 6.00× | 1.00× |")
    assert tables[2].splitlines()[4].endswith("| 3.00× | 0.50× |")   # barrier
    assert "CPU/call: a rank process's CPU time (user + system)" in generated
    cpu = tables[1].split("CPU time per call per rank, back to back (the busiest rank / the "
                          "median over ranks):")[1].splitlines()
    assert cpu[2] == "| size | ray CPU/call | gloo CPU/call | mpi4py CPU/call |"
    assert cpu[4] == "| 8 B | 40.0 µs / 25.0 µs | 240.0 µs / 150.0 µs | 40.0 µs / 25.0 µs |"
    assert generated.count("CPU time per call per rank, back to back") == 2
    assert "CPU time per call per rank, barrier" not in generated   # those rows have none
    written = write_plots(rows, tmp_path / "plots")
    assert sorted(path.name for path in written) == [
        "busbw_allreduce_2ranks.png", "busbw_allreduce_4ranks.png",
        "latency_allreduce_2ranks.png", "latency_allreduce_4ranks.png",
        "time_allreduce_1KiB.png", "time_allreduce_8B.png"]


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
    from ray_collective.backends.base import GroupCall
    from ray_collective.backends.transport_membership import TransportMembership
    from ray_collective.tensors import as_view
    from ray_collective.types import CallOptions, Collective
    for world_size in (8, 4096):
        transport = InstantTransport(0, world_size)
        backend = TransportMembership("g", transport,
                                      node_of=[r // 8 for r in range(world_size)],
                                   forced={})
        tensor = as_view(np.zeros(2, np.float32), writable=True)
        options = CallOptions(Collective.ALLREDUCE, timeout=60.0)
        backend.run(GroupCall(options, 0, tensor))
        first = backend.prepared(options, tensor)
        for seq in range(1, 4):
            backend.run(GroupCall(options, seq, tensor))
        assert backend.prepared(options, tensor) is first and backend.prepared_calls() == 1


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
