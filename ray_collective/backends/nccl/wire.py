"""How a tensor's dtype and a ReduceOp become what NCCL is told: datatype, element count, op.

NCCL knows int8, uint8, int32, uint32, int64, uint64, float16, float32, float64 and (from 2.10)
bfloat16. The other dtypes of this library still work where the result is exact:

- Data movement (broadcast, allgather, gather, scatter, alltoall, send, recv) never looks at
  values, so a dtype NCCL lacks (bool, int16, uint16, complex) travels as its raw bytes.
- bool reductions run on the bytes as uint8, whose values are 0 and 1: SUM (logical or) is MAX,
  PRODUCT (logical and) is MIN, MIN and MAX are themselves.
- complex SUM and AVG are the SUM and AVG of the real and imaginary parts, so a complex64 tensor
  reduces as twice as many float32 values. Complex PRODUCT, MIN and MAX are not elementwise on
  the parts and are refused.
- int16 and uint16 reductions are refused (NCCL has no 16-bit integer): cast to int32 first.

``ReduceOp.AVG`` is NCCL's own ``ncclAvg`` (NCCL 2.10 and later); on integers it truncates
toward zero, as this library's CPU backends do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ...types import ReduceOp

_NATIVE = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}
_COMPLEX_PARTS = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_OPS = {
    ReduceOp.SUM: "NCCL_SUM", ReduceOp.PRODUCT: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX", ReduceOp.AVG: "NCCL_AVG",
}
# A bool is 0 or 1 in one byte: logical or is the maximum, logical and the minimum.
_BOOL_OPS = {ReduceOp.SUM: "NCCL_MAX", ReduceOp.PRODUCT: "NCCL_MIN",
             ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}

if TYPE_CHECKING:
    from .library import NcclLibrary

FIRST_VERSION_WITH_AVG = 21000  # NCCL 2.10.0, which added ncclAvg and bfloat16


@dataclass(frozen=True)
class WireFormat:
    """What one tensor is as NCCL sees it.

    Attributes:
        datatype: the NCCL datatype.
        per_element: NCCL elements per tensor element (2 for complex parts, the item size when
            the tensor travels as bytes, else 1).
        op: the NCCL reduction, or -1 for data movement.
    """

    datatype: int
    per_element: int = 1
    op: int = -1


def _native(library: "NcclLibrary", dtype_name: str) -> Optional[int]:
    name = _NATIVE.get(dtype_name)
    if name is None or (dtype_name == "bfloat16" and library.version < FIRST_VERSION_WITH_AVG):
        return None
    return library.constant(name)


def movement_format(library: "NcclLibrary", dtype_name: str, itemsize: int) -> WireFormat:
    """The format that moves a tensor unchanged: its own NCCL type, else its bytes.

    Args:
        library: the NCCL library (enum values, version).
        dtype_name: the tensor's dtype name.
        itemsize: bytes per element.

    Returns:
        The format (``op`` is -1).
    """
    datatype = _native(library, dtype_name)
    if datatype is not None:
        return WireFormat(datatype)
    return WireFormat(library.constant("NCCL_UINT8"), itemsize)


def reduction_format(library: "NcclLibrary", dtype_name: str, op: ReduceOp) -> WireFormat:
    """The format that reduces a tensor with ``op`` exactly as the CPU backends do.

    Args:
        library: the NCCL library (enum values, version).
        dtype_name: the tensor's dtype name.
        op: the reduction.

    Returns:
        The format.

    Raises:
        TypeError: NCCL cannot reduce this dtype with this op (int16/uint16; complex PRODUCT,
            MIN, MAX), or the op or dtype needs a newer NCCL than this process has; the message
            says what to do instead. (A TypeError, like any bad argument, leaves the group
            usable.)
    """
    if op is ReduceOp.AVG and (library.version < FIRST_VERSION_WITH_AVG
                               or library.constant("NCCL_AVG") is None):
        raise TypeError(
            f"ReduceOp.AVG needs NCCL 2.10 or newer, and this process has NCCL "
            f"{format_version(library.version)}; upgrade NCCL, or reduce with ReduceOp.SUM and "
            f"divide by the world size")
    if dtype_name == "bool":
        return WireFormat(library.constant("NCCL_UINT8"), 1, library.constant(_BOOL_OPS[op]))
    nccl_op = library.constant(_OPS[op])
    if dtype_name in _COMPLEX_PARTS:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(
                f"the nccl backend cannot reduce {dtype_name} tensors with ReduceOp.{op.name}: "
                f"NCCL reduces real numbers, and only SUM and AVG of complex numbers are sums "
                f"of their parts. Reduce the real and imaginary parts yourself, or use the "
                f"'ray' backend.")
        return WireFormat(library.constant(_COMPLEX_PARTS[dtype_name]), 2, nccl_op)
    datatype = _native(library, dtype_name)
    if datatype is None:
        if dtype_name == "bfloat16":
            raise TypeError(
                f"bfloat16 reductions need NCCL 2.10 or newer, and this process has NCCL "
                f"{format_version(library.version)}; upgrade NCCL or cast to float32")
        raise TypeError(
            f"the nccl backend cannot reduce {dtype_name} tensors: NCCL has no such type. "
            f"Cast to int32 (or float32) first; broadcast, allgather, send and recv move "
            f"{dtype_name} unchanged.")
    return WireFormat(datatype, 1, nccl_op)


def format_version(code: int) -> str:
    """NCCL's version code as ``major.minor.patch``.

    Args:
        code: ``ncclGetVersion``'s value (``21805`` for 2.18.5; ``2708`` for 2.7.8, before 2.9).

    Returns:
        The dotted version.
    """
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"
