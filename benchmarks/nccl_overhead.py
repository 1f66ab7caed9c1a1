"""What the ``nccl`` backend costs over calling ``cupy.cuda.nccl`` directly: one GPU per rank.

For each message size, every rank (a thread of this process driving its own GPU; no Ray) owns
two things on the same GPU: a raw ``cupy.cuda.nccl`` communicator and a ray_collective group on
the ``nccl`` backend. It times blocking allreduces both ways, interleaved in alternating blocks
(direct first, then the library first, ...) so drift of clocks and temperature falls on both
alike, and prints per-call medians:

- ``direct``: ``comm.allReduce(...)`` on a stream, then ``stream.synchronize()``: the least a
  blocking call can do.
- ``library``: ``ray_collective.allreduce(tensor)``, which also returns only once the result is
  in place.

A call's time is the slowest rank's time for it. The targets are checked at the end: at 256 MiB
the library reaches at least 95% of the direct bus bandwidth (nccl-tests' ``busbw``; two or more
ranks, since NCCL's in-place allreduce of one rank moves no data), and at 8 bytes a call costs at
most 20 µs more.

    python -m benchmarks.nccl_overhead --ranks 2 --bytes 8,1M,256M
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from benchmarks.collectives import COLLECTIVES

BANDWIDTH_TARGET = 0.95  # library busbw / direct busbw at BANDWIDTH_SIZE
BANDWIDTH_SIZE = 256 * 1024 * 1024
OVERHEAD_TARGET_S = 20e-6  # library - direct per call at OVERHEAD_SIZE
OVERHEAD_SIZE = 8
_SUFFIXES = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_sizes(text: str) -> List[int]:
    """Comma-separated byte counts with optional binary suffixes (``8,1M,256M``).

    Args:
        text: the option's value.

    Returns:
        The sizes in bytes.

    Raises:
        argparse.ArgumentTypeError: a size that is not a positive count.
    """
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        suffix = item[-1:] if item[-1:] in _SUFFIXES and not item[-1:].isdigit() else ""
        number = item[:-1] if suffix else item
        if not number.isdigit() or int(number) == 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive size like 8, 1M, 256M")
        sizes.append(int(number) * _SUFFIXES[suffix])
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """The command line.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.nccl_overhead",
        description="Per-call cost of ray_collective's nccl backend against direct "
                    "cupy.cuda.nccl calls (allreduce, one GPU per rank, no Ray).")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks, one GPU each (default 1; use 2+ for a bus bandwidth)")
    parser.add_argument("--first-gpu", type=int, default=0, help="GPU of rank 0 (default 0)")
    parser.add_argument("--bytes", type=parse_sizes, default=[OVERHEAD_SIZE, BANDWIDTH_SIZE],
                        help="message sizes, comma-separated (default 8,256M)")
    parser.add_argument("--dtype", default="float32", help="tensor dtype (default float32)")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed calls per path and size (default: 2000 up to 1 MiB, "
                             "else 40)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per path")
    parser.add_argument("--blocks", type=int, default=8,
                        help="interleaved blocks the timed calls are split into (default 8)")
    return parser


@dataclass(frozen=True)
class Point:
    """The medians of one message size.

    Attributes:
        nbytes: the message size.
        direct_s: median seconds per direct call.
        library_s: median seconds per library call.
        ranks: the number of ranks.
    """

    nbytes: int
    direct_s: float
    library_s: float
    ranks: int

    def bandwidth(self, seconds: float) -> float:
        """Bus bandwidth in GB/s for a call of ``seconds`` (algorithm bandwidth at one rank)."""
        factor = COLLECTIVES["allreduce"].bus_factor(self.ranks) if self.ranks > 1 else 1.0
        return self.nbytes / seconds * factor / 1e9


def _iterations(arguments: argparse.Namespace, nbytes: int) -> int:
    if arguments.iters:
        return arguments.iters
    return 2000 if nbytes <= 1024 * 1024 else 40


def _time_calls(call: Callable[[], None], count: int) -> List[float]:
    durations = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        durations.append(time.perf_counter() - start)
    return durations


