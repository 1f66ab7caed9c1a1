"""The ``*_multigpu`` collectives: one tensor per GPU of this process, on a group whose backend
runs them (``nccl``), and ``synchronize``.

The backend brings the checks of their arguments (``Membership.multi_gpu_arguments``) and a
prepared call per call; the shared arguments and errors are those of every collective
(``ray_collective.api``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .backends import BACKENDS
from .errors import ArgumentValueError, UnsupportedOperationError
from .group import Group, Work, current_registry
from .reductions import check_op
from .types import Collective, ReduceOp
from .validation import check_call_timeout, check_group_name, check_rank, check_reduce_op


def _options(group: Group, collective: Collective, timeout: Optional[float], **fields):
    return group.options(collective, check_call_timeout(timeout), **fields)


def _check_rank(rank: Any, group: Group, what: str) -> int:
    return check_rank(rank, group.world_size, group.name, what)


def _multigpu_group(name: str, group_name: str) -> Tuple[Group, Any]:
    """The group of a ``*_multigpu`` call and the argument checks its membership brings."""
    group = current_registry().get(check_group_name(group_name))
    gpu = group.membership.multi_gpu_arguments()
    if gpu is None:
        raise UnsupportedOperationError(
            f"{name} needs a group on the 'nccl' backend (or another backend with the "
            f"multi-GPU calls), one tensor per GPU of this process; group '{group.name}' (rank "
            f"{group.rank}) runs on a backend without them. Use "
            f"{name.replace('_multigpu', '')} with one tensor instead.")
    return group, gpu


def _submit_multigpu(group: Group, prepared: Any, async_op: bool,
                     seq_key: Tuple[str, int, int] = ("", -1, 0)) -> Optional[Work]:
    """Run a ``*_multigpu`` call (prepared per call: its tensors are in its record)."""
    return group.submit(group.unshared(prepared, None), None, async_op, seq_key)


def _on_every_gpu(collective: Collective, group_name: str, tensor_list: Any, async_op: bool,
                  timeout: Optional[float], op: Any = None, root: Any = None,
                  root_index: Any = 0) -> Optional[Work]:
    """allreduce (no ``root``), reduce, or broadcast (no ``op``) on one tensor per GPU, the
    root's GPU being ``root_index`` of rank ``root``."""
    group, gpu = _multigpu_group(f"{collective.value}_multigpu", group_name)
    fields = {}
    if op is not None:
        op = fields["op"] = check_reduce_op(op)
    if root is not None:
        side = "src" if collective is Collective.BROADCAST else "dst"
        fields["root"] = _check_rank(root, group, f"{side}_rank")
        root_index = gpu.index(root_index, f"{side}_tensor")
    views = gpu.tensors(tensor_list, "tensor_list")
    if op is not None:
        check_op(op, views[0].dtype_name)
    options = _options(group, collective, timeout, **fields)
    prepared = gpu.call(options, device_tensors=views, root_index=root_index)
    return _submit_multigpu(group, prepared, async_op)


def _point_to_point_multigpu(collective: Collective, tensor: Any, peer: int, peer_index: int,
                             group_name: str, n_elements: int, async_op: bool,
                             timeout: Optional[float]) -> Optional[Work]:
    sending = collective is Collective.SEND
    name = "send_multigpu" if sending else "recv_multigpu"
    group, gpu = _multigpu_group(name, group_name)
    peer = _check_rank(peer, group, "dst_rank" if sending else "src_rank")
    if peer == group.rank:
        raise ArgumentValueError(
            f"rank {group.rank} of group '{group.name}' cannot {name} to itself; "
            f"copy between this process's GPUs directly instead (cupy: "
            f"dst.data.copy_from_device(src.data, nbytes); torch: dst.copy_(src))")
    peer_index = gpu.index(peer_index, "dst_gpu_index" if sending else "src_gpu_index")
    view, count = gpu.tensor(tensor, n_elements)
    options = _options(group, collective, timeout, peer=peer)
    prepared = gpu.call(options, device_tensors=(view,), peer_index=peer_index,
                        n_elements=count)
    return _submit_multigpu(group, prepared, async_op, (name, peer, 0))


