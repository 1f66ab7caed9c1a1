"""Whether a process of this node is alive, read from the process table (``/proc``).

A rank learns that a peer on its node died from the peer's entry in ``/proc``: gone, or a
zombie (exited, not yet reaped by Ray). Reading ``/proc/PID/stat`` costs one small file read
and no signal, so it is safe to do every 0.1 s for the peers a rank waits for.
"""

from __future__ import annotations

import time


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
