"""An actor that reports its own memory as the kernel counts it, stage by stage.

``benchmarks.scale_memory`` starts these in place of rank actors so that a bare Ray actor can
be measured: this module imports nothing at its top beyond the standard library (numpy,
``ray_collective`` and the group come in one stage at a time, when the driver asks), and it
reads ``/proc`` with plain files.

The figures (:func:`process_memory`), per process, from ``/proc/PID/smaps_rollup``:

- ``rss``: resident pages, shared ones counted whole in every process that maps them;
- ``pss``: proportional set size, each resident page divided by the processes that map it
  (summed over every process, the memory they use together);
- ``uss``: unique set size, the private pages alone (``Private_Clean`` + ``Private_Dirty``),
  what the machine gets back when the process ends.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import sys
import threading
from typing import Dict, List, Optional, Sequence

SMAPS_FIELDS = {"Rss": "rss", "Pss": "pss", "Private_Clean": "uss", "Private_Dirty": "uss",
                "Pss_Shmem": "pss_shmem", "Shared_Clean": "shared", "Shared_Dirty": "shared"}
"""Fields of ``smaps_rollup`` read, and what each adds to (both Private fields make USS)."""


def process_memory(pid: object = "self") -> Dict[str, int]:
    """RSS, PSS, USS, the PSS of shared memory (tmpfs, ``/dev/shm``) and the shared pages of
    process ``pid``, in bytes, from ``/proc/PID/smaps_rollup``; threads from its status.

    Args:
        pid: a process id, or ``"self"``.

    Returns:
        ``{"rss", "pss", "uss", "pss_shmem", "shared", "threads"}``; every field 0 for a
        process that is gone or unreadable.
    """
    figures = dict.fromkeys(("rss", "pss", "uss", "pss_shmem", "shared", "threads"), 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                name, _, rest = line.partition(":")
                if name in SMAPS_FIELDS:
                    figures[SMAPS_FIELDS[name]] += int(rest.split()[0]) * 1024
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    figures["threads"] = int(line.split()[1])
    except (OSError, ValueError):
        return dict.fromkeys(figures, 0)
    return figures


def trim_heap() -> None:
    """Collect garbage and hand the heap's free pages back (glibc), so that what a stage
    freed is not counted as its cost."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way


class MemoryProbe:
    """One actor: each method takes it one stage further and reports its memory after."""

    def measure(self) -> dict:
        """This process's :func:`process_memory` (heap trimmed first), its pid, and the
        names of the modules it has loaded."""
        trim_heap()
        return {"pid": os.getpid(), **process_memory(), "modules": sorted(sys.modules),
                "thread_names": sorted(t.name for t in threading.enumerate())}

    def load(self, module: str) -> dict:
        """Import ``module``; then :meth:`measure`."""
        importlib.import_module(module)
        return self.measure()

    def join(self, world_size: int, rank: int, group_name: str, timeout_s: float) -> dict:
        """Join a ``ray`` backend group; then :meth:`measure`."""
        import ray_collective as col
        col.init_collective_group(world_size, rank, backend="ray", group_name=group_name,
                                  timeout=timeout_s)
        return self.measure()

    def call(self, group_name: str, elements: int) -> dict:
        """One float32 allreduce of ``elements`` (the first call maps the rings its
        algorithm uses) and a barrier; then :meth:`measure`."""
        import numpy as np

        import ray_collective as col
        col.allreduce(np.ones(elements, np.float32), group_name)
        col.barrier(group_name)
        return self.measure()

    def leave(self, group_name: str) -> dict:
        """Destroy this rank's membership; then :meth:`measure`."""
        import ray_collective as col
        col.destroy_collective_group(group_name)
        return self.measure()


def tree_pids(root: int) -> List[int]:
    """``root`` and every process descended from it now."""
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                # The name is in parentheses and may hold spaces: the parent follows the last ')'.
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def command_line(pid: int) -> str:
    """Process ``pid``'s command line, arguments joined by spaces ('' if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as source:
            return source.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


RAY_PROCESS_KINDS = (("gcs_server", "gcs_server"), ("raylet", "/raylet "),
                     ("dashboard", "dashboard/dashboard.py"),
                     ("dashboard agent", "ray::DashboardAgent"),
                     ("runtime env agent", "ray::RuntimeEnvAgent"),
                     ("log monitor", "log_monitor.py"), ("autoscaler monitor", "monitor.py"),
                     ("idle worker", "ray::IDLE"), ("actor", "ray::"),
                     ("worker (starting)", "default_worker.py"))
"""(kind, text of the command line that tells it), first match wins."""


def process_kind(command: str) -> Optional[str]:
    """Which of Ray's processes ``command`` (a command line) is, or None."""
    for kind, marker in RAY_PROCESS_KINDS:
        if marker in command:
            return kind
    return None


def ray_processes(root: int, exclude: Sequence[int] = ()) -> List[dict]:
    """Every process under ``root`` (a driver that started its own Ray) that is one of
    Ray's, with its kind and :func:`process_memory`, ``exclude`` left out."""
    rows = []
    for pid in tree_pids(root):
        kind = process_kind(command_line(pid)) if pid != root else "driver"
        if kind and pid not in exclude:
            rows.append({"pid": pid, "kind": kind, **process_memory(pid)})
    return rows
