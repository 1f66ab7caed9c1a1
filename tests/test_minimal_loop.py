"""The minimal loop (``python -m benchmarks.minimal_loop``): its options, its figures from
made-up durations, and one tiny real run across two nodes of a local cluster (in a subprocess,
which starts and stops a Ray of its own)."""

import json

import pytest

from benchmarks import minimal_loop
from support.helpers import run_benchmark


def test_layouts_and_trial_options_parse_and_bad_ones_exit_with_status_2(capsys):
    arguments = minimal_loop.build_parser().parse_args(
        ["--layouts", "2x2,1x4", "--timing", "back-to-back", "--barrier", "block",
         "--actor", "threaded", "--cluster", "user", "--placement", "alternate",
         "--gloo-group", "default", "--libraries", "gloo,ray"])
    assert arguments.layouts == ((2, 2), (1, 4))
    assert (arguments.timing, arguments.barrier, arguments.actor, arguments.cluster,
            arguments.placement, arguments.gloo_group) == (
        "back-to-back", "block", "threaded", "user", "alternate", "default")
    assert arguments.libraries == ("gloo", "ray")
    defaults = minimal_loop.build_parser().parse_args([])
    assert defaults.layouts == ((2, 2), (1, 2), (1, 4)) and defaults.timing == "per-call"
    for bad in (["--layouts", "1x1"], ["--layouts", "0x2"], ["--layouts", "2y2"],
                ["--timing", "sometimes"], ["--libraries", "ray,ray"], ["--actor", "busy"]):
        with pytest.raises(SystemExit) as exited:
            minimal_loop.build_parser().parse_args(bad)
        assert exited.value.code == 2
    assert capsys.readouterr().err


def test_a_forced_algorithm_is_a_library_of_its_own_checked_against_the_collective(capsys):
    arguments = minimal_loop.build_parser().parse_args(
        ["--collective", "reducescatter", "--bytes", "1K",
         "--libraries", "ray,ray@recursive_halving"])
    assert (arguments.collective, arguments.bytes) == ("reducescatter", 1024)
    assert arguments.libraries == ("ray", "ray@recursive_halving")
    options = minimal_loop.LoopOptions()
    assert minimal_loop.group_name("ray@pairwise", options, (1, 4)) == \
        "minimal-loop-ray-pairwise-1x4"
    for bad in (["--libraries", "gloo@ring"], ["--libraries", "ray@"],
                ["--collective", "gather"], ["--bytes", "lots"]):
        with pytest.raises(SystemExit) as exited:
            minimal_loop.build_parser().parse_args(bad)
        assert exited.value.code == 2
    # Known to the catalog, but not as an algorithm of this collective: refused before Ray.
    with pytest.raises(SystemExit) as exited:
        minimal_loop.main(["--collective", "reducescatter", "--libraries", "ray@ring_bogus"])
    assert exited.value.code == 2
    assert "reducescatter has no algorithm 'ring_bogus'" in capsys.readouterr().err


def test_sizes_are_the_clis_reducescatter_the_whole_list():
    assert minimal_loop.block_elements("allreduce", 8, 4) == 2
    assert minimal_loop.block_elements("reducescatter", 16, 4) == 1
    assert minimal_loop.block_elements("reducescatter", 4096, 4) == 256
    assert minimal_loop.block_elements("reducescatter", 8, 4) == 1


@pytest.mark.ray
def test_a_tiny_reducescatter_loop_sets_the_rule_against_a_forced_algorithm(tmp_path):
    out = tmp_path / "loop.json"
    completed = run_benchmark(
        "benchmarks.minimal_loop", "--layouts", "1x2", "--collective", "reducescatter",
        "--bytes", "64", "--libraries", "ray,ray@pairwise", "--iters", "4",
        "--warmup", "1", "--blocks", "2", "--timeout", "60", "--json", str(out))
    [result] = json.loads(out.read_text())["results"]
    assert result["block_order"] == [["ray", "ray@pairwise"], ["ray@pairwise", "ray"]]
    for figures in result["libraries"].values():
        assert figures["sum_right"] is True
        assert [len(durations) for durations in figures["durations"]] == [4, 4]
    # Two ranks with a core each: the rule halves; the forced group does not, and the forcing
    # does not reach the group joined before it.
    assert result["libraries"]["ray@pairwise"]["algorithm"] == ["pairwise"] * 2
    assert result["libraries"]["ray"]["algorithm"] == ["recursive_halving"] * 2
    assert "WRONG SUM" not in completed.stdout


def test_figures_are_the_slowest_rank_per_iteration_and_each_ranks_own():
    figures = minimal_loop.summarize([[1.0, 5.0, 2.0, 4.0], [3.0, 1.0, 2.5, 0.5]], [2.0, 1.0])
    # slowest per iteration 3, 5, 2.5, 4: p50 3.5; rank 0 sorted 1 2 4 5: 3; rank 1: 1.75.
    assert figures["slowest_p50_s"] == pytest.approx(3.5)
    assert figures["rank_p50_s"] == pytest.approx([3.0, 1.75])
    assert figures["cpu_per_call_s"] == pytest.approx([0.5, 0.25])
    assert minimal_loop._split(10, 4) == [3, 3, 2, 2] and minimal_loop._split(2, 4) == [1, 1]


