"""The CPU engine: a membership that runs the transport-free algorithms over a transport.

What a call needs beyond its data depends only on its shape (the collective, element count,
dtype, shape, op, root, forced algorithm; peer for send and recv): the algorithm the selector
picks, its recorded plan (``plan.py``), the combiner and the packed header. All of it is derived
once per group and shape and kept (a bounded cache), so that a call only lays the caller's
tensors out as the plan's buffers, stamps the header with its sequence number, replays the plan
over the transport (``executor``) and writes the results back. The environment and the topology
are read once per group. The in-process backend (tests) and the Ray backend differ only in the
transport they give it.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..algorithms.catalog import flat_choice
from ..algorithms.core import Blocks, Context, Team, Topology
from ..algorithms.selector import forced_algorithms, select
from ..backends.base import CallViews, Membership, PreparedCall, node_map_or_none
from ..reductions import combiner, finalize_average
from ..tensors import TensorView, known_shape_input
from ..transport.base import COLLECTIVE_TAG, Transport
from ..transport.wire import CallHeader, HeaderTemplate
from ..types import CallOptions, Collective, ReduceOp
from .executor import run_plan
from .native_runner import SLICE_S, NativePlan, NativeRunner, entries_overlap
from .plan import KEEP_SCRATCH_BYTES, Local, Plan, point_to_point, record
from .stream_rounds import StreamPlan

_log = logging.getLogger(__name__)

_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCESCATTER)
_GATHERING = (Collective.ALLGATHER, Collective.GATHER)
_POINT_TO_POINT = (Collective.SEND, Collective.RECV)
_LISTS = (Collective.ALLGATHER, Collective.REDUCESCATTER, Collective.ALLTOALL)
"""Collectives whose list (alltoall: lists) is on every rank."""
_LISTS_IN_CORE = _LISTS + (Collective.GATHER, Collective.SCATTER)
"""Collectives whose tensors are copied to and from the plan's buffers in C on the native core
(``NativeRunner.prepare``); gather and scatter have their list on the root only."""
_LIST_LAYOUTS = ("gather", "split", "receive block", "exchange")

CUT_BY_WAY = ("hierarchical", "hierarchical_sharded")
"""The node-aware algorithms whose plans a group on the native core across nodes cuts into runs
of rounds within a node (on the core) and between nodes (over the transport): none of their
rounds has peers both ways (``tests/test_plan.py``). The decision goes by the algorithm alone,
so every rank takes it alike. ``hierarchical_pipeline`` is not among them: a leader forwards a
chunk to the next node and to its node-mates in one round, so it runs over the transport."""


class PlannedCall(PreparedCall):
    """A call shape prepared on a transport: what every call of the shape shares, and its
    ``run`` (see :class:`~ray_collective.backends.base.PreparedCall`).

    Attributes:
        options: the options the call shape was prepared for.
        plan: the recorded algorithm.
        template: the packed header, stamped per call.
        combine: the reduction (reducing collectives), else None.
        blocks: the partition of the plan's buffer into one block per rank.
        tag: the messages' tag (``COLLECTIVE_TAG``, or the send/recv's own).
        layout: how the call's tensors become the plan's buffer and back (see ``_layout``).
        average: divide the result by the world size at the end (AVG, on ranks that get one).
        native: the plan in the native core's form, where the membership runs its collectives
            there (None: the executor runs it over the transport). A send or recv on the core
            whose message was not read in place then runs ``plan`` over the transport.
        kept_buffer: a list collective's buffer on the native core (alltoall's send buffer
            followed by its receive buffer), kept from call to call when it is small (calls
            of one group run one at a time), else None.
        segments: for an algorithm of ``CUT_BY_WAY`` in a group on the native core that spans
            nodes, the plan cut where its rounds change way: ``(core plan, None, None)`` for
            a run of rounds with this node's ranks, ``(None, plan, stream plan)`` for one with
            other nodes' ranks (over the transport, its rounds in the core where their streams
            allow: ``engine.stream_rounds``; the stream plan None where the group has no streams);
            the local steps go with the rounds before them. None otherwise.
        on_streams: for any other plan run over the transport in a group on the native core
            that spans nodes, its rounds between nodes in the core's form
            (``engine.stream_rounds``), or None.
    """

    __slots__ = ("plan", "template", "combine", "blocks", "tag", "layout", "average", "native",
                 "kept_buffer", "segments", "on_streams")

    def __init__(self, options: CallOptions, plan: Plan, template: HeaderTemplate, combine,
                 blocks: Blocks, tag: int, layout: str, average: bool,
                 native: Optional[NativePlan] = None,
                 segments: Optional[Tuple[Tuple[Optional[NativePlan], Optional[Plan],
                                                Optional[StreamPlan]], ...]] = None,
                 on_streams: Optional[StreamPlan] = None):
        super().__init__(options)
        self.plan = plan
        self.template = template
        self.combine = combine
        self.blocks = blocks
        self.tag = tag
        self.layout = layout
        self.average = average
        self.native = native
        self.segments = segments
        self.on_streams = on_streams
        self.kept_buffer = None
        if (native is not None and options.collective in _LISTS_IN_CORE
                and blocks.total * plan.dtype.itemsize <= KEEP_SCRATCH_BYTES):
            self.kept_buffer = self._new_buffer()

    def _new_buffer(self) -> np.ndarray:
        """A list collective's buffer: alltoall's holds its send and its receive buffer."""
        return np.empty(self.blocks.total * (2 if self.layout == "exchange" else 1),
                        self.plan.dtype)

    def buffers(self, buffer: Optional[np.ndarray]) -> List[np.ndarray]:
        """The plan's slots on the list collective's ``buffer`` (one holding the send and the
        receive buffer for alltoall); None: on the core's kept buffer, or a fresh one."""
        if buffer is None:
            buffer = self.kept_buffer
        total = self.blocks.total
        if buffer is None:
            buffer = self._new_buffer()
        if self.layout == "exchange":
            return self.plan.slots(buffer[:total], buffer[total:])
        return self.plan.slots(buffer)

    def describe(self) -> Tuple[str, Tuple[int, ...]]:
        peers = {message.peer for step in self.plan.steps if type(step) is not Local
                 for message in step}
        return self.template.header.algorithm, tuple(sorted(peers))


