"""Tensor adapters: how a caller's tensor becomes a flat wire buffer.

Every collective sees the caller's tensors through a :class:`TensorView`: the original object,
its dtype, shape and device, and (for CPU tensors) a flat, 1-D, C-contiguous numpy array that
*shares memory* with the tensor, so that a backend reads the input and writes the result in
place without a copy. Recognised tensors:

- ``numpy.ndarray``;
- ``torch.Tensor`` on the CPU (through ``t.detach().numpy()``, which shares memory, also for a
  tensor that requires grad);
- ``torch.Tensor`` on CUDA and ``cupy.ndarray``: recognised with their dtype, shape and device
  (``"cuda:N"``) but without a numpy array (``array=None``), for a GPU backend.

torch and cupy are never imported by this module: a tensor is recognised by the module of its
type, so ``import ray_collective`` works without them.

A read-only numpy array given where a collective writes its result (what Ray hands to a process
as a task argument or from ``ray.get``) is written through, as ``ray.util.collective`` with Gloo
does (torch ignores numpy's flag), with a :class:`~ray_collective.errors.ReadOnlyTensorWarning`
once per process; ``RAY_COLLECTIVE_READ_ONLY=error`` refuses it instead.

Supported dtypes: bool, int8/16/32/64, uint8/16/32/64, float16, bfloat16 (torch only), float32,
float64, complex64 and complex128. A bfloat16 tensor travels as its raw bits, in a uint16 array
(``TensorView.wire_dtype``).

The element-wise reductions of these views are :mod:`ray_collective.reductions`'.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ray_collective.errors import ArgumentTypeError, ArgumentValueError, ReadOnlyTensorWarning

__all__ = [
    "SUPPORTED_DTYPES",
    "SUPPORTED_TEXT",
    "MemoryAlias",
    "TensorView",
    "as_view",
    "check_same_layout",
]

SUPPORTED_DTYPES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128",
)
"""dtype names a collective accepts (torch and numpy spell them the same way)."""

_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
SUPPORTED_TEXT = ", ".join(SUPPORTED_DTYPES) + (" (bfloat16 from torch, DLPack or ml_dtypes' "
                                                  "numpy dtype)")
"""The supported dtypes, as error messages list them."""
_SUPPORTED_TYPES_TEXT = ("numpy.ndarray, torch.Tensor (CPU or CUDA), cupy.ndarray, or an array "
                         "with __dlpack__, __cuda_array_interface__ or the buffer protocol")

_BF16_WIRE = np.dtype(np.uint16)

# Native numpy dtypes the library takes, by dtype: one dict lookup instead of dtype.name (a
# Python property of numpy's that costs microseconds) plus the byte-order and structure checks.
# A dtype that is not here goes through the full checks, which say what is wrong with it.
_NUMPY_NAMES = MappingProxyType({np.dtype(name): name for name in SUPPORTED_DTYPES
                                 if name != "bfloat16"})


def _wire_dtype(dtype_name: str) -> np.dtype:
    return _BF16_WIRE if dtype_name == "bfloat16" else np.dtype(dtype_name)


class TensorView:
    """A caller's tensor as a collective sees it.

    Attributes:
        tensor: the caller's object, unchanged.
        array: a flat, 1-D, C-contiguous numpy array that shares memory with ``tensor`` (its
            elements in C order), or None for a GPU tensor.
        dtype_name: the element type, e.g. ``"float32"``, ``"bfloat16"``, ``"bool"``.
        wire_dtype: the numpy dtype of ``array`` (bfloat16 travels as its raw bits, uint16).
        shape: the tensor's shape (``()`` for a 0-d tensor).
        device: ``"cpu"`` or ``"cuda:N"``.
        kind: ``"numpy"``, ``"torch"`` or ``"cupy"``.

    Views compare by identity (the array is not hashable or comparable as a whole). A plain
    class with slots, not a frozen dataclass: one is made per tensor per call, and a frozen
    dataclass costs microseconds to build. Treat it as read-only.
    """

    __slots__ = ("tensor", "array", "dtype_name", "wire_dtype", "shape", "device", "kind")

    def __init__(self, tensor: Any, array: Optional[np.ndarray], dtype_name: str,
                 wire_dtype: np.dtype, shape: tuple, device: str, kind: str):
        self.tensor = tensor
        self.array = array
        self.dtype_name = dtype_name
        self.wire_dtype = wire_dtype
        self.shape = shape
        self.device = device
        self.kind = kind

    @property
    def count(self) -> int:
        """Number of elements (1 for a 0-d tensor, 0 for an empty one)."""
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return (f"TensorView({self.kind} {self.dtype_name}{list(self.shape)} on "
                f"{self.device})")


def type_name(obj: Any) -> str:
    """``obj``'s type as a message names it: ``module.Class``, or the bare name of a builtin."""
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _unsupported_dtype(what: str, dtype_text: str) -> ArgumentTypeError:
    return ArgumentTypeError(
        f"{what} has dtype {dtype_text}, which collectives do not support. Supported dtypes: "
        f"{SUPPORTED_TEXT}. Cast it first (e.g. .astype(np.float32) or .to(torch.float32)).")


