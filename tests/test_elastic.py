"""Elastic ``ray`` groups on real actors (issue 31): survivors of a killed rank shrink and their
next allreduce equals numpy's sum over them; a fresh actor grows the group back; the same from
the driver on a declared group; two deaths at once; a survivor that dies during the shrink; a
stopped rank left out, then told so when it runs again; and many shrink/grow cycles leave no
key, file, socket or descriptor behind."""

import os
import signal
import socket
import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.backends.ray import private_dirs
from ray_collective.transport.processes import exits_within
from support.helpers import group_keys, rank_data, run_in, start_members

LENGTHS = (5, 300_000)
"""Elements of the checked allreduces: inline, and through shared memory (1.2 MB)."""


def _group_dirs(ray):
    from ray._private.worker import global_worker
    root = private_dirs.session_directory(global_worker.node.get_session_dir_path())
    if root is None or not os.path.isdir(root):
        return set()
    return {os.path.relpath(os.path.join(where, name), root)
            for where, dirs, files in os.walk(root) for name in dirs + files}


def _expected_sum(world_size, length, seed):
    return np.sum([rank_data(r, length, np.float32, seed=seed) for r in range(world_size)],
                  axis=0)


def _checked_allreduce(rank, group, seed):
    """Inside a member: allreduce rank-dependent integers (exact in float32) of each length;
    (its rank, the world size, whether every result equals numpy's sum over the group)."""
    assert col.get_rank(group) == rank, (col.get_rank(group), rank)
    world_size = col.get_collective_group_size(group)
    correct = True
    for length in LENGTHS:
        tensor = rank_data(rank, length, np.float32, seed=seed)
        col.allreduce(tensor, group, timeout=60.0)
        correct &= bool(np.array_equal(tensor, _expected_sum(world_size, length, seed)))
    return rank, world_size, correct


def _loop_until_error(rank, group, timeout=60.0):
    """Inside a member: allreduce 8 B back to back until a call fails; the error's class."""
    tensor = np.ones(2, np.float32)
    while True:
        try:
            col.allreduce(tensor, group, timeout=timeout)
        except col.CollectiveError as err:
            return type(err).__name__


def _shrink(rank, group, timeout=60.0):
    """Inside a member: shrink; (new rank, new world size) or (the error's class, message)."""
    try:
        new_rank = col.shrink_collective_group(group, timeout=timeout)
    except col.CollectiveError as err:
        return type(err).__name__, str(err)
    return new_rank, col.get_collective_group_size(group)


def _grow(rank, group, world_size):
    return col.grow_collective_group(group, world_size=world_size, timeout=60.0)


def _init(rank, group, world_size):
    col.init_collective_group(world_size, rank, "ray", group, timeout=60.0)
    return col.get_rank(group)


def _destroy(rank, group):
    col.destroy_collective_group(group)
    return col.is_group_initialized(group)


def _looping_group(ray, group, size=6, declare=False):
    """``size`` fresh members of ``group`` (joined inside each, or declared from the driver),
    every one looping on allreduce; (the actors, their pids, the loops' refs). The loops have
    run for a second when it returns, so that a kill falls among their calls (one that fell
    before them would fail the survivors' first call all the same)."""
    actors = start_members(ray, size)
    pids = ray.get([a.pid.remote() for a in actors])
    if declare:
        col.declare_collective_group(actors, group_name=group)
    else:
        run_in(ray, actors, _init, group, size)
    loops = [actor.__ray_call__.remote(lambda _s, r=r: _loop_until_error(r, group))
             for r, actor in enumerate(actors)]
    time.sleep(1.0)
    return actors, pids, loops


def _in_each(ray, actors, ranks, function, *args, timeout=120):
    """``function(rank, *args)`` inside each actor, with the given ranks, all at once."""
    refs = [actor.__ray_call__.remote(lambda _s, r=r: function(r, *args))
            for r, actor in zip(ranks, actors)]
    return ray.get(refs, timeout=timeout)


def _kill(pid):
    os.kill(pid, signal.SIGKILL)


