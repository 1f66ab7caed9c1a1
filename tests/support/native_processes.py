"""Run the ranks of one node as processes of this machine, without Ray: how the native core's
tests drive it, each rank a process with its own ``Node`` over one private directory::

    with ProcessRanks(4) as ranks, node_directory() as directory:
        results = ranks.run(body, [(directory, rank, ...) for rank in range(4)], timeout=60)

Needs the extension (``native.available()``). Workers are spawned once (fresh interpreters:
nothing inherited from the caller's threads) and reused. A world of p ranks takes p idle
workers: every rank of a world blocks until all of them run, so no worker can take a second
rank of the same world. ``body`` must be a module-level function (it is pickled by name) and
should bound its own waits, so that a failed world ends with an error rather than a stuck
worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import time
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np

from ray_collective.native import _core

SHARED_MEMORY = "/dev/shm"


class Call(NamedTuple):
    """One call: its plan code, dtype and op (a ``Program`` once built, in the process that
    runs it), and what ``Node.start`` takes besides."""

    code: np.ndarray
    slots: List[np.ndarray]
    header: bytes
    dtype_code: int
    op_code: int
    tag: int = -1

    def program(self):
        """The call's ``_core.Program``."""
        return _core.Program(self.code, self.dtype_code, self.op_code)


def start(node, call: Call) -> None:
    """``node.start`` of ``call``."""
    node.start(call.program(), call.slots, call.header, call.tag)


class Outcome(NamedTuple):
    """How a call ended on one rank: its status (``PENDING`` if it ran out of time and was
    abandoned), its slots afterwards, the mismatch details, and how many messages of it this
    rank read in place from its peers' memory."""

    status: int
    slots: List[np.ndarray]
    mismatch: Optional[dict]
    remote_reads: int = 0


def run_calls(directory: str, rank: int, world_size: int, ring_bytes: int, part_bytes: int,
              spin_ns: int, calls: Sequence[Call], call_timeout: float,
              slice_s: float = 0.05, remote_min_bytes: int = 0) -> List[Outcome]:
    """A rank's body: open a Node and run ``calls`` one after the other, each for at most
    ``call_timeout`` seconds; stops after the first call that does not end DONE.

    Returns:
        The outcome of every call run.
    """
    outcomes = []
    with _core.Node(directory, rank, world_size, ring_bytes, part_bytes, spin_ns,
                    remote_min_bytes) as node:
        for call in calls:
            reads = node.remote_reads
            start(node, call)
            deadline = time.monotonic() + call_timeout
            status = node.progress(slice_s)
            while status == _core.PENDING and time.monotonic() < deadline:
                status = node.progress(slice_s)
            if status == _core.PENDING:
                node.abandon()
            outcomes.append(Outcome(status, call.slots, node.mismatch_details(),
                                    node.remote_reads - reads))
            if status != _core.DONE:
                break
    return outcomes


@contextlib.contextmanager
def node_directory() -> Iterator[str]:
    """A fresh private (0700) directory on tmpfs where there is one, removed afterwards."""
    where = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
    with tempfile.TemporaryDirectory(prefix="ray_collective-native-", dir=where) as directory:
        yield directory


class ProcessRanks:
    """A pool of spawned worker processes that run the ranks of a world side by side.

    Args:
        processes: the largest world it can run.
    """

    def __init__(self, processes: int):
        self.processes = processes
        self._pool = multiprocessing.get_context("spawn").Pool(processes)

    def run(self, body: Callable[..., Any], args: Sequence[tuple], timeout: float) -> List[Any]:
        """Run ``body(*args[rank])`` for every rank at once; their return values in rank order.

        Raises:
            ValueError: more ranks than workers.
            multiprocessing.TimeoutError: some rank did not return within ``timeout`` seconds
                (close the pool then: its workers may still be busy).
            Exception: what a rank raised.
        """
        if len(args) > self.processes:
            raise ValueError(f"{len(args)} ranks, but only {self.processes} workers")
        pending = [self._pool.apply_async(body, rank_args) for rank_args in args]
        deadline = time.monotonic() + timeout
        return [result.get(max(0.0, deadline - time.monotonic())) for result in pending]

    def close(self) -> None:
        """Stop every worker."""
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> "ProcessRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
