"""One collective library behind the three calls data-parallel training needs, on float32 buffers.

A ``Communicator`` is one library's mean-allreduce, mean-reducescatter and allgather on
contiguous numpy float32 arrays: this library (``RayCollectiveCommunicator``, through its public
API, any backend), ``ray.util.collective`` with Gloo, or ``torch.distributed``'s own Gloo group.
Each counts the bytes its algorithm must send per rank (nccl-tests' bus factors), so a benchmark
can report traffic without a packet capture, and ``StepClock`` counts the time spent in them
apart from the time spent computing.

Ray and torch are imported where a Gloo communicator is made: only those need them.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import time
from typing import Any, Iterator, List

import numpy as np

import ray_collective as col


class StepClock:
    """Seconds spent communicating, out of the steps' total (the rest is computing)."""

    def __init__(self) -> None:
        self.communication_seconds = 0.0

    @contextlib.contextmanager
    def communicating(self) -> Iterator[None]:
        """Count the time of the block as communication."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.communication_seconds += time.perf_counter() - started


# ------------------------------------------------------------------ libraries


class Communicator(abc.ABC):
    """One collective library, as the trainers use it, on contiguous float32 numpy arrays."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size = world_size
        self.rank = rank
        self.bus_bytes = 0
        """Bytes each rank's algorithm must send, summed over calls (nccl-tests' factors)."""

    @abc.abstractmethod
    def allreduce_mean(self, buffer: np.ndarray) -> None:
        """Replace ``buffer`` with the mean of every rank's ``buffer``.

        Args:
            buffer: contiguous float32, the same length on every rank; overwritten.

        Raises:
            Exception: whatever the library raises (timeout, dead peer, mismatch).
        """

    @abc.abstractmethod
    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        """``shard`` = the mean over ranks of ``flat``'s part ``rank`` (N equal parts).

        Args:
            shard: overwritten; ``flat.size // world_size`` elements.
            flat: every rank's full buffer (a library may use it as scratch space).

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def reducescatter_sum(self, shard: np.ndarray, flat: np.ndarray) -> None:
        """``reducescatter_mean``'s sum: ``shard`` = the sum over ranks of part ``rank``."""

    @abc.abstractmethod
    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        """``flat``'s part ``i`` = rank i's ``shard``, on every rank.

        Args:
            flat: overwritten, ``world_size`` times the shard's length.
            shard: this rank's part.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def allreduce_sum(self, buffer: np.ndarray) -> None:
        """Replace ``buffer`` with the sum of every rank's ``buffer`` (small control values).

        Args:
            buffer: contiguous float32 or float64, the same length on every rank; overwritten.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        """Replace ``buffer`` on every rank with rank ``root``'s.

        Args:
            buffer: contiguous, the same length and dtype on every rank.
            root: the rank whose buffer is sent.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group."""

    def abort(self, error: BaseException) -> None:
        """This rank failed outside a collective: tell the others, where the library can, so
        that they fail now instead of at their deadline (Gloo cannot: they wait for it).

        Args:
            error: what failed, for the others' messages.
        """

    def _count_allreduce(self, nbytes: int) -> None:
        self.bus_bytes += 2 * (self.world_size - 1) * nbytes // self.world_size

    def _count_scatter_or_gather(self, nbytes: int) -> None:
        self.bus_bytes += (self.world_size - 1) * nbytes // self.world_size

    def _count_broadcast(self, nbytes: int) -> None:
        self.bus_bytes += nbytes if self.world_size > 1 else 0


def parts_of(flat: np.ndarray, world_size: int) -> List[np.ndarray]:
    """``flat`` cut into ``world_size`` equal views (its length is a multiple of it)."""
    return list(flat.reshape(world_size, -1))


class GroupApiCommunicator(Communicator, abc.ABC):
    """A library with ``ray.util.collective``'s API (``_col``) and a group of it (``_group``):
    this library and Ray's own share allgather, the sum, broadcast and leaving."""

    _col: Any
    _group: str

    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        self._col.allgather(parts_of(flat, self.world_size), shard, self._group)
        self._count_scatter_or_gather(flat.nbytes)

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        self._col.allreduce(buffer, self._group)
        self._count_allreduce(buffer.nbytes)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        self._col.broadcast(buffer, root, self._group)
        self._count_broadcast(buffer.nbytes)

    def close(self) -> None:
        self._col.destroy_collective_group(self._group)


