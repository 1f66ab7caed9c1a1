"""Ranks of a torch process group inside the suite's member actors, for the torch backend's
tests: each rank joins ``init_process_group`` (tcp:// on a port the driver chose), runs a body
and leaves, so the actor stays usable whatever the body did."""

import socket
from datetime import timedelta

import pytest

from support.helpers import run_in, start_members


@pytest.fixture(scope="module")
def four(ray_session):
    """Four member actors for a test module's torch groups (its first 2 or all 4)."""
    actors = start_members(ray_session, 4)
    yield actors
    for actor in actors:
        ray_session.kill(actor)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_body(rank, size, port, backend, timeout_s, body, args):
    """Inside a member: join a torch group of ``size`` at ``port``, run ``body``, leave."""
    import torch.distributed as dist

    import ray_collective.torch  # noqa: F401 - registers the backend
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s))
    try:
        return body(rank, size, *args)
    finally:
        dist.destroy_process_group()


def run_torch_ranks(ray, actors, body, *args, backend="ray_collective", timeout_s=60,
                    timeout=180):
    """``body(rank, size, *args)`` in each actor inside a torch group of ``len(actors)``.

    Returns:
        Each rank's result, by rank.
    """
    port = free_port()
    return run_in(ray, actors, rank_body, len(actors), port, backend, timeout_s, body, args,
                  timeout=timeout)
