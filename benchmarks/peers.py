"""The libraries the harness compares, each behind one small interface used inside a rank.

A peer lives in one rank's actor: ``setup`` joins the group, ``operation`` binds one
collective to buffers made by ``make_buffers``, ``barrier`` aligns the ranks before a timed
call, and ``teardown`` leaves the group. Adding a library (issue 6: mpi4py, plain Ray object
passing) means one more subclass and one more entry in ``PEERS``.

Tensors: both peers get the same numpy arrays. ``ray.util.collective``'s Gloo group in Ray
2.60 (``TorchGLOOGroup``) accepts numpy arrays and wraps them with ``torch.from_numpy`` — a
zero-copy view — before calling ``torch.distributed``; that wrapping costs about half a
microsecond per call, so Gloo is timed on the tensors a user of either library would pass.
"""

from __future__ import annotations

import abc
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, List, Mapping, Optional

import numpy as np

from .collectives import message_layout

BROADCAST_ROOT = 0
"""The root rank of broadcast and reduce."""


@dataclass(frozen=True)
class Buffers:
    """One rank's buffers for a point, reused by every iteration of it.

    Attributes:
        tensor: the single tensor (input and output of allreduce, broadcast, reduce; input of
            allgather; output of reducescatter); None for barrier.
        tensor_list: the list of parts (output of allgather, input of reducescatter); empty
            for the collectives that take no list.
    """

    tensor: Optional[Any]
    tensor_list: List[Any] = field(default_factory=list)


class Peer(abc.ABC):
    """One collective library as a rank drives it; a fresh instance per rank and group."""

    name: ClassVar[str]
    """The backend name of the CLI's ``--backends``."""

    @abc.abstractmethod
    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float) -> dict:
        """Join the group; returns once every rank has joined.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: a name no other group of this run uses.
            timeout_s: the longest any call of the group may wait.

        Returns:
            Facts for the report's metadata (library versions), JSON-serializable.

        Raises:
            Exception: whatever the library raises when it cannot form the group.
        """

    @abc.abstractmethod
    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """A call that runs one blocking collective on ``buffers``, bound once per point.

        Binding ahead keeps argument handling of the harness out of the timed region.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments; it raises whatever the library raises.

        Raises:
            KeyError: a collective this peer does not run.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has called it.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def teardown(self) -> None:
        """Leave the group and release what this rank holds for it.

        Raises:
            Exception: whatever the library raises.
        """

    def make_tensor(self, count: int, dtype: np.dtype) -> Any:
        """A tensor of ``count`` elements this library accepts, its pages already touched.

        Args:
            count: number of elements.
            dtype: numpy dtype.

        Returns:
            A zero-filled numpy array; zeros keep sums finite and free of denormals however
            many iterations run.
        """
        tensor = np.empty(count, dtype=dtype)
        tensor.fill(0)
        return tensor


class CollectiveApiPeer(Peer):
    """A library with ``ray.util.collective``'s function names and argument order.

    Subclasses join in ``setup`` and record the group's name in ``_group_name``.
    """

    def __init__(self) -> None:
        self._group_name = ""

    @abc.abstractmethod
    def module(self) -> Any:
        """The module whose free functions run the collectives (imported on first use).

        Returns:
            The module.
        """

    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """The module's free function for ``collective`` with its arguments bound.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments.

        Raises:
            KeyError: a collective this peer does not run.
        """
        group = self._group_name
        arguments = {
            "allreduce": (buffers.tensor, group),
            "reduce": (buffers.tensor, BROADCAST_ROOT, group),
            "broadcast": (buffers.tensor, BROADCAST_ROOT, group),
            "allgather": (buffers.tensor_list, buffers.tensor, group),
            "reducescatter": (buffers.tensor, buffers.tensor_list, group),
            "barrier": (group,),
        }
        return functools.partial(getattr(self.module(), collective), *arguments[collective])

    def barrier(self) -> None:
        """Block on the library's own barrier.

        Raises:
            Exception: whatever the library raises.
        """
        self.module().barrier(self._group_name)

    def teardown(self) -> None:
        """Destroy this rank's membership of the group.

        Raises:
            Exception: whatever the library raises.
        """
        self.module().destroy_collective_group(self._group_name)


class RayCollectivePeer(CollectiveApiPeer):
    """This library, ``ray_collective``, with its native ``ray`` backend."""

    name = "ray"

    def module(self) -> Any:
        """``ray_collective``.

        Returns:
            The module.
        """
        import ray_collective
        return ray_collective

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float) -> dict:
        """``init_collective_group(..., backend="ray", timeout=timeout_s)``.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: the group's name.
            timeout_s: the group's default deadline per call.

        Returns:
            ``{"ray_collective": version}``.

        Raises:
            ray_collective.BackendNotAvailableError: the backend cannot run here.
            ray_collective.CollectiveError: the group could not be formed in time.
        """
        api = self.module()
        self._group_name = group_name
        api.init_collective_group(world_size, rank, backend="ray",
                                  group_name=self._group_name, timeout=timeout_s)
        return {"ray_collective": api.__version__}


class GlooPeer(CollectiveApiPeer):
    """``ray.util.collective`` with ``backend="gloo"`` (torch.distributed's Gloo)."""

    name = "gloo"

    def module(self) -> Any:
        """``ray.util.collective``; importing it with torch present registers Gloo.

        Returns:
            The module.
        """
        import ray.util.collective
        return ray.util.collective

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float) -> dict:
        """``ray.util.collective.init_collective_group(..., backend="gloo")``.

        torch is imported here, in the rank's process, and nowhere else in the harness.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: the group's name.
            timeout_s: the rendezvous deadline (Ray's ``gloo_timeout``).

        Returns:
            ``{"torch": version}``.

        Raises:
            ImportError: torch is not installed (``pip install '.[bench]'``).
            RuntimeError: Gloo is not available, or the rendezvous failed.
        """
        import torch
        api = self.module()
        self._group_name = group_name
        api.init_collective_group(world_size, rank, backend="gloo",
                                  group_name=self._group_name,
                                  gloo_timeout=int(timeout_s * 1000))
        return {"torch": torch.__version__}


PEERS: Mapping[str, type] = types.MappingProxyType(
    {peer.name: peer for peer in (RayCollectivePeer, GlooPeer)})
"""Every backend the CLI can measure, by name (read-only)."""


def make_buffers(peer: Peer, collective: str, requested_bytes: int, world_size: int,
                 dtype: np.dtype) -> Buffers:
    """The buffers one rank of ``peer`` needs for a point, laid out by ``message_layout``.

    Args:
        peer: the library whose tensors to make.
        collective: a name of ``collectives.COLLECTIVES``.
        requested_bytes: the size asked for.
        world_size: number of ranks.
        dtype: numpy dtype.

    Returns:
        The buffers.

    Raises:
        KeyError: an unknown collective.
    """
    layout = message_layout(collective, requested_bytes, world_size, dtype.itemsize)
    if layout.nbytes == 0:
        return Buffers(tensor=None)
    tensor = peer.make_tensor(layout.elements_per_tensor, dtype)
    parts = [peer.make_tensor(layout.elements_per_tensor, dtype)
             for _ in range(layout.list_length)]
    return Buffers(tensor=tensor, tensor_list=parts)
