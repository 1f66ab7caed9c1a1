"""The ``ray_collective`` process group: torch's collectives mapped onto the library's.

Torch calls a Python process group's methods with its own option objects; each method here
checks the tensors (CPU only, one per call: :func:`cpu_tensor`), makes them contiguous where
they are not (a contiguous copy is written back once the call has run), maps the reduction
(:func:`library_op`) and hands the library call to the group's :class:`~.work.CallQueue`,
which returns torch's ``Work``. ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single`` run on views of their flat tensors; ``all_to_all_single`` with split
sizes first agrees every rank's sizes (an ``allgather``) and then exchanges chunks padded to
the largest. Sends and receives go through :class:`~.p2p.PointToPoint`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import api as col
from ..errors import ArgumentValueError
from ..types import ReduceOp
from .p2p import PointToPoint
from .views import ArrayViews
from .work import CallQueue, CollectiveWork, overlaps

BACKEND_NAME = "ray_collective"

_RED_OP = dist.ReduceOp.RedOpType
_OPS = {_RED_OP.SUM: ReduceOp.SUM, _RED_OP.AVG: ReduceOp.AVG, _RED_OP.PRODUCT: ReduceOp.PRODUCT,
        _RED_OP.MIN: ReduceOp.MIN, _RED_OP.MAX: ReduceOp.MAX}
# The same keyed by the enum's integer: a lookup by int takes about half the time of one by the
# pybind enum, which counts on the path every small all_reduce takes.
_OPS_BY_VALUE = {kind.value: op for kind, op in _OPS.items()}
# What an options object holds when its caller gave no timeout (a negative duration).
_NO_TIMEOUT = dist.AllreduceOptions().timeout


def library_op(op, where: str) -> ReduceOp:
    """The library's reduction for torch's ``op``.

    Args:
        op: a ``dist.ReduceOp`` (or its ``RedOpType``).
        where: who and what, for the message.

    Returns:
        The :class:`~ray_collective.ReduceOp`.

    Raises:
        ArgumentValueError: ``op`` is not SUM, AVG, PRODUCT, MIN or MAX.
    """
    kind = op.op if type(op) is dist.ReduceOp else op
    found = _OPS.get(kind)
    if found is None:
        raise ArgumentValueError(
            f"{where}: ray_collective does not support {kind}; it reduces with SUM, AVG, "
            f"PRODUCT, MIN and MAX (for PREMUL_SUM, scale the tensor and use SUM)")
    return found


def cpu_tensor(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """``tensor`` if it is a CPU tensor, else raise.

    Args:
        tensor: a tensor torch handed the backend.
        where: who and what, for the message.

    Returns:
        ``tensor``.

    Raises:
        ArgumentValueError: it is on another device, or sparse.
    """
    if tensor.layout is not torch.strided:
        raise ArgumentValueError(
            f"{where}: ray_collective carries dense tensors only, not {tensor.layout}; "
            f"call .to_dense() first")
    if tensor.device.type != "cpu":
        raise ArgumentValueError(
            f"{where}: ray_collective carries CPU tensors only, this one is on "
            f"{tensor.device}; for CUDA tensors initialise with "
            f"backend='cpu:ray_collective,cuda:nccl' or a group of their own "
            f"(dist.new_group(backend='nccl')), or move the tensor to the CPU")
    return tensor


class _Contiguous:
    """Contiguous stand-ins for a call's tensors, written back to the originals afterwards."""

    def __init__(self):
        self._written: List[tuple] = []

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        # The tensor itself where it can be: the library keeps what it learnt of a tensor it
        # saw before, which a new view each call would lose.
        if tensor.is_contiguous() and not tensor.requires_grad:
            return tensor
        plain = tensor.detach()
        return plain if plain.is_contiguous() else plain.contiguous()

    def write(self, tensor: torch.Tensor) -> torch.Tensor:
        plain = self.read(tensor)
        if plain.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            self._written.append((tensor, plain))
        return plain

    def back(self) -> None:
        for original, plain in self._written:
            original.detach().copy_(plain)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ProcessGroupRayCollective(dist.ProcessGroup):
    """One torch group over one library group (and its pair groups for sends and receives)."""

    def __init__(self, rank: int, size: int, group_name: str, timeout: timedelta):
        super().__init__(rank, size)
        self._group_name = group_name
        self._torch_group_name = ""
        self._who = f"rank {rank} of group '{group_name}'"
        self._timeout = timeout.total_seconds()
        self._queue = CallQueue(group_name, overlaps(size))
        self._arrays = ArrayViews()
        self._p2p = PointToPoint(group_name, rank, self._timeout)

    @property
    def library_group(self) -> str:
        """The name of the library group this process group runs on."""
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        # torch's own getter reads the name from a C++ backend, which a Python group has none
        # of, so destroy_process_group(subgroup) would fail without this copy.
        self._torch_group_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        """The name torch gave this group (``"0"`` for the default one)."""
        return self._torch_group_name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"ray_collective"``."""
        return BACKEND_NAME

    def name(self) -> str:
        """``"ray_collective"``."""
        return BACKEND_NAME

    def _where(self, what: str) -> str:
        return f"{self._who}, {what}"

    def _call_timeout(self, opts) -> Optional[float]:
        seconds = opts.timeout.total_seconds()  # negative: not given
        return seconds if seconds > 0 else None

    def _tensor(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ArgumentValueError(f"{self._where(what)}: one tensor per call, "
                                     f"not {len(tensors)}")
        return cpu_tensor(tensors[0], self._where(what))

    def _run(self, call: Callable[[_Contiguous], None], outputs: List[torch.Tensor],
             nbytes: int, opts=None) -> CollectiveWork:
        stand_ins = _Contiguous()

        def run() -> None:
            call(stand_ins)
            stand_ins.back()
        return self._queue.run(run, outputs, nbytes, getattr(opts, "asyncOp", True))

    # ------------------------------------------------------------ reductions and copies

    def allreduce(self, tensors, opts) -> Optional[CollectiveWork]:
        """``dist.all_reduce``: SUM, AVG, PRODUCT, MIN or MAX of one tensor, in place (None
        instead of a work for a plain call already done that its caller waits for:
        :meth:`~.work.CallQueue.allreduce`)."""
        if len(tensors) == 1:
            # The common call (one contiguous CPU tensor, a known op, no timeout of its own)
            # in the fewest steps: every microsecond here is paid per call by every rank,
            # and where ranks share cores a peer waits for it too. A ReduceOp hashes to its
            # kind's integer, which is read faster than its ``op``.
            op = _OPS_BY_VALUE.get(hash(opts.reduceOp))
            if op is not None and opts.timeout == _NO_TIMEOUT:
                tensor = tensors[0]
                array = self._arrays.array(tensor)  # a small tensor's, kept: ArrayViews
                if array is not None:
                    return self._queue.allreduce(array, op, tensors, opts.asyncOp)
                if (tensor.is_cpu and tensor.layout is torch.strided and tensor.is_contiguous()
                        and not tensor.requires_grad):
                    return self._queue.allreduce(tensor, op, tensors, opts.asyncOp)
        tensor = self._tensor(tensors, "all_reduce")
        op = library_op(opts.reduceOp, self._where("all_reduce"))
        timeout = self._call_timeout(opts)
        return self._run(lambda c: col.allreduce(c.write(tensor), self._group_name, op,
                                                 timeout=timeout), [tensor], _nbytes([tensor]), opts)

    def reduce(self, tensors, opts) -> CollectiveWork:
        """``dist.reduce``: the reduction lands on ``dst``."""
        tensor = self._tensor(tensors, "reduce")
        op = library_op(opts.reduceOp, self._where("reduce"))
        root, timeout = opts.rootRank, self._call_timeout(opts)
        return self._run(lambda c: col.reduce(c.write(tensor), root, self._group_name, op,
                                              timeout=timeout), [tensor], _nbytes([tensor]), opts)

    def broadcast(self, tensors, opts) -> CollectiveWork:
        """``dist.broadcast`` from ``src``."""
        tensor = self._tensor(tensors, "broadcast")
        root, timeout = opts.rootRank, self._call_timeout(opts)
        return self._run(lambda c: col.broadcast(c.write(tensor), root, self._group_name,
                                                 timeout=timeout), [tensor], _nbytes([tensor]), opts)

    def allgather(self, output_tensors, input_tensors, opts) -> CollectiveWork:
        """``dist.all_gather``: rank i's tensor into ``output_tensors[0][i]`` everywhere."""
        tensor = self._tensor(input_tensors, "all_gather")
        outputs = [cpu_tensor(t, self._where("all_gather")) for t in output_tensors[0]]
        timeout = self._call_timeout(opts)
        return self._run(lambda c: col.allgather([c.write(t) for t in outputs], c.read(tensor),
                                                 self._group_name, timeout=timeout),
                         outputs, _nbytes(outputs), opts)

    def all_gather_single(self, output, input, opts) -> CollectiveWork:  # noqa: A002
        """``dist.all_gather_into_tensor``: every rank's input, in rank order, into ``output``."""
        where = self._where("all_gather_into_tensor")
        cpu_tensor(output, where)
        cpu_tensor(input, where)
        timeout = self._call_timeout(opts)

        def call(c: _Contiguous) -> None:
            rows = c.write(output).view(self.size(), -1)
            col.allgather(list(rows), c.read(input).reshape(-1), self._group_name,
                          timeout=timeout)
        return self._run(call, [output], _nbytes([output]), opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> CollectiveWork:
        """``dist.reduce_scatter``: rank i gets the reduction of every rank's ``input[i]``."""
        tensor = self._tensor(output_tensors, "reduce_scatter")
        inputs = [cpu_tensor(t, self._where("reduce_scatter")) for t in input_tensors[0]]
        op = library_op(opts.reduceOp, self._where("reduce_scatter"))
        timeout = self._call_timeout(opts)
        return self._run(lambda c: col.reducescatter(c.write(tensor), [c.read(t) for t in inputs],
                                                     self._group_name, op, timeout=timeout),
                         [tensor], _nbytes(inputs), opts)

    def reduce_scatter_single(self, output, input, opts) -> CollectiveWork:  # noqa: A002
        """``dist.reduce_scatter_tensor``: rank i gets the reduction of row block i."""
        where = self._where("reduce_scatter_tensor")
        cpu_tensor(output, where)
        cpu_tensor(input, where)
        op = library_op(opts.reduceOp, where)
        timeout = self._call_timeout(opts)

        def call(c: _Contiguous) -> None:
            rows = c.read(input).view(self.size(), -1)
            col.reducescatter(c.write(output).view(-1), list(rows), self._group_name, op,
                              timeout=timeout)
        return self._run(call, [output], _nbytes([input]), opts)

    def gather(self, output_tensors, input_tensors, opts) -> CollectiveWork:
        """``dist.gather``: every rank's tensor into ``gather_list`` on ``dst``."""
        tensor = self._tensor(input_tensors, "gather")
        root, timeout = opts.rootRank, self._call_timeout(opts)
        outputs = list(output_tensors[0]) if output_tensors else []
        return self._run(lambda c: col.gather([c.write(t) for t in outputs] or None,
                                              c.read(tensor), root, self._group_name,
                                              timeout=timeout),
                         outputs, _nbytes([tensor]) * self.size(), opts)

    def scatter(self, output_tensors, input_tensors, opts) -> CollectiveWork:
        """``dist.scatter``: ``scatter_list[i]`` from ``src`` into rank i's tensor."""
        tensor = self._tensor(output_tensors, "scatter")
        root, timeout = opts.rootRank, self._call_timeout(opts)
        inputs = list(input_tensors[0]) if input_tensors else []
        return self._run(lambda c: col.scatter(c.write(tensor),
                                               [c.read(t) for t in inputs] or None, root,
                                               self._group_name, timeout=timeout),
                         [tensor], _nbytes([tensor]) * self.size(), opts)

    def alltoall(self, output_tensors, input_tensors, opts) -> CollectiveWork:
        """``dist.all_to_all``: ``input[j]`` to rank j, rank i's into ``output[i]``."""
        where = self._where("all_to_all")
        outputs = [cpu_tensor(t, where) for t in output_tensors]
        inputs = [cpu_tensor(t, where) for t in input_tensors]
        timeout = self._call_timeout(opts)
        if len({t.shape for t in inputs + outputs}) > 1:
            # Tensors of several sizes: the exchange of all_to_all_single with split sizes,
            # over their flattened concatenations.
            return self._run(lambda c: self._uneven_all_to_all(c, outputs, inputs, timeout),
                             outputs, _nbytes(inputs), opts)
        return self._run(lambda c: col.alltoall([c.write(t) for t in outputs],
                                                [c.read(t) for t in inputs],
                                                self._group_name, timeout=timeout),
                         outputs, _nbytes(inputs), opts)

    def _uneven_all_to_all(self, c: _Contiguous, outputs: List[torch.Tensor],
                           inputs: List[torch.Tensor], timeout: Optional[float]) -> None:
        flat_in = torch.cat([t.detach().reshape(-1) for t in inputs])
        flat_out = flat_in.new_empty(sum(t.numel() for t in outputs))
        _Splits(self.rank(), self.size(), flat_in, flat_out, [t.numel() for t in inputs],
                [t.numel() for t in outputs]).exchange(c, self._group_name, timeout)
        for tensor, part in zip(outputs, flat_out.split([t.numel() for t in outputs])):
            tensor.detach().copy_(part.view(tensor.shape))

    def all_to_all_single(self, output, input, output_split_sizes,  # noqa: A002
                          input_split_sizes, opts) -> CollectiveWork:
        """``dist.all_to_all_single``, with split sizes (rows along the first dimension)."""
        where = self._where("all_to_all_single")
        cpu_tensor(output, where)
        cpu_tensor(input, where)
        timeout = self._call_timeout(opts)
        if not output_split_sizes and not input_split_sizes:
            def even(c: _Contiguous) -> None:
                col.alltoall(list(c.write(output).view(self.size(), -1)),
                             list(c.read(input).view(self.size(), -1)), self._group_name,
                             timeout=timeout)
            return self._run(even, [output], _nbytes([input]), opts)
        splits = _Splits(self.rank(), self.size(), input, output, input_split_sizes,
                         output_split_sizes)
        return self._run(lambda c: splits.exchange(c, self._group_name, timeout),
                         [output], _nbytes([input]), opts)

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single

    def allreduce_coalesced(self, tensors, opts) -> CollectiveWork:
        """``dist.all_reduce_coalesced``: each tensor reduced in turn, one work for all."""
        where = self._where("all_reduce_coalesced")
        tensors = [cpu_tensor(t, where) for t in tensors]
        op = library_op(opts.reduceOp, where)
        timeout = self._call_timeout(opts)

        def call(c: _Contiguous) -> None:
            for tensor in tensors:
                col.allreduce(c.write(tensor), self._group_name, op, timeout=timeout)
        return self._run(call, tensors, _nbytes(tensors), opts)

    def allgather_coalesced(self, output_lists, input_tensors, opts) -> CollectiveWork:
        """``dist.all_gather_coalesced``: each input gathered in turn, one work for all."""
        where = self._where("all_gather_coalesced")
        inputs = [cpu_tensor(t, where) for t in input_tensors]
        outputs = [[cpu_tensor(t, where) for t in listed] for listed in output_lists]
        timeout = self._call_timeout(opts)

        def call(c: _Contiguous) -> None:
            # output_lists[rank][i] receives rank's inputs[i].
            for i, tensor in enumerate(inputs):
                col.allgather([c.write(listed[i]) for listed in outputs], c.read(tensor),
                              self._group_name, timeout=timeout)
        return self._run(call, [t for listed in outputs for t in listed],
                         _nbytes(inputs) * self.size(), opts)

    def barrier(self, opts) -> CollectiveWork:
        """``dist.barrier``."""
        timeout = self._call_timeout(opts)
        return self._run(lambda c: col.barrier(self._group_name, timeout=timeout), [], 0, opts)

    def monitored_barrier(self, timeout: Optional[timedelta] = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier with a deadline (torch's ``dist.monitored_barrier`` calls it only on
        Gloo groups; a direct call works here).

        Args:
            timeout: the deadline; the group's when None.
            wait_all_ranks: accepted; the library's error names the ranks it could tell.

        Raises:
            DistBackendError: a rank did not arrive in time or died.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        self._run(lambda c: col.barrier(self._group_name, timeout=seconds), [], 0).wait()

    # ------------------------------------------------------------ sends and receives

    def send(self, tensors, dstRank, tag) -> CollectiveWork:  # noqa: N803 - torch's names
        """``dist.send`` / ``isend`` to group rank ``dstRank`` with ``tag``."""
        tensor = self._tensor(tensors, "send")
        plain = _Contiguous().read(tensor)
        future = self._p2p.post("send", plain, dstRank, tag, self._timeout)
        return CollectiveWork([tensor], future)

    def recv(self, tensors, srcRank, tag) -> CollectiveWork:  # noqa: N803 - torch's names
        """``dist.recv`` / ``irecv`` from group rank ``srcRank`` with ``tag``."""
        tensor = self._tensor(tensors, "recv")
        stand_ins = _Contiguous()
        future = self._p2p.post("recv", stand_ins.write(tensor), srcRank, tag, self._timeout)
        future.add_done_callback(lambda done: done.exception() or stand_ins.back())
        return CollectiveWork([tensor], future)

    def recv_anysource(self, tensors, tag):
        """Refused: a receive from any source.

        Raises:
            ArgumentValueError: always; name the source rank.
        """
        raise ArgumentValueError(f"{self._where('recv')}: ray_collective receives from a named "
                                 f"rank only; pass src=")

    def shutdown(self) -> None:
        """Leave the library groups (``dist.destroy_process_group``)."""
        self._queue.close()
        self._p2p.close()
        self._arrays.clear()
        if col.is_group_initialized(self._group_name):
            col.destroy_collective_group(self._group_name)


class _Splits:
    """``all_to_all_single`` with split sizes: every rank's sizes agreed, chunks padded."""

    def __init__(self, rank: int, size: int, input: torch.Tensor,  # noqa: A002
                 output: torch.Tensor, input_splits: List[int], output_splits: List[int]):
        self._rank, self._size = rank, size
        self._input, self._output = input, output
        self._in = list(input_splits) or [input.shape[0] // size] * size
        self._out = list(output_splits) or [output.shape[0] // size] * size

    def exchange(self, c: _Contiguous, group: str, timeout: Optional[float]) -> None:
        # Every rank's sizes both ways, so that every rank finds a disagreement and all raise.
        mine = torch.tensor(self._in + self._out, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self._size)]
        col.allgather(every, mine, group, timeout=timeout)
        sent = torch.stack(every)[:, :self._size]
        received = torch.stack(every)[:, self._size:]
        if not torch.equal(sent, received.T):
            wrong = [(i, j) for i in range(self._size) for j in range(self._size)
                     if sent[i, j] != received[j, i]]
            raise ArgumentValueError(
                f"rank {self._rank} of group '{group}', all_to_all_single: the split sizes "
                f"disagree: rank i's input_split_sizes[j] must equal rank j's "
                f"output_split_sizes[i], and differ for (i, j) in {wrong}")
        widest = int(sent.max())
        row = self._input[0].shape if self._input.dim() else ()
        send = self._input.new_zeros((self._size, widest) + tuple(row))
        receive = torch.empty_like(send)
        source = c.read(self._input)
        start = 0
        for peer, rows in enumerate(self._in):
            send[peer, :rows] = source[start:start + rows]
            start += rows
        col.alltoall(list(receive), list(send), group, timeout=timeout)
        target = c.write(self._output)
        start = 0
        for peer, rows in enumerate(self._out):
            target[start:start + rows] = receive[peer, :rows]
            start += rows
