"""The in-process backend: every rank of the group is a thread of this process.

It runs the same algorithms and the same group layer as the Ray backend, over
``transport.local``; ``ray_collective.testing.run_ranks`` builds on it. Given a directory, its
ranks run their collectives on the native core instead (one core node per rank, all in that
directory, as the ranks of one machine would; with a pretend node map, one directory per
pretend node, and the transport between them), which tests the native engine without Ray.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ..engine.native_runner import NativeRunner, native_node
from ..transport.local import LocalFabric
from .base import BackendFactory, Membership
from ..engine.cpu import TransportMembership


class LocalBackendFactory(BackendFactory):
    """Joins ranks to one :class:`LocalFabric`.

    Args:
        fabric: the shared mailboxes of the group (threaded mode).
        node_of: an optional pretend rank→node map, to exercise the node-aware algorithms.
        native_directory: a private directory (0700, this user's) where the ranks' native core
            nodes meet; None runs the pure-Python engine.
        spin_s: with ``native_directory``: how long a waiting rank polls before it sleeps.
    """

    name = "local"

    def __init__(self, fabric: LocalFabric, node_of: Optional[Sequence] = None,
                 native_directory: Optional[str] = None, spin_s: float = 0.0):
        if fabric.deferred:
            raise ValueError("the local backend needs a LocalFabric in threaded mode "
                             "(deferred=False)")
        self.fabric = fabric
        self.node_of = tuple(node_of) if node_of is not None else None
        self.native_directory = native_directory
        self.spin_s = spin_s

    def available(self) -> bool:
        return True

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> Membership:
        if world_size != self.fabric.world_size:
            raise ValueError(f"world_size {world_size} does not match the local fabric's "
                             f"{self.fabric.world_size} ranks")
        transport = self.fabric.transport(rank)
        runner = None
        if self.native_directory is not None:
            directory = self.native_directory
            if self.node_of is not None:
                # One directory per pretend node, as each node of a cluster has its own.
                directory = os.path.join(directory, f"node-{self.node_of[rank]}")
                os.makedirs(directory, mode=0o700, exist_ok=True)
            runner = NativeRunner(native_node(directory, rank, world_size, self.spin_s),
                                  transport, spans_nodes=len(set(self.node_of or ())) > 1)
        return TransportMembership(group_name, transport, node_of=self.node_of, native=runner)
