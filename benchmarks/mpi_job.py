"""The driver's side of the ``mpi4py`` peer: one ``mpiexec`` job per world size.

MPI processes cannot live inside Ray actors, so the ``mpi4py`` peer runs in a job of its own
(``mpiexec -n N python -m benchmarks.mpi_worker SOCKET``), started with MPICH's ``mpiexec``
from the interpreter's directory. The driver listens on a Unix socket in a private (0700)
directory; rank 0 connects and relays commands (see ``mpi_worker``). ``MpiJob.call`` has the
interface of ``harness.RankPool.call``, so the harness interleaves the job's blocks with the
in-actor backends exactly like theirs.

Every wait has a deadline, and ``kill`` ends the job's whole process group whatever happened.
MPICH's Hydra runs more processes than cores without any flag (it oversubscribes by default).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, List, Optional, Sequence

from .memory_probe import tree_pids
from .rows import CallOutcome, summarize_failures
from .worker import BlockSpec

QUIT_GRACE_S = 5.0
"""How long the job may take to leave after ``quit`` before it is killed."""

ERROR_LOG_TAIL = 600
"""Characters of the job's output quoted when it fails to start."""


def mpiexec_path() -> str:
    """MPICH's ``mpiexec`` next to the interpreter (the ``mpich`` wheel installs it there).

    Returns:
        The path.

    Raises:
        FileNotFoundError: there is none (``pip install mpich mpi4py``).
    """
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"no mpiexec at {path}: the mpi4py peer needs "
                                f"'pip install mpich mpi4py' in this environment")
    return path


def encode_arguments(arguments: Sequence[Any]) -> List[Any]:
    """Arguments of a ``RankWorker`` method as JSON values (a ``BlockSpec`` becomes a dict).

    Args:
        arguments: the arguments.

    Returns:
        JSON-serializable arguments.
    """
    return [{"block": asdict(value)} if isinstance(value, BlockSpec) else value
            for value in arguments]


def decode_arguments(arguments: Sequence[Any]) -> List[Any]:
    """The inverse of ``encode_arguments``.

    Args:
        arguments: decoded JSON arguments.

    Returns:
        The arguments, ``BlockSpec`` restored.
    """
    return [BlockSpec(**value["block"]) if isinstance(value, dict) and "block" in value
            else value for value in arguments]


def descendant_count(pid: int) -> int:
    """How many processes ``pid`` and its descendants are, from ``/proc`` (0 if it is gone).

    Args:
        pid: the root process.

    Returns:
        The count, the root included.
    """
    if not os.path.exists(f"/proc/{pid}"):
        return 0
    return len(tree_pids(pid))


class MpiJob:
    """A running ``mpiexec`` job of ``world_size`` ``mpi_worker`` ranks.

    Args:
        world_size: number of MPI ranks.
        timeout_s: how long the job may take to start and connect.

    Raises:
        FileNotFoundError: no ``mpiexec``.
        TimeoutError: rank 0 did not connect in time (the job is killed first).
        RuntimeError: the job exited before connecting.
    """

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self._directory = tempfile.mkdtemp(prefix="ray_collective_mpi_")
        self._log_path = os.path.join(self._directory, "job.log")
        self._process: Optional[subprocess.Popen] = None
        self._channel = None
        self._connection: Optional[socket.socket] = None
        socket_path = os.path.join(self._directory, "driver.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(socket_path)
            listener.listen(1)
            repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            environment = dict(os.environ)
            environment["PYTHONPATH"] = os.pathsep.join(
                filter(None, [repository, environment.get("PYTHONPATH", "")]))
            with open(self._log_path, "wb") as log:
                self._process = subprocess.Popen(
                    [mpiexec_path(), "-n", str(world_size), sys.executable, "-m",
                     "benchmarks.mpi_worker", socket_path],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=environment, start_new_session=True)
            self._connection = self._accept(listener, timeout_s)
            self._channel = self._connection.makefile("rw", encoding="utf-8")
            self._read_line(timeout_s)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        listener.settimeout(0.2)
        while True:
            try:
                return listener.accept()[0]
            except socket.timeout:
                pass
            if self._process.poll() is not None:
                raise RuntimeError(f"mpiexec exited with status {self._process.returncode} "
                                   f"before rank 0 connected: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mpiexec's rank 0 did not connect within {timeout_s:g} s")

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, errors="replace") as log:
                return " ".join(log.read()[-ERROR_LOG_TAIL:].split())
        except OSError:
            return "(no output)"

    def _read_line(self, timeout_s: float) -> dict:
        self._connection.settimeout(timeout_s)
        line = self._channel.readline()
        if not line:
            raise RuntimeError(f"the mpiexec job closed its channel: {self._log_tail()}")
        return json.loads(line)

    @property
    def pid(self) -> Optional[int]:
        """The ``mpiexec`` process's id (None once killed)."""
        return None if self._process is None else self._process.pid

    def process_count(self) -> int:
        """How many processes the job runs: ``mpiexec``, Hydra's proxy and the ranks.

        Returns:
            The count (0 once killed).
        """
        return 0 if self._process is None else descendant_count(self._process.pid)

    def call(self, method: str, *args: Any, timeout_s: float):
        """Run ``method(*args)`` on every rank's ``RankWorker``, like ``RankPool.call``.

        Args:
            method: a method of ``RankWorker``.
            *args: its arguments, the same for every rank.
            timeout_s: the deadline.

        Returns:
            A ``rows.CallOutcome``; ``stuck`` when the job did not answer in time or died
            (the caller then kills it).
        """
        try:
            self._channel.write(json.dumps({"method": method,
                                            "args": encode_arguments(args)}) + "\n")
            self._channel.flush()
            answer = self._read_line(timeout_s)
        except (OSError, ValueError, RuntimeError) as exc:
            late = "did not answer" if isinstance(exc, socket.timeout) else "failed"
            return CallOutcome(error=f"the mpiexec job {late} {method} within {timeout_s:g} s: "
                                     f"{exc}", stuck=True)
        failures: dict = {}
        for rank, error in enumerate(answer["errors"]):
            if error:
                failures.setdefault(error, []).append(rank)
        if failures:
            return CallOutcome(error=summarize_failures([], failures, method, timeout_s))
        return CallOutcome(results=tuple(answer["results"]))

    def kill(self) -> None:
        """Ask the job to quit, then kill its process group; safe to call twice."""
        if self._channel is not None:
            try:
                self._channel.write(json.dumps({"method": "quit", "args": []}) + "\n")
                self._channel.flush()
            except OSError:
                pass
        if self._process is not None:
            try:
                self._process.wait(timeout=QUIT_GRACE_S if self._channel is not None else 0.1)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.wait(timeout=QUIT_GRACE_S)
            self._process = None
        for closable in (self._channel, self._connection):
            if closable is not None:
                try:
                    closable.close()
                except OSError:
                    pass
        self._channel = self._connection = None
        shutil.rmtree(self._directory, ignore_errors=True)