def _layout(collective: Collective, rank: int, root: int) -> str:
    """How a call lays its tensors out as the plan's buffer:

    - ``"in place"``: the tensor itself (allreduce, reduce, broadcast, barrier, send, recv);
    - ``"gather"``: a fresh buffer holding this rank's tensor in its block, split into the
      outputs afterwards (allgather, gather);
    - ``"split"``: the inputs concatenated, this rank's block copied into the tensor afterwards
      (reducescatter, scatter on the root);
    - ``"receive block"``: a fresh buffer, this rank's block copied into the tensor (scatter
      elsewhere);
    - ``"exchange"``: the inputs concatenated, received into a fresh buffer that is split into
      the outputs (alltoall).
    """
    if collective in _GATHERING:
        return "gather"
    if collective is Collective.REDUCESCATTER or (collective is Collective.SCATTER
                                                  and rank == root):
        return "split"
    if collective is Collective.SCATTER:
        return "receive block"
    if collective is Collective.ALLTOALL:
        return "exchange"
    return "in place"


def _nothing_to_run(seq: int, array) -> None:
    return None


def _scatter_blocks(buf: np.ndarray, blocks: Blocks, outputs: Sequence[np.ndarray]) -> None:
    for i, output in enumerate(outputs):
        np.copyto(output, blocks.view(buf, i))


