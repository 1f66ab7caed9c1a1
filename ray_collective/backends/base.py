"""What a backend is: one rank's engine for one group, and the factory that joins it.

The API layer validates a call and hands the backend a :class:`GroupCall`; the backend runs it
to completion (blocking) or raises. Asynchrony, sequence numbers and the broken state live in
the group layer, so every backend gets them for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional, Sequence, Tuple

from ..errors import UnsupportedOperationError
from ..tensors import TensorView
from ..types import CallOptions, Collective


class GroupCall:
    """One validated call as the backend sees it.

    Attributes:
        options: what was asked (collective, op, root/peer, tag, timeout).
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


class Membership(ABC):
    """One rank's membership of one group on one backend.

    Attributes:
        accepts_gpu_tensors: its calls take CUDA tensors (the API refuses them otherwise).
        collectives: the operations it runs (the API refuses the others before any
            communication, with ``UnsupportedOperationError``).
    """

    accepts_gpu_tensors = False
    collectives: FrozenSet[Collective] = frozenset(Collective)

    def multi_gpu_arguments(self) -> Optional[Any]:
        """What checks the arguments of the ``*_multigpu`` calls for this membership's GPUs,
        or None when it does not run them (the default).

        A membership that runs them returns an object with the methods the API calls
        (``tensors``, ``tensor_lists``, ``tensor``, ``index`` and ``call``; see
        ``backends.nccl.arguments.GpuArguments``), so that a backend brings its own checks.

        Returns:
            The argument binder, or None.
        """
        return None

    def shape_runner(self, options: CallOptions, view: Optional[TensorView]
                     ) -> Optional[Callable[[int, Any], None]]:
        """How to run the later calls of one shape without building a call each time.

        Asked once per call shape, after a call with ``options`` on a tensor like ``view``
        (None for a barrier) passed every check of the API; the group then runs each later
        call of the same shape (numpy array, dtype, shape, strides, root, op; the peer and
        tag of a send or recv, numbered per channel) as
        ``runner(seq, array)``, with the same failure handling as :meth:`run`. The default
        offers none: every call goes through :meth:`run`.

        Args:
            options: the calls' options.
            view: the first call's tensor.

        Returns:
            ``runner(seq, array)``, or None.
        """
        return None

    def describe(self, options: CallOptions, view: Optional[TensorView]
                 ) -> Tuple[str, Tuple[int, ...]]:
        """How calls with ``options`` on tensors like ``view`` run, for the flight recorder.

        Asked once per call shape. The default says nothing.

        Args:
            options: the calls' options.
            view: their tensor (the first of a list), None for none.

        Returns:
            ``(algorithm, peers)``: the algorithm's name and the ranks this rank exchanges
            messages with, sorted (``("", ())`` when unknown).

        Raises:
            ValueError: the call cannot run as asked (as :meth:`run` would raise).
        """
        return "", ()

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

    def shrink(self, failures: Sequence[Optional[BaseException]],
               timeout: float) -> "Reformed":
        """Agree with the other survivors on who goes on, and join the group's next incarnation
        with them (``shrink_collective_group``); this membership stays as it was, for the
        group layer to close once it has the new one.

        A backend that can shrink overrides this; the default refuses.

        Args:
            failures: what this rank knows of the failure: what broke the group here (None
                if nothing did), and what the driver saw (a member actor dead).
            timeout: seconds the whole shrink may take.

        Returns:
            The new membership and this rank's place in it.

        Raises:
            UnsupportedOperationError: the backend cannot shrink a group (the default).
        """
        raise UnsupportedOperationError(self.elastic_refusal("shrink"))

    def prepare_grow(self, world_size: int) -> "BackendFactory":
        """Decide (or learn) the grow of the group to ``world_size`` ranks; the factory its new
        ranks join with (sent to them by a grow from the driver).

        Args:
            world_size: the group's size once grown.

        Returns:
            The factory the new ranks join with.

        Raises:
            UnsupportedOperationError: the backend cannot grow a group (the default).
        """
        raise UnsupportedOperationError(self.elastic_refusal("grow"))

    def grow(self, world_size: int, timeout: float) -> "Reformed":
        """Join the group's next incarnation of ``world_size`` ranks with the other members and
        the new ranks (``grow_collective_group``); this membership stays as it was, for the
        group layer to close once it has the new one.

        Args:
            world_size: the group's size once grown.
            timeout: seconds the whole grow may take.

        Returns:
            The new membership and this rank's place in it (its rank is unchanged).

        Raises:
            UnsupportedOperationError: the backend cannot grow a group (the default).
        """
        raise UnsupportedOperationError(self.elastic_refusal("grow"))

    def elastic_refusal(self, what: str) -> str:
        """Why this membership cannot ``what`` (``"shrink"`` or ``"grow"``) its group: the
        message of the ``UnsupportedOperationError`` the defaults raise (a backend may say
        more).

        Args:
            what: ``"shrink"`` or ``"grow"``.

        Returns:
            The message.
        """
        return (f"{type(self).__name__} cannot {what} a group: its backend has no elastic "
                f"groups. Destroy the group and create it again with the ranks you want (the "
                f"'ray' backend can {what} one)")

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
               timeout: float) -> Membership:
        """Join ``rank`` to the group; returns once the membership is usable.

        Raises:
            BackendNotAvailableError: the backend cannot run here.
            CollectiveTimeoutError: the other ranks did not join within ``timeout`` seconds.
        """

    def synchronize(self, gpu_id: int) -> bool:
        """Wait until the work this backend queued on GPU ``gpu_id`` has finished.

        Args:
            gpu_id: the GPU's index among the devices this process sees.

        Returns:
            True once it has waited; False when this backend runs nothing on GPUs (the
            default, with nothing to wait for).

        Raises:
            BackendNotAvailableError: the backend runs on GPUs but cannot here.
            ValueError: ``gpu_id`` is not a visible GPU.
        """
        return False

    def prepare_declaration(self, group_name: str) -> "Declaration":
        """What the members of a group declared from the driver join with.

        The default sends this factory to the members as it is; a backend overrides it to
        prepare the incarnation first (from the driver) or to clean up after it.

        Args:
            group_name: the group being declared.

        Returns:
            The :class:`Declaration`.
        """
        return Declaration(self, None)


@dataclass(frozen=True)
class Reformed:
    """A rank's membership of a group's next incarnation, after a shrink or a grow.

    Attributes:
        membership: the new membership.
        rank: this rank in it.
        world_size: its ranks.
        kept: the old ranks that go on, in their new rank order (``kept[new] = old``); the
            ranks of a grow beyond them are new.
    """

    membership: Membership
    rank: int
    world_size: int
    kept: Tuple[int, ...]


@dataclass(frozen=True)
class Declaration:
    """How the members of a group declared from the driver join, and what is left after them.

    Attributes:
        member_factory: the factory each member joins with (sent to the actors).
        clean_up: removes what the group keeps outside its members, run once they left (and
            after a failed declaration); None when there is nothing.
    """

    member_factory: BackendFactory
    clean_up: Optional[Callable[[], None]]


def node_map_or_none(node_of: Optional[Sequence]) -> Optional[Tuple]:
    """``node_of`` as a tuple, or None when it puts every rank on one node."""
    if node_of is None or len(set(node_of)) <= 1:
        return None
    return tuple(node_of)
