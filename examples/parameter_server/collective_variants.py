"""The collective replacements of the parameter server, and the libraries they run on.

Three ways to train data-parallel with collectives, each a ``Trainer`` with one ``step``:

- ``FlatAllreduce``: the model's gradients live in one flat buffer (thinc adds into views of
  it); one ``allreduce`` (mean) per step, then every worker runs the optimizer on the whole
  model. Identical inputs and identical arithmetic keep the replicas identical bit for bit.
- ``ShardedUpdate``: the collective counterpart of the sharded server. ``reducescatter``
  (mean) leaves each worker the mean gradient of its 1/N of the flat buffer; it runs the
  optimizer on that shard only (its optimizer state is 1/N of the model's), then ``allgather``
  puts every shard's new parameters into every worker's flat parameter buffer, which the model's
  arrays are views of.
- ``PerArrayAllreduce``: the structure of the original design document (spacy-ray-nccl): a proxy
  in thinc's parameter-server hook allreduces each gradient array as thinc produces it, one
  collective per array, and the optimizer runs after the backward pass.

``LocalTrainer`` is one process with no communication: the single-process reference.

A ``Communicator`` is one library's mean-allreduce, mean-reducescatter and allgather on numpy
float32 buffers: this library's ``ray`` backend, ``ray.util.collective`` with Gloo, or
``torch.distributed``'s own Gloo group. Each counts the bytes its algorithm must send per rank
(nccl-tests' bus factors), so the benchmark can report traffic without a packet capture.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import time
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from .task import KeyT, install_proxy, key_of_node, loss_and_gradients, parameter_nodes


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
    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        """``flat``'s part ``i`` = rank i's ``shard``, on every rank.

        Args:
            flat: overwritten, ``world_size`` times the shard's length.
            shard: this rank's part.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group."""

    def _count_allreduce(self, nbytes: int) -> None:
        self.bus_bytes += 2 * (self.world_size - 1) * nbytes // self.world_size

    def _count_scatter_or_gather(self, nbytes: int) -> None:
        self.bus_bytes += (self.world_size - 1) * nbytes // self.world_size


def parts_of(flat: np.ndarray, world_size: int) -> List[np.ndarray]:
    """``flat`` cut into ``world_size`` equal views (its length is a multiple of it)."""
    return list(flat.reshape(world_size, -1))


class RayCollectiveCommunicator(Communicator):
    """This library, ``ray_collective``, with the given backend (``ray`` on CPU)."""

    def __init__(self, world_size: int, rank: int, group_name: str, backend: str = "ray",
                 timeout_s: float = 600.0) -> None:
        super().__init__(world_size, rank)
        import ray_collective
        self._col = ray_collective
        self._group = group_name
        ray_collective.init_collective_group(world_size, rank, backend=backend,
                                             group_name=group_name, timeout=timeout_s)

    def allreduce_mean(self, buffer: np.ndarray) -> None:
        self._col.allreduce(buffer, self._group, op=self._col.ReduceOp.AVG)
        self._count_allreduce(buffer.nbytes)

    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._col.reducescatter(shard, parts_of(flat, self.world_size), self._group,
                                op=self._col.ReduceOp.AVG)
        self._count_scatter_or_gather(flat.nbytes)

    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        self._col.allgather(parts_of(flat, self.world_size), shard, self._group)
        self._count_scatter_or_gather(flat.nbytes)

    def close(self) -> None:
        self._col.destroy_collective_group(self._group)


class RayUtilGlooCommunicator(Communicator):
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
        self._scale = np.float32(1.0 / world_size)
        rucol.init_collective_group(world_size, rank, backend="gloo", group_name=group_name,
                                    gloo_timeout=int(timeout_s * 1000))

    def allreduce_mean(self, buffer: np.ndarray) -> None:
        self._col.allreduce(buffer, self._group)
        buffer *= self._scale
        self._count_allreduce(buffer.nbytes)

    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._col.reducescatter(shard, parts_of(flat, self.world_size), self._group)
        shard *= self._scale
        for _ in range(self.world_size):
            self._count_allreduce(shard.nbytes)

    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        self._col.allgather(parts_of(flat, self.world_size), shard, self._group)
        self._count_scatter_or_gather(flat.nbytes)

    def close(self) -> None:
        self._col.destroy_collective_group(self._group)


