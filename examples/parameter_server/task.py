"""The learning task every variant shares: data, model, optimizer, batches and evaluation.

The data are scikit-learn's bundled handwritten digits (1797 images of 8x8 pixels, installed
with the package, nothing downloaded): a fixed stratified split keeps 360 images for testing.
The model is a thinc MLP, ``depth`` ReLU layers of ``width`` units and a softmax: with the
defaults (8 x 384) it has 1,063,690 parameters in 9 nodes and 18 arrays, 4.25 MB of float32,
large enough that moving its gradients costs as much as computing them.

Every variant sees the same global batches: global batch ``t`` is the next ``workers *
per_worker_batch`` images of a stream of per-epoch permutations of the training set (seeded),
and worker ``r`` takes rows ``[r * per_worker_batch, (r + 1) * per_worker_batch)`` of it.
thinc's categorical cross-entropy averages over a batch's rows, so the mean of the workers'
gradients is the gradient of the whole global batch: a synchronous variant computes what one
process computes on the global batch.

thinc, numpy and scikit-learn are imported lazily: importing this module needs none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class TaskConfig:
    """What defines the learning task; the same on every worker of a run.

    Attributes:
        width: units of each hidden ReLU layer.
        depth: number of hidden layers.
        per_worker_batch: rows each worker takes of each global batch.
        learn_rate: Adam's learning rate.
        seed: initial weights and data order.
    """

    width: int = 384
    depth: int = 8
    per_worker_batch: int = 16
    learn_rate: float = 0.001
    seed: int = 0


@dataclass(frozen=True)
class Digits:
    """The digits, split once: float32 pixels in [0, 1], one-hot training targets."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_labels: np.ndarray


def load_digits() -> Digits:
    """scikit-learn's bundled digits, split 80/20 stratified with a fixed seed.

    Returns:
        The split data.

    Raises:
        ImportError: scikit-learn is not installed (``pip install '.[example]'``).
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split
    digits = sklearn_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    train_x, test_x, train_labels, test_labels = train_test_split(
        pixels, digits.target, test_size=TEST_FRACTION, random_state=SPLIT_SEED,
        stratify=digits.target)
    train_y = np.eye(10, dtype=np.float32)[train_labels]
    return Digits(train_x, train_y, test_x, test_labels)


def build_model(config: TaskConfig, data: Digits) -> Any:
    """The MLP, initialised from ``config.seed`` alone (the same weights in every process).

    Args:
        config: the task.
        data: gives the input and output widths.

    Returns:
        An initialised thinc Model.

    Raises:
        ImportError: thinc is not installed (``pip install '.[example]'``).
    """
    from thinc.api import Relu, Softmax, chain, fix_random_seed
    fix_random_seed(config.seed)
    layers = [Relu(config.width) for _ in range(config.depth)]
    model = chain(*layers, Softmax())
    model.initialize(X=data.train_x[:2], Y=data.train_y[:2])
    return model


def make_optimizer(config: TaskConfig) -> Any:
    """thinc's Adam, elementwise only, so that a shard of an array updates like the array.

    Gradient clipping (per array, by its norm) and weight averaging are off: clipping would
    make the sharded update of ``rs-ag`` differ from the per-array one.

    Args:
        config: the task.

    Returns:
        A thinc Optimizer.
    """
    from thinc.api import Adam
    return Adam(config.learn_rate, grad_clip=0.0, use_averages=False)


class BatchStream:
    """The rows of each global batch: consecutive slices of seeded per-epoch permutations."""

    def __init__(self, train_size: int, global_batch: int, seed: int) -> None:
        """Args:
            train_size: rows of the training set.
            global_batch: rows of one global batch (workers x per-worker batch).
            seed: the data order's seed.
        """
        self._train_size = train_size
        self._global_batch = global_batch
        self._seed = seed
        self._permutations: Dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            self._permutations = {epoch: np.random.default_rng(
                [self._seed, epoch]).permutation(self._train_size)}
        return self._permutations[epoch]

    def rows(self, step: int, first: int, count: int) -> np.ndarray:
        """Rows ``[first, first + count)`` of global batch ``step``.

        Args:
            step: the global batch's index.
            first: the first row of the slice within the global batch.
            count: rows in the slice.

        Returns:
            Indices into the training set.
        """
        start = step * self._global_batch + first
        positions = np.arange(start, start + count)
        epochs = positions // self._train_size
        indices = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            indices[chosen] = self._permutation(int(epoch))[positions[chosen] % self._train_size]
        return indices


def loss_and_gradients(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """One forward and backward pass; the gradients go wherever the model's hook sends them.

    Args:
        model: a thinc Model.
        x: a batch of inputs.
        y: its one-hot targets.

    Returns:
        The batch's mean cross-entropy.
    """
    from thinc.api import CategoricalCrossentropy
    guesses, backprop = model.begin_update(x)
    backprop(CategoricalCrossentropy(normalize=True).get_grad(guesses, y))
    # thinc's own "loss" is the squared norm of the gradient; report the cross-entropy itself.
    xp = model.ops.xp
    return float(-xp.mean(xp.log(xp.maximum(xp.sum(guesses * y, axis=1), 1e-12))))


def held_out_accuracy(model: Any, data: Digits) -> float:
    """The share of test images whose most probable class is right.

    Args:
        model: a thinc Model.
        data: the split data.

    Returns:
        Accuracy in [0, 1].
    """
    guesses = model.ops.to_numpy(model.predict(model.ops.asarray(data.test_x)))
    return float(np.mean(guesses.argmax(axis=1) == data.test_labels))
