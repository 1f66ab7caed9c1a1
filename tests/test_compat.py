"""Compatibility with ``ray.util.collective``: code written for it runs here unchanged.

The actors are ``support.compat_members.CollectiveUser``: code written for ``ray.util.collective`` that
receives its tensors as task arguments or from ``ray.get`` (read-only numpy arrays) and runs
in-place collectives on them. The same class runs on ``ray_collective`` with
``backend="ray"`` and on ``ray.util.collective`` with Gloo (two ranks each: a Gloo rank loads
torch), and the two must give the same results, which are also checked against numpy. The
error tests check that bad input raises what ``ray.util.collective`` raises (``RuntimeError``)
as well as the ``ValueError``/``TypeError`` this library documents.
"""

import inspect
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import ray_collective as col
from support import extras

# Every test here compares with ray.util.collective or runs it.
ray_util_collective = pytest.importorskip(
    "ray.util.collective", reason="these tests compare with ray.util.collective")

from support.compat_members import CollectiveUser  # noqa: E402
from support.paths import python_path

torch = extras.need("torch", "the Gloo side of these tests")

WORLD = 2
GROUP = "compat"


@pytest.fixture(scope="module")
def pairs(ray_session):
    """Two ranks on ray_collective (``"ray"``) and two on ray.util.collective (``"gloo"``), each
    pair in the group GROUP; the same actor class for both."""
    actor = ray_session.remote(num_cpus=0)(CollectiveUser)
    made = {"ray": [actor.remote("ray_collective") for _ in range(WORLD)],
            "gloo": [actor.remote("ray.util.collective") for _ in range(WORLD)]}
    for backend, actors in made.items():
        ray_session.get([a.init_group.remote(WORLD, r, backend, GROUP)
                         for r, a in enumerate(actors)])
    yield made
    for actors in made.values():
        for a in actors:
            ray_session.kill(a)


def _set_buffers(ray, actors, make):
    """Hand ``make(rank)`` to each actor as a task argument; returns whether each is writable."""
    return ray.get([a.set_buffer.remote(make(r)) for r, a in enumerate(actors)])


def _both(ray, pairs, scenario):
    """Run ``scenario(ray, actors)`` on both pairs; check they agree and return ours."""
    ours, gloo = scenario(ray, pairs["ray"]), scenario(ray, pairs["gloo"])
    assert len(ours) == len(gloo)
    for mine, theirs in zip(ours, gloo):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    return ours


def _errors(ray, refs, expected=RuntimeError):
    """The error each ref raises (every one must raise ``expected``)."""
    errors = []
    for ref in refs:
        with pytest.raises(expected) as info:
            ray.get(ref)
        errors.append(info.value)
    return errors


# ------------------------------------------------------------------ read-only arrays


@pytest.mark.parametrize("dtype, shape", [(np.float32, (10,)), (np.uint8, (2, 2)),
                                          (np.float16, (5, 5, 5)), (np.float64, (3,)),
                                          (np.float32, (1 << 15,))])  # 128 KiB: object store
def test_allreduce_on_task_arguments(ray_session, pairs, dtype, shape):
    def scenario(ray, actors):
        writable = _set_buffers(ray, actors, lambda r: np.full(shape, r + 1, dtype))
        assert writable == [False, False]  # what Ray hands to an actor is read-only
        return ray.get([a.allreduce.remote(GROUP) for a in actors])

    for result in _both(ray_session, pairs, scenario):
        np.testing.assert_array_equal(result, np.full(shape, 1 + 2, dtype))


@pytest.mark.parametrize("op, expected", [("PRODUCT", 6.0), ("MIN", 2.0), ("MAX", 3.0)])
def test_reduce_ops_on_task_arguments(ray_session, pairs, op, expected):
    def scenario(ray, actors):
        _set_buffers(ray, actors, lambda r: np.full(10, r + 2.0, np.float32))
        everyone = ray.get([a.allreduce.remote(GROUP, op) for a in actors])
        _set_buffers(ray, actors, lambda r: np.full(10, r + 2.0, np.float32))
        onto_one = ray.get([a.reduce.remote(1, GROUP, op) for a in actors])
        return everyone + onto_one

    everyone_0, everyone_1, kept, reduced = _both(ray_session, pairs, scenario)
    for result in (everyone_0, everyone_1, reduced):
        np.testing.assert_array_equal(result, np.full(10, expected, np.float32))
    np.testing.assert_array_equal(kept, np.full(10, 2.0, np.float32))  # not the destination


