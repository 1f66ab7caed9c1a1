"""The floor under a small allreduce across nodes: the same exchanges on bare sockets.

``python -m benchmarks.socket_floor [--iterations 3000] [--repeats 3] [--json PATH]`` starts a
local cluster of 2 nodes with 2 rank actors on each, pinned as ``python -m benchmarks --nodes 2
--ranks-per-node 2`` pins them, connects every rank to its node-mate by a Unix socket and to
its counterpart on the other node by TCP (``TCP_NODELAY``), and times an allreduce of one
float64 written straight on those sockets, without this library, in two patterns:

- **hierarchical** (what the library runs for small messages across nodes): the mate sends to
  its node's leader, the leaders exchange, each leader sends the sum back to its mate: three
  hops one after the other;
- **doubling** (node-aware recursive doubling): every rank exchanges with its node-mate, then
  with its counterpart: two rounds, every rank in both.

Every rank blocks in ``recv``; the iterations run back to back, and each counts for the slowest
rank's time, as the library's benchmark counts them. It prints the p50 of every repeat (the two
patterns alternate in order). What it measures is what any implementation on this machine
pays, the wake-ups and system calls; the rest of a library's time is its own CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .nodes import local_cluster_driver, pick_nodes, pinned, rank_nodes

NODES = 2
WORLD_SIZE = 4
PATTERNS = ("hierarchical", "doubling")
WARM_UP_ITERATIONS = 200
VALUE_FORMAT = "<d"
VALUE_BYTES = struct.calcsize(VALUE_FORMAT)
RANK_FORMAT = "<i"
RANK_BYTES = struct.calcsize(RANK_FORMAT)
"""Formats, not ``struct.Struct`` objects: run as ``__main__``, the rank class travels to its
actors by value with the globals it uses, and a ``Struct`` cannot be pickled."""


def mate_of(rank: int) -> int:
    """The other rank on ``rank``'s node (ranks 0, 1 on node 0; 2, 3 on node 1)."""
    return rank ^ 1


def counterpart_of(rank: int) -> int:
    """The rank in the same position on the other node."""
    return rank ^ 2


def receive_value(sock: socket.socket) -> float:
    """Read one value from a stream socket.

    Raises:
        ConnectionError: the other end closed first.
    """
    data = b""
    while len(data) < VALUE_BYTES:
        chunk = sock.recv(VALUE_BYTES - len(data))
        if not chunk:
            raise ConnectionError("the other end closed before sending its value")
        data += chunk
    return struct.unpack(VALUE_FORMAT, data)[0]


def allreduce_once(pattern: str, rank: int, sockets: Mapping[int, socket.socket],
                   value: float) -> float:
    """The sum of every rank's ``value``, exchanged over ``sockets`` in ``pattern``.

    Args:
        pattern: one of ``PATTERNS``.
        rank: this rank (0..3).
        sockets: connected blocking sockets to the node-mate and to the counterpart, by rank.
        value: this rank's contribution.

    Returns:
        The sum over the 4 ranks.
    """
    mate, counterpart = sockets[mate_of(rank)], sockets[counterpart_of(rank)]
    if pattern == "hierarchical":
        if rank % 2:
            mate.sendall(struct.pack(VALUE_FORMAT, value))
            return receive_value(mate)
        total = value + receive_value(mate)
        counterpart.sendall(struct.pack(VALUE_FORMAT, total))
        total += receive_value(counterpart)
        mate.sendall(struct.pack(VALUE_FORMAT, total))
        return total
    mate.sendall(struct.pack(VALUE_FORMAT, value))
    total = value + receive_value(mate)
    counterpart.sendall(struct.pack(VALUE_FORMAT, total))
    return total + receive_value(counterpart)


def run_iterations(pattern: str, rank: int, sockets: Mapping[int, socket.socket],
                   iterations: int) -> List[float]:
    """Run ``iterations`` allreduces back to back.

    Returns:
        ``time.perf_counter()`` before the first and after every iteration.

    Raises:
        AssertionError: a sum came out wrong.
    """
    expected = WORLD_SIZE * (WORLD_SIZE + 1) / 2
    stamps = [time.perf_counter()]
    for _ in range(iterations):
        total = allreduce_once(pattern, rank, sockets, float(rank + 1))
        assert total == expected, f"rank {rank}: {pattern} sum {total}, expected {expected}"
        stamps.append(time.perf_counter())
    return stamps


