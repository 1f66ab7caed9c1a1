"""A backend made of a transport and the transport-free algorithms.

For each call it picks the algorithm (``algorithms.selector``), lays the caller's tensors out
as the algorithm's flat buffers, drives the algorithm over the transport (``executor``), and
writes the results back into the caller's tensors. The in-process backend (tests) and the Ray
backend differ only in the transport they give it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..algorithms import p2p
from ..algorithms.catalog import start
from ..algorithms.core import Blocks, Context, Team
from ..algorithms.selector import chooser, select
from ..executor import drive
from ..tensors import TensorView, combiner, finalize_average
from ..transport.base import COLLECTIVE_CHANNEL, CallHeader, Transport, p2p_channel
from ..types import Collective, ReduceOp
from .base import CollectiveBackend, GroupCall, node_map_or_none

_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCESCATTER)


def _concatenate(views: Sequence[TensorView]) -> np.ndarray:
    return np.concatenate([v.array for v in views])


def _scatter_blocks(buf: np.ndarray, blocks: Blocks, views: Sequence[TensorView]) -> None:
    for i, view in enumerate(views):
        np.copyto(view.array, blocks.view(buf, i))


class TransportBackend(CollectiveBackend):
    """Runs every collective as an algorithm over ``transport``.

    Args:
        group_name: the group's name (headers, errors).
        transport: this rank's transport.
        epoch: the group's incarnation; a re-created group with the same name gets a new one,
            so stale messages of the old one are recognised.
        node_of: node id of every rank, or None when all ranks share one node.
        oversubscribed: some node runs more ranks than it has cores (the selector then
            prefers algorithms with fewer messages).
    """

    def __init__(self, group_name: str, transport: Transport, epoch: int = 0,
                 node_of: Optional[Sequence] = None, oversubscribed: bool = False):
        self.group_name = group_name
        self.transport = transport
        self.epoch = epoch
        self.node_of = node_map_or_none(node_of)
        self.oversubscribed = oversubscribed
        self.rank = transport.rank
        self.world_size = transport.world_size

    def run(self, call: GroupCall) -> None:
        collective = call.options.collective
        if collective in (Collective.SEND, Collective.RECV):
            self._point_to_point(call)
        else:
            self._collective(call)

    def _header(self, call: GroupCall, view: Optional[TensorView], collective: str,
                algorithm: str) -> CallHeader:
        options = call.options
        op = options.op.name if options.collective in _REDUCING else ""
        dtype_name, count, shape = ("", 0, ()) if view is None else (
            view.dtype_name, view.count, tuple(view.shape))
        return CallHeader(self.group_name, self.epoch, call.seq, collective, algorithm,
                          dtype_name, count, shape, options.root, op)

    def _point_to_point(self, call: GroupCall) -> None:
        options, view = call.options, call.tensor
        header = self._header(call, view, "send/recv", "direct")
        run = p2p.send if options.collective is Collective.SEND else p2p.recv
        drive(run(options.peer, view.array), self.transport, p2p_channel(options.tag), header,
              None, options.timeout, options.collective.value)

    def _collective(self, call: GroupCall) -> None:
        options = call.options
        collective = options.collective
        reference = call.tensor if call.tensor is not None else (call.inputs or call.outputs or
                                                                 (None,))[0]
        p, rank = self.world_size, self.rank
        if reference is None:
            dtype, itemsize, count = np.dtype(np.uint8), 1, 0
        else:
            dtype, count = reference.wire_dtype, reference.count
            itemsize = dtype.itemsize
        algorithm = select(collective.value, count, itemsize, p, self.node_of,
                           forced=options.algorithm, oversubscribed=self.oversubscribed)
        combine = combiner(options.op, reference.dtype_name) if collective in _REDUCING else None
        ctx = Context(dtype, combine, node_of=self.node_of, choose=chooser(itemsize))
        team = Team.world(p, rank)
        header = self._header(call, reference, collective.value, algorithm.name)
        blocks = Blocks.uniform(count, p)
        root = options.root
        tensor = call.tensor.array if call.tensor is not None else None
        recvbuf = None
        if collective in (Collective.ALLGATHER, Collective.GATHER):
            buf = np.empty(p * count, dtype)
            np.copyto(blocks.view(buf, rank), tensor)
        elif collective in (Collective.REDUCESCATTER, Collective.ALLTOALL) or (
                collective is Collective.SCATTER and rank == root):
            buf = _concatenate(call.inputs)
        elif collective is Collective.SCATTER:
            buf = np.empty(p * count, dtype)
        else:
            buf = tensor
        if collective is Collective.ALLTOALL:
            recvbuf = np.empty(p * count, dtype)
        drive(start(algorithm, team, ctx, buf, blocks, root, recvbuf), self.transport,
              COLLECTIVE_CHANNEL, header, combine, options.timeout, collective.value)
        if collective in (Collective.ALLGATHER, Collective.GATHER):
            _scatter_blocks(buf, blocks, call.outputs)
        elif collective is Collective.ALLTOALL:
            _scatter_blocks(recvbuf, blocks, call.outputs)
        elif collective in (Collective.REDUCESCATTER, Collective.SCATTER):
            np.copyto(tensor, blocks.view(buf, rank))
        if options.op is ReduceOp.AVG:
            self._average(call, reference.dtype_name)

    def _average(self, call: GroupCall, dtype_name: str) -> None:
        collective = call.options.collective
        if collective is Collective.REDUCE and self.rank != call.options.root:
            return
        finalize_average(call.tensor.array, dtype_name, self.world_size)

    def abort(self, error: BaseException) -> None:
        self.transport.abort(error)

    def close(self) -> None:
        self.transport.close()
