"""The 400-rank benchmark's mechanics on a small real group (the run itself is ``make bench-400``):
every result checked against numpy, nothing left after a destroy, and the failure drill, whose
survivors must name the killed rank, leave nothing behind and rebuild without it."""

import json
import os

import numpy as np
import pytest

from benchmarks import scale_rank, scale_real


@pytest.mark.parametrize("world_size", [1, 2, 30, 31, 32, 63, 400])
def test_the_allreduce_reference_is_the_sum_of_every_rank_input(world_size):
    inputs = np.stack([scale_rank.rank_input(rank, 100) for rank in range(world_size)])
    exact = inputs.astype(np.int64).sum(axis=0)
    assert np.array_equal(scale_rank.expected_result("allreduce", world_size, 0, 100), exact)


def test_rank_inputs_make_sums_that_float32_holds_exactly_at_400_ranks():
    inputs = np.stack([scale_rank.rank_input(rank, 1000) for rank in range(400)])
    assert inputs.astype(np.int64).sum(axis=0).max() < 2**24
    # A reference that ignored a rank would be caught: the inputs differ from rank to rank.
    assert not np.array_equal(inputs[0], inputs[1])


def test_allgather_and_broadcast_references():
    gathered = scale_rank.expected_result("allgather", 3, 1, 4)
    assert gathered.shape == (3, 4)
    assert np.array_equal(gathered[2], scale_rank.rank_input(2, 4))
    assert np.array_equal(scale_rank.expected_result("broadcast", 3, 2, 4),
                          scale_rank.rank_input(0, 4))


@pytest.fixture(scope="module")
def scale_run(ray_session):
    run = scale_real.Run(ray_session, [], [], timeout_s=30.0, warmup=1, iterations=3)
    scale_real.start_actors(ray_session, 4, [None], run.actors, run.pids)
    yield run
    for actor in run.actors:
        ray_session.kill(actor)


def test_every_point_is_correct_and_a_destroyed_group_leaves_nothing(scale_run):
    imperative = scale_run.imperative(3, "scale-real-imperative")
    assert imperative["wrong"] == []
    assert [(p["collective"], p["bytes"]) for p in imperative["points"]] == \
        list(scale_real.POINTS)
    assert all(p["p50_s"] > 0 and p["iterations"] == 3 for p in imperative["points"])
    assert imperative["after_destroy"] == {"kv_keys": 0, "group_dir_entries": 0}
    assert 0 < imperative["task_round_before_join_s"] < imperative["join_s"] + 5
    assert 0 < imperative["task_round_before_destroy_s"]
    assert 0 < imperative["destroy_in_rank_p50_s"] <= imperative["destroy_in_rank_max_s"] \
        <= imperative["destroy_s"]
    declared = scale_run.declarative(3, "scale-real-declared")
    assert declared["wrong"] == []
    assert declared["after_destroy"] == {"kv_keys": 0, "group_dir_entries": 0}


def test_rank_actors_run_one_task_at_a_time_and_their_cpu_inside_a_task_is_measured(scale_run):
    # A threaded rank actor keeps Ray's 100 Hz signal check running beside every collective
    # (the 400-rank page's figures were 1.3-3.5x slower that way).
    assert scale_real.RANK_OPTIONS.get("max_concurrency", 1) == 1
    cores = scale_run.holding_cpu_cores(seconds=1.0)
    assert 0.0 <= cores < 2.0 * (os.cpu_count() or 1)


def test_the_drill_names_the_killed_rank_then_rebuilds_without_it_and_leaves_nothing(scale_run):
    drill = scale_run.drill(4, "scale-real-drill")
    assert drill["victim"] == 3
    assert drill["survivors_answered"] == drill["survivors"] == 3
    assert drill["types"] == ["PeerDiedError"]
    assert drill["naming_victim"] == 3
    assert drill["raise_after_kill_max_s"] < 5
    assert drill["after_destroy"] == {"kv_keys": 0, "group_dir_entries": 0}
    assert drill["rebuild_wrong"] == []
    assert drill["rebuild_after_destroy"] == {"kv_keys": 0, "group_dir_entries": 0}


