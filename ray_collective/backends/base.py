"""What a backend is: one rank's engine for one group, and the factory that joins it.

The API layer validates a call and hands the backend a :class:`GroupCall`; the backend runs it
to completion (blocking) or raises. Asynchrony, sequence numbers and the broken state live in
the group layer, so every backend gets them for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence, Tuple

from ..tensors import TensorView
from ..types import CallOptions


class GroupCall:
    """One validated call as the backend sees it.

    Attributes:
        options: what was asked (collective, op, root/peer, tag, timeout, forced algorithm).
        seq: the call's sequence number (per group for collectives, per peer and tag for p2p).
        tensor: the single tensor argument (input and/or output), if the collective has one.
        inputs: the input list (reducescatter, scatter on the root, alltoall).
        outputs: the output list (allgather, gather on the root, alltoall).

    A plain class with slots rather than a frozen dataclass, because one is built per call and
    a frozen dataclass costs microseconds to build. Treat it as read-only.
    """

    __slots__ = ("options", "seq", "tensor", "inputs", "outputs")

    def __init__(self, options: CallOptions, seq: int, tensor: Optional[TensorView] = None,
                 inputs: Tuple[TensorView, ...] = (), outputs: Tuple[TensorView, ...] = ()):
        self.options = options
        self.seq = seq
        self.tensor = tensor
        self.inputs = inputs
        self.outputs = outputs

    def __repr__(self) -> str:
        return f"GroupCall({self.options.collective.value} #{self.seq})"


class CollectiveBackend(ABC):
    """One rank's membership of one group on one backend.

    Attributes:
        accepts_gpu_tensors: its calls take CUDA tensors (the API refuses them otherwise).
        multi_gpu: it runs the ``*_multigpu`` calls, with a ``devices`` attribute listing the
            GPUs of this process.
    """

    accepts_gpu_tensors = False
    multi_gpu = False

    @abstractmethod
    def run(self, call: GroupCall) -> None:
        """Run ``call`` to completion.

        Raises:
            CollectiveError: timeout, mismatch, dead peer, or a group aborted elsewhere.
            ValueError: the call cannot run as asked (for example a forced algorithm that needs
                a power-of-two group), detected before any communication.
        """

    def on_submit(self, call: GroupCall) -> None:
        """Called in the caller's thread when ``call`` is submitted, before it may be queued.

        A backend that needs the caller's thread state captures it here: the NCCL backend
        records an event on the caller's current CUDA stream, which is per thread and would be
        lost once the call runs on the group's worker thread. The default does nothing.
        """

    @abstractmethod
    def abort(self, error: BaseException) -> None:
        """Tell every other member that the group is broken by ``error``."""

    @abstractmethod
    def close(self) -> None:
        """Release everything this membership holds."""


class BackendFactory(ABC):
    """Creates memberships: ``create`` performs the rendezvous of one rank."""

    name: str = ""

    @abstractmethod
    def available(self) -> bool:
        """Whether this backend can be used in this process."""

    @abstractmethod
    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> CollectiveBackend:
        """Join ``rank`` to the group; returns once the membership is usable.

        Raises:
            BackendNotAvailableError: the backend cannot run here.
            CollectiveTimeoutError: the other ranks did not join within ``timeout`` seconds.
        """

    def declare(self, actors: Sequence, ranks: Sequence[int], world_size: int, group_name: str,
                timeout: float) -> "DeclaredGroup":
        """Join ``actors[i]`` as rank ``ranks[i]``, driven from the driver.

        The default runs :meth:`create` inside each actor (``backends.declared``); a backend
        overrides it to prepare the incarnation first or to clean up after it.

        Raises:
            CollectiveTimeoutError: the actors did not all join within ``timeout`` seconds.
            Exception: an actor's own failure to join.
        """
        from .declared import declare_in_actors  # here: declared.py builds on this module
        return declare_in_actors(self, actors, ranks, world_size, group_name, timeout)


class DeclaredGroup(ABC):
    """A group declared from this driver: what the driver needs to destroy it."""

    name: str
    actors: Tuple
    members: Tuple
    """The member actors in rank order: ``members[r]`` is rank r."""

    @abstractmethod
    def destroy(self, timeout: float) -> None:
        """Make every member leave and remove what the group left behind."""


def node_map_or_none(node_of: Optional[Sequence]) -> Optional[Tuple]:
    """``node_of`` as a tuple, or None when it puts every rank on one node."""
    if node_of is None or len(set(node_of)) <= 1:
        return None
    return tuple(node_of)
