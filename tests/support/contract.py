"""The contract every backend keeps: every collective (and send/recv, barrier) gives what numpy
gives, for each rank, whatever runs the ranks.

Written once and bound to each backend by the tests that run ranks their way:
tests/test_contract.py (threads of this process: the in-process backend, a backend registered
from outside the package, the NCCL backend over its stand-in), tests/test_ray_backend.py and
tests/support/multinode_cluster.py (Ray actors: the ``ray`` backend on one node and across nodes),
tests/test_nccl_gpu.py (real NCCL, on a GPU machine).

:func:`every_collective` runs inside a rank and returns plain numpy outputs;
:func:`check_every_collective` compares what every rank returned with numpy.
"""

import numpy as np

import ray_collective as col
from support.helpers import numpy_reduce, rank_data

OPS = {"SUM": col.ReduceOp.SUM, "MAX": col.ReduceOp.MAX, "PRODUCT": col.ReduceOp.PRODUCT,
       "AVG": col.ReduceOp.AVG, "MIN": col.ReduceOp.MIN}

CASES = [("int64", "SUM", 7), ("float32", "MAX", 1000), ("int32", "PRODUCT", 1),
         ("float64", "AVG", 0), ("uint8", "MIN", 5000)]
"""(dtype, op, elements): small, empty and shared-memory sizes, every op."""


class TensorKind:
    """How a binding turns numpy inputs into its tensors and its outputs back into numpy.

    The default is numpy itself; ``"torch"`` (a name, so that it travels to Ray actors) is
    torch CPU tensors; a binding with device tensors subclasses this.
    """

    def tensor(self, array: np.ndarray, rank: int):
        """``array`` as this kind's tensor on ``rank``."""
        return array

    def array(self, tensor) -> np.ndarray:
        """``tensor`` as a numpy array."""
        return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)


class TorchKind(TensorKind):
    """torch CPU tensors sharing the numpy inputs' memory."""

    def tensor(self, array: np.ndarray, rank: int):
        import torch
        return torch.from_numpy(array)


_NAMED_KINDS = {"numpy": TensorKind(), "torch": TorchKind()}


def every_collective(rank, group, world_size, dtype, op_name, length, kind="numpy"):
    """Inside a rank: run every collective once on deterministic inputs; return the outputs.

    Args:
        rank, group, world_size: the rank, its group's name and size.
        dtype, op_name, length: the case (a key of :data:`OPS` for the op).
        kind: ``"numpy"``, ``"torch"`` or a :class:`TensorKind`.

    Returns:
        Per collective, the rank's output as numpy (a list for the list collectives).
    """
    kind = _NAMED_KINDS[kind] if isinstance(kind, str) else kind
    op = OPS[op_name]
    p, root = world_size, world_size - 1
    mine = rank_data(rank, length, dtype, op)
    blocks = [rank_data(rank * 100 + j, length, dtype, op) for j in range(p)]

    def fresh(array):
        return kind.tensor(array.copy(), rank)

    out = {}
    tensor = fresh(mine)
    col.allreduce(tensor, group, op)
    out["allreduce"] = tensor
    tensor = fresh(mine)
    col.reduce(tensor, root, group, op)
    out["reduce"] = tensor
    tensor = fresh(mine)
    col.broadcast(tensor, root, group)
    out["broadcast"] = tensor
    gathered = [fresh(np.zeros_like(mine)) for _ in range(p)]
    col.allgather(gathered, fresh(mine), group)
    out["allgather"] = gathered
    tensor = fresh(np.zeros_like(mine))
    col.reducescatter(tensor, [fresh(b) for b in blocks], group, op)
    out["reducescatter"] = tensor
    gathered = [fresh(np.zeros_like(mine)) for _ in range(p)] if rank == root else None
    col.gather(gathered, fresh(mine), root, group)
    out["gather"] = gathered
    tensor = fresh(np.zeros_like(mine))
    col.scatter(tensor, [fresh(b) for b in blocks] if rank == root else None, root, group)
    out["scatter"] = tensor
    received = [fresh(np.zeros_like(mine)) for _ in range(p)]
    col.alltoall(received, [fresh(b) for b in blocks], group)
    out["alltoall"] = received
    col.barrier(group)
    if p > 1:
        # Around the ring, even ranks sending first: a backend whose send waits for the
        # matching receive (NCCL) completes it too.
        tensor = fresh(np.zeros_like(mine))
        for sending in ((True, False) if rank % 2 == 0 else (False, True)):
            if sending:
                col.send(fresh(mine), (rank + 1) % p, group)
            else:
                col.recv(tensor, (rank - 1) % p, group)
        out["sendrecv"] = tensor
    return {k: ([kind.array(t) for t in v] if isinstance(v, list) else
                None if v is None else kind.array(v)) for k, v in out.items()}


def check_every_collective(results, world_size, dtype, op_name, length):
    """Compare each rank's outputs of :func:`every_collective` with numpy."""
    op = OPS[op_name]
    p, root = world_size, world_size - 1
    mine = [rank_data(r, length, dtype, op) for r in range(p)]
    blocks = [[rank_data(r * 100 + j, length, dtype, op) for j in range(p)] for r in range(p)]
    close = (np.testing.assert_allclose if np.dtype(dtype).kind == "f"
             else np.testing.assert_array_equal)
    assert len(results) == p
    for rank, got in enumerate(results):
        close(got["allreduce"], numpy_reduce(mine, op))
        if rank != root:
            np.testing.assert_array_equal(got["reduce"], mine[rank])
        else:
            close(got["reduce"], numpy_reduce(mine, op))
            for j in range(p):
                np.testing.assert_array_equal(got["gather"][j], mine[j])
        np.testing.assert_array_equal(got["broadcast"], mine[root])
        for j in range(p):
            np.testing.assert_array_equal(got["allgather"][j], mine[j])
            np.testing.assert_array_equal(got["alltoall"][j], blocks[j][rank])
        close(got["reducescatter"], numpy_reduce([blocks[r][rank] for r in range(p)], op))
        np.testing.assert_array_equal(got["scatter"], blocks[root][rank])
        if p > 1:
            np.testing.assert_array_equal(got["sendrecv"], mine[(rank - 1) % p])