READ_ONLY_POLICY_VARIABLE = "RAY_COLLECTIVE_READ_ONLY"
"""Environment variable choosing what an in-place collective does with a read-only numpy array:
``write`` (the default) writes the result through it, as ``ray.util.collective`` with Gloo does;
``error`` refuses the array with an :class:`ArgumentValueError`."""

_READ_ONLY_POLICIES = ("write", "error")

_READ_ONLY_WARNING = (
    "ray_collective wrote a collective's result into a read-only numpy array, as "
    "ray.util.collective with Gloo does, so that the caller sees it in the array it passed. "
    "Numpy arrays that Ray hands to a process (task and actor arguments, ray.get results) are "
    "read-only because they are views of Ray's copy of the object, and the write changes that "
    "copy: later ray.get calls of the same ObjectRef see the new values, in this process and, "
    "for an object in the shared object store (anything put with ray.put, large arguments and "
    "results), in every process on this node, while copies made before (on other nodes, "
    "spilled to disk) keep the old ones. To leave the object intact, pass a writable copy "
    "(arr.copy()); to refuse read-only outputs instead, set "
    f"{READ_ONLY_POLICY_VARIABLE}=error in the job's environment. Shown once per process.")


class MemoryAlias:
    """Memory offered to numpy through its array interface: ``np.asarray`` of it is a flat
    array over ``address``. Holds ``owners`` (what keeps that memory alive), so the memory lives
    as long as any array made from the alias.

    Args:
        owners: the objects the memory belongs to.
        count: the elements.
        dtype: their numpy dtype.
        address: where the first one is.
        read_only: whether numpy's array refuses writes.
    """

    def __init__(self, owners: tuple, count: int, dtype: np.dtype, address: int,
                 read_only: bool):
        self.owners = owners
        self.__array_interface__ = {"shape": (count,), "typestr": dtype.str,
                                    "data": (address, read_only), "version": 3}


def _write_through(arr: np.ndarray, what: str) -> np.ndarray:
    """A flat writable array over the memory of the read-only, contiguous ``arr``.

    Numpy refuses to make such an array writable when its memory belongs to a read-only buffer
    (Ray's object store, a task's argument buffer), yet code written for ``ray.util.collective``
    runs in-place collectives on exactly those arrays and reads the result from them. The policy
    comes from the environment variable ``RAY_COLLECTIVE_READ_ONLY`` (read only on this path).

    Raises:
        ArgumentValueError: the policy is ``error``, or the variable holds an unknown policy.
    """
    policy = os.environ.get(READ_ONLY_POLICY_VARIABLE, "write").strip().lower() or "write"
    if policy not in _READ_ONLY_POLICIES:
        raise ArgumentValueError(
            f"{READ_ONLY_POLICY_VARIABLE}={policy!r} is not a policy for read-only outputs; "
            f"use one of {', '.join(_READ_ONLY_POLICIES)}")
    if policy == "error":
        raise ArgumentValueError(
            f"{what} is a read-only numpy array, but this collective writes its result into it "
            f"({READ_ONLY_POLICY_VARIABLE}=error). Arrays Ray hands to a process (task "
            f"arguments, ray.get results) are read-only views of the object: pass a writable "
            f"copy, e.g. arr.copy(), or unset {READ_ONLY_POLICY_VARIABLE} to write through.")
    # A fixed message and location: the default warning filter shows it once per process.
    warnings.warn(_READ_ONLY_WARNING, ReadOnlyTensorWarning, stacklevel=1)
    if arr.size == 0:
        return np.empty(0, arr.dtype)  # nothing will be written
    # The memory of the read-only array, offered as writable.
    return np.asarray(MemoryAlias((arr,), arr.size, arr.dtype, arr.ctypes.data, False))


