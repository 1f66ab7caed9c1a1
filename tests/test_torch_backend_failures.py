"""Failures through the ``ray_collective`` torch backend: a rank that dies makes the
survivor's next call raise (no hang), calls that disagree raise on every rank, a rank that
never comes makes the call raise at the timeout given to ``init_process_group``; each as
torch's ``DistBackendError`` with the library's error and message kept as its cause."""

import os

import pytest

torch = pytest.importorskip("torch")

from support.helpers import start_members  # noqa: E402
from support.torch_ranks import rank_body, four, free_port, run_torch_ranks  # noqa: E402,F401


def _die_or_outlive(rank, size):
    import torch.distributed as dist
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 1:
        os._exit(1)
    try:
        while True:
            dist.all_reduce(tensor)
    except dist.DistBackendError as error:
        return type(error.__cause__).__name__, str(error)


def test_a_rank_that_dies_makes_the_survivor_raise(ray_session):
    actors = start_members(ray_session, 2)
    port = free_port()
    refs = [actor.__ray_call__.remote(
        lambda _self, r=rank: rank_body(r, 2, port, "ray_collective", 600, _die_or_outlive, ()))
        for rank, actor in enumerate(actors)]
    try:
        cause, message = ray_session.get(refs[0], timeout=300)
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(refs[1], timeout=300)
    finally:
        for actor in actors:
            ray_session.kill(actor)
    assert cause in ("PeerDiedError", "GroupBrokenError")
    assert "ranks [1] died" in message and "allreduce" in message


def _disagree(rank, size):
    import torch.distributed as dist
    caught = {}
    try:
        dist.all_reduce(torch.ones(4 + rank))
    except dist.DistBackendError as error:
        caught["count"] = (type(error.__cause__).__name__, str(error))
    return caught


def test_calls_that_disagree_raise_on_every_rank(ray_session, four):
    results = run_torch_ranks(ray_session, four[:2], _disagree)
    for caught in results:
        cause, message = caught["count"]
        assert cause in ("CollectiveMismatchError", "GroupBrokenError")
        assert "Mismatch" in message or "mismatch" in message


def _one_stays_away(rank, size):
    import torch.distributed as dist
    if rank == 1:
        return None
    work = dist.all_reduce(torch.ones(1 << 19), async_op=True)  # the error comes via wait
    try:
        work.wait()
    except dist.DistBackendError as error:
        return type(error.__cause__).__name__, work.is_completed(), isinstance(
            work.exception(), dist.DistBackendError)


def test_a_rank_that_never_calls_makes_the_call_raise_at_the_timeout(ray_session, four):
    results = run_torch_ranks(ray_session, four[:2], _one_stays_away, timeout_s=3)
    assert results == [("CollectiveTimeoutError", True, True), None]
