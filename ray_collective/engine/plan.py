"""Plans: an algorithm recorded once per call shape, replayed by every call of that shape.

An algorithm is a generator that yields rounds of Send/Recv operations and, between rounds, asks
its context for scratch memory, local reductions and copies. What it does depends only on the
call's shape -- the collective, the team, this rank, the element count, the root, the node map --
never on the data. A :class:`Plan` is that behaviour recorded once, every buffer an operation
names turned into a place (which of the call's buffers, and where in it), so that a call replays
the rounds on its own buffers without running the generator, selecting the algorithm or building
its team, blocks and operations again. Gloo builds an algorithm object once and runs it many
times; MPI's persistent collectives (``MPI_Allreduce_init``) exist for the same reason.

The buffers of a plan are its *slots*: slot 0 is the call's buffer (alltoall's send buffer),
slot 1 alltoall's receive buffer, and one slot per ``ctx.alloc`` the algorithm made. While
recording, the call's buffers are arrays that are allocated but never written (a 64 MiB call costs
no memory to record), and local operations are noted, not run. A plan keeps its scratch memory
between calls when it is small (calls of one group run one at a time); large scratch is
allocated per call, so that a cached plan never holds much memory.

A plan replays exactly what its generator does: the same operations, in the same order, on the
same parts of the same buffers (``tests/test_plan.py`` checks this for every algorithm).
"""

from __future__ import annotations

import copy
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ..algorithms.catalog import start
from ..algorithms.core import Algorithm, Blocks, Context, Recv, Team

KEEP_SCRATCH_BYTES = 1 << 20
"""A plan whose scratch memory is at most this large keeps it from call to call."""


class Place(NamedTuple):
    """Elements ``start .. stop-1`` of slot ``slot`` (what every Send and Recv names)."""

    slot: int
    start: int
    stop: int


class StridedPlace(NamedTuple):
    """Any other view of a slot (the 2-D and reversed blocks of a local copy), in elements."""

    slot: int
    offset: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]


AnyPlace = Union[Place, StridedPlace]


class Message(NamedTuple):
    """One Send (``is_send``) or Recv of a round, with its buffer as a place."""

    is_send: bool
    peer: int
    step: int
    place: Place
    reduce: bool


class Local(NamedTuple):
    """A local operation between rounds: ``combine`` (reduce ``source`` into ``target``) or
    ``copy``."""

    kind: str
    target: AnyPlace
    source: AnyPlace

    def run(self, slots: Sequence[np.ndarray], combine) -> None:
        """Do the operation on a call's ``slots``, reducing with ``combine``."""
        target, source = view(slots, self.target), view(slots, self.source)
        if self.kind == "combine":
            combine(target, source)
        else:
            np.copyto(target, source)


Step = Union[Tuple[Message, ...], Local]


class Plan:
    """One rank's recorded algorithm for one call shape.

    Attributes:
        algorithm: what was recorded (None for a send or recv).
        steps: rounds (tuples of :class:`Message`) and :class:`Local` operations, in order.
        scratch: the element count of each scratch slot (slots 2, 3, ...).
        dtype: the wire dtype of every buffer.
    """

    __slots__ = ("algorithm", "steps", "scratch", "dtype", "_kept", "_empty")

    def __init__(self, algorithm: Optional[Algorithm], steps: Sequence[Step],
                 scratch: Sequence[int], dtype: np.dtype):
        self.algorithm = algorithm
        self.steps = tuple(steps)
        self.scratch = tuple(scratch)
        self.dtype = dtype
        kept = sum(self.scratch) * dtype.itemsize <= KEEP_SCRATCH_BYTES
        self._kept = [np.empty(count, dtype) for count in self.scratch] if kept else None
        self._empty = np.empty(0, dtype)

    def part(self, steps: Sequence[Step]) -> "Plan":
        """A plan of some of this plan's ``steps``, on the same slots: its scratch is this
        plan's, kept memory included, not a copy of its own (a call runs its parts one after
        the other, on this plan's slots)."""
        part = copy.copy(self)
        part.steps = tuple(steps)
        return part

    @property
    def rounds(self) -> int:
        """How many rounds of messages the plan has."""
        return sum(1 for step in self.steps if not isinstance(step, Local))

    def fixed_tail(self) -> Optional[List[np.ndarray]]:
        """What :meth:`slots` puts after ``buf`` when there is no ``recvbuf``, where it is the
        same arrays on every call (the scratch is kept); else None."""
        return None if self._kept is None else [self._empty] + self._kept

    def slots(self, buf: Optional[np.ndarray], recvbuf: Optional[np.ndarray] = None
              ) -> List[np.ndarray]:
        """The arrays a call's places refer to: its buffers, then the scratch memory."""
        empty = self._empty
        head = [empty if buf is None else buf, empty if recvbuf is None else recvbuf]
        if self._kept is not None:
            return head + self._kept
        return head + [np.empty(count, self.dtype) for count in self.scratch]


