"""What a backend is: one rank's membership of one group, and the factory that joins it.

The API layer validates a call; the group asks the backend to prepare its shape once
(:meth:`Membership.prepare`), and runs every call of that shape through the
:class:`PreparedCall` it got, to completion (blocking) or raising. Asynchrony, sequence
numbers and the broken state live in the group layer, so every backend gets them for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional, Sequence, Tuple

from ..errors import UnsupportedOperationError
from ..tensors import TensorView
from ..types import CallOptions, Collective


class CallViews:
    """The views of one call's tensors, as the API checked them.

    Attributes:
        tensor: the single tensor argument (input and/or output), if the collective has one.
        inputs: the input list (reducescatter, scatter on the root, alltoall).
        outputs: the output list (allgather, gather on the root, alltoall).

    A plain class with slots rather than a frozen dataclass: one is built per call of the full
    path. Treat it as read-only.
    """

    __slots__ = ("tensor", "inputs", "outputs")

    def __init__(self, tensor: Optional[TensorView] = None,
                 inputs: Tuple[TensorView, ...] = (), outputs: Tuple[TensorView, ...] = ()):
        self.tensor = tensor
        self.inputs = inputs
        self.outputs = outputs

    def reference(self) -> Optional[TensorView]:
        """The view that stands for the call's shape: its tensor, else the first entry of a
        list, else None (a barrier)."""
        if self.tensor is not None:
            return self.tensor
        return self.inputs[0] if self.inputs else self.outputs[0] if self.outputs else None

    def arrays(self, collective: Collective) -> Any:
        """The call's arrays in the form :attr:`PreparedCall.run` takes them (see there)."""
        tensor = None if self.tensor is None else _payload(self.tensor)
        if collective in _TAKES_OUTPUTS:
            return tensor, [_payload(view) for view in self.outputs]
        if collective in _TAKES_INPUTS:
            return tensor, [_payload(view) for view in self.inputs]
        if collective is Collective.ALLTOALL:
            return ([_payload(view) for view in self.inputs],
                    [_payload(view) for view in self.outputs])
        return tensor


def _payload(view: TensorView) -> Any:
    """What a prepared call takes of a view: its numpy array on the CPU, else the tensor."""
    return view.tensor if view.array is None else view.array


_TAKES_OUTPUTS = (Collective.ALLGATHER, Collective.GATHER)
_TAKES_INPUTS = (Collective.REDUCESCATTER, Collective.SCATTER)


class PreparedCall:
    """One call shape made ready to run: what a membership derives once per shape.

    A membership prepares one per call shape (:meth:`Membership.prepare`); the group keeps
    them (``Group.prepared``) and runs every call of the shape, blocking or queued, as
    ``prepared.run(seq, arrays)``.

    Attributes:
        options: the calls' options.
        run: ``run(seq, arrays)`` runs call ``seq`` of the shape to completion, or raises
            ``CollectiveError`` (timeout, mismatch, dead peer, a group aborted elsewhere);
            ``TypeError``/``ValueError`` for a call it refuses before sending anything.
            ``arrays`` is, by collective: the tensor (allreduce, reduce, broadcast, send,
            recv); None (barrier); ``(tensor, outputs)`` (allgather, gather: the list is
            ignored off the root); ``(tensor, inputs)`` (reducescatter, scatter, likewise);
            ``(inputs, outputs)`` (alltoall). A CPU tensor is a C-contiguous numpy array
            (the view's flat array, or the caller's own array of the shape on the known-shape
            path; a membership that also takes the caller's torch tensor or bfloat16 array
            says so in its ``prepare``); a GPU tensor is the caller's object.
    """

    __slots__ = ("options", "run")

    def __init__(self, options: CallOptions,
                 run: Optional[Callable[[int, Any], None]] = None):
        self.options = options
        self.run = run

    def describe(self) -> Tuple[str, Tuple[int, ...]]:
        """How the calls run, for the flight recorder.

        Returns:
            ``(algorithm, peers)``: the algorithm's name and the ranks this rank exchanges
            messages with, sorted (``("", ())`` when unknown, the default).
        """
        return "", ()

    def on_submit(self, seq: int, arrays: Any) -> None:
        """Called in the caller's thread when call ``seq`` is submitted, before it may be
        queued to run on the group's worker thread.

        A backend that needs the caller's thread state captures it here: the NCCL backend
        records an event on the caller's current CUDA stream, which is per thread and would be
        lost once the call runs on the worker thread. The default does nothing.

        Args:
            seq: the call's sequence number.
            arrays: its arrays, as :attr:`run` takes them.
        """


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

    @abstractmethod
    def prepare(self, options: CallOptions, views: CallViews) -> PreparedCall:
        """Make calls with ``options`` on tensors like ``views`` ready to run, once per shape.

        Asked at a shape's first call, after the API checked it; the group keeps what it
        returns and runs every call of the shape through it (see :class:`PreparedCall`).

        Args:
            options: the calls' options.
            views: the first call's tensors.

        Returns:
            The prepared call.

        Raises:
            ValueError: the call cannot run as asked (for example a forced algorithm that needs
                a power-of-two group), detected before any communication.
            TypeError: a tensor this backend does not take (a CPU tensor on a GPU backend).
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