def test_broadcast_and_recv_into_task_arguments(ray_session, pairs):
    def scenario(ray, actors):
        _set_buffers(ray, actors, lambda r: np.arange(6.0).reshape(2, 3) * (r + 1))
        broadcast = ray.get([a.broadcast.remote(1, GROUP) for a in actors])
        _set_buffers(ray, actors, lambda r: np.full(4, r + 10, np.int64))
        sent_and_received = ray.get([actors[0].send.remote(1, GROUP),
                                     actors[1].recv.remote(0, GROUP)])
        return broadcast + sent_and_received

    results = _both(ray_session, pairs, scenario)
    for result in results[:2]:
        np.testing.assert_array_equal(result, np.arange(6.0).reshape(2, 3) * 2)
    for result in results[2:]:
        np.testing.assert_array_equal(result, np.full(4, 10, np.int64))


def test_allreduce_on_ray_get_results_writes_into_the_object(ray_session, pairs):
    """An array from ``ray.get`` is Ray's copy of the object: the result is seen in it, and in
    every later ``ray.get`` of the ref, with Gloo as here (docs/semantics.md says so)."""
    def scenario(ray, actors):
        refs = [ray.put(np.full(1 << 15, r + 1.0, np.float32)) for r in range(WORLD)]
        assert ray.get([a.fetch_buffer.remote([ref]) for a, ref in zip(actors, refs)]) == \
            [False, False]
        results = ray.get([a.allreduce.remote(GROUP) for a in actors])
        return results + [ray.get(ref) for ref in refs]

    for result in _both(ray_session, pairs, scenario):
        np.testing.assert_array_equal(result, np.full(1 << 15, 3.0, np.float32))


def _strict(_actor, on):
    if on:
        os.environ["RAY_COLLECTIVE_READ_ONLY"] = "error"
    else:
        os.environ.pop("RAY_COLLECTIVE_READ_ONLY", None)


def test_strict_mode_refuses_read_only_outputs(ray_session, pairs):
    ray = ray_session
    actors = pairs["ray"]
    ray.get([a.__ray_call__.remote(_strict, True) for a in actors])
    try:
        _set_buffers(ray, actors, lambda r: np.full(3, r + 1.0))
        for error in _errors(ray, [a.allreduce.remote(GROUP) for a in actors]):
            assert isinstance(error, ValueError) and "read-only" in str(error)
    finally:
        ray.get([a.__ray_call__.remote(_strict, False) for a in actors])
    # Nothing was sent: the group still works, and writes through again.
    assert ray.get([a.allreduce.remote(GROUP) for a in actors])[1].tolist() == [3.0] * 3


# ------------------------------------------------------------------ torch and numpy mixed


def _mixed(kinds, shape, value):
    return [torch.full(shape, value, dtype=torch.float32) if kind == "torch"
            else np.full(shape, value, np.float32) for kind in kinds]


@pytest.mark.parametrize("tensor_kind, list_kinds", [("torch", ["numpy", "numpy"]),
                                                     ("numpy", ["torch", "torch"]),
                                                     ("numpy", ["torch", "numpy"]),
                                                     ("torch", ["numpy", "torch"])])
def test_allgather_mixes_torch_and_numpy(ray_session, pairs, tensor_kind, list_kinds):
    def scenario(ray, actors):
        ray.get([a.set_buffer.remote(_mixed([tensor_kind], (3, 2), r + 1)[0])
                 for r, a in enumerate(actors)])
        ray.get([a.set_list_buffer.remote(_mixed(list_kinds, (3, 2), 0)) for a in actors])
        gathered = ray.get([a.allgather.remote(GROUP) for a in actors])
        for lists in gathered:
            assert [type(t).__module__.split(".")[0] for t in lists] == list_kinds
        return [np.stack([np.asarray(t) for t in lists]) for lists in gathered]

    for result in _both(ray_session, pairs, scenario):
        np.testing.assert_array_equal(result, np.stack([np.full((3, 2), j + 1.0, np.float32)
                                                        for j in range(WORLD)]))


