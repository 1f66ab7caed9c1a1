"""Whether a process of this node is alive: from the process table (``/proc``), or, for the
peers a rank keeps looking at, from a pidfd per process.

A rank learns that a peer on its node died from the peer's entry in ``/proc``: gone, or a
zombie (exited, not yet reaped by Ray). Reading ``/proc/PID/stat`` costs one small file read
and no signal. A rank waiting in a call looks at the peers it waits for every 0.05 s, though,
and at hundreds of ranks on two cores those reads added up to a core
(:class:`ProcessWatch` says how much): it watches them through pidfds instead, which the
kernel marks readable when their process exits, so one ``poll`` looks at them all.
"""

from __future__ import annotations

import os
import select
import time
from typing import Dict, Iterable, List, Optional


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on this node.

    Args:
        pid: the process id.

    Returns:
        False when the process is gone or is a zombie, True otherwise.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone, or goes within ``seconds`` (polled every 0.5 ms).

    Args:
        pid: the process id.
        seconds: how long to wait for it to go.

    Returns:
        True once it is gone; False if it is still alive after ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
    return True


class ProcessWatch:
    """Which of some processes of this node have exited, each watched through a pidfd
    (``os.pidfd_open``) from the first time it is asked about: one ``poll`` of them all per
    look. A pidfd names the process it was opened for, so a reused PID is not taken for it;
    where one cannot be opened (a kernel without pidfds), that process is looked up in
    ``/proc`` (:func:`process_alive`).

    Measured on the 2-core machine, 48 ranks on one node waiting in a barrier: each rank's
    look at its 12 peers took about 0.2 ms through ``/proc``.
    """

    def __init__(self):
        self._pidfds: Dict[int, Optional[int]] = {}  # None: read /proc, or exited
        self._pid_of: Dict[int, int] = {}
        self._poll = select.poll()
        self._exited: set = set()

    def exited(self, pids: Iterable[int]) -> List[int]:
        """The processes among ``pids`` that have exited (zombies included).

        Args:
            pids: process ids of this node.

        Returns:
            Those of them that are gone, in the order given.
        """
        pids = list(pids)
        for pid in pids:
            if pid not in self._pidfds:
                self._watch(pid)
        if self._pid_of:
            for fd, _ in self._poll.poll(0):
                self._forget(fd)
        for pid in pids:
            if self._pidfds[pid] is None and pid not in self._exited and not process_alive(pid):
                self._exited.add(pid)
        return [pid for pid in pids if pid in self._exited]

    def close(self) -> None:
        """Close every pidfd."""
        for fd in list(self._pid_of):
            self._poll.unregister(fd)
            del self._pid_of[fd]
            os.close(fd)
        self._pidfds.clear()

    def _watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfds[pid] = None
            self._exited.add(pid)
            return
        except (OSError, AttributeError):
            self._pidfds[pid] = None
            return
        self._pidfds[pid] = fd
        self._pid_of[fd] = pid
        self._poll.register(fd, select.POLLIN)

    def _forget(self, fd: int) -> None:
        """The process of ``fd`` has exited."""
        pid = self._pid_of.pop(fd)
        self._poll.unregister(fd)
        os.close(fd)
        self._pidfds[pid] = None
        self._exited.add(pid)
