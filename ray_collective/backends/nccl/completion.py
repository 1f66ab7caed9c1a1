"""Waiting for NCCL work with a deadline: the completion poll and the launch watchdog.

A collective is queued on the GPU and finishes later; the host learns of it from a CUDA event.
:func:`wait_for_events` polls the events (and NCCL's asynchronous error flag) until they
complete, the deadline passes, or NCCL reports an error; it never calls a blocking synchronize,
which could wait forever on a dead peer.

The launch itself can also block: a blocking communicator connects to its peers lazily, inside
the first call that needs them, and waits there for a peer that never comes. No poll loop runs
in that thread then, so :class:`LaunchWatchdog`, one thread per backend, watches the deadline of
the launch in progress and aborts the communicators when it passes, which makes the launch
return. (Non-blocking communicators would avoid the thread, but ``cupy.cuda.nccl`` only creates
blocking ones.)
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from .library import NcclLibrary


@dataclass(frozen=True)
class NcclOptions:
    """How the NCCL backend waits.

    Attributes:
        spin_seconds: poll a collective's completion without sleeping for this long (yielding
            the processor between polls): small collectives finish within microseconds, and
            even one sleep would dominate them.
        sleep_fraction: after spinning, sleep this fraction of the time waited so far between
            polls, so the wait overshoots the completion by at most about that fraction.
        max_sleep_seconds: the longest single sleep between polls.
        watchdog_period_seconds: how often the launch watchdog looks at the launch in progress.
    """

    spin_seconds: float = 0.02
    sleep_fraction: float = 0.02
    max_sleep_seconds: float = 0.001
    watchdog_period_seconds: float = 0.05


def wait_for_events(library: "NcclLibrary", events: Sequence[int],
                    communicators: Sequence[Any], deadline: float,
                    options: NcclOptions) -> bool:
    """Poll until every event has completed, or the deadline passes.

    Args:
        library: the NCCL library.
        events: the events to wait for.
        communicators: the communicators whose asynchronous errors end the wait.
        deadline: ``time.monotonic()`` value after which the wait gives up.
        options: the polling policy.

    Returns:
        True when every event completed, False when the deadline passed first.

    Raises:
        NcclError: NCCL recorded an asynchronous error on a communicator.
        CUDARuntimeError: the device reported an error for an event.
    """
    start = time.monotonic()
    pending = list(events)
    while True:
        pending = [event for event in pending if not library.done(event)]
        if not pending:
            return True
        for communicator in communicators:
            library.check_async_error(communicator)
        now = time.monotonic()
        if now >= deadline:
            return False
        waited = now - start
        if waited < options.spin_seconds:
            # Lets other threads run between polls. Not time.sleep(0): that is a timed sleep,
            # and the kernel's timer slack (50 us by default) makes it last 55-75 us, more
            # than a small collective takes.
            os.sched_yield()
        else:
            time.sleep(min(options.max_sleep_seconds, waited * options.sleep_fraction,
                           deadline - now))


class LaunchWatchdog:
    """Calls ``on_expire`` when a launch is still running past its deadline.

    Args:
        on_expire: what to do (abort the communicators); called from the watchdog's thread.
        period: seconds between looks; a deadline is noticed at most this late.
        name: the thread's name.
    """

    def __init__(self, on_expire: Callable[[], None], period: float, name: str):
        self._on_expire = on_expire
        self._period = period
        self._name = name
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None
        self._expired = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def expired(self) -> bool:
        """Whether the watchdog fired since the last :meth:`arm`."""
        return self._expired

    def arm(self, deadline: float) -> None:
        """Watch a launch that must finish by ``deadline`` (a ``time.monotonic()`` value).

        Args:
            deadline: when the launch's time is up.
        """
        with self._lock:
            self._expired = False
            self._deadline = deadline
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._watch, daemon=True,
                                                name=self._name)
                self._thread.start()

    def disarm(self) -> bool:
        """Stop watching the launch, which has returned.

        Returns:
            Whether the watchdog fired during it.
        """
        with self._lock:
            self._deadline = None
            return self._expired

    def close(self) -> None:
        """Stop the watchdog's thread."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._period * 4)

    def _watch(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                fire = self._deadline is not None and time.monotonic() > self._deadline
                if fire:
                    self._deadline = None
                    self._expired = True
            if fire:
                self._on_expire()