@pytest.mark.parametrize("tensor_kinds, list_kinds", [(["torch", "numpy"], ["torch", "numpy"]),
                                                      (["numpy", "torch"], ["numpy", "torch"]),
                                                      (["torch", "torch"], ["numpy", "numpy"])])
def test_reducescatter_mixes_torch_and_numpy(ray_session, pairs, tensor_kinds, list_kinds):
    def scenario(ray, actors):
        ray.get([a.set_buffer.remote(_mixed([tensor_kinds[r]], (4,), 0)[0])
                 for r, a in enumerate(actors)])
        ray.get([a.set_list_buffer.remote(
            [t * (j + 1) * (r + 1) for j, t in enumerate(_mixed(list_kinds, (4,), 1))])
            for r, a in enumerate(actors)])
        return [np.asarray(t) for t in ray.get([a.reducescatter.remote(GROUP) for a in actors])]

    results = _both(ray_session, pairs, scenario)
    for rank, result in enumerate(results):  # block j of rank r is (j + 1) * (r + 1)
        np.testing.assert_array_equal(result, np.full(4, (rank + 1) * (1 + 2), np.float32))


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("length", [0, 1, 3])
def test_allgather_list_of_wrong_length(ray_session, pairs, length):
    def scenario(ray, actors):
        _set_buffers(ray, actors, lambda r: np.ones(10, np.float32))
        ray.get([a.set_list_buffer.remote([np.ones(10, np.float32)] * length) for a in actors])
        return _errors(ray, [a.allgather.remote(GROUP) for a in actors])

    ours, _ = scenario(ray_session, pairs["ray"]), scenario(ray_session, pairs["gloo"])
    assert all(isinstance(e, ValueError) and isinstance(e, col.ArgumentError) for e in ours)


@pytest.mark.parametrize("shape", [20, (4, 5), (1, 3, 5, 7)])
def test_allgather_list_of_wrong_shape(ray_session, pairs, shape):
    def scenario(ray, actors):
        _set_buffers(ray, actors, lambda r: np.ones(10, np.float32))
        ray.get([a.set_list_buffer.remote([np.ones(shape, np.float32)] * WORLD)
                 for a in actors])
        return _errors(ray, [a.allgather.remote(GROUP) for a in actors])

    ours, _ = scenario(ray_session, pairs["ray"]), scenario(ray_session, pairs["gloo"])
    assert all(isinstance(e, ValueError) and "shape" in str(e) for e in ours)


def test_argument_errors_are_also_what_ray_util_collective_raises(ray_session, pairs):
    """The checks ``ray.util.collective`` makes before reaching its backend, on the same
    calls: both raise a RuntimeError (here also the documented ValueError/TypeError), and a
    rank out of range is a ValueError in both."""
    ray = ray_session
    calls = [("send", np.ones(2), 0), ("recv", np.ones(2), 0),  # to or from itself
             ("allreduce", [1.0, 2.0]),  # not a tensor
             ("reducescatter", np.ones(2), [np.ones(2)])]  # not one tensor per rank
    for call in calls:
        for actors in (pairs["gloo"], pairs["ray"]):
            with pytest.raises(RuntimeError):
                ray.get(actors[0].call.remote(call[0], *call[1:], GROUP))
    for name, args in [("broadcast", (np.ones(2), 3)), ("reduce", (np.ones(2), -1)),
                       ("send", (np.ones(2), 2))]:
        for actors in pairs.values():
            with pytest.raises(ValueError):
                ray.get(actors[0].call.remote(name, *args, GROUP))
    with pytest.raises(TypeError):
        ray.get(pairs["ray"][0].call.remote("allreduce", [1.0, 2.0], GROUP))
    _set_buffers(ray, pairs["ray"], lambda r: np.ones(2))  # the group is still healthy
    assert ray.get([a.allreduce.remote(GROUP) for a in pairs["ray"]])[0].tolist() == [2.0, 2.0]