def _in_place_run(membership: "TransportMembership", prepared: PlannedCall,
                  view: Optional[TensorView]) -> Callable[[int, Any], None]:
    """The ``run`` of an allreduce, reduce, broadcast, barrier, send or recv shape: the
    plan on the caller's array itself (any C-contiguous shape)."""
    plan, template = prepared.plan, prepared.template
    if not plan.steps and membership.world_size == 1:
        # Nothing to send, and no one to tell that this rank came (AVG of one is itself).
        return _nothing_to_run
    options = prepared.options
    timeout, what = options.timeout, options.collective.value
    average, world_size, tag = prepared.average, membership.world_size, prepared.tag
    dtype_name = "" if view is None else view.dtype_name
    run_on_transport = membership._run_on_transport
    native, native_run = prepared.native, membership.native and membership.native.run
    tail = plan.fixed_tail()
    if native is not None and tail is not None and not average:
        # The core takes the caller's array as it is: no reshape, and the slots after it are
        # the same every call.
        def rerouted(seq: int, array) -> None:
            run_on_transport(prepared, plan.slots(array.reshape(-1)), template.stamp(seq))

        return membership.native.bind(native, template, timeout, what, tag, tail,
                                      plan.slots(None)[0], rerouted)

    def run(seq: int, array) -> None:
        flat = None if array is None else array.reshape(-1)
        if native is not None:
            slots = plan.slots(flat)
            if native_run(native, slots, template, seq, timeout, what, tag):
                run_on_transport(prepared, slots, template.stamp(seq))
        else:
            run_on_transport(prepared, plan.slots(flat), template.stamp(seq))
        if average:
            finalize_average(flat, dtype_name, world_size)

    return run


def _wire_input(view: Optional[TensorView], layout: str) -> Optional[Callable[[Any], Any]]:
    """What turns a call's arrays into numpy arrays of the wire dtype where the caller's
    tensors are not (a torch CPU tensor of the known-shape path, a numpy bfloat16 array: its
    bits as uint16), or None where they are. Arrays already in that form pass unchanged."""
    if view is None or view.device != "cpu":
        return None
    to_numpy = known_shape_input(view)
    if to_numpy is not None and layout == "in place":
        return lambda tensor: tensor if type(tensor) is np.ndarray else to_numpy(tensor)
    if view.kind != "numpy" or view.dtype_name != "bfloat16":
        return None
    wire = view.wire_dtype
    if layout == "in place":
        return lambda array: array.view(wire)
    if layout == "exchange":
        return lambda arrays: ([a.view(wire) for a in arrays[0]],
                               [a.view(wire) for a in arrays[1]])
    # Off their root, gather and scatter may be given no list (None): it is not used there.
    return lambda arrays: (arrays[0].view(wire), arrays[1] and [a.view(wire) for a in arrays[1]])


def _list_run(membership: "TransportMembership", prepared: PlannedCall, dtype_name: str):
    """The ``run`` of allgather or gather (``(tensor, outputs)``), reducescatter or scatter
    (``(tensor, inputs)``), or alltoall (``(inputs, outputs)``) calls of one shape on
    ``membership``; gather and scatter ignore the list except at their root, as the full path
    does."""
    template, layout = prepared.template, prepared.layout
    average, world_size = prepared.average, membership.world_size
    execute = membership._execute
    options = prepared.options
    uses_list = options.collective in _LISTS or options.root == membership.rank
    native, kept = prepared.native, prepared.kept_buffer
    if native is not None and native.buffered is None and kept is not None:
        # A small call on the native core: the core takes the arrays as they are (any
        # C-contiguous shape) and copies them to and from the kept buffer.
        head, native_run = prepared.buffers(kept), membership.native.run
        timeout, what = options.timeout, options.collective.value
        if layout == "exchange":
            def exchange_in_core(seq: int, arrays) -> None:
                inputs, outputs = arrays
                native_run(native, [*head, *inputs, *outputs], template, seq, timeout, what)

            return exchange_in_core

        def run_in_core(seq: int, arrays) -> None:
            tensor, others = arrays
            native_run(native, [*head, tensor, *others] if uses_list else [*head, tensor],
                       template, seq, timeout, what)
            if average:
                finalize_average(tensor.reshape(-1), dtype_name, world_size)

        return run_in_core

    if layout == "exchange":
        def exchange(seq: int, arrays) -> None:
            inputs, outputs = arrays
            execute(prepared, template.stamp(seq), None,
                    [array.reshape(-1) for array in inputs],
                    [array.reshape(-1) for array in outputs])

        return exchange

    def run(seq: int, arrays) -> None:
        tensor, others = arrays
        flat = tensor.reshape(-1)
        others = [array.reshape(-1) for array in others] if uses_list else ()
        if layout == "gather":
            execute(prepared, template.stamp(seq), flat, (), others)
        else:
            execute(prepared, template.stamp(seq), flat, others, ())
        if average:
            finalize_average(flat, dtype_name, world_size)

    return run