class TorchGlooCommunicator(Communicator):
    """``torch.distributed``'s own Gloo process group (``init_process_group("gloo")``).

    Gloo has no mean either (``ReduceOp.AVG`` is NCCL-only): a sum, then 1/N. Its
    ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` work on the flat buffers directly.
    """

    def __init__(self, world_size: int, rank: int, init_method: str,
                 timeout_s: float = 600.0) -> None:
        super().__init__(world_size, rank)
        import datetime

        import torch
        import torch.distributed as dist
        self._torch, self._dist = torch, dist
        self._scale = np.float32(1.0 / world_size)
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size,
                                rank=rank, timeout=datetime.timedelta(seconds=timeout_s))

    def allreduce_mean(self, buffer: np.ndarray) -> None:
        self._dist.all_reduce(self._torch.from_numpy(buffer))
        buffer *= self._scale
        self._count_allreduce(buffer.nbytes)

    def reducescatter_mean(self, shard: np.ndarray, flat: np.ndarray) -> None:
        self._dist.reduce_scatter_tensor(self._torch.from_numpy(shard),
                                         self._torch.from_numpy(flat))
        shard *= self._scale
        self._count_scatter_or_gather(flat.nbytes)

    def allgather(self, flat: np.ndarray, shard: np.ndarray) -> None:
        self._dist.all_gather_into_tensor(self._torch.from_numpy(flat),
                                          self._torch.from_numpy(shard))
        self._count_scatter_or_gather(flat.nbytes)

    def close(self) -> None:
        self._dist.destroy_process_group()


# ------------------------------------------------------------------ trainers


class Trainer(abc.ABC):
    """One worker's way of turning a batch into an update of its model."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.clock = StepClock()

    @abc.abstractmethod
    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        """Compute the batch's gradients and apply this step's update.

        Args:
            step: the step's index.
            x: this worker's rows of the global batch.
            y: their one-hot targets.

        Returns:
            The batch's mean cross-entropy before the update.
        """

    def before_reading(self, steps_done: int) -> None:
        """Make the next reads of the parameters see ``steps_done`` updates (already so here).

        Args:
            steps_done: updates made so far.
        """

    def finish(self) -> None:
        """Apply whatever the last step left pending (nothing, for the collectives)."""

    def parameters(self) -> np.ndarray:
        """Every parameter of the model, concatenated in walk order (a copy).

        Returns:
            A float32 vector.
        """
        ops = self.model.ops
        return np.concatenate([ops.to_numpy(node.get_param(name)).ravel()
                               for _, node in parameter_nodes(self.model)
                               for name in node.param_names])

    def digest(self) -> str:
        """A hash of ``parameters()``: equal on two workers only if the weights are bitwise equal.

        Returns:
            Hex SHA-256.
        """
        return hashlib.sha256(self.parameters().tobytes()).hexdigest()


class LocalTrainer(Trainer):
    """One process, no communication: thinc's own update."""

    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        loss = loss_and_gradients(self.model, x, y)
        self.model.finish_update(self.optimizer)
        return loss


