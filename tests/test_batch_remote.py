"""batch_remote and ActorPool on real actors: results, one put per large argument, validation
before submission, options, and the failure semantics of the docstring."""

import numpy as np
import pytest

import ray_collective as col
from ray_collective import batch as batch_module


class Recorder:
    """An actor that records what it received, so a test can see what a call delivered."""

    def __init__(self, label=0):
        self.label = label
        self.calls = 0

    def echo(self, value, scale=1):
        self.calls += 1
        kind = type(value).__name__
        total = float(np.sum(value)) * scale if isinstance(value, np.ndarray) else value
        return self.label, kind, total

    def pair(self):
        self.calls += 1
        return self.label, -self.label

    def fail_if(self, label):
        self.calls += 1
        if self.label == label:
            raise ValueError(f"actor {label} refuses")
        return self.label

    def count(self):
        return self.calls


class OtherRecorder:
    """A second actor class with a method of the same name and another signature."""

    def echo(self, value, scale=1, extra=None):
        return "other", type(value).__name__, float(np.sum(value)) * scale


@pytest.fixture(scope="module")
def recorders(ray_session):
    actor_class = ray_session.remote(num_cpus=0)(Recorder)
    actors = [actor_class.remote(label) for label in range(4)]
    ray_session.get([a.count.remote() for a in actors])
    yield actors
    for actor in actors:
        ray_session.kill(actor)


def _calls(ray, actors):
    return ray.get([a.count.remote() for a in actors])


def test_results_come_back_in_actor_order_with_values_delivered(ray_session, recorders):
    ray = ray_session
    reversed_actors = list(reversed(recorders))
    refs = col.batch_remote(reversed_actors).echo.remote(7, scale=2)
    assert len(refs) == len(recorders)
    assert ray.get(refs) == [(label, "int", 7) for label in (3, 2, 1, 0)]


def test_large_argument_is_put_once_and_actors_receive_the_value(ray_session, recorders,
                                                                  monkeypatch):
    ray = ray_session
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value))
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB, above the 100 KiB inline limit
    small = np.ones(16, dtype=np.float32)
    results = ray.get(col.batch_remote(recorders).echo.remote(big, scale=1))
    assert len(puts) == 1 and puts[0] is big
    assert results == [(label, "ndarray", float(big.sum())) for label in range(4)]
    puts.clear()
    results = ray.get(col.batch_remote(recorders).echo.remote(value=small))
    assert puts == []
    at_limit = np.zeros(batch_module.inline_limit_bytes(), dtype=np.uint8)  # + Ray's metadata
    ray.get(col.batch_remote(recorders).echo.remote(at_limit))
    assert len(puts) == 1 and puts[0] is at_limit
    assert [r[2] for r in results] == [16.0] * 4


def test_large_generic_object_is_measured_and_put_once(ray_session, recorders, monkeypatch):
    ray = ray_session
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value))
    big_list = list(range(60_000))
    assert batch_module._serialized_size(big_list) > batch_module.inline_limit_bytes()
    results = ray.get(col.batch_remote(recorders[:2]).echo.remote(big_list))
    assert len(puts) == 1
    assert [r[1] for r in results] == ["list", "list"]


def test_object_ref_arguments_are_passed_through_and_resolved(ray_session, recorders):
    ray = ray_session
    array = np.full(1000, 2.0)
    ref = ray.put(array)
    results = ray.get(col.batch_remote(recorders).echo.remote(ref, scale=ref.hex() and 1))
    assert results == [(label, "ndarray", 2000.0) for label in range(4)]


def test_per_actor_argument_gives_each_actor_its_value(ray_session, recorders):
    ray = ray_session
    values = col.PerActor([np.full(1, v) for v in (10, 20, 30, 40)])
    refs = col.batch_remote(recorders).echo.remote(values, scale=col.PerActor([1, 1, 2, 2]))
    assert [r[2] for r in ray.get(refs)] == [10, 20, 60, 80]


def test_bad_calls_raise_before_anything_is_submitted(ray_session, recorders):
    ray = ray_session
    before = _calls(ray, recorders)
    handle = col.batch_remote(recorders)
    with pytest.raises(AttributeError, match="no method 'ech'"):
        handle.ech.remote(1)
    with pytest.raises(TypeError, match="do not fit echo"):
        handle.echo.remote(1, 2, 3)
    with pytest.raises(TypeError, match="do not fit echo"):
        handle.echo.remote(1, nonsense=True)
    with pytest.raises(TypeError, match="3 values for 4 actors"):
        handle.echo.remote(col.PerActor([1, 2, 3]))
    with pytest.raises(TypeError, match="unknown option"):
        handle.echo.options(num_gpus=1)
    assert _calls(ray, recorders) == before


def test_handle_rejects_what_is_not_a_list_of_actors(ray_session, recorders):
    with pytest.raises(ValueError, match="at least one"):
        col.batch_remote([])
    with pytest.raises(TypeError, match="actor handles"):
        col.batch_remote([recorders[0], "not an actor"])
    with pytest.raises(TypeError, match="list of actor handles"):
        col.batch_remote(recorders[0])