def _segments(plan: Plan, node_of: Sequence, rank: int, on_core: Callable[[Plan], NativePlan],
              on_streams: Callable[[Plan], Optional[StreamPlan]]
              ) -> Tuple[Tuple[Optional[NativePlan], Optional[Plan], Optional[StreamPlan]],
                         ...]:
    """``plan`` of an algorithm of ``CUT_BY_WAY`` cut where its rounds change way
    (``PlannedCall.segments``). Every member of the group cuts its plan alike: a message
    between two ranks of a node goes through the core, one between nodes through the
    transport, on both ends. These algorithms never mix the two in a round (a test
    checks it over many layouts); a round that did would raise here. ``on_core`` prepares a
    run of rounds for the core, ``on_streams`` one between nodes."""
    here = node_of[rank]
    runs: List[Tuple[bool, list]] = []
    leading: list = []  # local steps before the first round
    for step in plan.steps:
        if type(step) is Local:
            (runs[-1][1] if runs else leading).append(step)
            continue
        ways = {node_of[message.peer] == here for message in step}
        if len(ways) != 1:
            raise RuntimeError(f"{plan.algorithm.name}: a round of rank {rank} has peers "
                               f"on its node and on others")
        within = ways.pop()
        if runs and runs[-1][0] == within:
            runs[-1][1].append(step)
        else:
            runs.append((within, leading + [step]))
            leading = []
    if leading:
        runs.append((False, leading))
    segments = []
    for within, steps in runs:
        part = plan.part(steps)
        segments.append((on_core(part), None, None) if within
                        else (None, part, on_streams(part)))
    return tuple(segments)


def _in_core(native: Optional[NativeRunner], on_streams: Optional[StreamPlan], tag: int,
             watch: Optional[Callable[[], None]]):
    """``run_plan``'s ``rounds`` for a plan whose rounds between nodes are ``on_streams`` (the
    core runs them where their streams allow), or None where there are none."""
    if on_streams is None:
        return None
    return functools.partial(native.streams.run, on_streams, tag=tag, watch=watch)