def _numpy_view(arr: np.ndarray, writable: bool, what: str) -> TensorView:
    dtype = arr.dtype
    name = _NUMPY_NAMES.get(dtype)
    if name is None or type(arr) is not np.ndarray:
        name = _check_unusual_numpy(arr, what)
    if not arr.flags.c_contiguous:
        raise ArgumentValueError(
            f"{what} is a non-contiguous numpy array (shape {arr.shape}, strides "
            f"{arr.strides}). Pass np.ascontiguousarray({what.split('[')[0]}) instead "
            f"(and copy the result back if you need it in the original array).")
    if writable and not arr.flags.writeable:
        flat = _write_through(arr, what)
    else:
        flat = arr.view(np.ndarray).reshape(-1)  # np.matrix and such stay 2-D otherwise
    if name == "bfloat16":
        flat, dtype = flat.view(_BF16_WIRE), _BF16_WIRE
    return TensorView(arr, flat, name, dtype, arr.shape, "cpu", "numpy")


def _check_unusual_numpy(arr: np.ndarray, what: str) -> str:
    """The dtype name of an array of a numpy subclass or of an uncommon dtype, once checked."""
    if isinstance(arr, np.ma.MaskedArray):
        raise ArgumentTypeError(
            f"{what} is a numpy masked array; collectives would ignore its mask. Pass "
            f"{what.split('[')[0]}.filled(value) (a plain ndarray) instead.")
    dtype = arr.dtype
    name = dtype.name
    if name == "bfloat16" and _is_ml_dtypes_bfloat16(dtype):
        return name
    if name not in _SUPPORTED_SET or name == "bfloat16" or dtype.fields is not None:
        raise _unsupported_dtype(what, f"'{dtype}'")
    if not dtype.isnative:
        raise ArgumentTypeError(
            f"{what} has the non-native byte order dtype '{dtype.str}'. Convert it with "
            f"arr.astype(arr.dtype.newbyteorder('=')) first.")
    return name