class FlatBuffers:
    """Flat float32 buffers whose views are the model's gradients (and, if asked, parameters).

    Both are padded with zeros to a multiple of ``world_size`` so that they split in equal parts.
    """

    def __init__(self, model: Any, world_size: int, parameters_too: bool) -> None:
        arrays = [(node, name, node.get_param(name)) for _, node in parameter_nodes(model)
                  for name in node.param_names]
        size = sum(array.size for _, _, array in arrays)
        padded = -(-size // world_size) * world_size
        xp = model.ops.xp
        self.grads = xp.zeros(padded, dtype=xp.float32)
        self.params = xp.zeros(padded, dtype=xp.float32) if parameters_too else None
        offset = 0
        for node, name, array in arrays:
            window = slice(offset, offset + array.size)
            node.set_grad(name, self.grads[window].reshape(array.shape))
            if self.params is not None:
                self.params[window] = array.ravel()
                node.set_param(name, self.params[window].reshape(array.shape))
            offset += array.size


class FlatAllreduce(Trainer):
    """Variant 1: one allreduce (mean) of the flat gradient buffer, then the local optimizer."""

    def __init__(self, model: Any, optimizer: Any, communicator: Communicator) -> None:
        super().__init__(model, optimizer)
        self._communicator = communicator
        self._buffers = FlatBuffers(model, 1, parameters_too=False)

    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        loss = loss_and_gradients(self.model, x, y)
        with self.clock.communicating():
            self._communicator.allreduce_mean(self._buffers.grads)
        self.model.finish_update(self.optimizer)
        self._buffers.grads.fill(0)
        return loss


class ShardedUpdate(Trainer):
    """Variant 2: reducescatter (mean) of gradients, update of the own shard, allgather."""

    SHARD_KEY = (-1, "shard")
    """The optimizer's key of this worker's shard (its Adam moments live under it)."""

    def __init__(self, model: Any, optimizer: Any, communicator: Communicator) -> None:
        super().__init__(model, optimizer)
        self._communicator = communicator
        world, rank = communicator.world_size, communicator.rank
        self._buffers = FlatBuffers(model, world, parameters_too=True)
        self._shard_grad = model.ops.xp.zeros(self._buffers.grads.size // world,
                                              dtype=self._buffers.grads.dtype)
        self._shard_param = parts_of(self._buffers.params, world)[rank].copy()

    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        loss = loss_and_gradients(self.model, x, y)
        with self.clock.communicating():
            self._communicator.reducescatter_mean(self._shard_grad, self._buffers.grads)
        self._shard_param, _ = self.optimizer(self.SHARD_KEY, self._shard_param,
                                              self._shard_grad)
        with self.clock.communicating():
            self._communicator.allgather(self._buffers.params, self._shard_param)
        self._buffers.grads.fill(0)
        return loss


class AllreduceProxy:
    """thinc's parameter-server hook for variant 3: each gradient array is allreduced at once."""

    def __init__(self, model: Any, communicator: Communicator, clock: StepClock) -> None:
        self._position = key_of_node(model)
        self._communicator = communicator
        self._clock = clock
        self.params: Dict[KeyT, np.ndarray] = {}
        self.grads: Dict[KeyT, Optional[np.ndarray]] = {}
        install_proxy(model, self)

    def get_param(self, model_id: int, name: str) -> np.ndarray:
        """thinc reads a parameter: this worker's copy (identical on every worker)."""
        return self.params[(self._position[model_id], name)]

    def set_param(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc sets a parameter."""
        self.params[(self._position[model_id], name)] = value

    def set_grad(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc sets a gradient (kept as it is: only ``inc_grad`` communicates)."""
        self.grads[(self._position[model_id], name)] = value.copy()

    def inc_grad(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc adds a gradient: its mean over the workers is added, one allreduce per call."""
        key = (self._position[model_id], name)
        reduced = value.copy()
        with self._clock.communicating():
            self._communicator.allreduce_mean(reduced)
        if self.grads.get(key) is None:
            self.grads[key] = reduced
        else:
            self.grads[key] += reduced


class PerArrayAllreduce(Trainer):
    """Variant 3: one allreduce (mean) per gradient array, inside thinc's backward pass."""

    def __init__(self, model: Any, optimizer: Any, communicator: Communicator) -> None:
        super().__init__(model, optimizer)
        self._proxy = AllreduceProxy(model, communicator, self.clock)

    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        loss = loss_and_gradients(self.model, x, y)
        for key, gradient in self._proxy.grads.items():
            if gradient is not None:
                self._proxy.params[key], _ = self.optimizer(key, self._proxy.params[key],
                                                            gradient)
                self._proxy.grads[key] = None
        return loss
