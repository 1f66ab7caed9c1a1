"""Checking GPU tensor arguments, and the call record of the ``*_multigpu`` collectives.

A process of an NCCL group owns k GPUs, the group's ``devices`` (``cuda:<index>`` as CuPy and
torch number the visible devices). The plain collectives take one tensor on one of them; the
``*_multigpu`` variants take one tensor per GPU, in the order of ``devices``, and GPU ``i`` of
rank ``r`` is number ``r * k + i`` among the ``world_size * k`` GPUs of the group. These checks
run before anything is launched and raise ``ArgumentTypeError``/``ArgumentValueError`` (see
``ray_collective.validation``) that say what to do.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

from ...errors import ArgumentTypeError, ArgumentValueError
from ...tensors import TensorView, as_view
from ...types import CallOptions
from ...validation import check_index
from ..base import PreparedCall


class GroupCall:
    """One call as the NCCL backend builds its steps from it.

    Attributes:
        options: what was asked (collective, op, root/peer, tag, timeout).
        seq: the call's sequence number (per group for collectives, per peer and tag for p2p).
        tensor: the single tensor argument (input and/or output), if the collective has one.
        inputs: the input list (reducescatter, scatter on the root, alltoall).
        outputs: the output list (allgather, gather on the root, alltoall).

    A plain class with slots rather than a frozen dataclass: one is built per call. Treat it
    as read-only.
    """

    __slots__ = ("options", "seq", "tensor", "inputs", "outputs")

    def __init__(self, options: CallOptions, seq: int, tensor: Optional[TensorView] = None,
                 inputs: Tuple[TensorView, ...] = (), outputs: Tuple[TensorView, ...] = ()):
        self.options = options
        self.seq = seq
        self.tensor = tensor
        self.inputs = inputs
        self.outputs = outputs


class MultiGpuCall(GroupCall):
    """A ``*_multigpu`` call: the GroupCall fields plus one tensor (or list) per local GPU.

    Attributes:
        device_tensors: per local GPU, its tensor: input and output of allreduce, reduce and
            broadcast; the input of allgather; the output of reducescatter. send and recv have
            one entry, the tensor on the GPU that sends or receives.
        device_lists: per local GPU, ``world_size * k`` tensors: the outputs of allgather, the
            inputs of reducescatter.
        root_index: the root's GPU index on the root rank (``dst_tensor``, ``src_tensor``).
        peer_index: the peer's GPU index (``dst_gpu_index``, ``src_gpu_index``).
        n_elements: elements to send or receive.
    """

    __slots__ = ("device_tensors", "device_lists", "root_index", "peer_index", "n_elements")

    def __init__(self, options: CallOptions, seq: int,
                 device_tensors: Tuple[TensorView, ...] = (),
                 device_lists: Tuple[Tuple[TensorView, ...], ...] = (), root_index: int = 0,
                 peer_index: int = 0, n_elements: int = 0):
        super().__init__(options, seq)
        self.device_tensors = device_tensors
        self.device_lists = device_lists
        self.root_index = root_index
        self.peer_index = peer_index
        self.n_elements = n_elements


def _device_names(devices: Sequence[int]) -> str:
    return "[" + ", ".join(f"cuda:{d}" for d in devices) + "]"


def device_of(view: TensorView, devices: Sequence[int], group_name: str, what: str) -> int:
    """The GPU a tensor lives on, checked against the group's GPUs.

    Args:
        view: the tensor's view.
        devices: the GPUs this process uses in the group.
        group_name: the group (for messages).
        what: the argument's name (for messages).

    Returns:
        The device index.

    Raises:
        TypeError: the tensor is on the CPU.
        ValueError: the tensor is on a GPU this process does not use in the group.
    """
    if not view.device.startswith("cuda:"):
        raise ArgumentTypeError(
            f"{what} is a CPU {view.kind} tensor, but group '{group_name}' runs on the nccl "
            f"backend, which moves GPU memory only. Pass a cupy array or a torch CUDA tensor on "
            f"{_device_names(devices)} (for example cupy.asarray(x) or x.cuda()), or use a "
            f"group on the 'ray' backend for CPU tensors.")
    device = int(view.device.split(":", 1)[1])
    if device not in devices:
        raise ArgumentValueError(
            f"{what} is on {view.device}, but this process uses {_device_names(devices)} in "
            f"group '{group_name}'. Move the tensor there (tensor.to(...) or "
            f"cupy.cuda.Device(...)), or create the group with the GPU you need.")
    return device


def _check_like(views: Sequence[TensorView], what: str, reference: TensorView,
                reference_name: str) -> None:
    # Shape, dtype and kind must agree; devices differ by design across a process's GPUs.
    for i, view in enumerate(views):
        for field, label in (("shape", "shape"), ("dtype_name", "dtype"), ("kind", "kind")):
            mine, theirs = getattr(view, field), getattr(reference, field)
            if mine != theirs:
                raise ArgumentValueError(
                    f"{what}[{i}] has {label} {mine!r} but {reference_name} has {label} "
                    f"{theirs!r}; every tensor of a multi-GPU call must have the same shape "
                    f"and dtype.")


def _length_text(value: Any) -> str:
    return str(len(value)) if isinstance(value, (list, tuple)) else type(value).__name__


class GpuArguments:
    """The argument checks of one group's ``*_multigpu`` calls, bound to its GPUs.

    Args:
        devices: the GPUs this process uses in the group, in order.
        group_name: the group.
        world_size: processes in the group.
        prepare: makes the prepared call of one ``*_multigpu`` call from the options and
            what builds its record from its sequence number.
    """

    def __init__(self, devices: Sequence[int], group_name: str, world_size: int,
                 prepare: Callable[[CallOptions, Callable[[int, Any], MultiGpuCall]],
                                   PreparedCall]):
        self.devices = tuple(devices)
        self.group_name = group_name
        self.world_size = world_size
        self._prepare = prepare

    def _views_on(self, tensors: Sequence[Any], what: str,
                  expected: Sequence[int]) -> Tuple[TensorView, ...]:
        # GPU tensors have no read-only form; a CPU tensor is refused by device_of either way.
        views = tuple(as_view(t, writable=False, what=f"{what}[{i}]")
                      for i, t in enumerate(tensors))
        for i, view in enumerate(views):
            device = device_of(view, self.devices, self.group_name, f"{what}[{i}]")
            if device != expected[i]:
                raise ArgumentValueError(
                    f"{what}[{i}] is on cuda:{device} but belongs on cuda:{expected[i]}: a "
                    f"multi-GPU call takes one tensor per GPU, in the order "
                    f"{_device_names(self.devices)}.")
        return views

    def tensors(self, tensors: Any, what: str) -> Tuple[TensorView, ...]:
        """One GPU tensor per local GPU, tensor i on ``devices[i]``, all of one shape and dtype.

        Args:
            tensors: the caller's list.
            what: the argument's name.

        Returns:
            The views.

        Raises:
            ArgumentTypeError: not a list, a CPU tensor, or an unsupported tensor type.
            ArgumentValueError: wrong length, a tensor on the wrong GPU, shapes or dtypes that differ.
        """
        if not isinstance(tensors, (list, tuple)):
            raise ArgumentTypeError(f"{what} must be a list with one GPU tensor per GPU of this "
                            f"process, not {type(tensors).__name__}")
        if len(tensors) != len(self.devices):
            raise ArgumentValueError(
                f"{what} has {len(tensors)} tensors, but this process uses {len(self.devices)} "
                f"GPUs {_device_names(self.devices)} in group '{self.group_name}'; pass one "
                f"tensor per GPU, in that order.")
        views = self._views_on(tensors, what, self.devices)
        _check_like(views, what, views[0], f"{what}[0]")
        return views

    def tensor_lists(self, lists: Any, what: str, like: Sequence[TensorView],
                     like_name: str) -> Tuple[Tuple[TensorView, ...], ...]:
        """Per local GPU, one tensor per GPU of the group, on that local GPU, shaped like
        ``like[i]``.

        Args:
            lists: the caller's list of lists.
            what: the argument's name.
            like: per local GPU, the tensor the entries must match.
            like_name: the name of ``like`` in messages.

        Returns:
            The views, ``[local GPU][GPU of the group]``.

        Raises:
            ArgumentTypeError, ArgumentValueError: as :meth:`tensors`, for the outer or an inner list.
        """
        length = self.world_size * len(self.devices)
        if not isinstance(lists, (list, tuple)) or len(lists) != len(self.devices):
            raise ArgumentValueError(
                f"{what} must be a list of {len(self.devices)} lists (one per GPU of this "
                f"process, {_device_names(self.devices)}), each of {length} tensors; got "
                f"{_length_text(lists)}")
        result = []
        for i, inner in enumerate(lists):
            name = f"{what}[{i}]"
            if not isinstance(inner, (list, tuple)) or len(inner) != length:
                raise ArgumentValueError(
                    f"{name} must be a list of {length} tensors (one per GPU of group "
                    f"'{self.group_name}'), not {_length_text(inner)}")
            views = self._views_on(inner, name, [self.devices[i]] * length)
            _check_like(views, name, like[i], f"{like_name}[{i}]")
            result.append(views)
        return tuple(result)

    def index(self, value: Any, what: str) -> int:
        """Check a GPU index of a process (``dst_tensor``, ``src_gpu_index`` ...).

        Args:
            value: the caller's value.
            what: the argument's name.

        Returns:
            The index.

        Raises:
            ArgumentTypeError: not an int.
            ArgumentValueError: out of range.
        """
        count = len(self.devices)
        return check_index(value, count, what, f"the {count} GPUs each process of group "
                                               f"'{self.group_name}' owns")

    def tensor(self, tensor: Any, n_elements: Any) -> Tuple[TensorView, int]:
        """The one GPU tensor of send_multigpu/recv_multigpu, and how many elements move.

        Args:
            tensor: the caller's tensor, on one of the group's GPUs.
            n_elements: elements to move; 0 means the whole tensor.

        Returns:
            The view and the element count.

        Raises:
            ArgumentTypeError: a CPU tensor, an unsupported tensor, or ``n_elements`` not an int.
            ArgumentValueError: a GPU outside the group, or ``n_elements`` out of range.
        """
        view = as_view(tensor, writable=False, what="tensor")
        device_of(view, self.devices, self.group_name, "tensor")
        if isinstance(n_elements, bool) or not isinstance(n_elements, int):
            raise ArgumentTypeError(f"n_elements must be an int, not {type(n_elements).__name__}")
        if not 0 <= n_elements <= view.count:
            raise ArgumentValueError(f"n_elements={n_elements} is out of range for a tensor of "
                             f"{view.count} elements (0 means all of them)")
        return view, n_elements or view.count

    def call(self, options: CallOptions, **fields: Any) -> PreparedCall:
        """The prepared call of one ``*_multigpu`` call, for ``Group.submit`` (its ``arrays``
        are None: the tensors are in the record).

        Args:
            options: the call's options.
            **fields: the :class:`MultiGpuCall` fields beyond the options and the number.

        Returns:
            The prepared call.
        """
        return self._prepare(options, lambda seq, arrays: MultiGpuCall(options, seq, **fields))
