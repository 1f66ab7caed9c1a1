"""One rank of ``benchmarks.scale_real``: the actor class and the data it checks results with.

Kept apart from the driver's module so that each of up to 400 rank processes imports numpy and
small modules only (0.3 MB; the driver's module with its plotting and cluster code, 2 MB): at
400 ranks every megabyte per process is 400 MB of a machine that has 23.5 GiB.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import time
from typing import Any, List, Optional

import numpy as np

from .collectives import message_layout
from .worker import resident_bytes, time_back_to_back


def elements(collective: str, nbytes: int, world_size: int) -> int:
    """float32 elements of one rank's tensor (allgather's ``nbytes`` is its whole output, as
    in nccl-tests, so that 400 ranks do not each gather 400 times 64 KiB)."""
    return message_layout(collective, nbytes, world_size, 4).elements_per_tensor if nbytes else 0


MODULUS = 31
"""Rank inputs are residues modulo this prime (small integers: float32 sums of 400 of them are
exact, so results can be compared with numpy's exactly)."""


def rank_input(rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s data for a correctness check: element i is (7i + 13·rank) mod 31."""
    return ((np.arange(count) * 7 + rank * 13) % MODULUS).astype(np.float32)


def allreduce_sum(world_size: int, count: int) -> np.ndarray:
    """The sum of every rank's ``rank_input``, without building ``world_size`` arrays (at 400
    ranks and 1 MiB, 400 MB per rank): 13 is invertible modulo 31, so any 31 consecutive
    ranks contribute each residue once (0 + 1 + ... + 30 = 465), and only the remaining
    ``world_size mod 31`` ranks are added one by one."""
    full_cycles, rest = divmod(world_size, MODULUS)
    total = np.full(count, full_cycles * (MODULUS * (MODULUS - 1) // 2), dtype=np.float64)
    for rank in range(rest):
        total += rank_input(rank, count)
    return total.astype(np.float32)


def expected_result(collective: str, world_size: int, rank: int, count: int) -> Any:
    """What numpy says rank ``rank`` must hold after ``collective`` on ``rank_input`` data."""
    if collective == "allreduce":
        return allreduce_sum(world_size, count)
    if collective == "broadcast":
        return rank_input(0, count)
    if collective == "allgather":
        return np.stack([rank_input(r, count) for r in range(world_size)])
    raise KeyError(collective)


class ScaleRank:
    """One rank actor of the run; it knows its rank only per group, as the driver assigns it."""

    def ready(self) -> dict:
        """``{"pid", "rss_bytes"}`` of this actor, once it is up."""
        return {"pid": os.getpid(), "rss_bytes": resident_bytes()}

    def hold(self, seconds: float) -> None:
        """Sleep inside a task for ``seconds`` (Ray's signal check waits meanwhile)."""
        time.sleep(seconds)

    def load_library(self) -> dict:
        """Import ``ray_collective`` (a no-op after the first time); returns the resident
        memory before and after."""
        before = resident_bytes()
        importlib.import_module("ray_collective")
        return {"rss_before": before, "rss_after": resident_bytes()}

    def join(self, world_size: int, rank: int, group_name: str, timeout_s: float) -> dict:
        """``init_collective_group(backend="ray")``; returns seconds and memory around it."""
        import ray_collective as col
        before = resident_bytes()
        start = time.perf_counter()
        col.init_collective_group(world_size, rank, backend="ray", group_name=group_name,
                                  timeout=timeout_s)
        return {"seconds": time.perf_counter() - start, "rss_before": before,
                "rss_after": resident_bytes()}

    def release_memory(self) -> dict:
        """Hand the heap's free memory back to the system; returns ``{"rss_bytes"}`` after,
        and ``{"open_fds"}``, this process's open file descriptors (sockets and shared memory
        segments of the groups it is in among them).

        glibc keeps freed 1 MiB buffers in the heap once it has raised its mmap threshold, so
        without this each rank kept 12-30 MB after the 1 MiB points: 5-12 GB at 400 ranks.
        """
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing to trim this way
        return {"rss_bytes": resident_bytes(), "open_fds": len(os.listdir("/proc/self/fd"))}

    def leave(self, group_name: str) -> float:
        """``destroy_collective_group``; returns its seconds."""
        import ray_collective as col
        start = time.perf_counter()
        col.destroy_collective_group(group_name)
        return time.perf_counter() - start

    def check(self, group_name: str, collective: str, nbytes: int) -> Optional[str]:
        """One call on ``rank_input`` data; None if the result equals numpy's, else why not."""
        import ray_collective as col
        rank, size = col.get_rank(group_name), col.get_collective_group_size(group_name)
        if collective == "barrier":
            col.barrier(group_name)
            return None
        count = elements(collective, nbytes, size)
        tensor = rank_input(rank, count)
        if collective == "allreduce":
            col.allreduce(tensor, group_name)
            got = tensor
        elif collective == "broadcast":
            col.broadcast(tensor, 0, group_name)
            got = tensor
        else:
            parts = [np.empty(count, np.float32) for _ in range(size)]
            col.allgather(parts, tensor, group_name)
            got = np.stack(parts)
        want = expected_result(collective, size, rank, count)
        if np.array_equal(got, want):
            return None
        wrong = int(np.count_nonzero(got != want))
        return f"rank {rank}: {collective} {nbytes} B: {wrong} of {want.size} elements differ"

    def time_loop(self, group_name: str, collective: str, nbytes: int, warmup: int,
                  iterations: int) -> List[float]:
        """One barrier, then the calls back to back; this rank's seconds per timed call."""
        import ray_collective as col
        size = col.get_collective_group_size(group_name)
        count = elements(collective, nbytes, size)
        tensor = np.zeros(count, np.float32)
        parts = [np.empty(count, np.float32) for _ in range(size)]
        calls = {"allreduce": lambda: col.allreduce(tensor, group_name),
                 "broadcast": lambda: col.broadcast(tensor, 0, group_name),
                 "allgather": lambda: col.allgather(parts, tensor, group_name),
                 "barrier": lambda: col.barrier(group_name)}
        return time_back_to_back(lambda: col.barrier(group_name), calls[collective], warmup,
                                 iterations).durations

    def allreduce_until_error(self, group_name: str) -> dict:
        """Allreduce 8 B in a loop until the group fails; what failed, and when (wall clock)."""
        import ray_collective as col
        tensor = np.zeros(2, np.float32)
        calls = 0
        while True:
            try:
                col.allreduce(tensor, group_name)
                calls += 1
            except Exception as err:  # noqa: BLE001 - the drill reports whatever is raised
                return {"at": time.time(), "type": type(err).__name__, "calls": calls,
                        "dead_ranks": list(getattr(err, "dead_ranks", []) or []),
                        "message": str(err)[:300]}
