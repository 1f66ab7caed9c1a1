"""Whether a process of this node has exited: ``transport.processes``' look-ups in ``/proc``
and its pidfd watch, against real processes started and killed here."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ray_collective.transport.processes import ProcessWatch, process_alive


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _until_exited(watch, pids, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gone = watch.exited(pids)
        if gone:
            return gone
        time.sleep(0.01)
    return []


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_killed_process_is_seen_exited_and_a_live_one_not(monkeypatch, pidfds):
    """Killed and not reaped (a zombie, as a Ray worker is until the raylet reaps it): exited;
    its live neighbour and this process: not. Without pidfds, through /proc alike."""
    if not pidfds:
        def refuse(pid):
            raise OSError(38, "pidfd_open is not implemented here")
        monkeypatch.setattr(os, "pidfd_open", refuse)
    victim, neighbour = _sleeper(), _sleeper()
    watch = ProcessWatch()
    try:
        pids = [victim.pid, neighbour.pid, os.getpid()]
        assert watch.exited(pids) == []
        os.kill(victim.pid, signal.SIGKILL)
        assert _until_exited(watch, pids) == [victim.pid]
        assert not process_alive(victim.pid)  # a zombie still has its entry in /proc
        assert watch.exited(pids) == [victim.pid]  # it stays exited
    finally:
        watch.close()
        for process in (victim, neighbour):
            process.kill()
            process.wait()


def test_a_process_that_never_was_is_exited_and_close_releases_every_pidfd():
    live = [_sleeper() for _ in range(3)]
    before = _open_fds()
    watch = ProcessWatch()
    try:
        missing = 2 ** 22 + 12345  # above the default pid_max: no such process
        assert watch.exited([p.pid for p in live] + [missing]) == [missing]
        assert _open_fds() == before + 3  # a pidfd per live process
        watch.close()
        assert _open_fds() == before
    finally:
        for process in live:
            process.kill()
            process.wait()
