"""Where the ranks of an NCCL group exchange the few bytes of their set-up.

Creating NCCL communicators needs one secret shared by every rank: the unique id that rank 0
draws. :class:`Rendezvous` is the small key-value interface the backend hands it over with;
keys are named by the backend (group name, clique, what) and deleted once the communicators
exist. Two implementations:

- :class:`RayRendezvous`: Ray's internal key-value store (in the GCS), in the namespace
  ``"ray_collective"``, keys under ``nccl/<job id>/`` (apart from the ``ray`` backend's keys,
  which start with the job id, so neither backend's clean-up can touch the other's). The id
  therefore travels through Ray, with Ray's authentication and TLS; no file, no new listening
  socket.
- :class:`InProcessRendezvous`: a dictionary shared by ranks that are threads of one process
  (tests, single-process multi-GPU scripts); no Ray needed.

Values are plain bytes the backend encodes itself (JSON); nothing is unpickled.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
import os
from typing import Any, Callable, Dict, Optional

from ...errors import BackendNotAvailableError
from ..arrivals import Arrivals, Terms
from ..key_value import KeyValue

LOOK_INTERVAL_S = 0.5
"""How often a waiting fetch calls its ``look`` (a join's check for a disagreeing rank)."""

Look = Optional[Callable[[], None]]


class Rendezvous(ABC):
    """A key-value meeting point with blocking, deadline-bounded reads."""

    @abstractmethod
    def publish(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing what was there.

        Args:
            key: the key.
            value: the bytes.
        """

    @abstractmethod
    def fetch(self, key: str, timeout: float, look: Look = None) -> Optional[bytes]:
        """Wait until ``key`` exists and return its value.

        Args:
            key: the key.
            timeout: seconds to wait at most (0: only look).
            look: called every :data:`LOOK_INTERVAL_S` while waiting; what it raises ends
                the wait (a join's ``Arrivals.look``: a rank that came later disagrees).

        Returns:
            The value, or None if ``key`` did not appear in time.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent).

        Args:
            key: the key.
        """


class InProcessRendezvous(Rendezvous):
    """A rendezvous for ranks that are threads of one process: share one instance among them."""

    def __init__(self):
        self._values: Dict[str, bytes] = {}
        self._changed = threading.Condition()

    def publish(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = bytes(value)
            self._changed.notify_all()

    def fetch(self, key: str, timeout: float, look: Look = None) -> Optional[bytes]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while key not in self._values:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if look is not None:
                    look()
                    remaining = min(remaining, LOOK_INTERVAL_S)
                self._changed.wait(remaining)
            return self._values[key]

    def delete(self, key: str) -> None:
        with self._changed:
            self._values.pop(key, None)

    def keys(self) -> tuple:
        """The keys present now (for tests and debugging).

        Returns:
            The keys, sorted.
        """
        with self._changed:
            return tuple(sorted(self._values))


# Polling Ray's store: start fast (ranks usually arrive together) and back off to a gentle rate
# so that hundreds of waiting ranks do not hammer the GCS.
_FIRST_POLL_S = 0.001
_LAST_POLL_S = 0.05


class RayRendezvous(Rendezvous):
    """A rendezvous in Ray's internal key-value store, scoped to the current Ray job.

    Args:
        job_id: the scope of the keys; defaults to the current Ray job's id.
        store: the module with ``_internal_kv_put/_get/_del`` and ``_internal_kv_initialized``;
            defaults to ``ray.experimental.internal_kv`` (see ``backends.key_value``).
        node: this process's Ray node id (for :meth:`announce`); defaults to the current one.

    Raises:
        BackendNotAvailableError: Ray is not initialized in this process (so there is no job
            and no store to meet in).
    """

    def __init__(self, job_id: Optional[str] = None, store: Optional[Any] = None,
                 node: Optional[str] = None):
        kv = KeyValue(store)
        if not kv.initialized():
            raise BackendNotAvailableError(
                "the 'nccl' backend hands its NCCL unique id to the other ranks through Ray, "
                "and Ray is not initialized in this process: call ray.init() first (inside a "
                "Ray actor it already is), or pass "
                "NcclBackendFactory(rendezvous=InProcessRendezvous()) when every rank is a "
                "thread of this process")
        if job_id is None:
            import ray
            job_id = ray.get_runtime_context().get_job_id()
        self._kv = kv
        self._job_id, self._node = job_id, node
        self._prefix = f"nccl/{job_id}/"

    def announce(self, group_name: str, rank: int, terms: Terms, timeout: float) -> Arrivals:
        """Announce this rank's terms for a join, as the ``ray`` backend's ranks do
        (``backends.arrivals``): a rank of the same group joining with another backend, world
        size or rank claim is refused at once, on both sides.

        Args:
            group_name: the group.
            rank: this rank.
            terms: what it brings.
            timeout: the seconds its join may wait.

        Returns:
            The announcement: pass its ``look`` to :meth:`fetch`, ``withdraw`` it once joined.

        Raises:
            JoinMismatchError: a rank already there disagrees.
        """
        node = self._node
        if node is None:
            import ray
            node = ray.get_runtime_context().get_node_id()
        arrivals = Arrivals(self._kv, self._job_id, group_name, rank, terms, node, os.getpid(),
                            timeout)
        arrivals.announce()
        return arrivals

    def publish(self, key: str, value: bytes) -> None:
        self._kv.put(self._prefix + key, value)

    def fetch(self, key: str, timeout: float, look: Look = None) -> Optional[bytes]:
        deadline = time.monotonic() + timeout
        pause = _FIRST_POLL_S
        next_look = time.monotonic() + LOOK_INTERVAL_S
        while True:
            value = self._kv.get_bytes(self._prefix + key)
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if look is not None and time.monotonic() >= next_look:
                look()
                next_look = time.monotonic() + LOOK_INTERVAL_S
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _LAST_POLL_S)

    def delete(self, key: str) -> None:
        self._kv.delete(self._prefix + key)
