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
from support.reference import assert_reduced

OPS = {"SUM": col.ReduceOp.SUM, "MAX": col.ReduceOp.MAX, "PRODUCT": col.ReduceOp.PRODUCT,
       "AVG": col.ReduceOp.AVG, "MIN": col.ReduceOp.MIN}

CASES = [("int64", "SUM", 7), ("float32", "MAX", 1000), ("int32", "PRODUCT", 1),
         ("float64", "AVG", 0), ("uint8", "MIN", 5000), ("float64", "AVG", 1003),
         ("float32", "SUM", 1003), ("float64", "PRODUCT", 7), ("int32", "AVG", 9)]
"""(dtype, op, elements): every op, on one element, none and a few; floats that round
(:func:`rank_input`) and integers that truncate (int32 AVG)."""
LARGE_CASES = [("float64", "AVG", 10_001)]
"""Cases past what the ``ray`` backend sends inline (64 KiB: 10_001 float64), for the bindings
where the size changes the path a message takes."""


def rank_input(rank: int, length: int, dtype: str, op_name: str, block: int = -1) -> np.ndarray:
    """Rank ``rank``'s deterministic input for a case: its tensor, or its ``block``-th block.

    Floats are not integers, so that sums, averages and products round: normal values over
    five magnitudes, and for PRODUCT factors of magnitude 0.5 to 2 with either sign (17 of
    them stay far from overflow). Integers are small (-20..19, from 1..2 for PRODUCT, none
    negative when unsigned), so that sums and products are those of the integers.

    Args:
        rank: the rank.
        length: the number of elements.
        dtype: the dtype's name.
        op_name: the case's reduction.
        block: the block of its input list (reducescatter, scatter, alltoall), or -1 for its
            tensor.

    Returns:
        The array.
    """
    rng = np.random.default_rng([rank, block + 1])
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        if op_name == "PRODUCT":
            values = rng.uniform(0.5, 2.0, length) * rng.choice([-1.0, 1.0], length)
        else:
            values = rng.standard_normal(length) * 10.0 ** rng.integers(-2, 3, length)
        return values.astype(dtype)
    low, high = (1, 3) if op_name == "PRODUCT" else (0 if dtype.kind == "u" else -20, 20)
    return rng.integers(low, high, length).astype(dtype)


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


class DLPackOnly:
    """An array that exposes its memory through DLPack and nothing else (no buffer, no numpy
    type, no array interface): what a library the collectives do not know by type hands them.
    It exports versioned capsules, which say the memory is writable."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self._array.__dlpack__(stream=stream, max_version=max_version,
                                      dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class DLPackKind(TensorKind):
    """:class:`DLPackOnly` arrays over the numpy inputs' memory."""

    def tensor(self, array: np.ndarray, rank: int):
        return DLPackOnly(array)

    def array(self, tensor) -> np.ndarray:
        return np.from_dlpack(tensor)


class MemoryviewKind(TensorKind):
    """``memoryview``s of the numpy inputs (the buffer protocol)."""

    def tensor(self, array: np.ndarray, rank: int):
        return memoryview(array)


_NAMED_KINDS = {"numpy": TensorKind(), "torch": TorchKind(), "dlpack": DLPackKind(),
                "memoryview": MemoryviewKind()}


def every_collective(rank, group, world_size, dtype, op_name, length, kind="numpy"):
    """Inside a rank: run every collective once on deterministic inputs; return the outputs.

    Args:
        rank, group, world_size: the rank, its group's name and size.
        dtype, op_name, length: the case (a key of :data:`OPS` for the op).
        kind: ``"numpy"``, ``"torch"``, ``"dlpack"``, ``"memoryview"`` or a
            :class:`TensorKind`.

    Returns:
        Per collective, the rank's output as numpy (a list for the list collectives).
    """
    kind = _NAMED_KINDS[kind] if isinstance(kind, str) else kind
    op = OPS[op_name]
    p, root = world_size, world_size - 1
    mine = rank_input(rank, length, dtype, op_name)
    blocks = [rank_input(rank, length, dtype, op_name, j) for j in range(p)]

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
    """Compare each rank's outputs of :func:`every_collective` with numpy.

    Reductions are those of numpy bit for bit where their order cannot matter, else within the
    rounding bound of their dtype (``support.reference``); every rank's allreduce holds the same
    bits; what is only moved is moved bit for bit.
    """
    p, root = world_size, world_size - 1
    mine = [rank_input(r, length, dtype, op_name) for r in range(p)]
    blocks = [[rank_input(r, length, dtype, op_name, j) for j in range(p)] for r in range(p)]
    case = f"{dtype} {op_name} of {length} on {p} ranks"
    assert len(results) == p
    assert_reduced(results[0]["allreduce"], mine, op_name, f"{case}: rank 0's allreduce")
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["allreduce"], results[0]["allreduce"],
                                      err_msg=f"{case}: rank {rank}'s allreduce, rank 0's")
        if rank != root:
            np.testing.assert_array_equal(got["reduce"], mine[rank])
        else:
            assert_reduced(got["reduce"], mine, op_name, f"{case}: the root's reduce")
            for j in range(p):
                np.testing.assert_array_equal(got["gather"][j], mine[j])
        np.testing.assert_array_equal(got["broadcast"], mine[root])
        for j in range(p):
            np.testing.assert_array_equal(got["allgather"][j], mine[j])
            np.testing.assert_array_equal(got["alltoall"][j], blocks[j][rank])
        assert_reduced(got["reducescatter"], [blocks[r][rank] for r in range(p)], op_name,
                       f"{case}: rank {rank}'s reducescatter")
        np.testing.assert_array_equal(got["scatter"], blocks[root][rank])
        if p > 1:
            np.testing.assert_array_equal(got["sendrecv"], mine[(rank - 1) % p])