def _killed(pid, within=30.0):
    """SIGKILL ``pid`` and wait until it is gone (``ray.kill`` returns before the actor dies,
    which can then come to a shrink, alive, and die in it)."""
    _kill(pid)
    assert exits_within(pid, within), f"process {pid} still alive {within} s after SIGKILL"


def test_survivors_shrink_after_a_kill_then_a_fresh_actor_grows_the_group_back(ray_session):
    ray = ray_session
    group = "elastic-imperative"
    dirs_before = _group_dirs(ray)
    actors, pids, loops = _looping_group(ray, group)
    fresh = []
    try:
        _kill(pids[3])
        survivors = [a for r, a in enumerate(actors) if r != 3]
        errors = ray.get([ref for r, ref in enumerate(loops) if r != 3], timeout=60)
        assert set(errors) <= {"PeerDiedError", "GroupBrokenError"}, errors
        assert run_in(ray, survivors, _shrink, group) == [(r, 5) for r in range(5)]
        assert run_in(ray, survivors, _checked_allreduce, group, 1) == [
            (r, 5, True) for r in range(5)]
        fresh = start_members(ray, 1)
        grown = [a.__ray_call__.remote(lambda _s, r=r: _grow(r, group, 6))
                 for r, a in enumerate(survivors)]
        joined = fresh[0].__ray_call__.remote(lambda _s: _init(5, group, 6))
        assert ray.get(grown + [joined], timeout=120) == [6] * 5 + [5]
        assert run_in(ray, survivors + fresh, _checked_allreduce, group, 2) == [
            (r, 6, True) for r in range(6)]
        assert run_in(ray, survivors + fresh, _destroy, group) == [False] * 6
        assert group_keys(ray, group) == []
        assert _group_dirs(ray) == dirs_before
    finally:
        for actor in actors + fresh:
            ray.kill(actor)


def test_a_declared_group_shrinks_and_grows_from_the_driver(ray_session):
    ray = ray_session
    group = "elastic-declared"
    dirs_before = _group_dirs(ray)
    fresh = start_members(ray, 1)
    actors, _, loops = _looping_group(ray, group, declare=True)
    try:
        ray.kill(actors[2])
        survivors = [a for r, a in enumerate(actors) if r != 2]
        errors = ray.get([ref for r, ref in enumerate(loops) if r != 2], timeout=60)
        assert set(errors) <= {"PeerDiedError", "GroupBrokenError"}, errors
        assert col.shrink_collective_group(group) == {0: 0, 1: 1, 3: 2, 4: 3, 5: 4}
        assert run_in(ray, survivors, _checked_allreduce, group, 3) == [
            (r, 5, True) for r in range(5)]
        # the driver's own calls follow the new membership
        refs = col.allreduce_refs([ray.put(np.full(3, r, np.int64)) for r in range(5)], group)
        assert [list(v) for v in ray.get(refs)] == [[10] * 3] * 5
        assert col.grow_collective_group(group, actors=fresh, timeout=60) == 6
        assert run_in(ray, survivors + fresh, _checked_allreduce, group, 4) == [
            (r, 6, True) for r in range(6)]
    finally:
        col.destroy_collective_group(group)
    assert group_keys(ray, group) == []
    assert _group_dirs(ray) == dirs_before
    assert run_in(ray, survivors + fresh, lambda r: col.is_group_initialized(group)) == [
        False] * 6
    for actor in actors + fresh:
        ray.kill(actor)


