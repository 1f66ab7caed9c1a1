"""One process of the ``mpi4py`` peer's ``mpiexec`` job: a ``RankWorker`` driven over a socket.

Usage (by ``mpi_job.MpiJob``): ``mpiexec -n N python -m benchmarks.mpi_worker SOCKET_PATH``.

Rank 0 connects to the driver's Unix socket and reads one JSON command per line
(``{"method": "time_block", "args": [...]}``); it sends the command to the other ranks, every
rank runs it on its ``RankWorker``, and rank 0 writes back one JSON line with each rank's result
or error. ``{"method": "quit"}`` or the socket closing ends the job.

Ranks wait for the next command by polling with growing sleeps rather than in a blocking MPI
call: MPICH busy-waits inside blocking calls, and 64 idle ranks spinning would take the two
cores from the backends being timed in between.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any, List, Optional

from .rows import describe_exception
from .mpi_job import decode_arguments
from .worker import RankWorker

COMMAND_TAG = 7
"""MPI tag of the commands rank 0 forwards."""

LONGEST_IDLE_SLEEP_S = 0.05
"""The longest sleep between two polls for a command (the shortest is 0.5 ms)."""


def wait_for_command(communicator: Any) -> dict:
    """The next command from rank 0, polled without spinning.

    Args:
        communicator: ``MPI.COMM_WORLD``.

    Returns:
        The command.
    """
    sleep_s = 0.0005
    while not communicator.Iprobe(source=0, tag=COMMAND_TAG):
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, LONGEST_IDLE_SLEEP_S)
    return communicator.recv(source=0, tag=COMMAND_TAG)


def serve(socket_path: str) -> None:
    """Run commands until told to stop (see the module's docstring).

    Args:
        socket_path: the driver's Unix socket (only rank 0 connects).
    """
    from mpi4py import MPI
    communicator = MPI.COMM_WORLD
    rank, size = communicator.Get_rank(), communicator.Get_size()
    worker = RankWorker(size, rank)
    channel = None
    if rank == 0:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(socket_path)
        channel = connection.makefile("rw", encoding="utf-8")
        channel.write(json.dumps({"ready": size}) + "\n")
        channel.flush()
    while True:
        if rank == 0:
            line = channel.readline()
            command = json.loads(line) if line else {"method": "quit"}
            for other in range(1, size):
                communicator.send(command, dest=other, tag=COMMAND_TAG)
        else:
            command = wait_for_command(communicator)
        if command["method"] == "quit":
            break
        result: Optional[Any] = None
        error: Optional[str] = None
        try:
            result = getattr(worker, command["method"])(*decode_arguments(command["args"]))
        except Exception as exc:  # reported to the driver as this rank's failure
            error = describe_exception(exc)
        answers: Optional[List] = communicator.gather((result, error), root=0)
        if rank == 0:
            channel.write(json.dumps({"results": [answer[0] for answer in answers],
                                      "errors": [answer[1] for answer in answers]}) + "\n")
            channel.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
