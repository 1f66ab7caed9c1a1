"""Arrays the library does not know by their type, taken through the protocols they expose.

:func:`ray_collective.tensors.as_view` recognises numpy arrays, torch tensors and cupy arrays by
their type first (the per-call cost of those stays a type check); anything else comes here and
is taken through the first protocol it has:

- **DLPack** (``__dlpack__`` and ``__dlpack_device__``: JAX, PaddlePaddle, MXNet, TensorFlow's
  experimental arrays, and any numpy-like library). On the CPU (or host memory a CPU reads:
  pinned CUDA or ROCm host memory) the capsule is read here, without a copy: dtype, shape,
  strides, the byte offset and, for a versioned (DLPack 1.x) capsule, its read-only flag. The
  numpy array made over that memory keeps the capsule alive, so the producer frees the memory
  only when the last array made from it is gone. A capsule of the legacy, unversioned form
  carries no read-only flag: it is taken as read-only, as ``numpy.from_dlpack`` does, since
  the producer may be one whose arrays are immutable (JAX). On a CUDA device (or managed
  memory) it goes to a GPU backend through cupy's or torch's ``from_dlpack`` (whichever is
  installed), which share the memory.
- **``__cuda_array_interface__``** (Numba, PyCUDA, ...): on the GPU through cupy (or torch).
- **The buffer protocol** (``memoryview``, ``bytearray``, ``array.array``, ``mmap``, ``bytes``
  read-only): the memory as the buffer describes it (its struct format gives the dtype).

What is read-only (an immutable producer's array, a read-only buffer, ``bytes``) is refused
where a collective writes its result, and never copied behind the caller's back: the message
names :mod:`ray_collective.functional`, whose calls return the result as a new array. Memory
that is not contiguous is refused as a non-contiguous numpy array is. A dtype outside the
library's (float8, a vector of lanes, an opaque handle) is refused naming it.
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Any, Optional, Tuple

import numpy as np

from ray_collective.errors import ArgumentTypeError, ArgumentValueError
from ray_collective.tensors import (SUPPORTED_DTYPES, MemoryAlias, TensorView, as_view,
                                    type_name)

__all__ = ["view_of_protocol", "DLPACK_CPU_DEVICES", "DLPACK_GPU_DEVICES"]

DLPACK_CPU_DEVICES = frozenset({1, 3, 11})
"""DLPack device types whose memory this process's CPU reads: kDLCPU, kDLCUDAHost (pinned host
memory), kDLROCMHost."""
DLPACK_GPU_DEVICES = frozenset({2, 13})
"""DLPack device types a GPU backend takes: kDLCUDA and kDLCUDAManaged."""

_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                 9: "VPI", 10: "ROCm", 11: "ROCm host", 12: "an external device",
                 13: "CUDA managed", 14: "oneAPI", 15: "WebGPU", 16: "Hexagon"}

# DLPack's (type code, bits) of one lane, and the library's name of that dtype.
_DLPACK_DTYPES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
                  (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
                  (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
                  (4, 16): "bfloat16", (5, 64): "complex64", (5, 128): "complex128",
                  (6, 8): "bool"}
_DLPACK_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "an opaque handle", 4: "bfloat",
                      5: "complex", 6: "bool", 7: "float8_e3m4", 8: "float8_e4m3",
                      9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn", 11: "float8_e4m3fnuz",
                      12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
                      15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}
_BUFFER_DTYPES = frozenset(SUPPORTED_DTYPES) - {"bfloat16"}
_READ_ONLY_FLAG = 1
_VERSIONED = b"dltensor_versioned"
_LEGACY = b"dltensor"


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _ManagedLegacy(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _Tensor)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def view_of_protocol(obj: Any, writable: bool, what: str) -> Optional[TensorView]:
    """The view of an object taken through DLPack, the CUDA array interface or a buffer.

    Args:
        obj: the caller's object (not a numpy array, torch tensor or cupy array).
        writable: whether the collective writes into it.
        what: how messages name the argument.

    Returns:
        The view, or None when ``obj`` exposes none of the protocols. A CPU view's ``array``
        shares the object's memory and its ``kind`` is ``"dlpack"`` or ``"buffer"``; a GPU
        view is that of the cupy array (or torch tensor) over the same memory.

    Raises:
        ArgumentTypeError: its dtype or device is not one the library takes, or the GPU
            memory cannot be reached (neither cupy nor torch with CUDA is installed).
        ArgumentValueError: it is read-only and ``writable`` is set, or its memory is not
            contiguous.
    """
    cls = type(obj)
    if hasattr(cls, "__dlpack__") and hasattr(cls, "__dlpack_device__"):
        device_type, device_id = (int(v) for v in obj.__dlpack_device__())
        if device_type in DLPACK_CPU_DEVICES:
            return _dlpack_cpu_view(obj, writable, what)
        if device_type in DLPACK_GPU_DEVICES:
            return as_view(_on_gpu(obj, "from_dlpack", what), writable=writable, what=what)
        raise ArgumentTypeError(
            f"{what} is a {type_name(obj)} on a {_DEVICE_NAMES.get(device_type, device_type)}"
            f" device (DLPack device type {device_type}, id {device_id}); collectives take "
            f"CPU and CUDA memory. Move it to the CPU or a CUDA device first.")
    if hasattr(obj, "__cuda_array_interface__"):
        return as_view(_on_gpu(obj, "asarray", what), writable=writable, what=what)
    try:
        buffer = memoryview(obj)
    except TypeError:
        return None
    return _buffer_view(obj, buffer, writable, what)


def _on_gpu(obj: Any, how: str, what: str) -> Any:
    """``obj``'s GPU memory as a cupy array (or a torch tensor), without a copy."""
    cupy = _importable("cupy")
    if cupy is not None:
        return getattr(cupy, how)(obj)
    torch = _importable("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.from_dlpack(obj) if how == "from_dlpack" else \
            torch.as_tensor(obj, device="cuda")
    raise ArgumentTypeError(
        f"{what} is a {type_name(obj)} in CUDA memory, which this process reaches through "
        f"cupy or torch with CUDA; neither is installed here. Install cupy (or a CUDA build "
        f"of torch), or move the array to the CPU first.")


def _importable(name: str) -> Any:
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return __import__(name)
    except ImportError:
        return None


def _export(obj: Any, what: str) -> Any:
    """``obj.__dlpack__()``, asking for a versioned capsule (which says whether it is
    read-only); a producer that predates DLPack 1.0 refuses the argument and gives a legacy
    one. A producer that cannot export the array (a dtype DLPack has no code for) says why."""
    try:
        try:
            return obj.__dlpack__(max_version=(1, 0))
        except TypeError:
            return obj.__dlpack__()
    except Exception as error:  # the producer's own error type (JAX's, Paddle's, ...)
        raise ArgumentTypeError(
            f"{what} is a {type_name(obj)} that could not be exported through DLPack "
            f"({type(error).__name__}: {error}). Cast it to a supported dtype or pass a numpy "
            f"array.") from error


def _read_capsule(capsule: Any, what: str) -> Tuple[_Tensor, str]:
    """The capsule's DLTensor, and why its memory is read-only ("" when it is writable)."""
    name = _capsule_name(capsule)
    if name == _VERSIONED:
        managed = _ManagedVersioned.from_address(_capsule_pointer(capsule, name))
        if managed.version.major != 1:
            raise ArgumentTypeError(
                f"{what} was exported with DLPack {managed.version.major}."
                f"{managed.version.minor}, which this library cannot read (it reads 1.x).")
        read_only = managed.flags & _READ_ONLY_FLAG
        return managed.dl_tensor, "its DLPack export is marked read-only" if read_only else ""
    if name == _LEGACY:
        return (_ManagedLegacy.from_address(_capsule_pointer(capsule, name)).dl_tensor,
                "its producer exports DLPack capsules older than 1.0, which cannot say that "
                "the memory may be written, so it is taken as read-only")
    raise ArgumentTypeError(
        f"{what}.__dlpack__() gave {capsule!r}, not an unconsumed DLPack capsule.")


def _dlpack_dtype(tensor: _Tensor, what: str) -> str:
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    name = _DLPACK_DTYPES.get((code, bits)) if lanes == 1 else None
    if name is None:
        kind = _DLPACK_CODE_NAMES.get(code, f"type code {code}")
        lane_text = f" x {lanes} lanes" if lanes != 1 else ""
        raise ArgumentTypeError(
            f"{what} has the DLPack dtype {kind} of {bits} bits{lane_text}, which collectives "
            f"do not support. Supported dtypes: bool, int8/16/32/64, uint8/16/32/64, float16, "
            f"bfloat16, float32, float64, complex64, complex128; cast it first.")
    return name


def _dlpack_cpu_view(obj: Any, writable: bool, what: str) -> TensorView:
    capsule = _export(obj, what)
    tensor, read_only = _read_capsule(capsule, what)
    name = _dlpack_dtype(tensor, what)
    wire = np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    count = math.prod(shape)
    if tensor.strides and count > 1:
        strides = tuple(tensor.strides[i] for i in range(tensor.ndim))
        expected, step = [], 1
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if any(s != e for s, e, n in zip(strides, reversed(expected), shape) if n > 1):
            raise ArgumentValueError(
                f"{what} is a non-contiguous {type_name(obj)} (shape {shape}, strides "
                f"{strides} in elements). Pass a contiguous copy instead (and copy the result "
                f"back if you need it in the original array).")
    if writable and read_only:
        raise _read_only_error(obj, what, read_only)
    address = (tensor.data or 0) + tensor.byte_offset
    if count == 0:
        flat = np.empty(0, wire)
    else:
        # Holds the capsule: an unconsumed capsule's destructor calls the producer's deleter,
        # so the producer frees the memory only when the last array made from it is gone.
        flat = np.asarray(MemoryAlias((capsule, obj), count, wire, address, bool(read_only)))
    return TensorView(obj, flat, name, wire, shape, "cpu", "dlpack")


def _read_only_error(obj: Any, what: str, why: str) -> ArgumentValueError:
    return ArgumentValueError(
        f"{what} is a read-only {type_name(obj)} ({why}), but this collective writes its "
        f"result into it. Immutable arrays (JAX's) and read-only buffers are never written "
        f"through or copied behind your back: call the same collective in "
        f"ray_collective.functional, which returns the result as a new array, or pass a "
        f"writable array (e.g. np.array(x)).")


def _buffer_view(obj: Any, view: memoryview, writable: bool, what: str) -> TensorView:
    try:
        array = np.asarray(view)
    except (ValueError, TypeError) as error:
        raise ArgumentTypeError(
            f"{what} is a {type_name(obj)} whose buffer format {view.format!r} collectives "
            f"do not take ({error}). Pass a numpy array of a supported dtype instead.") from None
    name = array.dtype.name
    if (name not in _BUFFER_DTYPES or array.dtype.fields is not None
            or not array.dtype.isnative):
        raise ArgumentTypeError(
            f"{what} is a {type_name(obj)} whose buffer format {view.format!r} "
            f"(numpy dtype {array.dtype.str}) collectives do not take. Pass a numpy array of "
            f"a supported dtype instead.")
    if not array.flags.c_contiguous:
        raise ArgumentValueError(
            f"{what} is a non-contiguous {type_name(obj)} (shape {array.shape}, strides "
            f"{array.strides}). Pass a contiguous copy instead (and copy the result back if "
            f"you need it in the original buffer).")
    if writable and view.readonly:
        raise _read_only_error(obj, what, "its buffer is read-only")
    return TensorView(obj, array.reshape(-1), name, array.dtype, array.shape, "cpu", "buffer")
