"""The work a ``ray_collective`` process group hands torch: when each call runs, and the handle.

Torch gives a backend no sign of whether its caller waits (``dist.all_reduce(t)`` is the same
backend call as ``async_op=True`` followed by ``wait()``), so the backend decides by size and
by the cores there are: a small call runs inline, in the caller's thread, where a thread hop
would cost more than the call; a large one (:data:`QUEUED_MIN_BYTES` and up, which DDP's
buckets are) runs on the group's one worker thread, so that the caller (DDP's backward pass)
goes on while it moves, but only where the process has cores to spare for it
(:func:`overlaps`). Where it has not, the worker thread's call and the backward pass share the
cores, and the call, slowed by every rank's compute, costs the step more than it hides: DDP
on 2 ranks and 2 cores spent 33 ms per step inside the library's calls made on the worker
thread and 12 ms in the same calls made inline. A call made while earlier ones are queued
joins the queue, so calls run in the order they were made on every rank, as the library
requires.

:class:`CollectiveWork` is torch's ``Work``: ``wait``, ``is_completed``, ``result`` and
``get_future`` (a ``torch.futures.Future`` of the call's output tensors, which DDP's
communication hooks chain on). A failure is raised by ``wait`` (and set on the future) as
:class:`torch.distributed.DistBackendError` with the library's message, its cause kept.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from .. import api as col
from ..errors import CollectiveError
from ..types import ReduceOp

QUEUED_MIN_BYTES = 1 << 20
"""A call that moves this many bytes or more runs on the group's worker thread (where the
group :func:`overlaps` its calls)."""


def overlaps(world_size: int) -> bool:
    """Whether a group of ``world_size`` ranks runs its large asynchronous calls on a worker
    thread beside the caller: where this process may run on at least two cores per rank (one
    for the caller's compute, one for the call), counting every rank as if on this node.

    Args:
        world_size: the group's size.

    Returns:
        True to overlap, False to run every call inline.
    """
    return len(os.sched_getaffinity(0)) >= 2 * world_size


def backend_error(error: BaseException) -> BaseException:
    """The exception torch's callers expect for ``error``: library failures become
    ``DistBackendError`` (message kept, cause chained); bad arguments stay as they are.

    Args:
        error: what the library raised.

    Returns:
        The exception to raise.
    """
    if isinstance(error, CollectiveError):
        wrapped = dist.DistBackendError(f"{type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped
    return error


class CollectiveWork(dist.Work):
    """A call's handle for torch: done already (inline) or running on the worker thread."""

    # What a call that ran inline and succeeded keeps: nothing but its outputs is set on it,
    # since the handle is made for every call and most are dropped at once.
    _future: Optional[Future] = None
    _error: Optional[BaseException] = None
    # Made on the first get_future() of a call that ran inline (most never ask).
    _torch_future: Optional[torch.futures.Future] = None

    def __init__(self, outputs: List[torch.Tensor], future: Optional[Future] = None,
                 error: Optional[BaseException] = None):
        super().__init__()
        self._outputs = outputs
        if error is not None:
            self._error = backend_error(error)
        if future is not None:
            self._future = future
            self._torch_future = torch.futures.Future()
            future.add_done_callback(lambda done: self._settle(done.exception()))

    def _settle(self, error: Optional[BaseException]) -> None:
        if error is not None:
            self._error = backend_error(error)
        self._finish(self._torch_future)

    def _finish(self, torch_future: torch.futures.Future) -> None:
        if self._error is None:
            torch_future.set_result(self._outputs)
        else:
            torch_future.set_exception(self._error)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the call has run.

        Args:
            timeout: the longest wait (a ``timedelta``); None or zero waits until the call ends
                or reaches its own deadline (the group's timeout).

        Returns:
            True.

        Raises:
            DistBackendError: the call failed (the library's error as its cause).
            TimeoutError: ``timeout`` passed first; the call goes on running.
        """
        if self._future is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            if not done.wait(seconds if seconds and seconds > 0 else None):
                raise TimeoutError(f"ray_collective call still running after {seconds:g}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the call has ended (successfully or not)."""
        return self._future is None or self._future.done()

    def is_success(self) -> bool:
        """Whether the call ended without an error."""
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        """The call's error once it failed, else None."""
        return self._error

    def result(self) -> List[torch.Tensor]:
        """The call's output tensors (after waiting for them).

        Returns:
            The tensors the call wrote.

        Raises:
            DistBackendError: the call failed.
        """
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future of the call's output tensors (DDP's communication hooks chain on it)."""
        if self._torch_future is None:
            self._torch_future = torch.futures.Future()
            self._finish(self._torch_future)
        return self._torch_future


class CallQueue:
    """Runs one group's calls in order: inline when small, or when the group does not overlap,
    and nothing is queued; else on the group's one worker thread."""

    def __init__(self, name: str, overlap: bool):
        self._name = name
        self._overlap = overlap
        self._lock = threading.Lock()
        self._queued = 0
        self._worker: Optional[ThreadPoolExecutor] = None

    def run(self, call: Callable[[], None], outputs: List[torch.Tensor],
            nbytes: int, async_op: bool = True) -> CollectiveWork:
        """Run ``call`` (which writes ``outputs``) now or on the worker thread.

        Args:
            call: the library call, blocking.
            outputs: the tensors it writes (the work's result).
            nbytes: how many bytes it moves, for the choice.
            async_op: torch's ``opts.asyncOp``: whether the caller may go on before the end
                (False: it waits at once, so the call runs inline unless others are queued;
                True runs it inline too where the group does not overlap).

        Returns:
            Its work.
        """
        with self._lock:
            inline = not self._to_worker(async_op, nbytes)
            if not inline:
                self._queued += 1
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(
                        1, thread_name_prefix=f"ray_collective.torch[{self._name}]")
                future = self._worker.submit(self._run_queued, call)
        if not inline:
            return CollectiveWork(outputs, future)
        try:
            call()
        except CollectiveError as error:
            return CollectiveWork(outputs, error=error)
        return CollectiveWork(outputs)

    def allreduce(self, tensor: Union[torch.Tensor, np.ndarray], op: ReduceOp,
                  outputs: List[torch.Tensor], async_op: bool) -> Optional[CollectiveWork]:
        """``col.allreduce`` of a plain contiguous CPU tensor (or the numpy array over its
        memory) in this group, run as :meth:`run` runs a call, with no function made for it
        where it runs inline (most calls).

        Args:
            tensor: reduced in place.
            op: the library's reduction.
            outputs: the list torch handed the backend (the work's result).
            async_op: torch's ``opts.asyncOp``.

        Returns:
            Its work; None for a call whose caller waits for it (``async_op`` False) once it
            has run inline: torch's ``all_reduce`` then returns at once, as it does for a
            backend that waits in C++, and no handle is made only to be waited on.

        Raises:
            DistBackendError: the call ran inline, its caller waits, and it failed.
        """
        # Unlocked: only a call made on this group can raise the count, and one that the
        # worker lowers in the meantime was ahead of this call anyway.
        if self._to_worker(async_op, tensor.nbytes):
            return self.run(lambda: col.allreduce(tensor, self._name, op), outputs,
                            tensor.nbytes, async_op)
        try:
            col.allreduce(tensor, self._name, op)
        except CollectiveError as error:
            if not async_op:
                raise backend_error(error) from error
            return CollectiveWork(outputs, error=error)
        return CollectiveWork(outputs) if async_op else None

    def _to_worker(self, async_op: bool, nbytes: int) -> bool:
        """Whether a call goes to the worker thread: calls are queued there already (a call
        joins them, to keep its order), or it is a large asynchronous one in a group that
        :func:`overlaps`."""
        return bool(self._queued) or (async_op and self._overlap and nbytes >= QUEUED_MIN_BYTES)

    def _run_queued(self, call: Callable[[], None]) -> None:
        try:
            call()
        finally:
            with self._lock:
                self._queued -= 1

    def close(self) -> None:
        """Wait for queued calls, then stop the worker thread."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
