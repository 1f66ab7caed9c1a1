"""Running a group's collectives on the native core, with the Python side watching for failures.

A :class:`NativeRunner` belongs to one rank of a group whose ranks all have the core; in a group
that spans nodes it carries only the messages between this node's ranks. It turns a
call shape's recorded plan into the core's plan code once (:meth:`NativeRunner.prepare`), and
runs each call of it in the core (:meth:`NativeRunner.run`, or the function
:meth:`NativeRunner.bind` returns for a known shape), a slice of ``SLICE_S`` at a time (longer
on a crowded machine: :func:`slice_s_for`), the GIL released while it waits: between slices
the rank records that it is alive and asks its transport whether a peer died or the group was
aborted (``Transport.check_failures``), and gives up at the call's deadline. A mismatch the
core finds becomes the same ``CollectiveMismatchError`` the Python engine raises
(``wire.mismatch``).

Point-to-point calls between ranks of the node run on the core too, on their own tag (a
collective that meets one of their frames sets it aside for the receive that wants it). One
larger than the node's ``p2p_max_bytes`` is offered to be read in place; if its receiver has
not begun to read it within a millisecond, or cannot, :meth:`NativeRunner.run` says so on both
sides and the message goes over the transport, whose sends never wait for their receiver
(``engine.cpu``).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..algorithms.core import Blocks
from ..errors import CollectiveTimeoutError
from ..native import codes, core
from ..native.codes import DONE, MISMATCH, REROUTED
from ..transport.base import COLLECTIVE_TAG, SendRequest, Transport
from ..transport.node_state import COLLECTIVE_CODES
from ..transport.wire import CallStamp, HeaderTemplate, mismatch
from ..types import ReduceOp
from . import stream_rounds
from .plan import Local, Place, Plan
from .stream_rounds import StreamPlan, StreamRounds

SLICE_S = 0.05
"""The longest the core runs a call before the rank looks for failures. A killed peer leaves
no socket hang-up to notice in the rings, so this alone bounds how soon it is named: with
0.1 s, ``python -m benchmarks.fault_detection`` (4 ranks, 10 kills) gave p95 107 ms at 8 B,
past the 0.1 s target. A check costs 70-120 us per slice of waiting (48 ranks on 2 cores):
see ``SLICES_PER_CORE_S`` for crowded machines."""

SLICES_PER_CORE_S = 500
"""How many slices a second the waiting ranks of a machine may end, per core. Each end wakes
a rank and runs its failure check in Python (70-120 us each at 48 ranks on 2 cores, more on a
busier machine): 400 ranks waiting on 2 cores at 20 slices a second each would spend more
than a core on it, and so slow every step of the call they wait for. At 400 ranks, 0.05 s
slices gave allreduce 8 B in 649 ms, 0.4 s slices in 203 ms (``make bench-400``)."""


def slice_s_for(ranks_per_core: float) -> float:
    """The slice of a rank whose machine runs ``ranks_per_core`` ranks of the group per core:
    ``SLICE_S``, or longer where that many ranks would end more than ``SLICES_PER_CORE_S``
    slices a second per core (from 25 ranks a core: 0.4 s at 400 ranks on 2 cores, which is
    then how long a killed rank may go unnoticed by the first survivor to look).

    Args:
        ranks_per_core: ranks of the group on the machine, over its cores.

    Returns:
        Seconds.
    """
    return max(SLICE_S, ranks_per_core / SLICES_PER_CORE_S)

RING_BYTES_MAX = 4 << 20
"""A ring's room when the group is small: large messages stream through it in parts of
``RING_BYTES_MAX // PARTS_PER_RING`` while the receiver reduces the ones before."""
RING_BYTES_MIN = 64 << 10
RING_BUDGET_BYTES = 512 << 20
"""What the rings of one group may hold at most on one node, if every pair an algorithm uses
(about log2 p per rank and direction) streamed large messages at once: rings shrink with the
world size to stay within it (tmpfs backs only the pages a ring's data has reached)."""
PARTS_PER_RING = 16


