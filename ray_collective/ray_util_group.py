"""The ``ray`` backend as a ``ray.util.collective`` group class (see ``ray_collective.interop``).

``ray.util.collective`` builds a group object per process and calls its methods with tensors
wrapped in lists and with option classes. This class turns each call into the matching
``ray_collective`` call on a membership of its own, named ``ray.util.collective:<name>`` so it
never collides with a group the process made through ``ray_collective`` directly.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

from ray.util.collective.backend_registry import _global_registry, register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from . import api

BACKEND_NAME = "RAY"


def _timeout(options) -> Optional[float]:
    """The per-call timeout of a ``ray.util.collective`` option object in seconds; None (the
    group's default) where it is unset (a negative ``timedelta``)."""
    limit = getattr(options, "timeout_ms", None)
    if isinstance(limit, timedelta):
        limit = limit.total_seconds() * 1e3
    return None if limit is None or limit < 0 else limit / 1e3


class RayUtilCollectiveGroup(BaseGroup):
    """One process's membership of a ``ray.util.collective`` group on the ``ray`` backend.

    Args:
        world_size: ranks in the group.
        rank: this process's rank.
        group_name: the group's name in ``ray.util.collective``.
    """

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        self._name = f"ray.util.collective:{group_name}"
        api.init_collective_group(world_size, rank, backend="ray", group_name=self._name)

    @classmethod
    def backend(cls):
        return BACKEND_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        return api.is_backend_available("ray")

    def destroy_group(self):
        api.destroy_collective_group(self._name)

    def allreduce(self, tensors, allreduce_options=None):
        api.allreduce(tensors[0], self._name, allreduce_options.reduceOp,
                      timeout=_timeout(allreduce_options))

    def barrier(self, barrier_options=None):
        api.barrier(self._name, timeout=_timeout(barrier_options))

    def reduce(self, tensors, reduce_options=None):
        api.reduce(tensors[0], reduce_options.root_rank, self._name, reduce_options.reduceOp,
                   timeout=_timeout(reduce_options))

    def allgather(self, tensor_lists, tensors, allgather_options=None):
        api.allgather(tensor_lists[0], tensors[0], self._name,
                      timeout=_timeout(allgather_options))

    def broadcast(self, tensors, broadcast_options=None):
        api.broadcast(tensors[0], broadcast_options.root_rank, self._name,
                      timeout=_timeout(broadcast_options))

    def reducescatter(self, tensors, tensor_lists, reducescatter_options=None):
        api.reducescatter(tensors[0], tensor_lists[0], self._name,
                          reducescatter_options.reduceOp,
                          timeout=_timeout(reducescatter_options))

    def send(self, tensors, send_options):
        api.send(tensors[0], send_options.dst_rank, self._name, timeout=_timeout(send_options))

    def recv(self, tensors, recv_options):
        api.recv(tensors[0], recv_options.src_rank, self._name, timeout=_timeout(recv_options))


def register() -> None:
    """Register the class under ``"ray"`` in ``ray.util.collective`` (once per process)."""
    if not _global_registry.is_registered(BACKEND_NAME):
        register_collective_backend(BACKEND_NAME, RayUtilCollectiveGroup)
