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