def _report(size, points, drill=None):
    imperative = {"join_s": 1.0, "destroy_s": 0.5, "wrong": [], "import_s": 0.1,
                  "rss_added_by_import_p50_bytes": 2**21, "rss_added_p50_bytes": 2**17,
                  "shmem_in_use_bytes": 2**20, "processes_added": 0, "open_fds_max": 9,
                  "after_destroy": {"kv_keys": 0, "group_dir_entries": 0},
                  "points": [{"collective": c, "bytes": b, "p50_s": 0.01, "p95_s": 0.02}
                             for c, b in points]}
    declarative = {"join_s": 0.9, "destroy_s": 0.4, "wrong": ["rank 1: differs"],
                   "after_destroy": {"kv_keys": 0, "group_dir_entries": 0}}
    report = {"sizes": [{"world_size": size, "actors_start_s": 5.0, "idle_actor_cpu_cores": 0.5,
                         **({"holding_actor_cpu_cores": 0.25} if size == 64 else {}),
                         "imperative": imperative, "declarative": declarative,
                         "predicted_allreduce_8b": None}]}
    if drill:
        report["drill"] = drill
    return report


def test_runs_are_merged_by_world_size_and_a_point_not_run_says_so(tmp_path):
    paths = []
    for name, report in (("large.json", _report(400, scale_real.SMALL_POINTS, {"victim": 201})),
                         ("small.json", _report(64, scale_real.POINTS))):
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_text(json.dumps(report))
    merged = scale_real.merged_reports(paths)
    assert [row["world_size"] for row in merged["sizes"]] == [64, 400]
    assert merged["drill"] == {"victim": 201}
    table = scale_real.markdown(merged).splitlines()
    assert table[0] == "| | 64 ranks | 400 ranks |"
    assert "| allreduce 1 MiB, p50 (p95) | 10.0 ms (20.0 ms) | not run |" in table
    assert "| results differing from numpy | 1 | 1 |" in table
    assert "| Ray's actors inside a task, CPU (cores) | 0.25 | not measured |" in table
    assert not any(row.startswith("| post offices answering") for row in table)
    assert "| join / destroy inside a rank, p50 and most (s) |" not in "\n".join(table)
    merged["sizes"][1]["imperative"].update(
        task_round_before_join_s=0.75, task_round_before_destroy_s=1.5,
        join_in_rank_p50_s=0.5, join_in_rank_max_s=0.9,
        destroy_in_rank_p50_s=0.25, destroy_in_rank_max_s=0.4)
    table = scale_real.markdown(merged).splitlines()
    assert ("| a task doing nothing on every rank, before the join / the destroy (s) "
            "| not measured | 0.75 / 1.50 |") in table
    assert ("| join / destroy inside a rank, p50 and most (s) | not measured "
            "| 0.50, 0.90 / 0.25, 0.40 |") in table
    merged["sizes"][1]["imperative"]["post_offices_up_s"] = 2.5
    assert ("| post offices answering, after the join (s) | – | 2.50 |"
            in scale_real.markdown(merged).splitlines())


class _FakeRay:
    """``ray`` as ``wait_for_post_offices`` uses it: the named actors appear one per look."""

    def __init__(self, names):
        self.pending, self.listed, self.readied = list(names), [], []
        self.util = self

    def list_named_actors(self, all_namespaces):
        if self.pending:
            self.listed.append(self.pending.pop(0))
        return [{"name": "someone-else", "namespace": "ray_collective"},
                *({"name": n, "namespace": "ray_collective"} for n in self.listed)]

    def get_actor(self, name, namespace):
        fake = self

        class Ready:
            def remote(self):
                fake.readied.append(name)
                return name
        return type("Handle", (), {"__ray_ready__": Ready()})()

    def get(self, refs, timeout):
        return refs


def test_the_points_over_nodes_wait_until_every_post_office_answers():
    from ray_collective.backends.ray.post_offices import post_office_name
    names = [post_office_name("g", 1000 + i, f"node{i}") for i in range(3)]
    fake = _FakeRay(names)
    assert scale_real.wait_for_post_offices(fake, 3, timeout_s=5) < 5
    assert sorted(fake.readied) == sorted(names)
    with pytest.raises(TimeoutError, match="1 of 2 post offices"):
        scale_real.wait_for_post_offices(_FakeRay(names[:1]), 2, timeout_s=0.3)