class TransportMembership(Membership):
    """Runs every collective as a recorded algorithm over ``transport``.

    Args:
        group_name: the group's name (headers, errors).
        transport: this rank's transport.
        epoch: the group's incarnation; a re-created group with the same name gets a new one,
            so stale messages of the old one are recognised.
        node_of: node id of every rank, or None when all ranks share one node.
        oversubscribed: some machine runs more ranks than it has cores (the selector then
            prefers algorithms with fewer messages).
        forced: the algorithm forced per collective; None reads ``RAY_COLLECTIVE_ALGORITHM``.
        native: runs the collectives on the node's native core (every rank of the group with
            the core); None: the executor runs every plan over ``transport``, the pure-Python
            engine. In a group on one node every collective runs on the core; in one that
            spans nodes, only the node-aware algorithms' rounds between this node's ranks do
            (``PlannedCall.segments``), the rest over the transport. Point-to-point calls
            between nodes take the transport; within a node a large one that its receiver
            does not read in place goes over the transport after the core
            (``NativeRunner.run`` returns True on both sides).

    Raises:
        ValueError: ``RAY_COLLECTIVE_ALGORITHM`` is malformed.
    """

    def __init__(self, group_name: str, transport: Transport, epoch: int = 0,
                 node_of: Optional[Sequence] = None, oversubscribed: bool = False,
                 forced: Optional[Mapping[str, str]] = None,
                 native: Optional[NativeRunner] = None):
        self.group_name = group_name
        self.transport = transport
        self.epoch = epoch
        self.node_of = node_map_or_none(node_of)
        self.topology = Topology.from_node_of(self.node_of) if self.node_of else None
        self.oversubscribed = oversubscribed
        self.forced = forced_algorithms() if forced is None else forced
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.native = native

    def prepare(self, options: CallOptions, views: CallViews) -> PlannedCall:
        """Select, record and pack what every call of this shape needs, and how one runs.

        Its ``run`` also takes the caller's own torch CPU tensor (allreduce, reduce,
        broadcast) or numpy bfloat16 arrays, where the shape was prepared on one: it takes
        their numpy memory, or the wire view of the bfloat16 bits, as the full path does.
        """
        reference = views.reference()
        prepared = self._prepare(options, reference)
        if prepared.layout in _LIST_LAYOUTS:
            run = _list_run(self, prepared, reference.dtype_name)
        else:
            run = _in_place_run(self, prepared, reference)
        to_wire = _wire_input(reference, prepared.layout)
        if to_wire is not None:
            inner = run

            def run(seq: int, arrays) -> None:
                inner(seq, to_wire(arrays))
        prepared.run = run
        return prepared

    def _prepare(self, options: CallOptions, reference: Optional[TensorView]) -> PlannedCall:
        """Select, record and pack what every call of this shape needs."""
        collective = options.collective
        p, rank = self.world_size, self.rank
        if reference is None:
            dtype, count, dtype_name, shape = np.dtype(np.uint8), 0, "", ()
        else:
            dtype, count = reference.wire_dtype, reference.count
            dtype_name, shape = reference.dtype_name, tuple(reference.shape)
        reducing = collective in _REDUCING
        combine = combiner(options.op, dtype_name) if reducing else None
        blocks = Blocks.uniform(count, p)
        op = options.op.name if reducing else ""
        if collective in _POINT_TO_POINT:
            plan = point_to_point(collective is Collective.SEND, options.peer, count, dtype)
            header = CallHeader(self.group_name, self.epoch, 0, "send/recv", "direct",
                                dtype_name, count, shape)
            native = on_streams = None
            # Between nodes a send or recv takes the transport (its stream in the core where
            # it can: engine.stream_rounds).
            if self.native is not None and (
                    self.node_of is None or self.node_of[options.peer] == self.node_of[rank]):
                native = self.native.prepare(plan, collective.value, dtype_name, None)
            elif self.native is not None:
                on_streams = self.native.prepare_streams(plan, dtype_name, None, self.node_of)
            return PlannedCall(options, plan, HeaderTemplate(header), None, blocks,
                                options.tag, "in place", False, native, on_streams=on_streams)
        algorithm = select(collective.value, count, dtype.itemsize, p, self.node_of,
                           forced=self.forced.get(collective.value),
                           oversubscribed=self.oversubscribed, topology=self.topology,
                           nodes_in_core=self.native is not None)
        _log.debug("group %r rank %d: %s of %d %s on %d ranks (root %s): algorithm %s%s",
                   self.group_name, rank, collective.value, count, dtype_name, p, options.root,
                   algorithm.name, " (forced)" if collective.value in self.forced else "")
        ctx = Context(dtype, combine, node_of=self.node_of,
                      choose=flat_choice(dtype.itemsize, self.oversubscribed),
                      topology=self.topology, oversubscribed=self.oversubscribed)
        length = p * count if collective not in (Collective.ALLREDUCE, Collective.REDUCE,
                                                 Collective.BROADCAST) else count
        plan = record(algorithm, Team.world(p, rank), dtype, length, blocks, options.root, ctx)
        header = CallHeader(self.group_name, self.epoch, 0, collective.value, algorithm.name,
                            dtype_name, count, shape, options.root, op)
        average = options.op is ReduceOp.AVG and reducing and (
            collective is not Collective.REDUCE or rank == options.root)
        layout = _layout(collective, rank, options.root)
        lists = None
        if collective in _LISTS_IN_CORE:
            lists = (layout, blocks, rank, collective in _LISTS or rank == options.root)
        native = segments = None
        op_or_none = options.op if reducing else None
        if self.native is not None and self.node_of is None:
            native = self.native.prepare(plan, collective.value, dtype_name, op_or_none, lists)
        elif self.native is not None and algorithm.name in CUT_BY_WAY:
            segments = _segments(
                plan, self.node_of, rank,
                lambda part: self.native.prepare(part, collective.value, dtype_name,
                                                 op_or_none),
                lambda part: self.native.prepare_streams(part, dtype_name, op_or_none,
                                                         self.node_of))
        on_streams = None
        if self.native is not None and self.node_of is not None and segments is None:
            on_streams = self.native.prepare_streams(plan, dtype_name, op_or_none, self.node_of)
        return PlannedCall(options, plan, HeaderTemplate(header), combine, blocks,
                            COLLECTIVE_TAG, layout, average, native, segments=segments,
                            on_streams=on_streams)

    def _execute(self, prepared: PlannedCall, stamp, tensor: Optional[np.ndarray],
                 inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        """Lay a call's flat arrays out as its plan's buffers, run the plan, and write the
        results back (see ``_layout``); AVG's division is the caller's."""
        options = prepared.options
        plan, blocks, layout = prepared.plan, prepared.blocks, prepared.layout
        if prepared.native is not None and options.collective in _LISTS_IN_CORE:
            # The core copies the tensors and the lists to and from the buffers itself, or
            # needs no buffer (large blocks, and written arrays that overlap nothing).
            if layout == "exchange":
                arrays, written, read = [*inputs, *outputs], outputs, inputs
            elif layout == "gather":
                arrays, written, read = [tensor, *outputs], outputs, ()
            else:
                # Where the list is an input, the tensor is written while entries are sent.
                arrays, written, read = [tensor, *inputs], [tensor], inputs
            native, slots = prepared.native, plan.slots(None)
            if native.buffered is None or entries_overlap(written, read):
                native = native.buffered or native
                slots = prepared.buffers(None)
            self.native.run(native, slots + arrays, prepared.template, stamp.seq,
                            options.timeout, options.collective.value)
            return
        recvbuf = None
        if layout == "in place":
            buf = tensor
        elif layout == "gather":
            buf = np.empty(blocks.total, plan.dtype)
            np.copyto(blocks.view(buf, self.rank), tensor)
        elif layout == "receive block":
            buf = np.empty(blocks.total, plan.dtype)
        else:
            buf = np.concatenate(inputs)
            if layout == "exchange":
                recvbuf = np.empty(blocks.total, plan.dtype)
        if prepared.native is not None:
            slots = plan.slots(buf, recvbuf)
            if self.native.run(prepared.native, slots, prepared.template, stamp.seq,
                               options.timeout, options.collective.value, prepared.tag):
                self._run_on_transport(prepared, slots, stamp)  # a send or recv rerouted
        else:
            self._run_on_transport(prepared, plan.slots(buf, recvbuf), stamp)
        if layout == "gather":
            _scatter_blocks(buf, blocks, outputs)
        elif layout == "exchange":
            _scatter_blocks(recvbuf, blocks, outputs)
        elif layout != "in place":
            np.copyto(tensor, blocks.view(buf, self.rank))

    def _run_on_transport(self, prepared: PlannedCall, slots: Sequence[np.ndarray],
                          stamp) -> None:
        """Run a call's plan over the transport (the Python engine); or run its segments,
        each on its way, one after the other within the call's deadline."""
        options = prepared.options
        timeout, what = options.timeout, options.collective.value
        native, watch, watch_every_s = self.native, None, SLICE_S
        if native is not None and self.node_of is not None and prepared.tag == COLLECTIVE_TAG:
            # A peer on this node that runs another call may have sent its part through the
            # core, where the transport never looks.
            watch = functools.partial(native.look_for_mismatch, stamp)
            watch_every_s = native.slice_s
        if prepared.segments is not None:
            deadline = time.monotonic() + timeout
            for core_plan, part, on_streams in prepared.segments:
                left = max(0.0, deadline - time.monotonic())
                if core_plan is not None:
                    native.run(core_plan, slots, prepared.template, stamp.seq, left, what,
                               prepared.tag)
                    continue
                run_plan(part, slots, self.transport, prepared.tag, stamp, prepared.combine,
                         left, what, watch, watch_every_s,
                         _in_core(native, on_streams, prepared.tag, watch))
            return
        run_plan(prepared.plan, slots, self.transport, prepared.tag, stamp, prepared.combine,
                 timeout, what, watch, watch_every_s,
                 _in_core(native, prepared.on_streams, prepared.tag, watch))

    def abort(self, error: BaseException) -> None:
        self.transport.abort(error)
        if self.native is not None:
            self.native.wake_all()  # its ranks wait in the core, not in the transport's poll

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        self.transport.close()
