"""What the library itself costs per call, apart from moving data: no Ray, one process.

Two measurements, each the median of several timed blocks (a shared machine is noisy):

- ``world size 1``: ``ray_collective.allreduce`` of 8 bytes in a group of one rank (the
  in-process backend): nothing travels, so the time is the library's own path: validation,
  sequence number, the prepared call, the plan's (empty) replay. Printed beside ``np.add`` of
  the same arrays, the least any reduction costs.
- ``plan choice``: rank 0 of a group of ``p`` ranks on ``p / 8`` nodes, its group driven
  directly (no API) over a transport whose sends and receives complete at once. After the first call
  of a shape, a call finds its prepared plan, stamps the header and replays the plan.
  ``choice`` is the time of finding the prepared plan and stamping its header, which must not
  grow with ``p``; ``call`` the time of a whole call, which also replays the plan's messages
  (a number that grows as log p); ``prepare`` is the one-time cost of the first call of the
  shape (selection, topology, recording), for reference.

    python -m benchmarks.call_overhead [--ranks 8,512,4096] [--calls 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

import ray_collective
from ray_collective.backends.base import CallViews
from ray_collective.engine.cpu import TransportMembership
from ray_collective.group import Group
from ray_collective.tensors import as_view
from ray_collective.testing import run_ranks
from ray_collective.transport.base import Request, Transport
from ray_collective.types import CallOptions, Collective

from .cli import module_parser, print_and_save

RANKS_PER_NODE = 8
BLOCKS = 7


class Completed(Request):
    """A send or receive that completed when it was posted."""

    __slots__ = ("peer", "done")

    def __init__(self, peer: int):
        self.peer = peer
        self.done = True


class InstantTransport(Transport):
    """A transport on which every send and receive completes at once, moving nothing."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.messages = 0

    def isend(self, peer, channel, stamp, step, data):
        self.messages += 1
        return Completed(peer)

    def irecv(self, peer, channel, stamp, step, out, combine=None):
        self.messages += 1
        return Completed(peer)

    def test(self, request):
        return True

    def wait(self, requests, deadline):
        return ()

    def abort(self, error):
        pass


def median_seconds_per_call(action: Callable[[], None], calls: int) -> float:
    """The median over ``BLOCKS`` timed blocks of ``calls`` calls of ``action``, per call.

    Args:
        action: what one call does.
        calls: calls per block (one untimed block warms up first).

    Returns:
        Seconds per call.
    """
    times = []
    for block in range(BLOCKS + 1):
        start = time.perf_counter()
        for _ in range(calls):
            action()
        if block:
            times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def world_size_one(calls: int) -> Dict[str, float]:
    """Seconds per 8-byte allreduce in a group of one rank, and per ``np.add`` of the same."""
    def body(rank: int) -> float:
        tensor = np.zeros(2, np.float32)
        return median_seconds_per_call(lambda: ray_collective.allreduce(tensor), calls)

    library = run_ranks(1, body)[0]
    left, right = np.zeros(2, np.float32), np.ones(2, np.float32)
    add = median_seconds_per_call(lambda: np.add(left, right, out=left), calls)
    return {"allreduce_s": library, "np_add_s": add}


def plan_choice(world_size: int, calls: int) -> Dict[str, float]:
    """Per-call costs at rank 0 of ``world_size`` ranks on ``world_size / 8`` nodes (8 B)."""
    node_of = [rank // RANKS_PER_NODE for rank in range(world_size)]
    transport = InstantTransport(0, world_size)
    backend = TransportMembership("plan-choice", transport, node_of=node_of, forced={})
    group = Group("plan-choice", world_size, 0, backend, 60.0, trace_size=0)
    views = CallViews(as_view(np.zeros(2, np.float32), writable=True))
    options = CallOptions(Collective.ALLREDUCE, timeout=60.0)
    arrays = views.arrays(options.collective)
    start = time.perf_counter()
    group.submit(group.prepare(None, options, views), arrays, False)
    prepare = time.perf_counter() - start
    messages = transport.messages
    call = median_seconds_per_call(
        lambda: group.submit(group.prepare(None, options, views), arrays, False), calls)

    def choose() -> None:
        group.prepare(None, options, views)[0].template.stamp(0)

    choice = median_seconds_per_call(choose, calls)
    return {"ranks": world_size, "nodes": -(-world_size // RANKS_PER_NODE),
            "messages": messages, "prepare_s": prepare, "choice_s": choice, "call_s": call}


def format_report(one: Dict[str, float], rows: Sequence[Dict[str, float]]) -> str:
    """The two tables, in microseconds."""
    lines = [f"world size 1, allreduce 8 B: {one['allreduce_s'] * 1e6:.2f} us per call "
             f"(np.add of the same arrays: {one['np_add_s'] * 1e6:.2f} us)", "",
             "| ranks | nodes | messages at rank 0 | prepare (once) | choice | call |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['ranks']} | {row['nodes']} | {row['messages']} | "
                     f"{row['prepare_s'] * 1e6:.0f} us | {row['choice_s'] * 1e6:.2f} us | "
                     f"{row['call_s'] * 1e6:.2f} us |")
    # The claim is checked here, on the figures, not by a timed test.
    cheaper = all(row["choice_s"] < row["call_s"] for row in rows)
    lines += ["", f"choice below the whole call at every world size: {'yes' if cheaper else 'NO'}"]
    return "\n".join(lines)


def _ranks(text: str) -> List[int]:
    try:
        ranks = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints")
    if any(r < 2 for r in ranks):
        raise argparse.ArgumentTypeError("every world size must be at least 2")
    return ranks


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run both measurements, print the tables, optionally write them as JSON."""
    parser = module_parser("benchmarks.call_overhead", __doc__)
    parser.add_argument("--ranks", type=_ranks, default=[8, 512, 4096],
                        help="world sizes of the plan-choice rows (default 8,512,4096)")
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed block")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    one = world_size_one(args.calls)
    rows = [plan_choice(p, args.calls) for p in args.ranks]
    print_and_save(format_report(one, rows), {"world_size_one": one, "plan_choice": rows},
                   args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
