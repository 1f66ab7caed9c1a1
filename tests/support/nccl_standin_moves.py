"""What the NCCL stand-in (``support.nccl_standin``) does with the data of matched NCCL calls,
on host memory, as NCCL's kernels do it:

- No defensive copy: each rank's output is written from the other ranks' buffers as they are at
  that moment, rank after rank, so buffers that alias in a way NCCL does not allow (an output
  overlapping a part of an input that another output is made of) give wrong results here too.
  The aliasing NCCL allows works: a reduction's or broadcast's output in place of its input, an
  allgather's input at its rank's place in the output, a reduce-scatter's output at its rank's
  place in the input.
- Reductions in the buffer's dtype with numpy's ufuncs; bfloat16 (held as uint16 bit patterns)
  in float32 rounded to bfloat16, to nearest with ties to even, after every step, as NCCL's
  kernels do; the average is the sum divided once (``support.reference.average_of_sum``).
- A call whose parties disagree (kind, count, datatype, op, root) is not run at all: NCCL would
  hang or corrupt memory, and the stand-in leaves the parties waiting (see ``nccl_standin``).

Every function takes ``typed(op, pointer, count)``, the op's memory as an array of its
datatype's dtype.
"""

from typing import Callable, List, Sequence

import numpy as np

from support.reference import average_of_sum

NCCL_CONSTANTS = dict(
    NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, NCCL_AVG=4,
    NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4, NCCL_UINT64=5,
    NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_BFLOAT16=9,
)
BFLOAT16 = NCCL_CONSTANTS["NCCL_BFLOAT16"]
DATATYPE_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64,
                   5: np.uint64, 6: np.float16, 7: np.float32, 8: np.float64, BFLOAT16: np.uint16}
"""The numpy dtype of each NCCL datatype's memory (bfloat16: its bit patterns)."""
_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}
_MATCHED_FIELDS = ("count", "datatype", "op", "root")

Typed = Callable[[object, int, int], np.ndarray]


def disagreement(ops: Sequence) -> str:
    """What the parties of one matched call disagree on, or "" when they agree.

    Args:
        ops: the parties' ops (``kind`` and ``args``), in rank order (a send and a receive for
            point-to-point).

    Returns:
        A description, for the stand-in's log.
    """
    first = ops[0]
    kinds = {op.kind for op in ops}
    if kinds not in ({first.kind}, {"send", "recv"}):
        return f"kinds {sorted(kinds)}"
    for field in _MATCHED_FIELDS:
        if field == "op" and kinds == {"send", "recv"}:
            continue
        values = [op.args.get(field) for op in ops]
        if len(set(values)) > 1:
            return f"{field} {values}"
    return ""


def move_p2p(send, recv, typed: Typed) -> None:
    """Copy a send's buffer into its matching receive's."""
    count = send.args["count"]
    typed(recv, recv.args["buf"], count)[...] = typed(send, send.args["buf"], count)


def run_collective(ops: List, typed: Typed) -> None:
    """Move the data of one collective whose parties (in rank order) agree."""
    first = ops[0]
    n, count, kind = len(ops), first.args["count"], first.kind
    datatype, op = first.args["datatype"], first.args.get("op")
    if kind in ("allReduce", "reduce"):
        # one result for every target: NCCL allows each rank's output to be its input
        result = reduce_arrays([typed(o, o.args["sendbuf"], count) for o in ops], op, datatype)
        for target in ops if kind == "allReduce" else [ops[first.args["root"]]]:
            typed(target, target.args["recvbuf"], count)[...] = result
    elif kind == "broadcast":
        root = ops[first.args["root"]]
        for target in ops:
            typed(target, target.args["recvbuf"], count)[...] = typed(
                root, root.args["sendbuf"], count)
    elif kind == "allGather":
        for target in ops:
            received = typed(target, target.args["recvbuf"], count * n)
            for j, source in enumerate(ops):
                received[j * count:(j + 1) * count] = typed(source, source.args["sendbuf"],
                                                            count)
    else:  # reduceScatter
        for r, target in enumerate(ops):
            parts = [typed(o, o.args["sendbuf"], count * n)[r * count:(r + 1) * count]
                     for o in ops]
            typed(target, target.args["recvbuf"], count)[...] = reduce_arrays(parts, op,
                                                                               datatype)


def reduce_arrays(arrays: Sequence[np.ndarray], op: int, datatype: int) -> np.ndarray:
    """Reduce ``arrays`` (one per rank) with NCCL op ``op``, in NCCL datatype ``datatype``.

    Returns:
        A new array (the inputs are read, not kept).
    """
    if datatype == BFLOAT16:
        return _reduce_bfloat16(arrays, op)
    stacked = np.stack(arrays)
    if op == NCCL_CONSTANTS["NCCL_AVG"]:
        return average_of_sum(np.add.reduce(stacked, axis=0, dtype=stacked.dtype), len(arrays))
    return _UFUNCS[op].reduce(stacked, axis=0, dtype=stacked.dtype)


def _reduce_bfloat16(arrays: Sequence[np.ndarray], op: int) -> np.ndarray:
    average = op == NCCL_CONSTANTS["NCCL_AVG"]
    ufunc = np.add if average else _UFUNCS[op]
    total = _widen(arrays[0])
    for bits in arrays[1:]:
        total = _widen(_round_to_bfloat16(ufunc(total, _widen(bits))))
    if average:
        total = total / np.float32(len(arrays))
    return _round_to_bfloat16(total)


def _widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns as the float32 values they are (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 bit patterns: to nearest, ties to even; NaN stays
    NaN."""
    wide = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