# ------------------------------------------------------------------ groups


def test_destroy_and_recreate_the_same_group_in_the_same_actors(ray_session, pairs):
    def scenario(ray, actors):
        results = []
        for round_ in range(3):
            ranks = [round_ % 2, 1 - round_ % 2]  # the ranks swap between incarnations
            assert ray.get([a.init_group.remote(WORLD, r, backend_of(actors), "again")
                            for a, r in zip(actors, ranks)]) == [True, True]
            assert ray.get([a.rank_and_size.remote("again") for a in actors]) == \
                [(r, WORLD) for r in ranks]
            _set_buffers(ray, actors, lambda r: np.full(3, float(round_ + r)))
            results += ray.get([a.allreduce.remote("again") for a in actors])
            ray.get([a.destroy_group.remote("again") for a in actors])
            assert ray.get([a.is_initialized.remote("again") for a in actors]) == [False] * 2
            with pytest.raises(RuntimeError, match="not initialized"):
                ray.get(actors[0].allreduce.remote("again"))
        return results

    def backend_of(actors):
        return "ray" if actors is pairs["ray"] else "gloo"

    results = _both(ray_session, pairs, scenario)
    for round_ in range(3):
        for result in results[2 * round_:2 * round_ + 2]:
            np.testing.assert_array_equal(result, np.full(3, 2.0 * round_ + 1))


def test_reinit_while_the_other_rank_still_holds_the_old_group(ray_session, pairs):
    """Rank 1 destroys and re-inits before rank 0 has left: its init must wait for the new
    incarnation (which rank 0 opens), not rejoin the old one nor fail."""
    ray = ray_session
    actors = pairs["ray"]
    ray.get([a.init_group.remote(WORLD, r, "ray", "reset") for r, a in enumerate(actors)])
    ray.get(actors[1].destroy_group.remote("reset"))
    late = actors[1].init_group.remote(WORLD, 1, "ray", "reset")
    ready, _ = ray.wait([late], timeout=3.0)
    assert not ready  # still waiting for rank 0
    ray.get(actors[0].destroy_group.remote("reset"))
    assert ray.get([actors[0].init_group.remote(WORLD, 0, "ray", "reset"), late],
                   timeout=60) == [True, True]
    try:
        _set_buffers(ray, actors, lambda r: np.full(2, r + 1.0))
        assert ray.get([a.allreduce.remote("reset") for a in actors])[0].tolist() == [3.0] * 2
    finally:
        ray.get([a.destroy_group.remote("reset") for a in actors])


def test_several_groups_at_once_with_their_own_timeouts(ray_session, pairs):
    ray = ray_session
    actors = pairs["ray"]
    names = [f"side-{i}" for i in range(3)]
    for i, name in enumerate(names):
        ray.get([a.init_group.remote(WORLD, (r + i) % WORLD, "ray", name, 40000 + 1000 * i)
                 for r, a in enumerate(actors)])
    try:
        handles = ray.get([actors[0].__ray_call__.remote(
            lambda _self, n=name: col.get_group_handle(n).timeout) for name in names])
        assert handles == [40.0, 41.0, 42.0]
        for i, name in enumerate(names):
            _set_buffers(ray, actors, lambda r: np.full(2, float(10 ** i * (r + 1))))
            assert ray.get([a.allreduce.remote(name) for a in actors])[0].tolist() == \
                [3.0 * 10 ** i] * 2
    finally:
        for name in names:
            ray.get([a.destroy_group.remote(name) for a in actors])


