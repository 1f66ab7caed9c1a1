"""The ``ray`` backend on real Ray actors: every collective, imperative and declared groups,
numpy and torch tensors, several groups at once, ray.util.collective interop, and the failure
paths (dead rank, missing rank, mismatch), checked against numpy references."""

import os
import signal
import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.types import MAX_GROUP_NAME_BYTES
from support.helpers import group_keys, join, leave, process_resources, run_in, start_members
from support.contract import CASES, LARGE_CASES, check_every_collective, every_collective
from support.paths import python_path


# ------------------------------------------------------------------ correctness


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_declared_group_every_collective(ray_session, members, world_size):
    actors = members[:world_size]
    group = f"declared-{world_size}"
    col.declare_collective_group(actors, backend="ray", group_name=group)
    try:
        for dtype, op_name, length in CASES + LARGE_CASES:
            results = run_in(ray_session, actors, every_collective, group, world_size, dtype,
                             op_name, length, "numpy")
            check_every_collective(results, world_size, dtype, op_name, length)
    finally:
        col.destroy_collective_group(group)


@pytest.mark.parametrize("kind", ["dlpack", "memoryview"])
def test_declared_group_every_collective_on_arrays_known_only_by_their_protocol(
        ray_session, members, kind):
    actors = members[:3]
    group = f"declared-{kind}"
    col.declare_collective_group(actors, backend="ray", group_name=group)
    try:
        for dtype, op_name, length in CASES + LARGE_CASES:
            results = run_in(ray_session, actors, every_collective, group, 3, dtype,
                             op_name, length, kind)
            check_every_collective(results, 3, dtype, op_name, length)
    finally:
        col.destroy_collective_group(group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_imperative_group_torch_tensors_large_messages(ray_session, members, world_size):
    actors = members[-world_size:]
    group = f"imperative-{world_size}"
    assert run_in(ray_session, actors, join, group, world_size) == [
        (r, world_size) for r in range(world_size)]
    try:
        for dtype, op_name, length in [("float32", "SUM", 300_000), ("int16", "MAX", 33),
                                       ("float64", "SUM", 70_001)]:
            results = run_in(ray_session, actors, every_collective, group, world_size, dtype,
                             op_name, length, "torch")
            check_every_collective(results, world_size, dtype, op_name, length)
    finally:
        assert run_in(ray_session, actors, leave, group) == [False] * world_size


def _allreduce_loop(rank, group, value, rounds):
    totals = []
    for _ in range(rounds):
        tensor = np.full(3, value + rank, np.int64)
        col.allreduce(tensor, group)
        totals.append(int(tensor[0]))
    return totals


def test_overlapping_groups_do_not_interfere(ray_session, members):
    first, second = members[:3], members[1:5]
    col.declare_collective_group(first, group_name="overlap-a")
    col.declare_collective_group(second, group_name="overlap-b")
    try:
        refs = ([a.__ray_call__.remote(lambda _s, r=r: _allreduce_loop(r, "overlap-a", 10, 20))
                 for r, a in enumerate(first)])
        results = ray_session.get(refs)
        assert results == [[3 * 10 + 3] * 20] * 3
        results = run_in(ray_session, second, _allreduce_loop, "overlap-b", 100, 20)
        assert results == [[4 * 100 + 6] * 20] * 4
    finally:
        col.destroy_collective_group("overlap-a")
        col.destroy_collective_group("overlap-b")


def _interop(rank, group, world_size):
    import ray.util.collective as ray_col
    ray_col.init_collective_group(world_size, rank, backend="ray", group_name=group)
    tensor = np.full(4, rank + 1.0, np.float32)
    ray_col.allreduce(tensor, group_name=group)
    gathered = [np.zeros(4, np.float32) for _ in range(world_size)]
    ray_col.allgather(gathered, np.full(4, float(rank), np.float32), group_name=group)
    ray_col.destroy_collective_group(group)
    return tensor.tolist(), [g[0] for g in gathered]


def test_ray_util_collective_runs_on_this_backend(ray_session, members):
    results = run_in(ray_session, members[:3], _interop, "interop", 3)
    assert results == [([6.0] * 4, [0.0, 1.0, 2.0])] * 3


# ------------------------------------------------------------------ lifetime and leftovers


def _group_dirs(ray):
    from ray._private.worker import global_worker
    from ray_collective.backends.ray.private_dirs import session_directory
    root = session_directory(global_worker.node.get_session_dir_path())
    return set(os.listdir(root)) if root is not None and os.path.isdir(root) else set()


def _named_actors(ray):
    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def test_destroy_leaves_nothing_and_name_can_be_reused(ray_session, members):
    before_dirs = _group_dirs(ray_session)
    before_actors = _named_actors(ray_session)
    for attempt in range(2):
        col.declare_collective_group(members[:2], group_name="reused")
        assert run_in(ray_session, members[:2], _allreduce_loop, "reused", attempt, 2) == [
            [2 * attempt + 1] * 2] * 2
        col.destroy_collective_group("reused")
        assert group_keys(ray_session, "reused") == []
        assert _group_dirs(ray_session) == before_dirs
    assert _named_actors(ray_session) == before_actors
    assert run_in(ray_session, members[:2], join, "reused", 2) == [(0, 2), (1, 2)]
    assert run_in(ray_session, members[:2], leave, "reused") == [False, False]
    assert group_keys(ray_session, "reused") == []
    assert _group_dirs(ray_session) == before_dirs


def _leave_counting_post_office_lookups(rank, group):
    from ray_collective.backends.ray import membership
    looked_up = []
    original = membership.shut_post_office
    membership.shut_post_office = lambda *args: looked_up.append(args)
    try:
        join(rank, group, 2)
        leave(rank, group)
    finally:
        membership.shut_post_office = original
    return looked_up


def test_leaving_a_one_node_group_looks_for_no_post_office(ray_session, members):
    # It has none; each lookup is a request to Ray's control store.
    assert run_in(ray_session, members[:2], _leave_counting_post_office_lookups,
                  "one-node") == [[], []]
    assert group_keys(ray_session, "one-node") == []


def _join_once_all_started(rank, started_dir, starting, group, world_size, timeout):
    # On a loaded machine the joining ranks' tasks can start seconds apart; a rank that began
    # its join alone would then see the late one named missing beside the absent one.
    open(os.path.join(started_dir, str(rank)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(started_dir)) < starting:
        assert time.monotonic() < deadline, "the other joining rank's task never started"
        time.sleep(0.01)
    return join(rank, group, world_size, timeout)


def test_join_times_out_naming_missing_ranks(ray_session, members, tmp_path):
    with pytest.raises(col.CollectiveTimeoutError) as caught:
        run_in(ray_session, members[:2], _join_once_all_started, str(tmp_path), 2,
               "incomplete", 3, 5)
    assert caught.value.missing_ranks == (2,)
    assert "ranks [2]" in str(caught.value)


def test_declare_validates_before_submitting(ray_session, members):
    with pytest.raises(ValueError, match="permutation"):
        col.declare_collective_group(members[:2], ranks=[0, 0], group_name="bad")
    with pytest.raises(ValueError, match="world_size"):
        col.declare_collective_group(members[:2], world_size=3, group_name="bad")
    col.declare_collective_group(members[:2], group_name="twice")
    try:
        with pytest.raises(col.GroupAlreadyInitializedError):
            col.declare_collective_group(members[:2], group_name="twice")
    finally:
        col.destroy_collective_group("twice")


def test_declared_nccl_group_reports_the_actors_missing_gpu(ray_session, members):
    if col.nccl_available():
        pytest.skip("this machine has CuPy and NCCL; the test needs actors without them")
    with pytest.raises(col.BackendNotAvailableError, match="nccl|NCCL|CuPy|cupy"):
        col.declare_collective_group(members[:2], backend="nccl", group_name="no-gpu",
                                     timeout=20)
    assert run_in(ray_session, members[:2], lambda rank: col.is_group_initialized("no-gpu")) \
        == [False, False]


# ------------------------------------------------------------------ failures


def _allreduce_expecting_error(rank, group, length, timeout):
    tensor = np.ones(length, np.float32)
    start = time.monotonic()
    try:
        col.allreduce(tensor, group, timeout=timeout)
    except col.CollectiveError as err:
        again = None
        try:
            col.allreduce(tensor, group)
        except col.GroupBrokenError as broken:
            again = type(broken.cause).__name__
        return type(err).__name__, str(err), time.monotonic() - start, again
    return None, "", time.monotonic() - start, None


def _sleep(rank, seconds):
    time.sleep(seconds)
    return rank


def test_killed_rank_gives_peer_died_error_on_the_others(ray_session):
    actors = start_members(ray_session, 3)
    col.declare_collective_group(actors, group_name="killed")
    survivors = [a.__ray_call__.remote(lambda _s, r=r: _allreduce_expecting_error(
        r, "killed", 1 << 20, 300.0)) for r, a in enumerate(actors[:2])]
    actors[2].__ray_call__.remote(lambda _s: _sleep(2, 60))
    time.sleep(1.0)
    ray_session.kill(actors[2])
    results = ray_session.get(survivors, timeout=60)
    for kind, message, elapsed, again in results:
        assert kind == "PeerDiedError", message
        assert "ranks [2] died" in message
        # The error names the call that failed: the group's first, an allreduce.
        assert "allreduce #0 failed" in message, message
        assert elapsed < 30
        assert again == "PeerDiedError"
    col.destroy_collective_group("killed")
    for actor in actors[:2]:
        ray_session.kill(actor)


def _allreduce_loop_until_error(rank, group, timeout):
    """Allreduce 8 B back to back until a call fails; report the failure and its time."""
    tensor = np.ones(2, np.float32)
    while True:
        start = time.monotonic()
        try:
            col.allreduce(tensor, group, timeout=timeout)
        except col.CollectiveError as err:
            missing = getattr(err, "missing_ranks", getattr(getattr(err, "cause", None),
                                                            "missing_ranks", ()))
            return type(err).__name__, str(err), tuple(missing), time.monotonic() - start


def test_a_stopped_rank_is_named_by_every_survivor_whichever_times_out_first(ray_session):
    """SIGSTOP one rank (hung, not dead) while all four loop on allreduce: every survivor's
    error names it, not the rank whose deadline passed first; once it runs again it learns
    that the group broke."""
    actors = start_members(ray_session, 4)
    pids = ray_session.get([a.pid.remote() for a in actors])
    col.declare_collective_group(actors, group_name="stopped")
    stopped = 2
    try:
        # Rank 1 times out first. Whichever algorithm 8 B on 4 ranks takes here (recursive
        # doubling: partners 0 and 3; reduce + broadcast: parent 0), it never waits on rank 2
        # itself, so what it saw directly names another rank.
        deadlines = [8.0, 2.0, 8.0, 8.0]
        loops = [a.__ray_call__.remote(lambda _s, r=r: _allreduce_loop_until_error(
            r, "stopped", deadlines[r])) for r, a in enumerate(actors)]
        time.sleep(1.0)
        os.kill(pids[stopped], signal.SIGSTOP)
        survivors = [ref for r, ref in enumerate(loops) if r != stopped]
        results = ray_session.get(survivors, timeout=60)
        for kind, message, missing, elapsed in results:
            assert kind == "CollectiveTimeoutError", message
            assert missing == (stopped,), message
            assert elapsed < 10.0
        os.kill(pids[stopped], signal.SIGCONT)
        kind, message, _, _ = ray_session.get(loops[stopped], timeout=60)
        assert kind == "GroupBrokenError", message
    finally:
        os.kill(pids[stopped], signal.SIGCONT)
        col.destroy_collective_group("stopped")
        for actor in actors:
            ray_session.kill(actor)


def _init_group(rank, world_size, group, timeout):
    try:
        col.init_collective_group(world_size, rank, "ray", group, timeout=timeout)
        return "ok", ""
    except Exception as err:  # noqa: BLE001 - the test reads what each rank got
        return type(err).__name__, str(err)


def _allreduce_ones(rank, group):
    tensor = np.ones(4, np.float32)
    col.allreduce(tensor, group, timeout=30.0)
    return tensor.tolist()


@pytest.mark.parametrize("survivors", ["destroy", "keep"])
def test_a_group_is_rebuilt_after_a_crash_whatever_the_join_order(ray_session, survivors):
    """Rank 2 is killed; the survivors destroy the broken group or keep it; fresh actors form
    a group of the same name with ranks 1-3 joining before rank 0."""
    old = start_members(ray_session, 4)
    pids = ray_session.get([a.pid.remote() for a in old])
    run_in(ray_session, old, _init_group, 4, "rebuilt", 30.0)
    os.kill(pids[2], signal.SIGKILL)
    alive = [a for r, a in enumerate(old) if r != 2]
    refs = [a.__ray_call__.remote(lambda _s, r=r: _allreduce_expecting_error(
        r, "rebuilt", 2, 30.0)) for r, a in zip((0, 1, 3), alive)]
    assert [kind for kind, *_ in ray_session.get(refs, timeout=60)] == ["PeerDiedError"] * 3
    if survivors == "destroy":
        run_in(ray_session, alive, lambda r: col.destroy_collective_group("rebuilt"))
    fresh = start_members(ray_session, 4)
    try:
        early = [a.__ray_call__.remote(lambda _s, r=r: _init_group(r, 4, "rebuilt", 30.0))
                 for r, a in enumerate(fresh) if r != 0]
        time.sleep(1.5)
        last = fresh[0].__ray_call__.remote(lambda _s: _init_group(0, 4, "rebuilt", 30.0))
        assert ray_session.get(early + [last], timeout=90) == [("ok", "")] * 4
        assert run_in(ray_session, fresh, _allreduce_ones, "rebuilt") == [[4.0] * 4] * 4
        run_in(ray_session, fresh, lambda r: col.destroy_collective_group("rebuilt"))
    finally:
        for actor in old + fresh:
            ray_session.kill(actor)


def test_a_rank_held_by_a_live_member_of_a_live_group_is_refused(ray_session, members):
    actors = members[:2]
    run_in(ray_session, actors, _init_group, 2, "taken", 30.0)
    try:
        intruder = start_members(ray_session, 1)[0]
        kind, message = ray_session.get(intruder.__ray_call__.remote(
            lambda _s: _init_group(1, 2, "taken", 5.0)), timeout=60)
        assert kind == "ValueError" and "rank 1 has already joined" in message, message
        assert run_in(ray_session, actors, _allreduce_ones, "taken") == [[2.0] * 4] * 2
        ray_session.kill(intruder)
    finally:
        run_in(ray_session, actors, lambda r: col.destroy_collective_group("taken"))


def test_missing_rank_times_out_naming_it(ray_session, members):
    actors = members[:3]
    col.declare_collective_group(actors, group_name="skipper")
    try:
        refs = [a.__ray_call__.remote(lambda _s, r=r: _allreduce_expecting_error(
            r, "skipper", 10, 1.5)) for r, a in enumerate(actors[:2])]
        results = ray_session.get(refs, timeout=60)
        kinds = sorted(kind for kind, *_ in results)
        assert "CollectiveTimeoutError" in kinds, results
        timed_out = [m for kind, m, *_ in results if kind == "CollectiveTimeoutError"]
        assert all("waiting for ranks [2]" in m for m in timed_out), timed_out
        assert all(elapsed < 10 for _, _, elapsed, _ in results)
    finally:
        col.destroy_collective_group("skipper")


def _timed(call):
    """``call()``'s outcome: ("ok" or the error's class name, message, seconds)."""
    start = time.monotonic()
    try:
        call()
        return "ok", "", time.monotonic() - start
    except Exception as err:  # noqa: BLE001 - the test reads what each rank got
        return type(err).__name__, str(err), time.monotonic() - start


@pytest.mark.parametrize("collective, roots", [("broadcast", (0, 0, 0, 1)),
                                               ("reduce", (0, 0, 2, 0))])
def test_a_rank_that_disagrees_on_the_root_fails_at_once_and_breaks_the_group(
        ray_session, members, collective, roots):
    """The message of the same call with another root is a mismatch when it arrives, even
    though the disagreeing rank never posts a receive for its sender; the group breaks. The
    ranks make their next call only once every rank is done with this one, so no message of
    a later call can reveal the disagreement instead."""
    actors = members[:4]
    col.declare_collective_group(actors, group_name="roots")
    try:
        first = run_in(ray_session, actors, lambda r: _timed(lambda: getattr(col, collective)(
            np.full(4, r, np.float32), roots[r], "roots", timeout=20.0)), timeout=90)
        mismatched = [r for r, (kind, _, _) in enumerate(first)
                      if kind == "CollectiveMismatchError"]
        assert mismatched, first
        for r in mismatched:
            kind, message, elapsed = first[r]
            assert elapsed < 5.0 and "root: rank" in message, first[r]
        assert all(kind in ("ok", "CollectiveMismatchError", "GroupBrokenError")
                   for kind, _, _ in first), first
        # whoever returned from the broken call cannot go on as if nothing happened
        second = run_in(ray_session, actors, lambda r: _timed(lambda: col.allreduce(
            np.ones(4, np.float32), "roots", timeout=20.0)), timeout=90)
        for kind, message, elapsed in second:
            assert kind in ("GroupBrokenError", "CollectiveMismatchError"), second
            assert elapsed < 5.0, second
    finally:
        col.destroy_collective_group("roots")


def test_mismatched_shapes_raise_mismatch_on_the_ranks_involved(ray_session, members):
    actors = members[:2]
    col.declare_collective_group(actors, group_name="mismatch")
    try:
        refs = [a.__ray_call__.remote(lambda _s, r=r: _allreduce_expecting_error(
            r, "mismatch", 10 + r, 30.0)) for r, a in enumerate(actors)]
        results = ray_session.get(refs, timeout=60)
        for kind, message, _, again in results:
            assert kind == "CollectiveMismatchError", message
            assert "count" in message
            assert again == "CollectiveMismatchError"
    finally:
        col.destroy_collective_group("mismatch")


def test_what_a_finished_job_left_is_swept_when_a_later_job_opens_a_group(ray_session, members):
    """A driver that exits without destroying its declared group kills its members with it:
    nobody leaves, and the next group opened in the cluster removes its keys and directory."""
    import json
    import subprocess
    import sys
    from ray_collective.backends.ray import rendezvous
    address = ray_session.get_runtime_context().gcs_address
    finished = subprocess.run([sys.executable, "-m", "support.abandoned_job", address],
                              env=dict(os.environ, PYTHONPATH=python_path()),
                              capture_output=True, text=True, timeout=120, check=True)
    left = json.loads(finished.stdout.strip().splitlines()[-1])
    kv = rendezvous.KeyValue()
    assert left["exists"] and kv.keys(f"{left['job']}/abandoned/")
    deadline = time.monotonic() + 30
    while kv.keys(f"{left['job']}/") or os.path.exists(left["directory"]):
        assert time.monotonic() < deadline, "the finished job's group was never swept"
        col.declare_collective_group(members[:2], group_name="after-abandoned")
        col.destroy_collective_group("after-abandoned")
        time.sleep(0.5)



ODD_NAMES = ["a", "a/b", "../..", "名前 with spaces", "x" * MAX_GROUP_NAME_BYTES]


def test_odd_group_names_are_groups_of_their_own_and_leave_nothing(ray_session, members):
    """Names that contain the key separator, climb directories, use unicode or run long are
    all separate groups, used alternately on the same actors, and leave no key behind."""
    from ray_collective.backends.ray import rendezvous
    actors = members[:2]
    for name in ODD_NAMES:
        col.declare_collective_group(actors, group_name=name)
    try:
        for round_ in range(2):
            for position, name in enumerate(ODD_NAMES):
                results = run_in(ray_session, actors, lambda r, n=name, k=position: (
                    _allreduce_ones(r, n)[0] * (k + 1)))
                assert results == [2.0 * (position + 1)] * 2
    finally:
        for name in ODD_NAMES:
            col.destroy_collective_group(name)
    job = ray_session.get_runtime_context().get_job_id()
    kv = rendezvous.KeyValue()
    assert [kv.keys(rendezvous.group_prefix(job, name)) for name in ODD_NAMES] == [[]] * 5


def _churn(rank, group, calls):
    tensor = np.ones(2, np.float32)
    for _ in range(calls):
        col.allreduce(tensor, group)
        tensor[:] = 1
    return process_resources(rank)


def test_churn_leaves_descriptors_memory_keys_and_directories_where_they_were(
        ray_session, members):
    """200 create/destroy cycles with calls in each, then 10,000 small allreduces."""
    from ray_collective.backends.ray import rendezvous
    actors = members[:2]
    job = ray_session.get_runtime_context().get_job_id()
    kv = rendezvous.KeyValue()
    col.declare_collective_group(actors, group_name="warm")
    run_in(ray_session, actors, _churn, "warm", 10)
    col.destroy_collective_group("warm")
    before = run_in(ray_session, actors, process_resources)
    for cycle in range(200):
        col.declare_collective_group(actors, group_name="churn")
        run_in(ray_session, actors, _churn, "churn", 2)
        col.destroy_collective_group("churn")
    assert kv.keys(rendezvous.group_prefix(job, "churn")) == []
    col.declare_collective_group(actors, group_name="calls")
    try:
        during = run_in(ray_session, actors, _churn, "calls", 10_000, timeout=300)
    finally:
        col.destroy_collective_group("calls")
    after = run_in(ray_session, actors, process_resources)
    for (fds0, memfds0, rss0), (fds1, memfds1, rss1), (fds2, _, rss2) in zip(before, after,
                                                                          during):
        assert (fds1, memfds1) == (fds0, memfds0)
        assert rss1 - rss0 < 32 << 20 and rss2 - rss0 < 48 << 20
