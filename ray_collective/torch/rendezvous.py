"""How a ``ray_collective`` process group comes to be: torch's creator, and the registration.

Torch calls :func:`create_process_group` on every rank of a new group (the default one from
``init_process_group``, and each ``new_group``/``new_subgroups``) with the group's store, rank,
size and timeout. The group's rank 0 names a fresh library group in that store; every rank
reads the name and joins it with ``init_collective_group`` (backend ``ray``), which returns
once all have joined. The library's rendezvous and its watch on peers' liveness are Ray's
(its key-value store, its actors), so the creator refuses at once, saying so, in a process
that is not connected to Ray (``torchrun`` without Ray): it does not wait for a join that
cannot happen.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch.distributed as dist

from .. import api as col
from .process_group import BACKEND_NAME, ProcessGroupRayCollective

_NAME_KEY = "ray_collective/library_group"

_NO_TIMEOUT_S = 1800.0


def _connected_to_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def create_process_group(options, backend_options=None) -> ProcessGroupRayCollective:
    """Torch's creator for ``backend="ray_collective"`` (registered with ``extended_api``).

    Args:
        options: torch's ``_DistributedBackendOptions``: store, group_rank, group_size,
            timeout, group_id.
        backend_options: the ``pg_options`` of ``init_process_group``/``new_group``; unused.

    Returns:
        The process group, joined.

    Raises:
        RuntimeError: this process is not connected to Ray.
        CollectiveTimeoutError: the other ranks did not join within the timeout.
    """
    rank, size = options.group_rank, options.group_size
    if not _connected_to_ray():
        raise RuntimeError(
            f"backend '{BACKEND_NAME}' (rank {rank} of {size}) needs Ray: the library's ranks "
            f"meet and watch each other through Ray. Call init_process_group inside a Ray "
            f"actor or task (Ray Train's TorchTrainer, or actors of your own); under torchrun "
            f"without Ray use backend='gloo'")
    timeout = options.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else _NO_TIMEOUT_S
    store = options.store
    if rank == 0:
        store.set(_NAME_KEY, f"torch.{options.group_id}.{uuid.uuid4().hex[:12]}")
    name = store.get(_NAME_KEY).decode()
    col.init_collective_group(size, rank, backend="ray", group_name=name, timeout=seconds)
    return ProcessGroupRayCollective(rank, size, name, timedelta(seconds=seconds))


def register() -> None:
    """Make ``"ray_collective"`` a backend of ``torch.distributed`` in this process (for CPU
    tensors; CUDA tensors reach it only to be refused with the way to send them to NCCL).
    Idempotent."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