def ring_bytes(world_size: int) -> int:
    """The ring size of a group of ``world_size`` ranks (every rank computes the same)."""
    pairs = 2 * world_size * max(1, math.ceil(math.log2(max(world_size, 2))))
    size = min(RING_BYTES_MAX, max(RING_BYTES_MIN, RING_BUDGET_BYTES // pairs))
    return size - size % 128


CORE_SPIN_S = 500e-6
"""How long a waiting rank polls the core's rings before it sleeps, yielding its core between
polls (``sched_yield``), so that a peer that needs the core gets it: on a crowded machine too,
unlike the Python engine's spin (``transport.progress.PROGRESS_SPIN_S``). Long enough that a
peer's answer to a small message usually arrives while the rank still polls (with no polling,
or a few tens of microseconds, 4 and 8 ranks on 2 cores took 1.5-2.5x as long, each call
paying for a wake-up), and short enough not to hold a core a peer needs (polling for
milliseconds made 2 ranks on 2 cores slower)."""


REMOTE_MIN_BYTES = 32 << 20
"""From this size on, a message of a collective that reduces nothing (broadcast, allgather,
gather, scatter, alltoall) is read by its receiver straight from the sender's memory
(``process_vm_readv``, see ``remote.c``): one copy instead of two through the ring. Where the
kernel refuses (another user's process, Yama's ptrace_scope above 0 without CAP_SYS_PTRACE),
the messages go through the ring as below this size. Below 32 MiB the ring is faster: the
kernel walks and pins the sender's pages one by one (``perf`` at 4 ranks, alltoall of 1 MiB:
page-table walks and pinning took three times the samples of the copy itself), while the
ring's two copies stay in the cache and run on both sides at once. With a threshold of 256 KiB,
messages of 1-4 MiB read in place took up to twice as long as through the ring (alltoall,
allgather, broadcast and the allgather phase of an allreduce's ring, at 4 ranks on 2 cores),
while messages of 32 MiB and more took 1.1-1.4x as long through the ring as read in place
(2 ranks, 64 MiB). A fan-out's messages (one range sent to three peers or more in a round, as
a linear broadcast's root sends) are read in place from 2 MiB (``native/node.h``:
``RC_FAN_OUT_REMOTE_MIN_BYTES``), where the ring would cost the sender one copy per receiver."""


def _with_list_copies(plan: Plan, layout: str, blocks: Blocks, rank: int,
                      has_list: bool) -> Plan:
    """``plan`` with the copies of a list collective's layout around it: for ``gather``, this
    rank's tensor into its block of the buffer before, every block into its list entry after;
    for ``split``, every list entry into its block before, this rank's block into the tensor
    after; for ``receive block``, this rank's block into the tensor after; for ``exchange``
    (alltoall), every input entry into its block of the send buffer before, every block of
    the receive buffer into its output entry after. The tensor is the slot after the plan's
    own, the list entries the ones after it (alltoall has no tensor: its inputs, then its
    outputs); a rank without the list (gather's and scatter's others) copies only its
    tensor."""
    tensor = 2 + len(plan.scratch)

    def block(i: int, slot: int = 0) -> Place:
        return Place(slot, blocks.offsets[i], blocks.offsets[i + 1])

    def whole(slot: int, i: int) -> Place:
        return Place(slot, 0, blocks.size(i))

    entries = range(blocks.parts if has_list else 0)
    if layout == "exchange":
        inputs, outputs = tensor, tensor + blocks.parts
        before = [Local("copy", block(i), whole(inputs + i, i)) for i in entries]
        after = [Local("copy", whole(outputs + i, i), block(i, 1)) for i in entries]
    elif layout == "receive block":
        before, after = [], [Local("copy", whole(tensor, rank), block(rank))]
    elif layout == "gather":
        before = [Local("copy", block(rank), whole(tensor, rank))]
        after = [Local("copy", whole(tensor + 1 + i, i), block(i)) for i in entries]
    else:
        before = [Local("copy", block(i), whole(tensor + 1 + i, i)) for i in entries]
        after = [Local("copy", whole(tensor, rank), block(rank))]
    return Plan(plan.algorithm, before + list(plan.steps) + after, plan.scratch, plan.dtype)


DIRECT_BLOCK_BYTES = 64 << 10
"""A list collective whose blocks are at least this large sends from and receives into the
caller's arrays themselves when its plan allows it (``_direct``): at 16 MiB the buffer's extra
copies made allgather 1.3x MPICH's time at 4 ranks. Below, the per-call check that the list's
entries are disjoint (a few microseconds of Python) would cost more than the copies saved."""


def _direct(plan: Plan, layout: str, blocks: Blocks, rank: int,
            has_list: bool) -> Optional[Plan]:
    """``plan`` with its buffer replaced by the caller's arrays: each block is its list entry
    where this rank has the list, else this rank's own block is its tensor. An allgather or
    gather copies the tensor into this rank's entry first. Where the list is an input
    (reducescatter, scatter's root), this rank's own block is its tensor, which takes a copy
    of its entry first: the list is only sent from. None when the plan cannot run so: a
    message spans blocks (recursive doubling's, a tree's forwarding ranks), names a block this
    rank has no array for, receives into another block of an input list (reducescatter's ring
    beyond 2 ranks forwards partial sums), or a local step runs. The arrays written into must
    not overlap the others (the caller checks each call): a block received into one is sent on
    from it later."""
    tensor = 2 + len(plan.scratch)
    receives_into_list = layout == "gather"

    def moved(message) -> Optional[Place]:
        place = message.place
        if place.slot != 0:
            return place
        # The block the place starts in (blocks this large are never empty).
        i = bisect.bisect_right(blocks.offsets, place.start) - 1
        if i >= blocks.parts or place.stop > blocks.offsets[i + 1]:
            return None  # past the buffer, or spanning blocks
        low = blocks.offsets[i]
        if has_list and (receives_into_list or (message.is_send and i != rank)):
            return Place(tensor + 1 + i, place.start - low, place.stop - low)
        if i == rank:
            return Place(tensor, place.start - low, place.stop - low)
        return None

    own = blocks.size(rank)
    steps: list = []
    if has_list and layout == "gather":
        steps.append(Local("copy", Place(tensor + 1 + rank, 0, own), Place(tensor, 0, own)))
    if has_list and layout == "split":
        steps.append(Local("copy", Place(tensor, 0, own), Place(tensor + 1 + rank, 0, own)))
    for step in plan.steps:
        if type(step) is Local:
            return None
        messages = []
        for message in step:
            place = moved(message)
            if place is None:
                return None
            messages.append(message._replace(place=place))
        steps.append(tuple(messages))
    return Plan(plan.algorithm, steps, plan.scratch, plan.dtype)


def _direct_exchange(plan: Plan, blocks: Blocks) -> Optional[Plan]:
    """An alltoall's ``plan`` with its buffers replaced by the caller's arrays: block i of the
    send buffer is input entry i, block i of the receive buffer output entry i (the slots
    after the plan's own, inputs first). None when the plan cannot run so: it uses scratch
    memory or a strided copy, or a message spans blocks (Bruck's packed rounds). The outputs
    must overlap neither each other nor an input (the caller checks each call)."""
    first, parts = 2 + len(plan.scratch), blocks.parts

    def moved(place) -> Optional[Place]:
        if type(place) is not Place or place.slot > 1:
            return None
        i = bisect.bisect_right(blocks.offsets, place.start) - 1
        if i >= parts or place.stop > blocks.offsets[i + 1]:
            return None
        low = blocks.offsets[i]
        return Place(first + place.slot * parts + i, place.start - low, place.stop - low)

    steps: list = []
    for step in plan.steps:
        if type(step) is Local:
            target, source = moved(step.target), moved(step.source)
            if step.kind != "copy" or target is None or source is None:
                return None
            steps.append(Local("copy", target, source))
            continue
        messages = []
        for message in step:
            place = moved(message.place)
            if place is None:
                return None
            messages.append(message._replace(place=place))
        steps.append(tuple(messages))
    return Plan(plan.algorithm, steps, plan.scratch, plan.dtype)


def entries_overlap(written: Sequence[np.ndarray], read: Sequence[np.ndarray] = ()) -> bool:
    """Whether a call's arrays share memory where it matters: two of the ``written`` ones, or
    a written one and a ``read`` one. Arrays only read may share memory with each other (a
    list of one array repeated, as ``[x] * p``, is an input a user writes).

    Args:
        written: contiguous arrays the call writes.
        read: contiguous arrays the call only reads.

    Returns:
        True if the call must not run on these arrays in place.
    """
    spans = sorted([(array.ctypes.data, array.ctypes.data + array.nbytes, True)
                    for array in written if array.nbytes]
                   + [(array.ctypes.data, array.ctypes.data + array.nbytes, False)
                      for array in read if array.nbytes])
    # Sorted by start, a span overlaps an earlier one exactly when it starts before the
    # furthest end among them; only a written one's end counts against a read span.
    written_end = any_end = 0
    for start, end, is_written in spans:
        if start < (any_end if is_written else written_end):
            return True
        any_end = max(any_end, end)
        if is_written:
            written_end = max(written_end, end)
    return False


def native_node(directory: str, rank: int, world_size: int, spin_s: float = CORE_SPIN_S,
                remote_min_bytes: int = REMOTE_MIN_BYTES):
    """This rank's node of the native core, in the group's private ``directory``.

    Args:
        directory: the group's directory on this node (this user's, 0700), shared by its
            ranks there.
        rank: this rank.
        world_size: ranks in the group.
        spin_s: how long a waiting rank polls, yielding its core, before it sleeps.
        remote_min_bytes: messages of a collective that reduces nothing this large are read
            by their receiver from the sender's memory (0: never).

    Returns:
        The ``_core.Node``.

    Raises:
        ImportError: the core was not built.
        PermissionError, OSError: the directory or a file in it is not this user's alone.
    """
    size = ring_bytes(world_size)
    return core().Node(directory, rank, world_size, size, size // PARTS_PER_RING,
                       int(spin_s * 1e9), remote_min_bytes)


def _program(plan: Plan, dtype_code: int, op_code: int):
    """``plan`` as the core keeps it: its code (``codes.encode_plan``) checked once, a
    ``_core.Program`` that every call of the shape passes with its arrays."""
    return core().Program(codes.encode_plan(plan), dtype_code, op_code)


class NativePlan(NamedTuple):
    """What the core needs of one call shape, prepared once.

    Attributes:
        program: the plan as the core keeps it (``_core.Program``: its code, dtype and op).
        peers: one request per peer the plan talks to (what a failure check asks about).
        call_code: the collective's code on the node's state page (``COLLECTIVE_CODES``).
        buffered: for a list collective that runs on the caller's arrays (``code`` then uses
            no buffer), the plan through the buffer, for a list whose entries overlap; None
            otherwise.
    """

    program: object
    peers: Tuple[SendRequest, ...]
    call_code: int
    buffered: Optional["NativePlan"] = None


class NativeRunner:
    """Runs one rank's collectives on its node's native core.

    Args:
        node: the rank's ``_core.Node``.
        transport: the rank's transport (failures, who came to a call, point-to-point).
        slice_s: the longest the core runs before the rank looks for failures.
        spans_nodes: the group has ranks on other nodes, whose messages go through the
            transport, a call's parts on either way: the runner then records calls through
            the transport (not on the state page from the core), and between slices lets
            the transport take in what arrived, so that a peer's part of another call is a
            mismatch there.
        streams: runs the rounds between nodes in the core where it can (a group that
            spans nodes over TCP streams); None: they run on the Python engine.
    """

    def __init__(self, node, transport: Transport, slice_s: float = SLICE_S,
                 spans_nodes: bool = False, streams: Optional[StreamRounds] = None):
        self.node = node
        self.transport = transport
        self.slice_s = slice_s
        self.spans_nodes = spans_nodes
        self.streams = streams
        # A call with nothing to do (look_for_mismatch).
        nothing = Plan(None, [], [], np.dtype(np.uint8))
        self._no_steps = _program(nothing, codes.dtype_code("uint8"), codes.NO_OP)
        words = None if spans_nodes else transport.rank_words()
        # Where the core records a call's start and end itself, a call it finishes in its
        # first slice costs no Python of the transport's.
        self.core_records_calls = words is not None
        if words is not None:
            node.bind_state(*words)

    def prepare(self, plan: Plan, collective: str, dtype_name: str, op: Optional[ReduceOp],
                lists: Optional[Tuple[str, Blocks, int]] = None) -> NativePlan:
        """The core's form of a call shape's plan.

        Args:
            plan: the recorded plan.
            collective: the collective's name (``Collective.value``).
            dtype_name: the tensor's dtype name.
            op: the reduction (None when the call reduces nothing).
            lists: for a call whose tensors are a list (``(layout, blocks, rank, has_list)``:
                ``"gather"`` for allgather and gather, ``"split"`` for reducescatter and
                scatter's root, ``"receive block"`` for scatter elsewhere, ``"exchange"`` for
                alltoall; ``has_list`` False where gather or scatter has no list), the copies
                between the caller's arrays and the plan's buffers run in the core too: the
                call passes its tensor, then its list, as slots after the plan's (alltoall
                its inputs, then its outputs). A call of large blocks may not need the
                buffer at all (``NativePlan.buffered``).

        Returns:
            The prepared plan.
        """
        peers = tuple(SendRequest(peer) for peer in sorted(
            {message.peer for step in plan.steps if type(step) is not Local
             for message in step}))
        op_code = codes.NO_OP if op is None else codes.op_code(op, dtype_name)
        dtype_code = codes.dtype_code(dtype_name or "uint8")
        call_code = COLLECTIVE_CODES.get(collective, 0)
        if lists is None:
            return NativePlan(_program(plan, dtype_code, op_code), peers, call_code)
        layout, blocks, rank, has_list = lists
        buffered = NativePlan(_program(_with_list_copies(plan, *lists), dtype_code, op_code),
                              peers, call_code)
        direct = None
        if blocks.size(0) * plan.dtype.itemsize >= DIRECT_BLOCK_BYTES:
            direct = (_direct_exchange(plan, blocks) if layout == "exchange"
                      else _direct(plan, layout, blocks, rank, has_list))
        if direct is None:
            return buffered
        return NativePlan(_program(direct, dtype_code, op_code), peers, call_code, buffered)

    def prepare_streams(self, plan: Plan, dtype_name: str, op: Optional[ReduceOp],
                        node_of: Sequence) -> Optional[StreamPlan]:
        """The core's form of a plan's rounds whose peers are all on other nodes than this
        rank's (``engine.stream_rounds``; ``node_of`` gives every rank's node), or None where it has
        none or this rank has no :class:`StreamRounds`."""
        if self.streams is None:
            return None
        here = node_of[self.transport.rank]
        op_code = codes.NO_OP if op is None else codes.op_code(op, dtype_name)
        return stream_rounds.prepare(plan, codes.dtype_code(dtype_name or "uint8"), op_code,
                                     lambda peer: node_of[peer] != here)

    def run(self, native: NativePlan, slots: Sequence[np.ndarray], template: HeaderTemplate,
            seq: int, timeout: float, what: str, tag: int = COLLECTIVE_TAG) -> bool:
        """Run one call to completion, blocking.

        Args:
            native: the call shape's prepared plan.
            slots: the call's arrays (``plan.slots(...)``).
            template: the call shape's header.
            seq: the call's number (of its peer and tag for a send or recv).
            timeout: seconds the whole call may take.
            what: the call's name in a timeout error.
            tag: ``COLLECTIVE_TAG``, or a send's or recv's own tag.

        Returns:
            False; True for a send or recv whose large message was not read in place
            (``REROUTED``): the caller moves it over the transport, as its peer does.

        Raises:
            CollectiveMismatchError: a message differs from what this rank expects.
            CollectiveTimeoutError: the call was still running ``timeout`` seconds after its
                start; it names the ranks that hold it up, when the node knows them.
            PeerDiedError, GroupBrokenError: from the transport's failure check.
        """
        collective = tag == COLLECTIVE_TAG
        stamp = None
        # Only collectives are recorded on the node's state page (numbered alike everywhere).
        if collective and not self.core_records_calls:
            stamp = template.stamp(seq)
            self.transport.arrive(stamp)
        status = self.node.run(native.program, slots, template.packed, seq, tag,
                               native.call_code, self.slice_s)
        return self._finish(status, native, template, seq, timeout, what, tag, stamp)

    def bind(self, native: NativePlan, template: HeaderTemplate, timeout: float, what: str,
             tag: int, tail: Sequence[np.ndarray], no_array: np.ndarray,
             rerouted: Callable[[int, np.ndarray], None]) -> Callable[[int, Any], None]:
        """:meth:`run` of one call shape whose slots are the caller's array and then the same
        arrays every call, bound to its plan, header and deadline: where the core records the
        call itself, one that the core finishes in its first slice runs no other Python.

        Args:
            native: the call shape's prepared plan.
            template: its header.
            timeout: seconds a whole call may take.
            what: the call's name in a timeout error.
            tag: ``COLLECTIVE_TAG``, or a send's or recv's own tag.
            tail: the slots after the caller's array.
            no_array: the first slot of a call whose array is None.
            rerouted: ``rerouted(seq, array)`` moves a send's or recv's message over the
                transport where the core did not (``REROUTED``).

        Returns:
            ``run(seq, array)``, which raises as :meth:`run` does.
        """
        if tag != COLLECTIVE_TAG or not self.core_records_calls:
            def run_slow(seq: int, array) -> None:
                if self.run(native, [no_array if array is None else array, *tail], template,
                            seq, timeout, what, tag):
                    rerouted(seq, array)

            return run_slow
        node_run, program, packed = self.node.run, native.program, template.packed
        call_code, slice_s, finish = native.call_code, self.slice_s, self._finish

        def run_recorded(seq: int, array) -> None:
            status = node_run(program, [no_array if array is None else array, *tail], packed,
                              seq, tag, call_code, slice_s)
            if status != DONE and finish(status, native, template, seq, timeout, what, tag):
                rerouted(seq, array)

        return run_recorded

    def _finish(self, status: int, native: NativePlan, template: HeaderTemplate, seq: int,
                timeout: float, what: str, tag: int, stamp: Optional[CallStamp] = None) -> bool:
        """The rest of :meth:`run` once the core's first slice of the call ended with
        ``status``: the slices until it is done, failure checks between them; ``stamp`` is
        the call's where the transport recorded its start. Returns and raises as
        :meth:`run`."""
        node, transport = self.node, self.transport
        collective = tag == COLLECTIVE_TAG
        if status != DONE and status != REROUTED:
            # The first slice is over: the deadline counts it as if it took all of its time.
            deadline = time.monotonic() + timeout - self.slice_s
            if stamp is None:
                stamp = template.stamp(seq)
                # Names the call in a failure's error.
                if collective:
                    transport.arrive(stamp)
                else:
                    transport.name_call(stamp)
            while status != DONE and status != REROUTED:
                if status == MISMATCH:
                    raise self._mismatch(stamp)
                # A message of this call with another header may wait in a ring this rank
                # never reads from (ranks that disagree about the root): look at them all.
                if node.scan_incoming() == MISMATCH:
                    raise self._mismatch(stamp)
                try:
                    if self.spans_nodes:
                        transport.take_in()
                    transport.check_failures(native.peers)
                    if time.monotonic() >= deadline:
                        absent = transport.absent_ranks(seq) if collective else None
                        raise CollectiveTimeoutError(
                            template.header.group, transport.rank, what, seq,
                            absent or [r.peer for r in native.peers], timeout)
                except BaseException:
                    node.abandon()
                    raise
                status = node.progress(self.slice_s)
        if stamp is not None and collective:
            transport.complete(stamp)
        return status == REROUTED

    def look_for_mismatch(self, stamp: CallStamp) -> None:
        """Raise if a peer on this node sent the call ``stamp`` numbers through the core with
        another header: what a rank that runs the call over the transport (a group that spans
        nodes) looks for while it waits, so that ranks that disagree about the call meet a
        mismatch rather than each other's deadline.

        Raises:
            CollectiveMismatchError: such a frame waits at the head of a ring to this rank.
        """
        node = self.node
        node.start(self._no_steps, [], stamp.packed, COLLECTIVE_TAG)
        if node.scan_incoming() == MISMATCH:
            raise self._mismatch(stamp)  # the core ended the call
        node.abandon()

    def _mismatch(self, stamp: CallStamp):
        details = self.node.mismatch_details()
        expected_step = details["expected_step"]
        expected_count = details["expected_count"]
        if expected_step < 0:
            # Found at the head of a ring before this rank posted any receive from that peer:
            # only the header can be compared.
            expected_step, expected_count = details["step"], details["count"]
        return mismatch(self.transport.rank, details["peer"], stamp, expected_step,
                        expected_count, details["header"], details["step"], details["count"])

    def wake_all(self) -> None:
        """Make every rank of the node that waits in the core look for failures now."""
        self.node.wake_all()

    def close(self) -> None:
        """Release the node (its files go with the group's directory)."""
        self.node.close()