def test_second_init_after_a_failed_one(ray_session, pairs):
    ray = ray_session
    actors = pairs["ray"]
    with pytest.raises(col.CollectiveTimeoutError, match=r"ranks \[1\]"):
        ray.get(actors[0].init_group.remote(WORLD, 0, "ray", "late", 1000))  # rank 1 never came
    with pytest.raises(col.CollectiveTimeoutError, match=r"ranks \[0\]"):
        ray.get(actors[1].init_group.remote(WORLD, 1, "ray", "late", 1000))  # rank 0 left
    assert ray.get([a.is_initialized.remote("late") for a in actors]) == [False, False]
    assert ray.get([a.init_group.remote(WORLD, r, "ray", "late")
                    for r, a in enumerate(actors)]) == [True, True]
    try:
        _set_buffers(ray, actors, lambda r: np.full(2, r + 1.0))
        assert ray.get([a.allreduce.remote("late") for a in actors])[1].tolist() == [3.0, 3.0]
    finally:
        ray.get([a.destroy_group.remote("late") for a in actors])


def test_destroying_an_unknown_group_is_a_logged_no_op(caplog):
    with caplog.at_level(logging.WARNING, logger="ray_collective.api"):
        col.destroy_collective_group("never-made")
    assert "never-made" in caplog.text and "nothing to destroy" in caplog.text
    assert col.get_rank("never-made") == -1 and col.get_collective_group_size("never-made") == -1
    with pytest.raises(RuntimeError, match="not initialized"):
        col.get_group_handle("never-made")


def _declared(ray, actors, library, backend, ranks):
    """Declare ``actors`` with ``ray.util.collective``'s signature (positional world size,
    ranks, backend and name), run collectives in them by name, and destroy the group."""
    library.create_collective_group(actors, WORLD, ranks, backend, "declared")
    _set_buffers(ray, actors, lambda r: np.full(5, r + 1, np.int32))
    results = ray.get([a.allreduce.remote("declared") for a in actors])
    _set_buffers(ray, actors, lambda r: np.full(5, r + 1, np.int32))
    results += ray.get([a.reduce.remote(0, "declared") for a in actors])
    assert ray.get([a.rank_and_size.remote("declared") for a in actors]) == \
        [(rank, WORLD) for rank in ranks]
    ray.get([a.destroy_group.remote("declared") for a in actors])
    if library is col:
        col.destroy_collective_group("declared")
    return results


def test_create_collective_group_as_ray_util_collective_calls_it(ray_session, pairs):
    def scenario(ray, actors):
        if actors is pairs["ray"]:
            return _declared(ray, actors, col, "ray", [0, 1])
        return _declared(ray, actors, ray_util_collective, "gloo", [0, 1])

    allreduced_0, allreduced_1, reduced, kept = _both(ray_session, pairs, scenario)
    for result in (allreduced_0, allreduced_1, reduced):
        np.testing.assert_array_equal(result, np.full(5, 3, np.int32))
    np.testing.assert_array_equal(kept, np.full(5, 2, np.int32))
    # Ranks in another order than the actors' (with Gloo, a group made after the process's
    # first one keeps the first one's rank order whatever ranks it is given: not compared).
    _, _, kept, reduced = _declared(ray_session, pairs["ray"], col, "ray", [1, 0])
    np.testing.assert_array_equal(reduced, np.full(5, 3, np.int32))  # actor 1 is rank 0
    np.testing.assert_array_equal(kept, np.full(5, 1, np.int32))


# ------------------------------------------------------------------ the API, name by name


DELIBERATE_DEFAULTS = {
    # A CPU library: backend="ray" unless told otherwise (Ray's default is NCCL).
    ("init_collective_group", "backend"), ("create_collective_group", "backend"),
    # Gloo's 30 s per call fails long steps; this library's default deadline is 1800 s.
    ("init_collective_group", "gloo_timeout"), ("create_collective_group", "gloo_timeout"),
    # Optional here: the actors' count and their order.
    ("create_collective_group", "world_size"), ("create_collective_group", "ranks"),
}


@pytest.mark.parametrize("name", sorted(set(ray_util_collective.__all__)
                                        - {"register_collective_backend"}))
