"""The codes the native core speaks: dtype and op codes, and a recorded plan as int64 words.

The dtype and op tables mirror ``kernels.h`` (dtype codes follow ``tensors.SUPPORTED_DTYPES``);
:func:`encode_plan` writes the layout that ``program.c`` reads and checks:

- word 0: the number of steps, then one record per step;
- a round: ``STEP_ROUND, n``, then per message ``flags, peer, step, slot, start, stop``
  (flags: ``MESSAGE_SEND``, ``MESSAGE_REDUCE``; elements);
- a local step: ``STEP_LOCAL, kind`` (``LOCAL_COPY`` or ``LOCAL_COMBINE``), then the target and
  the source place, each ``slot, offset, ndim, *shape, *strides`` (elements).

Complex PRODUCT has two op codes because numpy multiplies complex numbers differently by CPU:
with fused multiply-adds where its SIMD loops have them (x86 with FMA3), with the plain formula
elsewhere; :func:`op_code` asks numpy once which it does here, so the native kernel agrees bit
for bit with ``reductions.combiner`` on every machine.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import List, Mapping

import numpy as np

from ..engine.plan import Local, Place, Plan
from ..reductions import check_op
from ..tensors import SUPPORTED_DTYPES
from ..types import ReduceOp

DTYPE_CODES: Mapping[str, int] = MappingProxyType(
    {name: code for code, name in enumerate(SUPPORTED_DTYPES)})
"""The dtype code of every supported dtype name."""

SUM, PRODUCT, MIN, MAX, PRODUCT_FUSED = range(5)
NO_OP = -1
"""The op code of a call that reduces nothing (broadcast, allgather, ...)."""

DONE, PENDING, MISMATCH, REROUTED = 0, 1, 2, 4
"""What ``Node.progress`` returns (the core's own constants of the same names; a test ties
them)."""

STEP_ROUND, STEP_LOCAL = 1, 2
LOCAL_COPY, LOCAL_COMBINE = 0, 1
MESSAGE_SEND, MESSAGE_REDUCE = 1, 2

_OPS = {ReduceOp.SUM: SUM, ReduceOp.AVG: SUM, ReduceOp.PRODUCT: PRODUCT, ReduceOp.MIN: MIN,
        ReduceOp.MAX: MAX}


def _numpy_fuses_complex_product(dtype_name: str) -> bool:
    """Whether numpy's complex multiply of ``dtype_name`` rounds once per component (fused).

    x = 1 + 2**-(k+1) with k half the mantissa: x*x - 1 loses its last term when x*x is rounded
    first (the plain formula) and keeps it when the product stays exact inside a fused
    multiply-add. Arrays of 16, so that numpy takes its vector loop.
    """
    finfo = np.finfo(np.dtype(dtype_name))
    x = 1.0 + 2.0 ** -(finfo.nmant // 2 + 1)
    a = np.full(16, complex(x, 1.0), dtype_name)
    plain = a.real * a.real - a.imag * a.imag
    return bool((a * a).real[0] != plain[0])


_FUSED: Mapping[str, bool] = MappingProxyType(
    {name: _numpy_fuses_complex_product(name) for name in ("complex64", "complex128")})


def dtype_code(dtype_name: str) -> int:
    """The dtype code of ``dtype_name``.

    Raises:
        KeyError: the dtype is not supported.
    """
    return DTYPE_CODES[dtype_name]


def op_code(op: ReduceOp, dtype_name: str) -> int:
    """The op code that reduces ``dtype_name`` as ``reductions.combiner(op, dtype_name)`` does.

    Args:
        op: the reduce op (AVG combines as SUM; its division stays in Python).
        dtype_name: the tensor's dtype name.

    Returns:
        The code to pass to ``Node.start`` or ``combine``.

    Raises:
        TypeError: as ``reductions.check_op`` (AVG on bool, an unsupported dtype).
    """
    check_op(op, dtype_name)
    code = _OPS[op]
    if code == PRODUCT and _FUSED.get(dtype_name, False):
        return PRODUCT_FUSED
    return code


def _place(place) -> List[int]:
    if type(place) is Place:
        return [place.slot, place.start, 1, place.stop - place.start, 1]
    return [place.slot, place.offset, len(place.shape), *place.shape, *place.strides]


def encode_plan(plan: Plan) -> np.ndarray:
    """The plan code of ``plan``, for ``Node.start``.

    Args:
        plan: a recorded plan (``plan.record`` or ``plan.point_to_point``).

    Returns:
        A read-only 1-D int64 array (encode once per call shape and keep it).

    Raises:
        ValueError: a local step of a kind the native core does not know.
    """
    words = [len(plan.steps)]
    for step in plan.steps:
        if type(step) is Local:
            if step.kind not in ("combine", "copy"):
                raise ValueError(f"a local step of kind {step.kind!r}")
            words += [STEP_LOCAL, LOCAL_COMBINE if step.kind == "combine" else LOCAL_COPY]
            words += _place(step.target) + _place(step.source)
            continue
        words += [STEP_ROUND, len(step)]
        for is_send, peer, number, (slot, start, stop), reduce in step:
            flags = (MESSAGE_SEND if is_send else 0) | (MESSAGE_REDUCE if reduce else 0)
            words += [flags, peer, number, slot, start, stop]
    code = np.array(words, np.int64)
    code.flags.writeable = False
    return code
