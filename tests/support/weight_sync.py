"""Weight syncs run as threads of one process (no Ray), for the unit tests of
``ray_collective.weight_sync``: every member is a thread with its own registry, and each group
of the sync gets an in-process fabric of its own."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ray_collective.backends.base import BackendFactory
from ray_collective.backends.local import LocalBackendFactory
from ray_collective.group import GroupRegistry, use_registry
from ray_collective.transport.local import LocalFabric


class FabricPerGroup(BackendFactory):
    """An in-process backend that gives each group name (and size) a fabric of its own."""

    name = "local"

    def __init__(self):
        self._factories: Dict[tuple, LocalBackendFactory] = {}
        self._lock = threading.Lock()

    def available(self) -> bool:
        return True

    def create(self, group_name: str, world_size: int, rank: int, timeout: float):
        with self._lock:
            key = (group_name, world_size)
            if key not in self._factories:
                self._factories[key] = LocalBackendFactory(LocalFabric(world_size, group_name))
            factory = self._factories[key]
        return factory.create(group_name, world_size, rank, timeout)


def run_members(bodies: List[Callable[[], Any]], timeout: float = 60.0) -> List[Any]:
    """Run each body in a thread with its own registry; each one's result or exception."""
    results: List[Any] = [None] * len(bodies)

    def main(i: int) -> None:
        with use_registry(GroupRegistry()):
            try:
                results[i] = bodies[i]()
            except BaseException as err:  # returned to the test, which asserts on it
                results[i] = err

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise TimeoutError(f"members {hung} did not finish within {timeout}s")
    return results


def model(seed: int, sizes: Dict[str, tuple], dtype=np.float32) -> Dict[str, np.ndarray]:
    """A state dict of random tensors of ``sizes`` (name -> shape)."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in sizes.items()}


# ------------------------------------------------------------------ inside Ray actors
# Run through ``actor.__ray_call__``: the member's state dict lives on the actor object.

def hold_model(actor, sizes: Dict[str, tuple], seed: int) -> None:
    """Give the actor a state dict of random tensors."""
    actor.weights = model(seed, sizes)


def step_and_publish(actor, name: str, version: int, **kwargs) -> int:
    """A trainer's step (every tensor changes), then its publish."""
    import ray_collective as col
    for tensor in actor.weights.values():
        tensor += np.float32(1)
    return col.publish_weights(actor.weights, name, version=version, **kwargs)


def publish(actor, name: str, version: int) -> int:
    import ray_collective as col
    return col.publish_weights(actor.weights, name, version=version)


def receive(actor, name: str) -> int:
    import ray_collective as col
    return col.receive_weights(actor.weights, name)


def try_sync(actor, role: str, name: str, version: int, timeout=None):
    """A publisher's step and publish, or a receive: ``(version or the error's type, its
    message, the members it names dead, seconds taken)``."""
    import time

    import ray_collective as col
    start = time.monotonic()
    try:
        if role == "publisher":
            result = step_and_publish(actor, name, version, timeout=timeout)
        else:
            result = col.receive_weights(actor.weights, name, timeout=timeout)
    except col.WeightSyncError as err:
        return (type(err).__name__, str(err), getattr(err, "dead", ()),
                time.monotonic() - start)
    return result, "", (), time.monotonic() - start


def report(actor, name: str):
    import ray_collective as col
    r = col.weight_sync_report(name)
    return None if r is None else (r.version, r.moved_bytes, r.model_bytes, r.full)


def fingerprint(actor) -> Dict[str, bytes]:
    """The bytes of each tensor's digest, to compare members without shipping the model."""
    import hashlib
    return {k: hashlib.sha256(v.tobytes()).digest() for k, v in sorted(actor.weights.items())}


def die_at_bucket(actor, bucket: int) -> None:
    """Make this process SIGKILL itself as it comes to its ``bucket``-th bucket of the next
    sync (the earlier ones issued, some still in flight): a death in the middle of a sync."""
    import os
    import signal

    from ray_collective.weight_sync import transfer
    original = transfer.segment_views
    seen = [0]

    def views(*args):
        seen[0] += 1
        if seen[0] > bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args)

    transfer.segment_views = views