class RayCollectiveCommunicator(GroupApiCommunicator):
    """This library, ``ray_collective``, with the given backend (``ray`` on CPU)."""

    def __init__(self, world_size: int, rank: int, group_name: str, backend: str = "ray",
                 timeout_s: float = 600.0) -> None:
        super().__init__(world_size, rank)
        self._col = col
        self._group = group_name
        col.init_collective_group(world_size, rank, backend=backend, group_name=group_name,
                                  timeout=timeout_s)

    def allreduce_mean(self, buffer: np.ndarray) -> None:
        self._col.allreduce(buffer, self._group, op=self._col.ReduceOp.AVG)
        self._count_allreduce(buffer.nbytes)

    def abort(self, error: BaseException) -> None:
        self._col.get_group_handle(self._group).fail(error)

    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._col.reducescatter(shard, parts_of(flat, self.world_size), self._group,
                                op=self._col.ReduceOp.AVG)
        self._count_scatter_or_gather(flat.nbytes)

    def reducescatter_sum(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._col.reducescatter(shard, parts_of(flat, self.world_size), self._group)
        self._count_scatter_or_gather(flat.nbytes)


class MeanFromSum(Communicator, abc.ABC):
    """A library without a mean (Gloo: ``ReduceOp.AVG`` is NCCL-only): the sum, then 1/N."""

    def allreduce_mean(self, buffer: np.ndarray) -> None:
        self.allreduce_sum(buffer)
        buffer *= buffer.dtype.type(1.0 / self.world_size)

    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self.reducescatter_sum(shard, flat)
        shard *= shard.dtype.type(1.0 / self.world_size)


class RayUtilGlooCommunicator(MeanFromSum, GroupApiCommunicator):
    """``ray.util.collective`` with ``backend="gloo"`` (torch.distributed's Gloo inside).

    It has no mean: a sum, then a multiplication by 1/N. Its reducescatter is one allreduce per
    rank's part (Ray 2.60's ``TorchGLOOGroup``), so that is what it sends.
    """

    def __init__(self, world_size: int, rank: int, group_name: str,
                 timeout_s: float = 600.0) -> None:
        super().__init__(world_size, rank)
        import ray.util.collective as rucol
        self._col = rucol
        self._group = group_name
        rucol.init_collective_group(world_size, rank, backend="gloo", group_name=group_name,
                                    gloo_timeout=int(timeout_s * 1000))

    def reducescatter_sum(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._col.reducescatter(shard, parts_of(flat, self.world_size), self._group)
        for _ in range(self.world_size):
            self._count_allreduce(shard.nbytes)


class TorchGlooCommunicator(MeanFromSum):
    """``torch.distributed``'s own Gloo process group (``init_process_group("gloo")``).

    Gloo has no mean either (``ReduceOp.AVG`` is NCCL-only): a sum, then 1/N. Its
    ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` work on the flat buffers directly.
    """

    def __init__(self, world_size: int, rank: int, init_method: str,
                 timeout_s: float = 600.0) -> None:
        super().__init__(world_size, rank)
        import torch
        import torch.distributed as dist
        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size,
                                rank=rank, timeout=datetime.timedelta(seconds=timeout_s))

    def reducescatter_sum(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._dist.reduce_scatter_tensor(self._torch.from_numpy(shard),
                                         self._torch.from_numpy(flat))
        self._count_scatter_or_gather(flat.nbytes)

    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        self._dist.all_gather_into_tensor(self._torch.from_numpy(flat),
                                          self._torch.from_numpy(shard))
        self._count_scatter_or_gather(flat.nbytes)

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        self._dist.all_reduce(self._torch.from_numpy(buffer))
        self._count_allreduce(buffer.nbytes)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        self._dist.broadcast(self._torch.from_numpy(buffer), root)
        self._count_broadcast(buffer.nbytes)

    def close(self) -> None:
        self._dist.destroy_process_group()