def test_the_modes_of_a_users_history_parse_into_the_options():
    arguments = minimal_loop.build_parser().parse_args(
        ["--block-warmup", "1", "--pause-ms", "5", "--first-calls", "3", "--warmup", "0"])
    assert (arguments.block_warmup, arguments.pause_ms, arguments.first_calls,
            arguments.warmup) == (1, 5, 3, 0)
    defaults = minimal_loop.build_parser().parse_args([])
    assert (defaults.block_warmup, defaults.pause_ms, defaults.first_calls) == (0, 0, 10)
    for bad in (["--block-warmup", "-1"], ["--pause-ms", "-2"], ["--first-calls", "x"]):
        with pytest.raises(SystemExit) as exited:
            minimal_loop.build_parser().parse_args(bad)
        assert exited.value.code == 2


class _Library:
    """A stand-in for a library's module that logs its barriers and calls."""

    def __init__(self, events):
        self.events = events

    def barrier(self, group):
        self.events.append("barrier")

    def allreduce(self, tensor, group):
        self.events.append("call")


@pytest.mark.parametrize("timing", ["per-call", "back-to-back"])
def test_a_block_warms_up_after_its_barrier_and_sleeps_before_each_call(monkeypatch, timing):
    events = []
    rank = minimal_loop.LoopRank(0, 2)
    rank.groups["ray"] = "g"
    monkeypatch.setattr(rank, "_module", lambda library: _Library(events))
    monkeypatch.setattr(minimal_loop.time, "sleep", lambda seconds: events.append(seconds))
    answer = rank.run_block("ray", 2, timing, True, warmup=1, pause_s=0.005)
    assert events == ["barrier"] + [0.005, "call"] * 3
    assert len(answer["durations"]) == 2
    events.clear()
    first = rank.first_calls("ray", 3)
    assert len(first["durations"]) == 3 and first["late_s"] == 0.0 and events == ["call"] * 3


def test_a_rank_that_begins_its_first_calls_late_says_by_how_much(monkeypatch):
    events = []
    rank = minimal_loop.LoopRank(0, 2)
    rank.groups["ray"] = "g"
    monkeypatch.setattr(rank, "_module", lambda library: _Library(events))
    monkeypatch.setattr(minimal_loop.time, "sleep", lambda seconds: events.append(seconds))
    late = rank.first_calls("ray", 1, start_at=minimal_loop.time.time() - 2.0)
    assert late["late_s"] >= 2.0 and events == ["call"]
    events.clear()
    early = rank.first_calls("ray", 1, start_at=minimal_loop.time.time() + 60.0)
    assert early["late_s"] == 0.0 and events[0] > 59.0 and events[1:] == ["call"]


def test_a_new_groups_first_calls_give_the_first_and_the_median_of_ten_of_the_slowest():
    # slowest per call: 9, 2, 3, 4, 5, 6, 7, 8, 1, 10, 50: the eleventh is left out.
    ranks = [[9.0, 2.0, 1.0, 4.0, 5.0, 6.0, 7.0, 8.0, 1.0, 10.0, 50.0],
             [1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]]
    figures = minimal_loop.summarize_first_calls(ranks)
    assert figures["first_call_s"] == 9.0
    assert figures["first_ten_p50_s"] == pytest.approx(5.5)


def test_group_names_differ_per_library_unless_gloo_takes_rays_default():
    options = minimal_loop.LoopOptions()
    assert minimal_loop.group_name("ray", options, (2, 2)) == "minimal-loop-ray-2x2"
    assert minimal_loop.group_name("gloo", options, (2, 2)) == "minimal-loop-gloo-2x2"
    default = minimal_loop.LoopOptions(gloo_group="default")
    assert minimal_loop.group_name("gloo", default, (1, 4)) == "default"
    assert minimal_loop.group_name("ray", default, (1, 4)) == "minimal-loop-ray-1x4"


@pytest.mark.multinode
def test_a_tiny_loop_across_two_nodes_times_both_libraries_in_alternating_blocks(tmp_path):
    pytest.importorskip("torch", reason="Ray's gloo group needs torch (pip install '.[bench]')")
    out = tmp_path / "loop.json"
    arguments = ["--layouts", "2x1", "--iters", "4", "--warmup", "1", "--blocks", "2",
                 "--block-warmup", "1", "--pause-ms", "1", "--first-calls", "3",
                 "--timeout", "60", "--json", str(out)]
    completed = run_benchmark("benchmarks.minimal_loop", *arguments)
    written = json.loads(out.read_text())
    assert written["command"] == " ".join(["python -m benchmarks.minimal_loop", *arguments])
    [result] = written["results"]
    assert result["layout"] == "2x1" and result["nodes"] == [0, 1]
    assert result["block_order"] == [["ray", "gloo"], ["gloo", "ray"]]
    for library in ("ray", "gloo"):
        figures = result["libraries"][library]
        assert figures["sum_right"] is True
        assert [len(durations) for durations in figures["durations"]] == [4, 4]
        assert min(min(durations) for durations in figures["durations"]) > 0
        assert figures["slowest_p50_s"] >= max(figures["rank_p50_s"]) > 0
        assert min(figures["cpu_per_call_s"]) > 0
        assert [len(durations) for durations in figures["first_calls"]] == [3, 3]
        assert figures["first_call_s"] > 0 and figures["first_ten_p50_s"] > 0
        assert figures["first_call_late_s"] >= 0
    lines = [line for line in completed.stdout.splitlines() if "slowest rank p50" in line]
    assert [line.split()[:2] for line in lines] == [["2x1", "ray"], ["2x1", "gloo"]]
    assert "WRONG SUM" not in completed.stdout
