"""spacy-ray's sharded parameter server, re-implemented on thinc's parameter-server hook.

How spacy-ray (explosion/spacy-ray, ``proxies.py`` and ``worker.py``) trains, and so how this
module does:

- Every worker builds the same model. The parameter arrays are divided among the workers by
  model node: ``len(nodes) // N`` nodes each (at least one), the remainder to the last worker
  (``divide_keys``). A worker *owns* the arrays of its nodes.
- A proxy (``PeerProxy``) is installed in each node's thinc ``ParamServer``; thinc then routes
  ``get_param`` / ``set_param`` / ``inc_grad`` through it. A gradient of an array the worker
  does not own becomes one fire-and-forget actor call ``owner.inc_grad.remote(key, version,
  grad)``, one call per array. The owner accepts it only if ``version`` is the owner's current
  version of the array, and drops it as stale otherwise (counted here; spacy-ray drops silently).
- When an owner has accumulated ``grads_per_update`` gradients of an array (spacy-ray's default:
  2) and the training thread next reads it (``get_param``), the owner runs the optimizer, bumps
  the version and sends ``peer.set_param.remote(key, version, param)`` to every other worker;
  there, the next ``get_param`` sees the new value.
- Training runs on a thread while the actor's own thread serves the incoming calls: no barrier
  anywhere, so the run is asynchronous (``synchronous=False``).

Two deliberate differences from spacy-ray, both for a fair comparison: by default the owner
applies the *mean* of the accumulated gradients (spacy-ray their sum, which ``average=False``
keeps: spaCy's losses are sums over a batch's examples, so there the sum is the global batch's
gradient; the example's loss is a mean, so there the mean is), and parameters go to every
other worker (spacy-ray sends only to workers that own
some array, so a worker owning nothing never receives an update when workers outnumber nodes).
One lock guards the proxy's tables: spacy-ray relies on the GIL alone while two threads add
into the same gradient arrays.

The synchronous variant (``synchronous=True``, ``grads_per_update = N``): at step ``s`` the
training thread waits, in ``get_param``, until every owned array has its ``N`` gradients of step
``s - 1`` (then updates it and sends it) and every other array has arrived at version ``s + 1``.
No gradient is ever stale, and the run computes what one process computes on the global batch.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .params import KeyT, install_proxy, key_of_node, parameter_nodes

INITIAL_VERSION = 1
"""Every array's version once the proxy is installed (spacy-ray's ``set_param`` bumps 0 to 1)."""


def divide_keys(model: Any, workers: int) -> List[List[KeyT]]:
    """The arrays each worker owns: whole nodes, ``len(nodes) // workers`` each (at least one).

    Args:
        model: a thinc Model.
        workers: the number of workers.

    Returns:
        For each worker, its keys; the last worker also takes the remainder, and workers past
        the number of nodes own nothing.
    """
    nodes = [[(position, name) for name in node.param_names]
             for position, node in parameter_nodes(model)]
    per_worker = max(1, len(nodes) // workers)
    owned: List[List[KeyT]] = []
    for rank in range(workers):
        chosen = nodes[rank * per_worker:(rank + 1) * per_worker]
        owned.append([key for node in chosen for key in node])
    for node in nodes[workers * per_worker:]:
        owned[-1].extend(node)
    return owned


@dataclass
class ServerCounters:
    """What one worker's proxy did, for the benchmark's per-update columns.

    Attributes:
        actor_calls: fire-and-forget calls made (gradients and parameters).
        bytes_sent: array bytes passed to those calls.
        grads_accepted: gradients added to an owned array (local ones included).
        grads_dropped: remote gradients dropped because their version was stale.
        updates: optimizer runs per owned key.
        send_seconds: training-thread time spent submitting calls.
        wait_seconds: training-thread time spent waiting for peers (synchronous only).
        serve_seconds: actor-thread time spent in ``receive_grad`` / ``receive_param``.
    """

    actor_calls: int = 0
    bytes_sent: int = 0
    grads_accepted: int = 0
    grads_dropped: int = 0
    updates: Dict[KeyT, int] = field(default_factory=Counter)
    send_seconds: float = 0.0
    wait_seconds: float = 0.0
    serve_seconds: float = 0.0


class PeerProxy:
    """The proxy thinc's ``ParamServer`` calls: owned arrays are served here, others pushed."""

    def __init__(self, model: Any, rank: int, peers: Sequence[Any], owned_by_rank:
                 Sequence[Sequence[KeyT]], optimizer: Any, grads_per_update: int,
                 synchronous: bool, timeout_s: float, average: bool = True) -> None:
        """Args:
            model: the worker's thinc Model (its node ids are mapped to shared keys).
            rank: this worker's position in ``peers``.
            peers: every worker's actor handle (this one's included), by rank.
            owned_by_rank: ``divide_keys(model, len(peers))``.
            optimizer: the thinc optimizer owners run.
            grads_per_update: gradients an owner accumulates before it updates an array.
            synchronous: wait for peers at each step (see the module's docstring).
            timeout_s: the longest a synchronous wait may last.
            average: apply the mean of the accumulated gradients (else their sum).
        """
        self._rank = rank
        self._average = average
        self._position = key_of_node(model)
        self._optimizer = optimizer
        self._grads_per_update = grads_per_update
        self._synchronous = synchronous
        self._timeout_s = timeout_s
        self._peers = list(peers)
        self._owner = {key: owner for owner, keys in enumerate(owned_by_rank) for key in keys}
        self._owned = set(owned_by_rank[rank])
        self._others = [index for index in range(len(peers)) if index != rank]
        self._sent_to: Dict[int, int] = Counter()
        self._received = 0
        self._announced = 0
        self._peers_done = 0
        self._params: Dict[KeyT, np.ndarray] = {}
        self._grads: Dict[KeyT, Optional[np.ndarray]] = {}
        self._grad_counts: Dict[KeyT, int] = Counter()
        self._versions: Dict[KeyT, int] = Counter()
        self._changed = threading.Condition()
        self._step = 0
        self.counters = ServerCounters()

    def install(self, model: Any) -> None:
        """Take the model's current parameters and route its nodes' ``ParamServer`` here.

        Args:
            model: the thinc Model the proxy was built for.
        """
        install_proxy(model, self)

    def begin_step(self, step: int) -> None:
        """Tell a synchronous proxy which step the training thread is about to compute.

        Args:
            step: the step's index (0 for the first).
        """
        self._step = step

    # ---------------------------------------------------------------- thinc's ParamServer hook

    def set_param(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc sets a parameter: kept if owned or not seen yet (a peer's value wins)."""
        key = (self._position[model_id], name)
        with self._changed:
            if key in self._owned or key not in self._params:
                self._params[key] = value
                self._versions[key] += 1
                self._grads[key] = None
                self._grad_counts[key] = 0

    def get_param(self, model_id: int, name: str) -> np.ndarray:
        """thinc reads a parameter: an owner first applies accumulated gradients."""
        key = (self._position[model_id], name)
        if self._synchronous:
            self._wait_for_step(key)
        with self._changed:
            updated = self._maybe_update(key)
            param, version = self._params[key], self._versions[key]
        if updated:
            self._send_param(key, version, param)
        return param

    def set_grad(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc sets a gradient: kept for owned arrays only."""
        key = (self._position[model_id], name)
        with self._changed:
            if key in self._owned:
                self._grads[key] = value.copy()
                self._grad_counts[key] = 1

    def inc_grad(self, model_id: int, name: str, value: np.ndarray) -> None:
        """thinc adds a gradient: into the owned array, or pushed to its owner."""
        key = (self._position[model_id], name)
        if key in self._owned:
            with self._changed:
                self._accumulate(key, value)
            return
        owner = self._owner[key]
        started = time.perf_counter()
        self._peers[owner].inc_grad.remote(key, self._versions[key], value)
        self.counters.send_seconds += time.perf_counter() - started
        self._sent_to[owner] += 1
        self.counters.actor_calls += 1
        self.counters.bytes_sent += value.nbytes

    # ---------------------------------------------------------------- served on the actor thread

    def receive_grad(self, key: KeyT, version: int, value: np.ndarray) -> None:
        """A peer's gradient of an owned array: added if current, else dropped as stale."""
        started = time.perf_counter()
        with self._changed:
            if self._versions.get(key) == version:
                self._accumulate(key, value)
            else:
                self.counters.grads_dropped += 1
            self._count_received()
        self.counters.serve_seconds += time.perf_counter() - started

    def receive_param(self, key: KeyT, version: int, value: np.ndarray) -> None:
        """An owner's new value of an array this worker reads."""
        started = time.perf_counter()
        with self._changed:
            self._params[key] = value
            self._versions[key] = version
            self._grads[key] = None
            self._grad_counts[key] = 0
            self._count_received()
        self.counters.serve_seconds += time.perf_counter() - started

    # ---------------------------------------------------------------- the end of a run

    def calls_sent_to(self, rank: int) -> int:
        """How many calls this worker made to worker ``rank`` (the training thread is over)."""
        return self._sent_to[rank]

    def peer_finished(self, calls_sent_to_us: int) -> None:
        """A peer's training is over and it made ``calls_sent_to_us`` calls to this worker."""
        with self._changed:
            self._peers_done += 1
            self._announced += calls_sent_to_us
            self._changed.notify_all()

    def wait_drained(self, timeout_s: float) -> None:
        """Block until every peer has finished and each of its calls to us has been served.

        A run's last calls are still in flight when its training threads end; serving them
        all keeps the drop counts complete and keeps them out of the actor's next run.

        Args:
            timeout_s: the longest to wait.

        Raises:
            TimeoutError: a peer never finished, or some of its calls never arrived.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._peers_done < len(self._others) or self._received < self._announced:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"rank {self._rank}: {self._peers_done} of {len(self._others)} peers "
                        f"finished, {self._received} of {self._announced} calls served after "
                        f"{timeout_s:.0f} s")
                self._changed.wait(left)

    # ---------------------------------------------------------------- internals

    def _count_received(self) -> None:
        """One more peer call served (the lock is held)."""
        self._received += 1
        self._changed.notify_all()

    def _accumulate(self, key: KeyT, value: np.ndarray) -> None:
        """Add ``value`` to the owned array's gradient (the lock is held)."""
        if self._grads.get(key) is None:
            self._grads[key] = value.copy()
        else:
            self._grads[key] += value
        self._grad_counts[key] += 1
        self.counters.grads_accepted += 1
        self._changed.notify_all()

    def _maybe_update(self, key: KeyT) -> bool:
        """Run the optimizer on an owned array with enough gradients (the lock is held)."""
        if key not in self._owned or self._grad_counts[key] < self._grads_per_update:
            return False
        gradient = self._grads[key]
        if self._average:
            gradient /= self._grad_counts[key]
        self._versions[key] += 1
        self._params[key], _ = self._optimizer(key, self._params[key], gradient)
        self._grads[key] = None
        self._grad_counts[key] = 0
        self.counters.updates[key] += 1
        return True

    def _send_param(self, key: KeyT, version: int, param: np.ndarray) -> None:
        """Push an owned array's new value to every other worker, one call each."""
        started = time.perf_counter()
        for index in self._others:
            self._peers[index].set_param.remote(key, version, param)
        self.counters.send_seconds += time.perf_counter() - started
        for index in self._others:
            self._sent_to[index] += 1
        self.counters.actor_calls += len(self._others)
        self.counters.bytes_sent += param.nbytes * len(self._others)

    def _wait_for_step(self, key: KeyT) -> None:
        """Synchronous only: block until ``key`` can be read at the current step."""
        target = INITIAL_VERSION + self._step
        started = time.perf_counter()
        deadline = started + self._timeout_s
        with self._changed:
            while not self._ready(key, target):
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(
                        f"rank {self._rank}: array {key} still at version "
                        f"{self._versions[key]} with {self._grad_counts[key]} of "
                        f"{self._grads_per_update} gradients after {self._timeout_s:.0f} s at "
                        f"step {self._step}; a peer is missing or dead")
                self._changed.wait(left)
        self.counters.wait_seconds += time.perf_counter() - started

    def _ready(self, key: KeyT, target: int) -> bool:
        """Can ``key`` be read at version ``target`` (the lock is held)?"""
        if self._versions[key] >= target:
            return True
        return key in self._owned and self._grad_counts[key] >= self._grads_per_update

