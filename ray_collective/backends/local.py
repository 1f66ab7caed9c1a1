"""The in-process backend: every rank of the group is a thread of this process.

It runs the same algorithms and the same group layer as the Ray backend, over
``transport.local``; ``ray_collective.testing.run_ranks`` builds on it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..transport.local import LocalFabric
from .base import BackendFactory, Membership
from .transport_membership import TransportMembership


class LocalBackendFactory(BackendFactory):
    """Joins ranks to one :class:`LocalFabric`.

    Args:
        fabric: the shared mailboxes of the group (threaded mode).
        node_of: an optional pretend rank→node map, to exercise the node-aware algorithms.
    """

    name = "local"

    def __init__(self, fabric: LocalFabric, node_of: Optional[Sequence] = None):
        if fabric.deferred:
            raise ValueError("the local backend needs a LocalFabric in threaded mode "
                             "(deferred=False)")
        self.fabric = fabric
        self.node_of = tuple(node_of) if node_of is not None else None

    def available(self) -> bool:
        return True

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> Membership:
        if world_size != self.fabric.world_size:
            raise ValueError(f"world_size {world_size} does not match the local fabric's "
                             f"{self.fabric.world_size} ranks")
        return TransportMembership(group_name, self.fabric.transport(rank), node_of=self.node_of)
