"""The GPU tests at world size 1 (``tests/test_nccl_gpu.py``), written once against a small
device interface so that they run on real GPUs and on the NCCL stand-in alike.

At world size 1 a correct result often equals the input, so a test that compares an in-place
result with its input cannot fail, even when nothing was launched. Here every output that a
launch or a copy must write starts as a sentinel unlike the expected result in every element
(:func:`unlike`), reductions are also run out of place (reducescatter of one part), and every
result is asserted against numpy. ``tests/test_nccl_standin.py`` shows that each body fails
when the stand-in's launches move nothing.

A body takes a :class:`Gpus` and returns what ``run_nccl_ranks`` runs as rank 0's body.
"""

from typing import Callable, Protocol, Sequence

import numpy as np

import ray_collective as col
from ray_collective.backends.nccl import NcclLibrary
from support.helpers import numpy_reduce, rank_data

OPS = [col.ReduceOp.SUM, col.ReduceOp.PRODUCT, col.ReduceOp.MIN, col.ReduceOp.MAX,
       col.ReduceOp.AVG]
REDUCIBLE = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"]
"""The dtypes the NCCL backend reduces (bool on its bytes, complex on its float parts)."""
MOVED_ONLY = ["int16", "uint16"]
"""The dtypes NCCL only moves (as bytes)."""


class Gpus(Protocol):
    """The GPUs a body runs on."""

    device_count: int
    """Visible GPUs."""

    def library(self) -> NcclLibrary:
        """The NCCL library the group uses."""

    def array(self, values: np.ndarray, device: int = 0):
        """A tensor on GPU ``device`` holding ``values``."""

    def host(self, tensor) -> np.ndarray:
        """A copy of ``tensor`` in host memory (after the caller's stream's work)."""


def ops_for(dtype: str) -> list:
    """The reductions NCCL can do on ``dtype``."""
    if dtype == "bool":
        return OPS[:4]
    if dtype.startswith("complex"):
        return [col.ReduceOp.SUM, col.ReduceOp.AVG]
    return OPS


def unlike(expected: np.ndarray) -> np.ndarray:
    """A sentinel of ``expected``'s dtype and shape that differs from it in every element."""
    if expected.dtype == np.bool_:
        return ~expected
    return expected + expected.dtype.type(1)  # integers may wrap: still another value


def _same(gpus: Gpus, tensor, expected: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(gpus.host(tensor), expected, err_msg=what)


def every_collective(gpus: Gpus) -> Callable[[int], bool]:
    """Every collective once per dtype (and op) it takes, at world size 1 on GPU 0."""
    def body(rank: int) -> bool:
        for dtype in REDUCIBLE:
            for op in ops_for(dtype):
                data = rank_data(0, (7, 3), dtype, op)
                expected = numpy_reduce([data], op)
                tensor = gpus.array(data)
                col.allreduce(tensor, op=op)
                _same(gpus, tensor, expected, f"allreduce {op.name} {dtype}")
                tensor = gpus.array(data)
                col.reduce(tensor, dst_rank=0, op=op)
                _same(gpus, tensor, expected, f"reduce {op.name} {dtype}")
                output = gpus.array(unlike(expected))
                col.reducescatter(output, [gpus.array(data)], op=op)
                _same(gpus, output, expected, f"reducescatter {op.name} {dtype}")
        source = np.arange(1000, dtype=np.float32)
        tensor = gpus.array(source)
        col.broadcast(tensor, src_rank=0)
        _same(gpus, tensor, source, "broadcast")
        for dtype in MOVED_ONLY + ["complex128", "bool", "float64"]:
            values = rank_data(1, 5, dtype)
            outputs = [gpus.array(unlike(values))]
            col.allgather(outputs, gpus.array(values))
            _same(gpus, outputs[0], values, f"allgather {dtype}")
            outputs = [gpus.array(unlike(values))]
            col.gather(outputs, gpus.array(values), dst_rank=0)
            _same(gpus, outputs[0], values, f"gather {dtype}")
            output = gpus.array(unlike(values))
            col.scatter(output, [gpus.array(values)], src_rank=0)
            _same(gpus, output, values, f"scatter {dtype}")
            outputs = [gpus.array(unlike(values))]
            col.alltoall(outputs, [gpus.array(values)])
            _same(gpus, outputs[0], values, f"alltoall {dtype}")
        col.barrier()
        empty = gpus.array(np.zeros(0, np.float32))
        col.allreduce(empty)
        assert gpus.host(empty).shape == (0,)
        return True
    return body


def multigpu_variants(gpus: Gpus) -> Callable[[int], bool]:
    """Every ``*_multigpu`` collective at world size 1, over every visible GPU."""
    devices = range(gpus.device_count)

    def on_each(make: Callable[[int], np.ndarray]) -> list:
        return [gpus.array(make(d), device=d) for d in devices]

    def body(rank: int) -> bool:
        values = [np.full(6, d + 1.0, np.float32) for d in devices]
        total = numpy_reduce(values, col.ReduceOp.SUM)
        tensors = on_each(lambda d: values[d])
        col.allreduce_multigpu(tensors)
        for d, tensor in enumerate(tensors):
            _same(gpus, tensor, total, f"allreduce_multigpu on GPU {d}")
        tensors = on_each(lambda d: values[d])
        col.reduce_multigpu(tensors, dst_rank=0, dst_tensor=len(devices) - 1)
        _same(gpus, tensors[-1], total, "reduce_multigpu")
        tensors = on_each(lambda d: unlike(values[0]) if d else values[0])
        col.broadcast_multigpu(tensors, src_rank=0, src_tensor=0)
        for d, tensor in enumerate(tensors):
            _same(gpus, tensor, values[0], f"broadcast_multigpu to GPU {d}")
        outputs = [on_each(lambda d: unlike(values[j])) for j in devices]
        outputs = [[outputs[j][d] for j in devices] for d in devices]  # GPU d's list
        col.allgather_multigpu(outputs, on_each(lambda d: values[d]))
        for d, per_gpu in enumerate(outputs):
            for j, got in enumerate(per_gpu):
                _same(gpus, got, values[j], f"allgather_multigpu part {j} on GPU {d}")
        parts = [[np.full(6, 10.0 * d + j, np.float32) for j in devices] for d in devices]
        sums = [numpy_reduce([parts[d][i] for d in devices], col.ReduceOp.SUM) for i in devices]
        scattered = on_each(lambda d: unlike(sums[d]))
        col.reducescatter_multigpu(scattered, [[gpus.array(part, device=d) for part in parts[d]]
                                               for d in devices])
        for d, got in enumerate(scattered):
            _same(gpus, got, sums[d], f"reducescatter_multigpu on GPU {d}")
        return True
    return body


BODIES: Sequence[Callable[[Gpus], Callable[[int], bool]]] = (every_collective,
                                                             multigpu_variants)