def view(slots: Sequence[np.ndarray], place: AnyPlace) -> np.ndarray:
    """The array ``place`` names among ``slots``."""
    if type(place) is Place:
        return slots[place.slot][place.start:place.stop]
    base = slots[place.slot]
    itemsize = base.itemsize
    return np.ndarray(place.shape, base.dtype, buffer=base, offset=place.offset * itemsize,
                      strides=tuple(s * itemsize for s in place.strides))


class _Recorder:
    """Stands in for the context's memory and local operations while a plan is recorded."""

    def __init__(self, dtype: np.dtype, buffers: Sequence[np.ndarray]):
        self.dtype = dtype
        self.steps: List[Step] = []
        self.scratch: List[int] = []
        # The slots are held for the whole recording, so that no two share an address; each
        # one's memory as (start address, end address) is read once: a plan names places many
        # times, and an array's address is a dictionary built per look.
        self.slots: List[np.ndarray] = []
        self._bounds: List[Tuple[int, int]] = []
        for buffer in buffers:
            self._add_slot(buffer)

    def _add_slot(self, array: np.ndarray) -> None:
        self.slots.append(array)
        start = array.__array_interface__["data"][0]
        self._bounds.append((start, start + array.nbytes))

    def alloc(self, count: int) -> np.ndarray:
        array = np.empty(count, self.dtype)
        self._add_slot(array)
        self.scratch.append(count)
        return array

    def combine(self, target: np.ndarray, source: np.ndarray) -> None:
        self.steps.append(Local("combine", self.place(target), self.place(source)))

    def copy(self, target: np.ndarray, source: np.ndarray) -> None:
        self.steps.append(Local("copy", self.place(target), self.place(source)))

    def place(self, array: np.ndarray) -> AnyPlace:
        """Where ``array`` (a view of one of the slots) lies."""
        itemsize = self.dtype.itemsize
        if array.size == 0:
            return Place(0, 0, 0)
        address = array.__array_interface__["data"][0]
        for slot, (start, end) in enumerate(self._bounds):
            if start <= address < end:
                offset = (address - start) // itemsize
                if array.ndim == 1 and (array.strides[0] == itemsize or array.size == 1):
                    return Place(slot, offset, offset + array.size)
                return StridedPlace(slot, offset, tuple(array.shape),
                                    tuple(s // itemsize for s in array.strides))
        raise ValueError("an algorithm named a buffer that is neither the call's nor scratch "
                         "memory from ctx.alloc")

    def message(self, op) -> Message:
        if isinstance(op, Recv):
            array, reduce, is_send = op.out, op.reduce, False
        else:
            array, reduce, is_send = op.data, False, True
        place = self.place(array)
        if type(place) is not Place:
            raise ValueError(f"{type(op).__name__} to/from rank {op.peer} names a buffer that is "
                             f"not 1-D and contiguous")
        return Message(is_send, op.peer, op.step, place, reduce)


def record(algorithm: Algorithm, team: Team, dtype: np.dtype, count: int,
           blocks: Optional[Blocks] = None, root: int = -1, ctx: Optional[Context] = None
           ) -> Plan:
    """Record what ``algorithm`` does on this rank for a call of ``count`` elements in slot 0.

    Args:
        algorithm: the algorithm (its collective fixes the signature, see ``catalog.start``).
        team: the ranks taking part, with this rank's index.
        dtype: the wire dtype.
        count: elements of the call's buffer (slot 0) -- and of alltoall's receive buffer.
        blocks: the block partition of the buffer (list collectives).
        root: the root's index in the team, or -1.
        ctx: the context to take ``node_of``, ``choose``, the topology and ``oversubscribed``
            from (its memory and local operations are replaced by the recorder's).

    Returns:
        The plan.

    Raises:
        ValueError: the algorithm names memory that is not the call's or ``ctx.alloc``'s, or
            sends or receives into a buffer that is not 1-D and contiguous.
    """
    dtype = np.dtype(dtype)
    alltoall = algorithm.collective == "alltoall"
    buffers = [np.empty(count, dtype), np.empty(count if alltoall else 0, dtype)]
    recorder = _Recorder(dtype, buffers)
    recording = Context(dtype, recorder.combine, alloc=recorder.alloc, copy=recorder.copy,
                        node_of=ctx.node_of if ctx else None, choose=ctx.choose if ctx else None,
                        topology=ctx.topology if ctx and ctx.node_of else None,
                        oversubscribed=ctx.oversubscribed if ctx else False)
    generator = start(algorithm, team, recording, buffers[0], blocks, root,
                      buffers[1] if alltoall else None)
    try:
        round_ = next(generator)
        while True:
            if round_:
                recorder.steps.append(tuple(recorder.message(op) for op in round_))
            round_ = generator.send(None)
    except StopIteration:
        pass
    return Plan(algorithm, recorder.steps, recorder.scratch, dtype)


def point_to_point(is_send: bool, peer: int, count: int, dtype: np.dtype) -> Plan:
    """The plan of a send (``is_send``) or recv: one message of the whole buffer with ``peer``.

    Messages between two ranks on one tag are matched in order, so a sequence of sends meets
    the same sequence of recvs; each tag is its own ordered channel.
    """
    message = Message(is_send, peer, 0, Place(0, 0, count), False)
    return Plan(None, [(message,)], [], np.dtype(dtype))
