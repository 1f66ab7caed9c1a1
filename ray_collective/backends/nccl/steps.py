"""How one call's NCCL steps are built: its lane (communicator, stream, event) on each GPU,
the NCCL launches of each collective, and the device copies through scratch memory where NCCL
wants one buffer and the call has a list (allgather, reducescatter).

``StepBuilding`` is the part of ``NcclMembership`` (``backend.py``) that turns a call's record
into :class:`CallSteps`; the membership queues them and waits for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Sequence, Tuple

from ...tensors import TensorView
from ...types import Collective, ReduceOp
from .arguments import GroupCall, MultiGpuCall, device_of
from .bootstrap import CliqueJoin
from .wire import WireFormat, movement_format, reduction_format

_LIST_NAMES = {Collective.ALLTOALL: ("input_tensor_list", "output_tensor_list")}


@dataclass(frozen=True)
class Lane:
    """One communicator on one GPU, with the GPU's dedicated stream and completion event."""

    device: int
    communicator: Any
    stream: int
    done: int


@dataclass
class CallSteps:
    """What one call queues, in order, on the streams of its lanes.

    Attributes:
        lanes: the communicators taking part, one per GPU.
        peers: the ranks a timeout or a peer failure names.
        before: device copies into scratch memory, ahead of the NCCL calls.
        launches: the NCCL calls (grouped when there are several).
        after: device copies out of scratch memory.
        scratch: allocations that must live until the call completes.
    """

    lanes: Tuple[Lane, ...]
    peers: Tuple[int, ...]
    before: List[Callable[[], None]] = field(default_factory=list)
    launches: List[Callable[[], None]] = field(default_factory=list)
    after: List[Callable[[], None]] = field(default_factory=list)
    scratch: List[Any] = field(default_factory=list)


