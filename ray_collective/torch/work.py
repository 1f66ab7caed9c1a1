"""The work a ``ray_collective`` process group hands torch: when each call runs, and the handle.

Torch gives a backend no sign of whether its caller waits (``dist.all_reduce(t)`` is the same
backend call as ``async_op=True`` followed by ``wait()``), so the backend decides by size: a
small call runs inline, in the caller's thread, where a thread hop would cost more than the
call; a large one (:data:`QUEUED_MIN_BYTES` and up, which DDP's buckets are) runs on the
group's one worker thread, so that the caller (DDP's backward pass) goes on while it moves. A
call made while earlier ones are queued joins the queue, so calls run in the order they were
made on every rank, as the library requires.

:class:`CollectiveWork` is torch's ``Work``: ``wait``, ``is_completed``, ``result`` and
``get_future`` (a ``torch.futures.Future`` of the call's output tensors, which DDP's
communication hooks chain on). A failure is raised by ``wait`` (and set on the future) as
:class:`torch.distributed.DistBackendError` with the library's message, its cause kept.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError

QUEUED_MIN_BYTES = 1 << 20
"""A call that moves this many bytes or more runs on the group's worker thread."""


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

    def __init__(self, outputs: List[torch.Tensor], future: Optional[Future] = None,
                 error: Optional[BaseException] = None):
        super().__init__()
        self._outputs = outputs
        self._future = future
        self._error = None if error is None else backend_error(error)
        # Made on the first get_future() of a call that ran inline (most never ask).
        self._torch_future: Optional[torch.futures.Future] = None
        if future is not None:
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
    """Runs one group's calls in order: inline when small and nothing is queued, else on the
    group's one worker thread."""

    def __init__(self, name: str):
        self._name = name
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
                (False: it waits at once, so the call runs inline unless others are queued).

        Returns:
            Its work.
        """
        with self._lock:
            inline = not self._queued and (not async_op or nbytes < QUEUED_MIN_BYTES)
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
