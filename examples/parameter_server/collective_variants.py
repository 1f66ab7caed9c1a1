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

The libraries (``Communicator``: this library's ``ray`` backend, ``ray.util.collective`` with
Gloo, ``torch.distributed``'s own Gloo group) and the flat buffers live in the package, in
``ray_collective.integrations.thinc``, which spaCy's integration shares.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Optional

import numpy as np

from ray_collective.integrations.thinc.communicators import Communicator, StepClock, parts_of
from ray_collective.integrations.thinc.params import (FlatBuffers, KeyT, install_proxy,
                                                      key_of_node, parameter_digest,
                                                      parameter_vector)

from .task import loss_and_gradients


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
        return parameter_vector(self.model)

    def digest(self) -> str:
        """A hash of ``parameters()``: equal on two workers only if the weights are bitwise equal.

        Returns:
            Hex SHA-256.
        """
        return parameter_digest(self.model)


class LocalTrainer(Trainer):
    """One process, no communication: thinc's own update."""

    def step(self, step: int, x: np.ndarray, y: np.ndarray) -> float:
        loss = loss_and_gradients(self.model, x, y)
        self.model.finish_update(self.optimizer)
        return loss


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