def _die_once_shrunk(actor):
    """Inside a member: its next shrink from the driver succeeds, then its process dies before
    it answers."""
    from ray_collective import elastic
    shrink_member = elastic.shrink_member

    def shrink_then_die(*args, **kwargs):
        shrink_member(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    elastic.shrink_member = shrink_then_die


def test_a_member_dying_as_the_driver_shrinks_the_group_makes_it_shrink_again(ray_session):
    ray = ray_session
    actors = start_members(ray, 4)
    group = "elastic-declared-again"
    col.declare_collective_group(actors, group_name=group)
    try:
        ray.get(actors[2].__ray_call__.remote(_die_once_shrunk))
        _killed(ray.get(actors[3].pid.remote()))
        with pytest.raises(col.PeerDiedError) as died:
            col.shrink_collective_group(group, timeout=60)
        assert died.value.dead_ranks == (2,) and "ranks [2] before the shrink" in str(died.value)
        assert col.shrink_collective_group(group, timeout=60) == {0: 0, 1: 1}
        assert run_in(ray, actors[:2], _checked_allreduce, group, 8) == [(0, 2, True),
                                                                         (1, 2, True)]
    finally:
        col.destroy_collective_group(group)
    assert group_keys(ray, group) == []
    for actor in actors:
        ray.kill(actor)


def test_two_ranks_killed_at_once_are_both_left_out(ray_session):
    ray = ray_session
    group = "elastic-two-deaths"
    actors, pids, loops = _looping_group(ray, group)
    try:
        _kill(pids[1])
        _kill(pids[4])
        alive = [0, 2, 3, 5]
        survivors = [actors[r] for r in alive]
        errors = ray.get([loops[r] for r in alive], timeout=60)
        assert set(errors) <= {"PeerDiedError", "GroupBrokenError"}, errors
        assert _in_each(ray, survivors, alive, _shrink, group) == [(r, 4) for r in range(4)]
        assert run_in(ray, survivors, _checked_allreduce, group, 5) == [
            (r, 4, True) for r in range(4)]
        run_in(ray, survivors, _destroy, group)
        assert group_keys(ray, group) == []
    finally:
        for actor in actors:
            ray.kill(actor)


def _shrink_then_die(rank, group):
    """Inside a member: come to the shrink (so that the others count this rank in), then die
    where the rank would join the new incarnation."""
    from ray_collective.backends.ray import elastic

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    elastic._join = die
    return _shrink(rank, group)


def test_a_survivor_that_dies_during_the_shrink_fails_it_and_the_next_one_leaves_it_out(
        ray_session):
    ray = ray_session
    group = "elastic-death-in-shrink"
    actors, pids, loops = _looping_group(ray, group)
    try:
        _kill(pids[5])
        ray.get(loops[:5], timeout=60)
        doomed = actors[4].__ray_call__.remote(lambda _s: _shrink_then_die(4, group))
        deadline = time.monotonic() + 30
        while not any("/reform/0/here/4/" in k.decode() for k in group_keys(ray, group)):
            assert time.monotonic() < deadline, "rank 4 never came to the shrink"
            time.sleep(0.05)
        first = run_in(ray, actors[:4], _shrink, group)
        for kind, message in first:
            assert kind == "PeerDiedError", message
            assert "ranks [4] died" in message and "shrink_collective_group again" in message
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(doomed, timeout=30)
        assert run_in(ray, actors[:4], _shrink, group) == [(r, 4) for r in range(4)]
        assert run_in(ray, actors[:4], _checked_allreduce, group, 6) == [
            (r, 4, True) for r in range(4)]
        run_in(ray, actors[:4], _destroy, group)
        assert group_keys(ray, group) == []
    finally:
        for actor in actors:
            ray.kill(actor)


def _loop_then_shrink(rank, group):
    """Inside a member: allreduce until a call fails, then shrink; what each step gave."""
    error = _loop_until_error(rank, group, timeout=2.0)
    return error, _shrink(rank, group)


def test_a_stopped_rank_is_left_out_and_told_so_when_it_runs_again(ray_session):
    ray = ray_session
    actors = start_members(ray, 4)
    pids = ray.get([a.pid.remote() for a in actors])
    group = "elastic-stopped"
    dirs_before = _group_dirs(ray)
    stopped = 2
    try:
        run_in(ray, actors, _init, group, 4)
        refs = [a.__ray_call__.remote(lambda _s, r=r: _loop_then_shrink(r, group))
                for r, a in enumerate(actors)]
        time.sleep(1.0)  # among the calls; before them, the others' first one times out alike
        os.kill(pids[stopped], signal.SIGSTOP)
        alive = [0, 1, 3]
        outcomes = ray.get([refs[r] for r in alive], timeout=90)
        assert [shrunk for _, shrunk in outcomes] == [(r, 3) for r in range(3)], outcomes
        assert {error for error, _ in outcomes} <= {"CollectiveTimeoutError", "GroupBrokenError"}
        survivors = [actors[r] for r in alive]
        assert run_in(ray, survivors, _checked_allreduce, group, 7) == [
            (r, 3, True) for r in range(3)]
        os.kill(pids[stopped], signal.SIGCONT)
        error, (kind, message) = ray.get(refs[stopped], timeout=60)
        assert error == "GroupBrokenError"
        assert kind == "RankExcludedError", message
        assert "rank 2 of group 'elastic-stopped' is no longer a member" in message
        assert "ranks [0, 1, 3] went on" in message
        assert ray.get(actors[stopped].__ray_call__.remote(
            lambda _s: col.is_group_initialized(group))) is False
        # what is left is the new incarnation's alone, and it goes with the survivors
        assert len({k.decode().split("/")[2] for k in group_keys(ray, group)} - {"token"}) == 1
        run_in(ray, survivors, _destroy, group)
        assert group_keys(ray, group) == []
        assert _group_dirs(ray) == dirs_before
    finally:
        os.kill(pids[stopped], signal.SIGCONT)
        for actor in actors:
            ray.kill(actor)


def _leave_and_return(rank, group, cycles):
    """Inside the member that leaves and comes back as rank 2, ``cycles`` times."""
    for cycle in range(cycles):
        col.destroy_collective_group(group)
        _init(2, group, 3)
        _checked_allreduce(2, group, cycle)
    return _resources(2)


def _shrink_and_grow(rank, group, cycles):
    """Inside a member that stays: shrink to 2, check, grow back to 3, check; ``cycles``
    times."""
    for cycle in range(cycles):
        assert _shrink(rank, group) == (rank, 2)
        assert _checked_allreduce(rank, group, cycle + 1000)[2]
        assert _grow(rank, group, 3) == 3
        assert _checked_allreduce(rank, group, cycle)[2]
    return _resources(rank)


def _resources(rank):
    """Inside a member: (its unix SOCK_SEQPACKET sockets, the library's transport on one node;
    its other descriptors than sockets; memfds among them; resident bytes). Ray's own
    connections (stream sockets, TCP among them: a metrics export to the node's agent once
    opened one between two counts) come and go as Ray likes, and are not counted."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    sockets = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    with open("/proc/self/net/unix") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    seqpacket = f"{socket.SOCK_SEQPACKET:04X}"
    library_sockets = sum(1 for row in rows if row[4] == seqpacket and row[6] in sockets)
    memfds = sum(1 for link in links if link.startswith("/memfd:"))
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return library_sockets, len(links) - len(sockets), memfds, rss


@pytest.mark.parametrize("cycles", [100])
def test_shrink_and_grow_cycles_leave_no_key_file_socket_or_descriptor(ray_session, members,
                                                                        cycles):
    """A member leaves (destroys its membership), the others shrink without it, then grow
    back with it as a new rank: ``cycles`` times, each checked against numpy."""
    ray = ray_session
    actors = members[:3]
    group = "elastic-cycles"
    dirs_before = _group_dirs(ray)
    run_in(ray, actors, _init, group, 3)
    run_in(ray, actors, _checked_allreduce, group, 0)
    before = run_in(ray, actors, _resources)
    assert all(sockets > 0 for sockets, *_ in before), before
    stayers = [a.__ray_call__.remote(lambda _s, r=r: _shrink_and_grow(r, group, cycles))
               for r, a in enumerate(actors[:2])]
    leaver = actors[2].__ray_call__.remote(lambda _s: _leave_and_return(2, group, cycles))
    after = ray.get(stayers + [leaver], timeout=600)
    tokens = {k.decode().split("/")[2] for k in group_keys(ray, group)} - {"token"}
    assert len(tokens) == 1, tokens  # the current incarnation's keys alone
    for (*descriptors0, rss0), (*descriptors1, rss1) in zip(before, after):
        assert descriptors1 == descriptors0  # sockets, other descriptors, memfds
        assert rss1 - rss0 < 32 << 20
    run_in(ray, actors, _destroy, group)
    assert group_keys(ray, group) == []
    assert _group_dirs(ray) == dirs_before