class StepBuilding:
    """The steps of a call on the membership's lanes (mixed into ``NcclMembership``, whose
    library, devices, cliques and rendezvous it uses)."""

    def _steps(self, call: GroupCall) -> CallSteps:
        if isinstance(call, MultiGpuCall):
            return self._steps_multigpu(call)
        collective = call.options.collective
        device = self._device_of_call(call)
        lane = self._single_lane(device, call)
        others = tuple(r for r in range(self.world_size) if r != self.rank)
        peers = (call.options.peer,) if collective in (Collective.SEND, Collective.RECV) \
            else others
        steps = CallSteps((lane,), peers)
        if collective is Collective.BARRIER:
            self._add_barrier(steps, lane)
        else:
            _SINGLE_PLANNERS[collective](self, steps, lane, call)
        return steps

    def _device_of_call(self, call: GroupCall) -> int:
        # The API layer has checked that every tensor of a call shares the first one's kind
        # and device, so the first tells where the call runs.
        for name, view in _named_views(call):
            return device_of(view, self.devices, self.group_name, name)
        return self.devices[0]  # barrier: no tensor; any GPU of the process will do

    def _single_lane(self, device: int, call: GroupCall) -> Lane:
        lane = self._single.get(device)
        if lane is None:
            index = self.devices.index(device)
            join = CliqueJoin(self._rendezvous, self._library, self.group_name, f"gpu{index}",
                              self.world_size, self.rank, [device], call_name(call),
                              call.seq, call.options.timeout)
            communicator = join.run()[0]
            with self._lock:
                self._communicators.append(communicator)
            lane = self._single[device] = self._lane(device, communicator)
        return lane

    def _reduction(self, view: TensorView, op: ReduceOp) -> WireFormat:
        return reduction_format(self._library, view.dtype_name, op)

    def _movement(self, view: TensorView) -> WireFormat:
        return movement_format(self._library, view.dtype_name, view.wire_dtype.itemsize)

    def _add_barrier(self, steps: CallSteps, lane: Lane) -> None:
        # NCCL has no barrier: a one-byte allreduce completes only once every rank has joined.
        scratch = self._barrier_scratch.get(lane.device)
        if scratch is None:
            scratch = self._barrier_scratch[lane.device] = self._library.allocate(lane.device, 1)
        uint8, nccl_max = self._library.constant("NCCL_UINT8"), self._library.constant("NCCL_MAX")
        steps.launches.append(functools.partial(lane.communicator.allReduce, scratch.ptr,
                                               scratch.ptr, 1, uint8, nccl_max, lane.stream))

    def _add_allreduce(self, steps: CallSteps, lane: Lane, view: TensorView,
                       op: ReduceOp) -> None:
        fmt = self._reduction(view, op)
        _add_launch(steps, view, lane.communicator.allReduce, self._ptr(view), self._ptr(view),
                    view.count * fmt.per_element, fmt.datatype, fmt.op, lane.stream)

    def _add_reduce(self, steps: CallSteps, lane: Lane, view: TensorView, op: ReduceOp,
                    root: int) -> None:
        fmt = self._reduction(view, op)
        _add_launch(steps, view, lane.communicator.reduce, self._ptr(view), self._ptr(view),
                    view.count * fmt.per_element, fmt.datatype, fmt.op, root, lane.stream)

    def _add_broadcast(self, steps: CallSteps, lane: Lane, view: TensorView, root: int) -> None:
        fmt = self._movement(view)
        _add_launch(steps, view, lane.communicator.broadcast, self._ptr(view), self._ptr(view),
                    view.count * fmt.per_element, fmt.datatype, root, lane.stream)

    def _allreduce(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        self._add_allreduce(steps, lane, call.tensor, call.options.op)

    def _reduce(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        self._add_reduce(steps, lane, call.tensor, call.options.op, call.options.root)

    def _broadcast(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        self._add_broadcast(steps, lane, call.tensor, call.options.root)

    def _allgather(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        self._gather_through_scratch(steps, lane, call.tensor, call.outputs)

    def _reducescatter(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        self._reduce_scatter_through_scratch(steps, lane, call.inputs, call.tensor,
                                             call.options.op)

    def _point_to_point(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        if call.options.collective is Collective.SEND:
            self._add_send(steps, lane, call.tensor, call.options.peer)
        else:
            self._add_recv(steps, lane, call.tensor, call.options.peer)

    def _gather(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        view, root = call.tensor, call.options.root
        if self.rank != root:
            self._add_send(steps, lane, view, root)
            return
        for peer, output in enumerate(call.outputs):
            if peer == self.rank:
                self._add_copy(steps.before, lane, output, view)
            else:
                self._add_recv(steps, lane, output, peer)

    def _scatter(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        view, root = call.tensor, call.options.root
        if self.rank != root:
            self._add_recv(steps, lane, view, root)
            return
        for peer, part in enumerate(call.inputs):
            if peer == self.rank:
                self._add_copy(steps.before, lane, view, part)
            else:
                self._add_send(steps, lane, part, peer)

    def _alltoall(self, steps: CallSteps, lane: Lane, call: GroupCall) -> None:
        for peer, (part, output) in enumerate(zip(call.inputs, call.outputs, strict=True)):
            if peer == self.rank:
                self._add_copy(steps.before, lane, output, part)
            else:
                self._add_send(steps, lane, part, peer)
                self._add_recv(steps, lane, output, peer)

    def _add_send(self, steps: CallSteps, lane: Lane, view: TensorView, peer: int) -> None:
        fmt = self._movement(view)
        _add_launch(steps, view, lane.communicator.send, self._ptr(view),
                    view.count * fmt.per_element, fmt.datatype, peer, lane.stream)

    def _add_recv(self, steps: CallSteps, lane: Lane, view: TensorView, peer: int) -> None:
        fmt = self._movement(view)
        _add_launch(steps, view, lane.communicator.recv, self._ptr(view),
                    view.count * fmt.per_element, fmt.datatype, peer, lane.stream)

    def _add_copy(self, steps: List[Callable[[], None]], lane: Lane, destination: TensorView,
                  source: TensorView) -> None:
        nbytes = _nbytes(source)
        if nbytes:
            steps.append(functools.partial(self._library.copy, self._ptr(destination),
                                           self._ptr(source), nbytes, lane.stream))

    def _gather_through_scratch(self, steps: CallSteps, lane: Lane, source: TensorView,
                                outputs: Sequence[TensorView]) -> None:
        nbytes = _nbytes(source)
        if not nbytes:
            return
        fmt = self._movement(source)
        scratch = self._library.allocate(lane.device, nbytes * len(outputs))
        steps.scratch.append(scratch)
        steps.launches.append(functools.partial(
            lane.communicator.allGather, self._ptr(source), scratch.ptr,
            source.count * fmt.per_element, fmt.datatype, lane.stream))
        for i, output in enumerate(outputs):
            steps.after.append(functools.partial(self._library.copy, self._ptr(output),
                                                scratch.ptr + i * nbytes, nbytes, lane.stream))

    def _reduce_scatter_through_scratch(self, steps: CallSteps, lane: Lane,
                                        inputs: Sequence[TensorView], output: TensorView,
                                        op: ReduceOp) -> None:
        nbytes = _nbytes(output)
        fmt = self._reduction(output, op)
        if not nbytes:
            return
        scratch = self._library.allocate(lane.device, nbytes * len(inputs))
        steps.scratch.append(scratch)
        for i, part in enumerate(inputs):
            steps.before.append(functools.partial(self._library.copy, scratch.ptr + i * nbytes,
                                                 self._ptr(part), nbytes, lane.stream))
        steps.launches.append(functools.partial(
            lane.communicator.reduceScatter, scratch.ptr, self._ptr(output),
            output.count * fmt.per_element, fmt.datatype, fmt.op, lane.stream))

    def _ptr(self, view: TensorView) -> int:
        return self._library.pointer(view)

    # ------------------------------------------------------------ multi-GPU steps

    def _steps_multigpu(self, call: MultiGpuCall) -> CallSteps:
        options = call.options
        gpus = len(self.devices)
        if options.collective in (Collective.SEND, Collective.RECV):
            view = call.device_tensors[0]
            lane = self._main[self.devices.index(int(view.device.split(":", 1)[1]))]
            steps = CallSteps((lane,), (options.peer,))
            fmt = self._movement(view)
            nccl_call = (lane.communicator.send if options.collective is Collective.SEND
                         else lane.communicator.recv)
            if call.n_elements:
                steps.launches.append(functools.partial(
                    nccl_call, self._ptr(view), call.n_elements * fmt.per_element,
                    fmt.datatype, options.peer * gpus + call.peer_index, lane.stream))
            return steps
        steps = CallSteps(self._main, tuple(r for r in range(self.world_size) if r != self.rank))
        # GPU i of rank r is NCCL rank r * gpus + i of the main clique.
        root = options.root * gpus + call.root_index
        for i, (lane, view) in enumerate(zip(self._main, call.device_tensors, strict=True)):
            if options.collective is Collective.ALLGATHER:
                self._gather_through_scratch(steps, lane, view, call.device_lists[i])
            elif options.collective is Collective.REDUCESCATTER:
                self._reduce_scatter_through_scratch(steps, lane, call.device_lists[i], view,
                                                     options.op)
            elif options.collective is Collective.BROADCAST:
                self._add_broadcast(steps, lane, view, root)
            elif options.collective is Collective.REDUCE:
                self._add_reduce(steps, lane, view, options.op, root)
            else:
                self._add_allreduce(steps, lane, view, options.op)
        return steps


def _add_launch(steps: CallSteps, view: TensorView, nccl_call: Callable, *args: Any) -> None:
    # An empty tensor moves nothing; every rank holds the same shape, so all skip alike.
    if view.count:
        steps.launches.append(functools.partial(nccl_call, *args))


def _nbytes(view: TensorView) -> int:
    return view.count * view.wire_dtype.itemsize


def call_name(call: GroupCall) -> str:
    name = call.options.collective.value
    return f"{name}_multigpu" if isinstance(call, MultiGpuCall) else name


def _named_views(call: GroupCall) -> Iterator[Tuple[str, TensorView]]:
    inputs_name, outputs_name = _LIST_NAMES.get(call.options.collective,
                                                ("tensor_list", "tensor_list"))
    if call.tensor is not None:
        yield "tensor", call.tensor
    for i, view in enumerate(call.inputs):
        yield f"{inputs_name}[{i}]", view
    for i, view in enumerate(call.outputs):
        yield f"{outputs_name}[{i}]", view


def views_of(call: GroupCall) -> Iterator[TensorView]:
    for _, view in _named_views(call):
        yield view
    if isinstance(call, MultiGpuCall):
        yield from call.device_tensors
        for views in call.device_lists:
            yield from views


_SINGLE_PLANNERS = {
    Collective.ALLREDUCE: StepBuilding._allreduce,
    Collective.REDUCE: StepBuilding._reduce,
    Collective.BROADCAST: StepBuilding._broadcast,
    Collective.ALLGATHER: StepBuilding._allgather,
    Collective.REDUCESCATTER: StepBuilding._reducescatter,
    Collective.GATHER: StepBuilding._gather,
    Collective.SCATTER: StepBuilding._scatter,
    Collective.ALLTOALL: StepBuilding._alltoall,
    Collective.SEND: StepBuilding._point_to_point,
    Collective.RECV: StepBuilding._point_to_point,
}
