"""How a worker's gradients meet the other workers': the optimizer that spaCy's loop is handed.

spaCy's training loop (``spacy.training.loop.train_while_improving``) runs ``nlp.update`` with
``sgd=False`` on a batch, then calls ``proc.finish_update(optimizer)`` for every trainable
component, then ``optimizer.step_schedules()``. thinc's ``Model.finish_update`` calls
``optimizer(key, param, grad)`` once per parameter array that has a gradient. An exchange is a
stand-in for that optimizer (every other attribute is the real one's), so the loop runs
unchanged:

- ``AllreduceExchange``: every gradient of the trainable components is a view of one flat
  buffer (``FlatBuffers``); the first optimizer call of a step, when every gradient of the
  step is final, sums that buffer over the workers with one allreduce, and each call then
  runs thinc's own optimizer on its array. spaCy's losses are sums over a batch's examples,
  so the sum over the workers is the gradient one process would get on all their batches
  together (a mean would be 1/N of it, which Adam with per-array clipping does not forgive:
  at equal samples it ended 18 points of dev F below one worker after 50 updates). Every worker applies the same update to the same
  weights, so the replicas stay identical bit for bit: the design document's ``inc_grad``
  replaced by an allreduce, one per step rather than one per array.
- ``ReduceScatterExchange``: the parameters are views of a flat buffer too. The first call of
  a step reduce-scatters the summed gradient (each worker gets its 1/N of it), runs the
  optimizer on that shard only, and all-gathers the shards into every worker's parameters.
  thinc clips each array's gradient by the array's norm: the squared norms of each worker's
  pieces of each array are summed over the workers (one small allreduce) so that a shard is
  clipped as its whole arrays would be; an L2 term that is not weight decay is added before
  that, as thinc does. Moving averages (``use_averages``) are kept per shard and gathered at
  the steps spaCy evaluates (``gather_averages``).
- ``ParameterServerExchange``: spacy-ray's sharded parameter server (``PeerProxy``): thinc's
  hook sends each gradient of an array owned elsewhere to its owner, which updates its arrays
  with the sum of the gradients it holds (as spacy-ray does) and sends them to every other
  worker; ``finish_update`` finds no gradient to apply, so the
  loop's optimizer calls never happen here.

Every exchange counts its communication time (``clock``) apart from the loop's compute.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..thinc.communicators import Communicator, StepClock, parts_of
from ..thinc.parameter_server import PeerProxy, divide_keys
from ..thinc.params import FlatBuffers, parameter_nodes

SHARD_KEY = (-1, "ray-collective-shard")
"""The optimizer's key of a worker's shard (its moments and average live under it)."""


class Exchange(abc.ABC):
    """The optimizer spaCy's loop calls; the real one (``optimizer``) behind it.

    Attributes:
        optimizer: thinc's optimizer, built from the config's ``[training.optimizer]``.
        clock: seconds spent communicating.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.clock = StepClock()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what the exchange does not define: learn_rate, schedules, step ...
        return getattr(self.optimizer, name)

    @property
    def averages(self) -> Optional[Dict[Any, Any]]:
        """The parameters' moving averages by thinc key, or None (``use_averages = false``)."""
        return self.optimizer.averages

    def __call__(self, key: Any, weights: Any, gradient: Any, *,
                 lr_scale: float = 1.0) -> Tuple[Any, Any]:
        """thinc's optimizer call for one array; see the subclasses for what they add."""
        return self.optimizer(key, weights, gradient, lr_scale=lr_scale)

    def step_schedules(self) -> None:
        """The step is over: advance the optimizer's schedules."""
        self.optimizer.step_schedules()

    def gather_averages(self) -> None:
        """Make ``averages`` whole on every worker (a collective where averages are sharded)."""

    def finish(self) -> None:
        """Apply whatever the last step left pending."""

    @property
    def bus_bytes(self) -> int:
        """Bytes this worker's collectives must send (nccl-tests' factors), summed."""
        return 0


class AllreduceExchange(Exchange):
    """One allreduce (sum) of the flat gradient buffer per step, then thinc's own update."""

    def __init__(self, optimizer: Any, holder: Any, communicator: Communicator) -> None:
        super().__init__(optimizer)
        self.communicator = communicator
        self._buffers = FlatBuffers(holder, 1, parameters_too=False)
        self._reduced = False

    def __call__(self, key: Any, weights: Any, gradient: Any, *,
                 lr_scale: float = 1.0) -> Tuple[Any, Any]:
        if not self._reduced:
            with self.clock.communicating():
                self.communicator.allreduce_sum(self._buffers.grads)
            self._reduced = True
        return self.optimizer(key, weights, gradient, lr_scale=lr_scale)

    def step_schedules(self) -> None:
        self._reduced = False
        self._buffers.grads.fill(0)
        super().step_schedules()

    @property
    def bus_bytes(self) -> int:
        return self.communicator.bus_bytes