def test_the_handle_class_by_its_public_name_is_what_batch_remote_gives(ray_session, recorders):
    ray = ray_session
    handle = col.BatchRemoteHandle(recorders[:2])
    assert isinstance(col.batch_remote(recorders), col.BatchRemoteHandle)
    assert handle.actors == tuple(recorders[:2]) and len(handle) == 2
    assert repr(handle) == "BatchRemoteHandle(2 actors)"
    assert ray.get(handle.echo.remote(5)) == [(0, "int", 5), (1, "int", 5)]
    with pytest.raises(ValueError, match="at least one"):
        col.BatchRemoteHandle([])


def test_options_apply_to_every_call(ray_session, recorders):
    ray = ray_session
    refs = col.batch_remote(recorders).pair.options(num_returns=2, name="batched").remote()
    assert all(isinstance(pair, list) and len(pair) == 2 for pair in refs)
    assert [ray.get(pair) for pair in refs] == [[label, -label] for label in range(4)]


def test_mixed_actor_classes_are_each_checked_against_their_own_signature(ray_session,
                                                                           recorders):
    ray = ray_session
    other = ray.remote(num_cpus=0)(OtherRecorder).remote()
    try:
        mixed = [recorders[0], other]
        results = ray.get(col.batch_remote(mixed).echo.remote(np.ones(4)))
        assert results == [(0, "ndarray", 4.0), ("other", "ndarray", 4.0)]
        with pytest.raises(TypeError, match="do not fit echo"):
            col.batch_remote(mixed).echo.remote(np.ones(4), extra=1)
    finally:
        ray.kill(other)


def test_an_error_in_one_actor_is_raised_by_its_ref_only(ray_session, recorders):
    ray = ray_session
    refs = col.batch_remote(recorders).fail_if.remote(2)
    assert ray.get([refs[i] for i in (0, 1, 3)]) == [0, 1, 3]
    with pytest.raises(ValueError, match="actor 2 refuses"):
        ray.get(refs[2])


def test_dead_actor_makes_its_own_ref_raise_and_the_others_go_ahead(ray_session):
    ray = ray_session
    actor_class = ray.remote(num_cpus=0, max_restarts=0)(Recorder)
    actors = [actor_class.remote(label) for label in range(3)]
    ray.get([a.count.remote() for a in actors])
    ray.kill(actors[1])
    refs = col.batch_remote(actors).echo.remote(np.ones(1 << 16))
    assert [ray.get(refs[i], timeout=60)[0] for i in (0, 2)] == [0, 2]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(refs[1], timeout=60)
    for actor in actors:
        ray.kill(actor)


def test_actor_pool_keeps_its_api_and_batches_over_all_its_actors(ray_session, recorders):
    ray = ray_session
    pool = col.ActorPool(recorders[:2])
    mapped = list(pool.map(lambda a, v: a.echo.remote(v), [1, 2, 3]))
    assert [total for _, _, total in mapped] == [1, 2, 3]
    assert [r[0] for r in ray.get(pool.batch_remote().echo.remote(5))] == [0, 1]
    pool.push(recorders[2])
    assert [r[0] for r in ray.get(pool.batch_remote().echo.remote(5))] == [0, 1, 2]
    popped = pool.pop_idle()
    remaining = [r[0] for r in ray.get(pool.batch_remote().echo.remote(5))]
    assert len(remaining) == 2 and popped is not None
    assert isinstance(pool, col.ActorPool)
    from ray.util import ActorPool as RayActorPool
    assert isinstance(pool, RayActorPool)


def test_direct_submission_is_used_on_this_ray_and_matches_the_full_path(ray_session,
                                                                          recorders):
    ray = ray_session
    assert batch_module._core_worker_speaks_direct_calls(), \
        "Ray's submit_actor_task changed: batch_remote fell back to the full .remote() path"
    plans = col.batch_remote(recorders).echo._plan((1,), {}, {})
    assert all(plan is not None for plan in plans)
    direct = ray.get(col.batch_remote(recorders).echo.remote(3, scale=2))
    loop = ray.get([a.echo.remote(3, scale=2) for a in recorders])
    assert direct == loop


def test_benchmark_runs_every_table_on_a_tiny_sweep(ray_session):
    from benchmarks import batch_remote as bench
    options = bench.Options(sizes=(10, 200 * 1024), size_table_actors=2, actor_counts=(2,),
                            count_table_size=200 * 1024, object_ref_size=1024, repeats=2)
    rows = bench.run(ray_session, options)
    assert [(r.table, r.actors, r.size) for r in rows] == [
        ("size", 2, 10), ("size", 2, 200 * 1024), ("actors", 2, 200 * 1024),
        ("no_args", 2, 0), ("object_ref", 2, 1024)]
    for row in rows:
        assert row.repeats == 2
        assert row.foreach_submit_ms["p50"] > 0 and row.batch_submit_ms["p50"] > 0
        assert row.done_speedup > 0 and row.submit_speedup > 0
    table = bench.format_tables(rows)
    assert "Argument size sweep" in table and "| 2 | 200 KiB |" in table
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--sizes", "0"])