def allreduce_multigpu(tensor_list: List[Any], group_name: str = "default",
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Allreduce across every GPU of every rank; ``tensor_list`` has one tensor per local GPU.

    Every GPU of the group ends with the reduction of all of them (AVG divides by the number
    of GPUs in the group).

    Args:
        tensor_list: one GPU tensor per device of this process, in the order of the group's
            devices; each is overwritten with the result.
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the result is in place (the Work of the call with ``async_op=True``).

    Raises:
        UnsupportedOperationError: the group's backend has no multi-GPU calls.
        GroupNotInitializedError: no such group here.
        ArgumentTypeError, ArgumentValueError: bad arguments (one tensor per GPU, same shape and
            dtype).
        CollectiveError: timeout, dead peer or broken group.
    """
    return _on_every_gpu(Collective.ALLREDUCE, group_name, tensor_list, async_op, timeout, op)


def reduce_multigpu(tensor_list: List[Any], dst_rank: int = 0, dst_tensor: int = 0,
                    group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
                    async_op: bool = False, timeout: Optional[float] = None
                    ) -> Optional[Work]:
    """Reduce across every GPU of every rank onto ``tensor_list[dst_tensor]`` of ``dst_rank``.

    Args:
        tensor_list: one GPU tensor per device of this process; only the destination GPU's
            tensor is overwritten.
        dst_rank: the receiving rank.
        dst_tensor: index of the receiving GPU tensor on ``dst_rank``.
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the result is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _on_every_gpu(Collective.REDUCE, group_name, tensor_list, async_op, timeout, op,
                         dst_rank, dst_tensor)


def broadcast_multigpu(tensor_list: List[Any], src_rank: int = 0, src_tensor: int = 0,
                       group_name: str = "default", *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Broadcast ``tensor_list[src_tensor]`` of ``src_rank`` to every GPU of every rank.

    Args:
        tensor_list: one GPU tensor per device of this process; all but the source are
            overwritten.
        src_rank: the sending rank.
        src_tensor: index of the sending GPU tensor on ``src_rank``.
        group_name: the group (an ``nccl`` group).

    Returns:
        None, once the result is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _on_every_gpu(Collective.BROADCAST, group_name, tensor_list, async_op, timeout,
                         None, src_rank, src_tensor)


def allgather_multigpu(output_tensor_lists: List[List[Any]], input_tensor_list: List[Any],
                       group_name: str = "default", *, async_op: bool = False,
                       timeout: Optional[float] = None) -> Optional[Work]:
    """Allgather the tensors of every GPU of every rank into each GPU's output list.

    Args:
        output_tensor_lists: per local GPU, a list with one tensor per GPU in the group (all on
            that local GPU); entry ``r * k + i`` receives GPU ``i`` of rank ``r``.
        input_tensor_list: one GPU tensor per device of this process.
        group_name: the group (an ``nccl`` group).

    Returns:
        None, once the results are in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("allgather_multigpu", group_name)
    inputs = gpu.tensors(input_tensor_list, "input_tensor_list")
    outputs = gpu.tensor_lists(output_tensor_lists, "output_tensor_lists", inputs,
                               "input_tensor_list")
    options = _options(group, Collective.ALLGATHER, timeout)
    prepared = gpu.call(options, device_tensors=inputs, device_lists=outputs)
    return _submit_multigpu(group, prepared, async_op)


def reducescatter_multigpu(output_tensor_list: List[Any], input_tensor_lists: List[List[Any]],
                           group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
                           async_op: bool = False, timeout: Optional[float] = None
                           ) -> Optional[Work]:
    """Reduce-scatter across every GPU of every rank.

    GPU ``i`` of rank ``r`` receives the reduction of entry ``r * k + i`` of every GPU's input
    list.

    Args:
        output_tensor_list: one GPU tensor per device of this process, receiving its part.
        input_tensor_lists: per local GPU, a list with one tensor per GPU in the group (all on
            that local GPU).
        group_name: the group (an ``nccl`` group).
        op: the reduction.

    Returns:
        None, once the results are in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    group, gpu = _multigpu_group("reducescatter_multigpu", group_name)
    op = check_reduce_op(op)
    outputs = gpu.tensors(output_tensor_list, "output_tensor_list")
    inputs = gpu.tensor_lists(input_tensor_lists, "input_tensor_lists", outputs,
                              "output_tensor_list")
    check_op(op, outputs[0].dtype_name)
    options = _options(group, Collective.REDUCESCATTER, timeout, op=op)
    prepared = gpu.call(options, device_tensors=outputs, device_lists=inputs)
    return _submit_multigpu(group, prepared, async_op)


def send_multigpu(tensor: Any, dst_rank: int, dst_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None) -> Optional[Work]:
    """Send a GPU tensor to GPU ``dst_gpu_index`` of ``dst_rank``.

    Args:
        tensor: the GPU tensor, on one of this process's GPUs in the group.
        dst_rank: the receiving rank (not this rank).
        dst_gpu_index: the receiving GPU's index on that rank.
        group_name: the group (an ``nccl`` group).
        n_elements: elements to send from the start of the tensor (0: all).

    Returns:
        None, once the data has left.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _point_to_point_multigpu(Collective.SEND, tensor, dst_rank, dst_gpu_index,
                                    group_name, n_elements, async_op, timeout)


def recv_multigpu(tensor: Any, src_rank: int, src_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None) -> Optional[Work]:
    """Receive into a GPU tensor from GPU ``src_gpu_index`` of ``src_rank``.

    Args:
        tensor: the GPU tensor to fill, on one of this process's GPUs in the group.
        src_rank: the sending rank (not this rank).
        src_gpu_index: the sending GPU's index on that rank.
        group_name: the group (an ``nccl`` group).
        n_elements: elements to receive into the start of the tensor (0: all).

    Returns:
        None, once the data is in place.

    Raises:
        UnsupportedOperationError, GroupNotInitializedError, ArgumentTypeError,
            ArgumentValueError, CollectiveError: see :func:`allreduce_multigpu`.
    """
    return _point_to_point_multigpu(Collective.RECV, tensor, src_rank, src_gpu_index,
                                    group_name, n_elements, async_op, timeout)


def synchronize(gpu_id: int) -> None:
    """Wait until all work queued on GPU ``gpu_id``, collectives included, has finished.

    Args:
        gpu_id: the GPU's index among the devices this process sees.

    Returns:
        None.

    Raises:
        BackendNotAvailableError: no GPU backend (such as 'nccl': CuPy with NCCL) can run in
            this process.
        ValueError: ``gpu_id`` is not a visible GPU.
    """
    BACKENDS.synchronize(gpu_id)
