"""A backend made of a transport and the transport-free algorithms.

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

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..algorithms.core import Blocks, Context, Team, Topology
from ..algorithms.selector import chooser, forced_algorithms, select
from ..executor import run_plan
from ..plan import Plan, point_to_point, record
from ..tensors import TensorView, combiner, finalize_average
from ..transport.base import COLLECTIVE_CHANNEL, Transport, p2p_channel
from ..transport.wire import CallHeader, HeaderTemplate
from ..types import Collective, ReduceOp
from .base import CollectiveBackend, GroupCall, node_map_or_none

_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCESCATTER)
_GATHERING = (Collective.ALLGATHER, Collective.GATHER)
_POINT_TO_POINT = (Collective.SEND, Collective.RECV)

PLAN_CACHE_SIZE = 64
"""Call shapes a group keeps prepared; the oldest is dropped beyond this."""


class PreparedCall:
    """What every call of one shape shares.

    Attributes:
        plan: the recorded algorithm.
        template: the packed header, stamped per call.
        combine: the reduction (reducing collectives), else None.
        blocks: the partition of the plan's buffer into one block per rank.
    """

    __slots__ = ("plan", "template", "combine", "blocks")

    def __init__(self, plan: Plan, template: HeaderTemplate, combine, blocks: Blocks):
        self.plan = plan
        self.template = template
        self.combine = combine
        self.blocks = blocks


def _concatenate(views: Sequence[TensorView]) -> np.ndarray:
    return np.concatenate([v.array for v in views])


def _scatter_blocks(buf: np.ndarray, blocks: Blocks, views: Sequence[TensorView]) -> None:
    for i, view in enumerate(views):
        np.copyto(view.array, blocks.view(buf, i))


class TransportBackend(CollectiveBackend):
    """Runs every collective as a recorded algorithm over ``transport``.

    Args:
        group_name: the group's name (headers, errors).
        transport: this rank's transport.
        epoch: the group's incarnation; a re-created group with the same name gets a new one,
            so stale messages of the old one are recognised.
        node_of: node id of every rank, or None when all ranks share one node.
        oversubscribed: some node runs more ranks than it has cores (the selector then
            prefers algorithms with fewer messages).
        forced: the algorithm forced per collective; None reads ``RAY_COLLECTIVE_ALGORITHM``.

    Raises:
        ValueError: ``RAY_COLLECTIVE_ALGORITHM`` is malformed.
    """

    def __init__(self, group_name: str, transport: Transport, epoch: int = 0,
                 node_of: Optional[Sequence] = None, oversubscribed: bool = False,
                 forced: Optional[Mapping[str, str]] = None):
        self.group_name = group_name
        self.transport = transport
        self.epoch = epoch
        self.node_of = node_map_or_none(node_of)
        self.topology = Topology.from_node_of(self.node_of) if self.node_of else None
        self.oversubscribed = oversubscribed
        self.forced = forced_algorithms() if forced is None else forced
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._prepared: Dict[Tuple, PreparedCall] = {}

    def run(self, call: GroupCall) -> None:
        options = call.options
        collective = options.collective
        reference = call.tensor if call.tensor is not None else (
            call.inputs[0] if call.inputs else call.outputs[0] if call.outputs else None)
        if reference is None:
            key = (collective, options.peer, options.root, options.op, options.algorithm,
                   "", ())
        else:
            key = (collective, options.peer, options.root, options.op, options.algorithm,
                   reference.dtype_name, reference.shape)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepare(call, reference)
            if len(self._prepared) >= PLAN_CACHE_SIZE:
                del self._prepared[next(iter(self._prepared))]
            self._prepared[key] = prepared
        stamp = prepared.template.stamp(call.seq)
        if collective in _POINT_TO_POINT:
            run_plan(prepared.plan, prepared.plan.slots(reference.array), self.transport,
                     p2p_channel(options.tag), stamp, None, options.timeout, collective.value)
            return
        self._collective(call, prepared, stamp)

    def prepared_calls(self) -> int:
        """How many call shapes this membership keeps prepared."""
        return len(self._prepared)

    def _prepare(self, call: GroupCall, reference: Optional[TensorView]) -> PreparedCall:
        """Select, record and pack what every call of ``call``'s shape needs."""
        options = call.options
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
            return PreparedCall(plan, HeaderTemplate(header), None, blocks)
        algorithm = select(collective.value, count, dtype.itemsize, p, self.node_of,
                           forced=options.algorithm or self.forced.get(collective.value),
                           oversubscribed=self.oversubscribed, topology=self.topology)
        ctx = Context(dtype, combine, node_of=self.node_of, choose=chooser(dtype.itemsize),
                      topology=self.topology)
        length = p * count if collective not in (Collective.ALLREDUCE, Collective.REDUCE,
                                                 Collective.BROADCAST) else count
        plan = record(algorithm, Team.world(p, rank), dtype, length, blocks, options.root, ctx)
        header = CallHeader(self.group_name, self.epoch, 0, collective.value, algorithm.name,
                            dtype_name, count, shape, options.root, op)
        return PreparedCall(plan, HeaderTemplate(header), combine, blocks)

    def _collective(self, call: GroupCall, prepared: PreparedCall, stamp) -> None:
        options = call.options
        collective = options.collective
        blocks = prepared.blocks
        rank, root = self.rank, options.root
        tensor = call.tensor.array if call.tensor is not None else None
        recvbuf = None
        if collective in _GATHERING:
            buf = np.empty(blocks.total, prepared.plan.dtype)
            np.copyto(blocks.view(buf, rank), tensor)
        elif collective in (Collective.REDUCESCATTER, Collective.ALLTOALL) or (
                collective is Collective.SCATTER and rank == root):
            buf = _concatenate(call.inputs)
        elif collective is Collective.SCATTER:
            buf = np.empty(blocks.total, prepared.plan.dtype)
        else:
            buf = tensor
        if collective is Collective.ALLTOALL:
            recvbuf = np.empty(blocks.total, prepared.plan.dtype)
        run_plan(prepared.plan, prepared.plan.slots(buf, recvbuf), self.transport,
                 COLLECTIVE_CHANNEL, stamp, prepared.combine, options.timeout, collective.value)
        if collective in _GATHERING:
            _scatter_blocks(buf, blocks, call.outputs)
        elif collective is Collective.ALLTOALL:
            _scatter_blocks(recvbuf, blocks, call.outputs)
        elif collective in (Collective.REDUCESCATTER, Collective.SCATTER):
            np.copyto(tensor, blocks.view(buf, rank))
        if options.op is ReduceOp.AVG:
            if collective is not Collective.REDUCE or rank == root:
                finalize_average(call.tensor.array, call.tensor.dtype_name, self.world_size)

    def abort(self, error: BaseException) -> None:
        self.transport.abort(error)

    def close(self) -> None:
        self.transport.close()