def _rank_main(rank: int, arguments: argparse.Namespace, unique_id: tuple,
               rendezvous, barrier: threading.Barrier,
               durations: Dict[tuple, List[List[float]]]) -> None:
    import cupy
    from cupy.cuda import nccl

    import ray_collective as col
    from ray_collective.backends.nccl import NcclBackendFactory, load_library
    from ray_collective.backends.nccl.wire import reduction_format

    device = arguments.first_gpu + rank
    wire = reduction_format(load_library(), arguments.dtype, col.ReduceOp.SUM)
    with cupy.cuda.Device(device), col.use_registry(col.GroupRegistry()):
        stream = cupy.cuda.Stream(non_blocking=True)
        communicator = nccl.NcclCommunicator(arguments.ranks, unique_id, rank)
        factory = NcclBackendFactory(rendezvous=rendezvous, devices=[device])
        col.init_collective_group(arguments.ranks, rank, factory, "nccl_overhead")
        try:
            for nbytes in arguments.bytes:
                # Zeros stay zeros under SUM, so repeated calls never overflow to inf.
                tensor = cupy.zeros(max(1, nbytes // cupy.dtype(arguments.dtype).itemsize),
                                    arguments.dtype)
                count = tensor.size * wire.per_element

                def direct(tensor=tensor, count=count):
                    communicator.allReduce(tensor.data.ptr, tensor.data.ptr, count,
                                           wire.datatype, wire.op, stream.ptr)
                    stream.synchronize()

                def library(tensor=tensor):
                    col.allreduce(tensor, group_name="nccl_overhead")

                paths = {"direct": direct, "library": library}
                for call in paths.values():
                    barrier.wait()
                    _time_calls(call, arguments.warmup)
                per_block = max(1, _iterations(arguments, nbytes) // arguments.blocks)
                for block in range(arguments.blocks):
                    order = ("direct", "library") if block % 2 == 0 else ("library", "direct")
                    for name in order:
                        barrier.wait()
                        durations[(nbytes, name)][rank].extend(
                            _time_calls(paths[name], per_block))
        finally:
            col.destroy_collective_group("nccl_overhead")
            communicator.destroy()


def measure(arguments: argparse.Namespace) -> List[Point]:
    """Run every size both ways on ``arguments.ranks`` GPUs.

    Args:
        arguments: the parsed command line.

    Returns:
        One point per size.

    Raises:
        RuntimeError: a rank failed (its error is chained).
    """
    from cupy.cuda import nccl

    from ray_collective.backends.nccl import InProcessRendezvous

    unique_id = nccl.get_unique_id()
    rendezvous = InProcessRendezvous()
    barrier = threading.Barrier(arguments.ranks)
    durations = {(nbytes, name): [[] for _ in range(arguments.ranks)]
                 for nbytes in arguments.bytes for name in ("direct", "library")}
    failures: List[Optional[BaseException]] = [None] * arguments.ranks

    def run(rank: int) -> None:
        try:
            _rank_main(rank, arguments, unique_id, rendezvous, barrier, durations)
        except BaseException as err:  # reported below, after every rank has stopped
            failures[rank] = err
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}")
               for rank in range(arguments.ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank, failure in enumerate(failures):
        if failure is not None and not isinstance(failure, threading.BrokenBarrierError):
            raise RuntimeError(f"rank {rank} failed: {failure}") from failure

    def median_of_slowest(nbytes: int, name: str) -> float:
        per_rank = durations[(nbytes, name)]
        return statistics.median(max(times) for times in zip(*per_rank, strict=True))

    return [Point(nbytes, median_of_slowest(nbytes, "direct"),
                  median_of_slowest(nbytes, "library"), arguments.ranks)
            for nbytes in arguments.bytes]


def report(points: Sequence[Point]) -> str:
    """The table, then a verdict line for each target whose size was measured.

    Args:
        points: the measurements.

    Returns:
        The text.
    """
    lines = [f"{'bytes':>11}  {'direct µs':>10}  {'library µs':>10}  {'+µs':>8}  "
             f"{'direct GB/s':>11}  {'library GB/s':>12}  {'ratio':>6}"]
    for p in points:
        lines.append(f"{p.nbytes:>11}  {p.direct_s * 1e6:>10.1f}  {p.library_s * 1e6:>10.1f}  "
                     f"{(p.library_s - p.direct_s) * 1e6:>8.1f}  "
                     f"{p.bandwidth(p.direct_s):>11.2f}  {p.bandwidth(p.library_s):>12.2f}  "
                     f"{p.direct_s / p.library_s:>6.3f}")
    by_size = {p.nbytes: p for p in points}
    if BANDWIDTH_SIZE in by_size and by_size[BANDWIDTH_SIZE].ranks == 1:
        lines.append("256 MiB: no bandwidth at one rank: NCCL's in-place allreduce of one rank "
                     "moves no data, so both columns time the call alone; run --ranks 2 or "
                     "more for the bandwidth target")
    elif BANDWIDTH_SIZE in by_size:
        ratio = by_size[BANDWIDTH_SIZE].direct_s / by_size[BANDWIDTH_SIZE].library_s
        verdict = "meets" if ratio >= BANDWIDTH_TARGET else "MISSES"
        lines.append(f"256 MiB: library at {ratio:.1%} of direct bandwidth: {verdict} the "
                     f"{BANDWIDTH_TARGET:.0%} target")
    if OVERHEAD_SIZE in by_size:
        extra = by_size[OVERHEAD_SIZE].library_s - by_size[OVERHEAD_SIZE].direct_s
        verdict = "meets" if extra <= OVERHEAD_TARGET_S else "MISSES"
        lines.append(f"8 B: library costs {extra * 1e6:+.1f} µs per call: {verdict} the "
                     f"{OVERHEAD_TARGET_S * 1e6:.0f} µs target")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Parse, measure, print.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 when CuPy, NCCL or enough GPUs are missing.
    """
    arguments = build_parser().parse_args(argv)
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401  (fails here when CuPy lacks NCCL)
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CuPy raises several types without a driver or NCCL
        print(f"nccl_overhead needs CuPy with NCCL and a GPU: {err}", file=sys.stderr)
        return 2
    if arguments.first_gpu + arguments.ranks > gpus:
        print(f"nccl_overhead: {arguments.ranks} ranks from GPU {arguments.first_gpu} need "
              f"{arguments.first_gpu + arguments.ranks} GPUs; {gpus} are visible",
              file=sys.stderr)
        return 2
    print(report(measure(arguments)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