def slowest_rank_p50(stamps_per_rank: Sequence[Sequence[float]]) -> float:
    """The median over iterations of the slowest rank's time for it, in seconds.

    Args:
        stamps_per_rank: per rank, what :func:`run_iterations` returned (same iterations).
    """
    durations = [max(stamps[i + 1] - stamps[i] for stamps in stamps_per_rank)
                 for i in range(len(stamps_per_rank[0]) - 1)]
    return statistics.median(durations)


class FloorRank:
    """One rank: a listener of each kind, then sockets to its node-mate and counterpart."""

    def __init__(self, rank: int):
        import ray
        self.rank = rank
        self.sockets: Dict[int, socket.socket] = {}
        self._tcp = socket.create_server((ray.util.get_node_ip_address(), 0))
        self._directory = tempfile.mkdtemp(prefix="socket_floor-")
        self._path = os.path.join(self._directory, "rank.sock")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self._path)
        self._unix.listen()

    def address(self) -> Tuple[Tuple[str, int], str]:
        """(TCP host and port, Unix socket path)."""
        return self._tcp.getsockname()[:2], self._path

    def link(self, addresses: Sequence[Tuple[Tuple[str, int], str]]) -> None:
        """Connect to the peers of higher rank (the kernel's backlog takes them at once), then
        accept those of lower rank; every socket starts with its connector's rank."""
        peers = (mate_of(self.rank), counterpart_of(self.rank))
        for peer in sorted(p for p in peers if p > self.rank):
            if peer == mate_of(self.rank):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(addresses[peer][1])
            else:
                sock = socket.create_connection(tuple(addresses[peer][0]))
            sock.sendall(struct.pack(RANK_FORMAT, self.rank))
            self.sockets[peer] = sock
        for peer in sorted(p for p in peers if p < self.rank):
            listener = self._unix if peer == mate_of(self.rank) else self._tcp
            sock, _ = listener.accept()
            (rank,) = struct.unpack(RANK_FORMAT, sock.recv(RANK_BYTES, socket.MSG_WAITALL))
            self.sockets[rank] = sock
        counterpart = self.sockets[counterpart_of(self.rank)]
        counterpart.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, pattern: str, iterations: int) -> List[float]:
        """:func:`run_iterations` on this rank's sockets."""
        return run_iterations(pattern, self.rank, self.sockets, iterations)

    def close(self) -> None:
        """Close every socket and remove the Unix socket's directory."""
        for sock in (*self.sockets.values(), self._tcp, self._unix):
            sock.close()
        os.unlink(self._path)
        os.rmdir(self._directory)


def measure(iterations: int, repeats: int) -> dict:
    """Start the cluster and the ranks, time every pattern ``repeats`` times, stop it all.

    Returns:
        ``{"date", "iterations", "p50_us": {pattern: [one per repeat]}}``.
    """
    import ray
    with local_cluster_driver(NODES):
        node_ids = pick_nodes(NODES)
        member = ray.remote(num_cpus=0)(FloorRank)
        ranks = [member.options(**pinned(node_ids[node])).remote(rank)
                 for rank, node in enumerate(rank_nodes(WORLD_SIZE, NODES))]
        addresses = ray.get([rank.address.remote() for rank in ranks])
        ray.get([rank.link.remote(addresses) for rank in ranks])
        p50_us: Dict[str, List[float]] = {pattern: [] for pattern in PATTERNS}
        for repeat in range(repeats):
            for pattern in PATTERNS if repeat % 2 == 0 else PATTERNS[::-1]:
                ray.get([rank.run.remote(pattern, WARM_UP_ITERATIONS) for rank in ranks])
                stamps = ray.get([rank.run.remote(pattern, iterations) for rank in ranks])
                p50_us[pattern].append(slowest_rank_p50(stamps) * 1e6)
        ray.get([rank.close.remote() for rank in ranks])
        return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "iterations": iterations,
                "p50_us": p50_us}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run from the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.socket_floor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the p50s to this file")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.repeats < 1:
        parser.error("need --iterations >= 1 and --repeats >= 1")
    report = measure(args.iterations, args.repeats)
    for pattern, values in report["p50_us"].items():
        print(f"{pattern:12s} p50 per repeat: {', '.join(f'{v:.1f}' for v in values)} µs "
              f"(2 nodes x 2 ranks, {args.iterations} iterations, slowest rank)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