def test_every_function_takes_ray_util_collective_arguments(name):
    """Same parameter names in the same order, with the same defaults unless docs/compatibility.md lists
    the difference; extras are keyword-only. (``register_collective_backend`` registers a
    class in ray.util.collective's own registry: deliberately absent, see docs/compatibility.md.)"""
    theirs = inspect.signature(getattr(ray_util_collective, name)).parameters
    ours = inspect.signature(getattr(col, name)).parameters
    positional = [p for p in ours.values() if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in positional[:len(theirs)]] == list(theirs)
    assert all(p.default is not p.empty for p in positional[len(theirs):])
    for parameter in theirs.values():
        mine = ours[parameter.name]
        if parameter.default is parameter.empty or (name, parameter.name) in DELIBERATE_DEFAULTS:
            continue  # a default where Ray has none only accepts more calls
        default = getattr(parameter.default, "value", parameter.default)  # enums by value
        assert getattr(mine.default, "value", mine.default) == default, parameter.name


def test_only_the_backend_registry_is_missing():
    assert set(ray_util_collective.__all__) - set(col.__all__) == {"register_collective_backend"}


# ------------------------------------------------------------------ keeping the import


_JOB = r"""
import json, sys
import numpy as np
import ray
from support.compat_members import CollectiveUser

address, register = sys.argv[1], sys.argv[2] == "register"
runtime_env = {"env_vars": {"PYTHONPATH": sys.argv[3]}}
if register:
    import ray_collective
    runtime_env = ray_collective.ray_util_collective_runtime_env(runtime_env)
ray.init(address=address, runtime_env=runtime_env, logging_level="ERROR")
import ray.util.collective as col
actors = [ray.remote(num_cpus=0)(CollectiveUser).remote("ray.util.collective")
          for _ in range(2)]
out = {}
try:
    ray.get([a.init_group.remote(2, r, "ray", "kept") for r, a in enumerate(actors)])
    ray.get([a.set_buffer.remote(np.full(3, r + 1.0)) for r, a in enumerate(actors)])
    out["imperative"] = [t.tolist() for t in ray.get([a.allreduce.remote("kept") for a in actors])]
    ray.get([a.destroy_group.remote("kept") for a in actors])
    col.create_collective_group(actors, 2, [1, 0], "ray", "kept-declared")
    ray.get([a.set_buffer.remote(np.full(2, 10.0 * (r + 1))) for r, a in enumerate(actors)])
    out["declared"] = [t.tolist() for t in ray.get([a.reduce.remote(0, "kept-declared")
                                                    for a in actors])]
    ray.get([a.destroy_group.remote("kept-declared") for a in actors])
    out["loaded"] = ray.get([a.loaded.remote() for a in actors])
except Exception as err:
    out["error"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def _run_job(ray, register):
    path = python_path()
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-c", _JOB, address,
                           "register" if register else "plain", path],
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_code_keeping_ray_util_collective_runs_after_one_driver_call(ray_session):
    """A job whose actors only know ``ray.util.collective``: with the runtime_env from
    ``ray_util_collective_runtime_env`` every worker registers ``backend="ray"`` (imperative
    and declarative groups work, on read-only arguments); without it, they cannot."""
    plain = _run_job(ray_session, register=False)
    assert "Backend RAY not registered" in plain["error"]
    kept = _run_job(ray_session, register=True)
    assert "error" not in kept, kept.get("error")
    assert kept["imperative"] == [[3.0] * 3] * 2
    assert kept["declared"] == [[10.0] * 2, [30.0] * 2]  # actor 1 is rank 0
    assert [m["ray_collective"] for m in kept["loaded"]] == [True, True]  # by the hook only


def test_the_runtime_env_call_keeps_what_it_is_given():
    given = {"env_vars": {"A": "1"}, "pip": ["x"]}
    env = col.ray_util_collective_runtime_env(given)
    assert env == {**given, "worker_process_setup_hook": "ray_collective.interop.install"}
    assert "worker_process_setup_hook" not in given
    assert col.ray_util_collective_runtime_env(env) == env
    with pytest.raises(ValueError, match="install"):
        col.ray_util_collective_runtime_env({"worker_process_setup_hook": "mine.setup"})
    assert ray_util_collective.is_backend_available("ray")  # this process is registered too
