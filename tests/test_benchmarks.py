"""The benchmark harness: its formulas against hand-computed values, the timing loops against a
recorded clock, the command line's options, the rows and their failures, the peers' parts.

The results page and the plots are tested in ``test_benchmarks_page.py``; the peers and the
small real runs in ``test_benchmarks_runs.py``; the runs across nodes in
``test_benchmarks_nodes.py``.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import numpy as np

from benchmarks.cli import build_parser, options_from_arguments, parse_size
from benchmarks.collectives import COLLECTIVES, message_layout
from benchmarks.harness import unsupported_reason
from benchmarks.mpi_job import decode_arguments, descendant_count, encode_arguments
from benchmarks.peers import PEERS, Mpi4pyPeer, make_buffers
from benchmarks.plain_ray import combine
from benchmarks.report import (ProgressBar, format_progress, format_size, format_table,
                               row_timing, to_json)
from benchmarks.rows import Footprint, Row, SweepResult, summarize_point, unmeasured_rows
from benchmarks.sweep import SweepOptions, block_order, count_points, split_iterations
from benchmarks import worker
from benchmarks.worker import BACK_TO_BACK, BARRIER, PACED, BlockSpec, RankWorker
from benchmarks.stats import (algorithm_bandwidth, bus_bandwidth, cpu_per_call,
                              default_iteration_counts, iteration_latencies, percentiles, speedup)


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