def _is_ml_dtypes_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is the bfloat16 of ml_dtypes (JAX's numpy arrays of bfloat16)."""
    return dtype.itemsize == 2 and type(dtype).__module__.split(".")[0] == "ml_dtypes"


def _torch_view(t: Any, torch: Any, writable: bool, what: str) -> TensorView:
    if t.layout != torch.strided:
        raise ArgumentTypeError(
            f"{what} is a torch tensor with layout {t.layout}; only dense (strided) tensors are "
            f"supported. Pass {what.split('[')[0]}.to_dense() instead.")
    name = str(t.dtype).replace("torch.", "", 1)
    if name not in _SUPPORTED_SET:
        raise _unsupported_dtype(what, str(t.dtype))
    dev = t.device
    if dev.type == "cpu":
        device = "cpu"
    elif dev.type == "cuda":
        device = f"cuda:{dev.index if dev.index is not None else 0}"
    else:
        raise ArgumentTypeError(
            f"{what} is a torch tensor on device '{dev}'; only CPU and CUDA tensors are "
            f"supported. Move it with .cpu() or .cuda() first.")
    if not t.is_contiguous():
        raise ArgumentValueError(
            f"{what} is a non-contiguous torch tensor (shape {tuple(t.shape)}, stride "
            f"{tuple(t.stride())}). Pass {what.split('[')[0]}.contiguous() instead (and copy "
            f"the result back with .copy_() if you need it in the original tensor).")
    if t.is_conj() or t.is_neg():
        raise ArgumentValueError(
            f"{what} is a lazily conjugated or negated torch view. Pass "
            f"{what.split('[')[0]}.resolve_conj().resolve_neg() instead.")
    shape = tuple(t.shape)
    if device != "cpu":
        return TensorView(tensor=t, array=None, dtype_name=name, wire_dtype=_wire_dtype(name),
                          shape=shape, device=device, kind="torch")
    d = t.detach()
    if name == "bfloat16":
        arr = d.view(torch.int16).numpy().view(np.uint16)
    else:
        arr = d.numpy()
    flat = arr.reshape(-1)
    return TensorView(tensor=t, array=flat, dtype_name=name, wire_dtype=flat.dtype,
                      shape=shape, device="cpu", kind="torch")


def _cupy_view(t: Any, what: str) -> TensorView:
    dtype = np.dtype(t.dtype)
    name = dtype.name
    if name not in _SUPPORTED_SET or name == "bfloat16":
        raise _unsupported_dtype(what, f"'{dtype}'")
    if not t.flags.c_contiguous:
        raise ArgumentValueError(
            f"{what} is a non-contiguous cupy array (shape {tuple(t.shape)}). Pass "
            f"cupy.ascontiguousarray({what.split('[')[0]}) instead.")
    device = f"cuda:{int(t.device.id)}"
    return TensorView(tensor=t, array=None, dtype_name=name, wire_dtype=dtype,
                      shape=tuple(t.shape), device=device, kind="cupy")


def _foreign_kind(tensor: Any) -> Optional[str]:
    """``"torch"`` for a torch tensor, ``"cupy"`` for an object of cupy's, else None: the one
    place either is recognised, by the tensor's type alone (neither is ever imported here: a
    torch tensor implies a loaded torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, getattr(torch, "Tensor", ())):
        return "torch"
    module = type(tensor).__module__ or ""
    if module == "cupy" or module.startswith("cupy."):
        return "cupy"
    return None


def tensor_layout(tensor: Any) -> Optional[tuple]:
    """What decides whether a cupy array or torch tensor passes :func:`as_view`'s checks, for
    a cache key.

    Two tensors with the same layout pass or fail alike: the dtype, shape and strides decide
    the dtype and contiguity checks, the device where the call runs, and for torch the lazy
    conjugate and negative bits.

    Args:
        tensor: any object.

    Returns:
        ``("cupy", dtype, shape, strides, device index)`` for a cupy array, ``("torch", dtype,
        shape, stride, device, is_conj, is_neg)`` for a dense torch tensor on the CPU (not
        bfloat16, whose numpy array :func:`known_shape_input` could not give) or CUDA, or None
        for anything else (an object of cupy's that is no array, say: :func:`as_view` names
        it).
    """
    kind = _foreign_kind(tensor)
    if kind == "cupy":
        try:
            return ("cupy", tensor.dtype, tensor.shape, tensor.strides, tensor.device.id)
        except AttributeError:
            return None
    if kind != "torch":
        return None
    torch = sys.modules["torch"]
    # Every attribute of a torch tensor costs a call into torch: each is read once, the
    # device's kind only for a bfloat16 tensor.
    dtype = tensor.dtype
    if tensor.layout is not torch.strided or (
            dtype is getattr(torch, "bfloat16", None) and not tensor.is_cuda):
        return None
    return ("torch", dtype, tensor.shape, tensor.stride(), tensor.device, tensor.is_conj(),
            tensor.is_neg())


def _torch_cpu_array(tensor: Any) -> np.ndarray:
    return tensor.detach().numpy()


def known_shape_input(view: TensorView) -> Optional[Callable[[Any], Any]]:
    """How a later call's tensor of ``view``'s shape becomes what a CPU backend's known-shape
    runner takes, or None when it takes the tensor itself (numpy arrays; GPU tensors, whose
    backend reads their address).

    Args:
        view: the first call's tensor.

    Returns:
        For a torch CPU tensor, a function giving its numpy array (sharing its memory, in its
        own shape); else None.
    """
    if view.kind == "torch" and view.device == "cpu":
        return _torch_cpu_array
    return None


def as_view(tensor: Any, *, writable: bool, what: str = "tensor") -> TensorView:
    """Recognise ``tensor`` and return its :class:`TensorView`, checking it can be used.

    Args:
        tensor: a ``numpy.ndarray``, a ``torch.Tensor`` (CPU or CUDA) or a ``cupy.ndarray``.
        writable: whether the collective writes into the tensor (a read-only numpy array is
            then written through; see the module's docstring).
        what: how messages name the argument, e.g. ``"tensor"`` or ``"tensor_list[2]"``.

    Returns:
        The view; for a CPU tensor its ``array`` shares memory with ``tensor``.

    Raises:
        ArgumentTypeError: ``tensor`` is not a supported tensor type (a Python list or a numpy
            scalar is not a tensor), or its dtype, layout or device is not supported.
        ArgumentValueError: the tensor is not contiguous, or ``writable`` is set, it is a
            read-only numpy array and ``RAY_COLLECTIVE_READ_ONLY=error``.
    """
    if isinstance(tensor, np.ndarray):
        return _numpy_view(tensor, writable, what)
    kind = _foreign_kind(tensor)
    if kind == "torch":
        return _torch_view(tensor, sys.modules["torch"], writable, what)
    if kind == "cupy" and all(hasattr(tensor, name) for name in ("flags", "device", "dtype")):
        return _cupy_view(tensor, what)
    if isinstance(tensor, np.generic):
        hint = (f"A numpy scalar is not a tensor: wrap it in an array, e.g. "
                f"np.array([{what.split('[')[0]}]), and read the result from that array.")
    elif isinstance(tensor, (list, tuple)):
        hint = (f"A Python {type(tensor).__name__} is not a tensor: convert it with "
                f"np.array(...) or torch.tensor(...) and pass that object.")
    else:
        # Known types first, the protocols after: a numpy array or torch tensor never pays
        # for this import or for the protocol checks.
        from ray_collective.array_protocols import view_of_protocol
        view = view_of_protocol(tensor, writable, what)
        if view is not None:
            return view
        hint = "Convert it to one of those first."
    raise ArgumentTypeError(
        f"{what} must be a {_SUPPORTED_TYPES_TEXT}, not {type_name(tensor)}. {hint}")


def check_same_layout(views: Sequence[TensorView], what: str,
                      reference: Optional[TensorView] = None,
                      reference_name: str = "tensor") -> None:
    """Check that every view has the same shape, dtype and device as a reference.

    CPU tensors of different kinds mix freely (a list of torch tensors and numpy arrays, as
    ``ray.util.collective`` with Gloo accepts); GPU tensors must also be of the same kind, since
    a GPU backend orders the call after the work queued on that library's stream.

    Args:
        views: the views of a list argument (e.g. an allgather's ``tensor_list``).
        what: the argument's name, used in the message (``"tensor_list"``).
        reference: the view every entry must match; None means ``views[0]``.
        reference_name: the reference's name in the message.

    Raises:
        ArgumentValueError: a view differs from the reference; the message names the first
            index that differs and both values.
    """
    if not views:
        return
    if reference is None:
        reference, reference_name = views[0], f"{what}[0]"
    fields = ("shape", "dtype_name", "device") if reference.device == "cpu" else \
        ("shape", "dtype_name", "kind", "device")
    for i, view in enumerate(views):
        for field in fields:
            mine, theirs = getattr(view, field), getattr(reference, field)
            if mine != theirs:
                label = "dtype" if field == "dtype_name" else field
                raise ArgumentValueError(
                    f"{what}[{i}] has {label} {mine!r} but {reference_name} has {label} "
                    f"{theirs!r}. Every tensor in {what} must have the same shape, dtype and "
                    f"device as {reference_name}.")
