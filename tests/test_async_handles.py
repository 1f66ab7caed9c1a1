"""Many ``async_op=True`` handles outstanding at once on the ``ray`` backend, real Ray actors:
every result right (numpy as the reference) and nothing leaked; and a rank killed while they
are outstanding fails every handle with an error naming it, none hanging."""

import os
import time

import numpy as np

import ray_collective as col
from support.helpers import process_resources, run_in, start_members

CALLS = 200
SMALL = 2
"""float32 elements of an 8-byte message (inline in its packet)."""
LARGE = 24 * 1024
"""float32 elements of a 96 KiB message (through shared memory)."""


def _submit_all(rank, group, world_size):
    """Issue ``CALLS`` collectives of mixed kinds and sizes without waiting on any; returns
    ``(handles, [(kind, output, expected)])``."""
    handles, checks = [], []
    for call in range(CALLS):
        length = SMALL if call % 2 == 0 else LARGE
        values = np.arange(length, dtype=np.float32) % 251
        kind = ("allreduce", "broadcast", "allgather")[call % 3]
        if kind == "allreduce":
            tensor = values + rank + call
            expected = world_size * values + sum(range(world_size)) + world_size * call
            handles.append(col.allreduce(tensor, group, async_op=True))
            checks.append((kind, tensor, expected))
        elif kind == "broadcast":
            root = call % world_size
            tensor = values + rank + call
            handles.append(col.broadcast(tensor, root, group, async_op=True))
            checks.append((kind, tensor, values + root + call))
        else:
            gathered = [np.zeros(length, np.float32) for _ in range(world_size)]
            handles.append(col.allgather(gathered, values + rank + call, group, async_op=True))
            checks.append((kind, gathered, [values + r + call for r in range(world_size)]))
    return handles, checks


def _many_outstanding(rank, group, world_size, rounds):
    """``rounds`` times: issue every call, then wait on each and check its result; returns
    the calls still outstanding when the last was issued, and this process's resources after
    each round."""
    outstanding, resources = [], []
    for _ in range(rounds):
        handles, checks = _submit_all(rank, group, world_size)
        outstanding.append(sum(not handle.is_completed() for handle in handles))
        for handle in handles:
            handle.wait(timeout=60)
        for call, (kind, got, expected) in enumerate(checks):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected),
                                          err_msg=f"{kind} #{call} on rank {rank}")
        del handles, checks
        resources.append(process_resources(rank))
    return outstanding, resources


def test_many_outstanding_handles_all_give_the_numpy_answer_and_leak_nothing(
        ray_session, members):
    actors = members[:3]
    before = run_in(ray_session, actors, process_resources)
    col.declare_collective_group(actors, group_name="outstanding")
    try:
        rounds = run_in(ray_session, actors, _many_outstanding, "outstanding", 3, 2)
    finally:
        col.destroy_collective_group("outstanding")
    after = run_in(ray_session, actors, process_resources)
    # calls were queued, not run one by one: on the rank that issued its calls first, most
    # were still outstanding when it issued its last
    assert max(max(outstanding) for outstanding, _ in rounds) > CALLS // 2, rounds
    for (_, (first, second)), (fds0, memfds0, _), (fds1, memfds1, _) in zip(rounds, before,
                                                                            after):
        assert (fds1, memfds1) == (fds0, memfds0)
        # the first round's memory is reused by the second (its tensors are ~35 MB at once)
        assert second[2] - first[2] < 8 << 20, (first, second)


def _outstanding_when_a_peer_dies(rank, group, world_size, issued):
    """Issue every call, create the file ``issued``, then wait on each call: ``[(error kind,
    cause kind, message, time.time() when its wait returned)]``."""
    handles, _ = _submit_all(rank, group, world_size)
    open(issued, "w").close()
    outcomes = []
    for handle in handles:
        try:
            handle.wait(timeout=30)
            outcomes.append(("ok", "", "", time.time()))
        except Exception as err:  # noqa: BLE001 - the test reads what each handle gave
            cause = getattr(err, "cause", None)
            outcomes.append((type(err).__name__, type(cause).__name__, str(err), time.time()))
    return outcomes


def test_a_rank_killed_while_handles_are_outstanding_fails_every_handle_naming_it(
        ray_session, members, tmp_path):
    survivors = members[:2]
    doomed = start_members(ray_session, 1)[0]
    actors = survivors + [doomed]
    before = run_in(ray_session, survivors, process_resources)
    col.declare_collective_group(actors, group_name="outstanding-killed", timeout=60)
    try:
        issued = [str(tmp_path / f"issued-{r}") for r in range(len(survivors))]
        refs = [a.__ray_call__.remote(lambda _s, r=r: _outstanding_when_a_peer_dies(
            r, "outstanding-killed", 3, issued[r])) for r, a in enumerate(survivors)]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(path) for path in issued):
            assert time.monotonic() < deadline, "the survivors never issued their calls"
            time.sleep(0.05)
        killed_at = time.time()
        ray_session.kill(doomed)
        for outcomes in ray_session.get(refs, timeout=120):
            assert len(outcomes) == CALLS
            first, rest = outcomes[0], outcomes[1:]
            assert first[0] == "PeerDiedError" and "ranks [2] died" in first[2], first
            for kind, cause, message, returned_at in rest:
                assert (kind, cause) == ("GroupBrokenError", "PeerDiedError"), message
                assert "ranks [2] died" in message
            assert max(returned_at for *_, returned_at in outcomes) - killed_at < 5.0
    finally:
        col.destroy_collective_group("outstanding-killed")
        ray_session.kill(doomed)
    after = run_in(ray_session, survivors, process_resources)
    assert [(fds, memfds) for fds, memfds, _ in after] == [
        (fds, memfds) for fds, memfds, _ in before]