def shard_segments(sizes: Sequence[int], world_size: int,
                   rank: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the arrays of a flat buffer fall in one worker's equal part of it.

    Args:
        sizes: each array's element count, in buffer order (the buffer may be padded after).
        world_size: the number of equal parts.
        rank: the part.

    Returns:
        ``(arrays, starts, lengths)``: for each piece of an array inside the part, in order,
        the array's index, the piece's offset in the part and its length.
    """
    padded = -(-sum(sizes) // world_size) * world_size
    part = padded // world_size
    low, high = rank * part, (rank + 1) * part
    arrays, starts, lengths = [], [], []
    offset = 0
    for index, size in enumerate(sizes):
        first, last = max(offset, low), min(offset + size, high)
        if first < last:
            arrays.append(index)
            starts.append(first - low)
            lengths.append(last - first)
        offset += size
    return np.array(arrays, dtype=np.int64), np.array(starts, dtype=np.int64), \
        np.array(lengths, dtype=np.int64)


class ReduceScatterExchange(Exchange):
    """Reduce-scatter (sum) of the gradients, an update of the own shard, all-gather."""

    def __init__(self, optimizer: Any, holder: Any, communicator: Communicator,
                 eval_frequency: int) -> None:
        """Args:
            optimizer: thinc's optimizer.
            holder: the model whose walk covers every trainable parameter.
            communicator: the workers' group.
            eval_frequency: spaCy's loop evaluates after every step ``s`` with ``s %
                eval_frequency == 0``: the averages are gathered then, on every worker.
        """
        super().__init__(optimizer)
        self.communicator = communicator
        self._eval_frequency = eval_frequency
        self._steps = 0
        world, rank = communicator.world_size, communicator.rank
        self._holder = holder
        self._buffers = FlatBuffers(holder, world, parameters_too=True)
        self._sizes = [node.get_param(name).size for _, node in parameter_nodes(holder)
                       for name in node.param_names]
        self._arrays, self._starts, self._lengths = shard_segments(self._sizes, world, rank)
        xp = holder.ops.xp
        self._shard_grad = xp.zeros(self._buffers.grads.size // world, dtype=xp.float32)
        self._shard_param = parts_of(self._buffers.params, world)[rank].copy()
        self._averages: Optional[Dict[Any, Any]] = None
        self._updated = False

    def __call__(self, key: Any, weights: Any, gradient: Any, *,
                 lr_scale: float = 1.0) -> Tuple[Any, Any]:
        if not self._updated:
            self._update_shard(lr_scale)
            self._updated = True
        # The parameters are views of the flat buffer the all-gather wrote: already updated.
        return weights, gradient

    def step_schedules(self) -> None:
        self._updated = False
        self._buffers.grads.fill(0)
        super().step_schedules()
        if self._steps % self._eval_frequency == 0:
            self.gather_averages()
        self._steps += 1

    @property
    def averages(self) -> Optional[Dict[Any, Any]]:
        if self.optimizer.averages is None:
            return None
        return self._averages or {}

    def gather_averages(self) -> None:
        """All-gather every worker's averaged shard into whole arrays (every worker calls it)."""
        shard_average = (self.optimizer.averages or {}).get(SHARD_KEY)
        if shard_average is None:
            return
        whole = self._holder.ops.xp.zeros_like(self._buffers.params)
        with self.clock.communicating():
            self.communicator.allgather(whole, shard_average)
        averages, offset = {}, 0
        for _, node in parameter_nodes(self._holder):
            for name in node.param_names:
                shape = node.get_param(name).shape
                size = int(np.prod(shape))
                averages[(node.id, name)] = whole[offset:offset + size].reshape(shape)
                offset += size
        self._averages = averages

    @property
    def bus_bytes(self) -> int:
        return self.communicator.bus_bytes

    def _update_shard(self, lr_scale: float) -> None:
        optimizer, grad, param = self.optimizer, self._shard_grad, self._shard_param
        with self.clock.communicating():
            self.communicator.reducescatter_sum(grad, self._buffers.grads)
        l2_in_gradient = optimizer.L2 != 0 and not optimizer.L2_is_weight_decay
        if l2_in_gradient:
            grad += optimizer.L2 * param
        if optimizer.grad_clip:
            self._clip(grad, optimizer.grad_clip)
        saved = optimizer.grad_clip, optimizer.L2
        # Done above, as thinc does them per whole array; the shard's update is elementwise.
        optimizer.grad_clip = 0.0
        if l2_in_gradient:
            optimizer.L2 = 0.0
        try:
            self._shard_param, _ = optimizer(SHARD_KEY, param, grad, lr_scale=lr_scale)
        finally:
            optimizer.grad_clip, optimizer.L2 = saved
        with self.clock.communicating():
            self.communicator.allgather(self._buffers.params, self._shard_param)

    def _clip(self, grad: Any, threshold: float) -> None:
        """Scale each array's pieces as thinc scales a whole array whose norm reaches
        ``threshold``; the norms' squares are summed over the workers."""
        xp = self._holder.ops.xp
        squares = np.zeros(len(self._sizes), dtype=np.float64)
        if len(self._starts):
            pieces = xp.add.reduceat(grad.astype(xp.float64) ** 2, xp.asarray(self._starts))
            squares[self._arrays] = self._holder.ops.to_numpy(pieces)
        with self.clock.communicating():
            self.communicator.allreduce_sum(squares)
        norms = np.sqrt(squares)
        scale = np.where(norms >= threshold, threshold / np.maximum(norms, 1e-30), 1.0)
        factors = np.repeat(scale[self._arrays].astype(np.float32), self._lengths)
        covered = int(self._lengths.sum())
        grad[:covered] *= xp.asarray(factors)


class ParameterServerExchange(Exchange):
    """spacy-ray's sharded parameter server: thinc's hook talks to the owners (``PeerProxy``)."""

    def __init__(self, optimizer: Any, holder: Any, rank: int, peers: List[Any],
                 timeout_s: float, grads_per_update: int) -> None:
        super().__init__(optimizer)
        self._holder = holder
        self.proxy = PeerProxy(holder, rank, peers, divide_keys(holder, len(peers)), optimizer,
                               grads_per_update, False, timeout_s, average=False)
        self.proxy.install(holder)

    def finish(self) -> None:
        """Read every array once more: owners apply the last gradients and send them."""
        for _, node in parameter_nodes(self._holder):
            for name in node.param_names:
                node.get_param(name)
