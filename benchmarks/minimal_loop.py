"""The minimal loop a user writes: this library against Ray's own Gloo group, call by call.

    python -m benchmarks.minimal_loop [--layouts 2x2,1x2,1x4] [--iters 200] [--warmup 20]
        [--blocks 4] [--collective allreduce] [--bytes 8] [--json PATH] [trial options]

For each layout (``NODESxRANKS``: nodes of a ``ray.cluster_utils.Cluster`` on this machine, as
``python -m benchmarks --nodes`` starts one, or Ray's ordinary one-node start for ``1xN``)
the loop starts plain rank actors (``num_cpus=0``), pinned evenly in blocks of ranks per node
(rank r on node ``r // ranks``), and in each actor joins a ``ray.util.collective`` group with
``backend="gloo"`` (Ray's own, on torch.distributed) and this library's group (``ray``). Then,
as a user would: one barrier of each library, ``--warmup`` calls of each, and the timed
``allreduce`` of two float32, ``perf_counter`` around each call, the two libraries alternating
in blocks (A B, B A, ...) in the same actors. Before timing, one call on inputs of ``rank + 1``
on each library checks the sum every rank gets.

``--collective reducescatter`` times that instead, and ``--bytes`` sizes either as the CLI's
rows do (``benchmarks.collectives``: allreduce's tensor, reducescatter's whole input list,
each rank's block a world size's part of it; float32, at least one element). A library
``ray@ALGORITHM`` is this library with the collective's algorithm forced
(``RAY_COLLECTIVE_ALGORITHM`` while the rank joins): ``--libraries ray,ray@recursive_halving``
sets the selector's rule against one algorithm in the loop a user writes.

It prints, per layout and library, the p50 of the slowest rank per iteration, each rank's own
p50 and each rank's CPU time per call.

It shares only the two timers of ``worker`` with ``python -m benchmarks``: no harness, no peer
classes. The trial options change one thing at a time, the candidates for why the two
disagreed (the results page, benchmarks/README.md, "Across nodes"):

- ``--timing per-call`` (default: ``perf_counter`` around each call) or ``back-to-back``
  (completion to completion, as the CLI);
- ``--barrier once`` (default: after joining) or ``block`` (each library's barrier at the start
  of every block, as the CLI);
- ``--actor plain`` (default), ``threaded`` (``max_concurrency=2``: Ray runs the calls on a
  thread pool) or ``async`` (an asyncio actor, its event loop in the process);
- ``--cluster bench`` (default: Ray as the CLI starts it, without the dashboard or the
  workers' logs; across nodes head 1 CPU, other nodes 0, as ``benchmarks.nodes``) or ``user``
  (every default kept: the dashboard and its agents, logs streamed to the driver, ``Cluster``'s
  nodes 1 CPU each);
- ``--placement blocks`` (default: rank r on node ``r // ranks``, as the CLI), ``alternate``
  (rank r on node ``r % nodes``) or ``unpinned`` (wherever Ray puts them);
- ``--gloo-group named`` (default: a group of its own name, a torch subgroup) or ``default``
  (Ray's ``"default"`` name: torch's world group itself);
- ``--libraries ray,gloo`` (default; the order the groups are joined in and the first
  block's order), or one library alone, or ``ray@ALGORITHM`` beside them.

On the network bed (``benchmarks.netbed``): ``--netbed 1gbit`` runs each layout on a bed of
its nodes, every node in a network namespace of its own behind a link of that rate (or
``unlimited``), this loop re-run as the driver in the head node's namespace.

The modes of a user's history: ``--block-warmup N`` untimed calls at the start of every block,
after its barrier (``--warmup 0 --block-warmup 1 --barrier block --libraries gloo,ray``: one
warm-up per block, Gloo joined first); ``--pause-ms MS`` of sleep before each timed call (a
training step's compute). The first ``--first-calls`` calls of each new group, right after the
joins, are timed apart (every rank's first at one instant): the first and the median of ten.

``--iters`` is split over the blocks: 30 calls a block, 4 blocks of each library, is
``--iters 120 --blocks 4``. Calls near a block's start and end, next to Ray's method call, are
slower for both libraries, and a short block has more of them: at 8 calls a block both
libraries' p50 rose 1.3-1.85x against 30 a block, their ratio much the same.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ray_collective.algorithms import catalog
from ray_collective.algorithms.selector import ENVIRONMENT_VARIABLE as ALGORITHM_VARIABLE

from .cli import (at_least, choice, comma_list, non_negative_int, one_value, parse_size,
                  positive_int)
from .collectives import message_layout
from .nodes import local_cluster_driver, pick_nodes, pinned, rank_nodes
from .stats import iteration_latencies, percentiles
from .worker import time_back_to_back, time_with_barriers

LIBRARIES = ("ray", "gloo")
"""This library and ``ray.util.collective``'s Gloo, in their default order."""

COLLECTIVES = ("allreduce", "reducescatter")

FORCED = "@"
"""Separates this library from the algorithm it is forced to run: ``ray@recursive_halving``."""

TIMINGS = ("per-call", "back-to-back")
BARRIERS = ("once", "block")
ACTORS = ("plain", "threaded", "async")
CLUSTERS = ("bench", "user")
PLACEMENTS = ("blocks", "alternate", "unpinned")
GLOO_GROUPS = ("named", "default")

ITEMSIZE = 4
"""Every buffer is float32."""

FIRST_CALL_DELAY_S = 0.5
"""How long after the driver asks for a new group's first calls every rank makes the first:
longer than Ray takes to start the four ranks' methods on a loaded 2-core machine, so that the
first call does not time how far apart they began (a rank that still begins late says so:
``first_call_late_s``)."""


@dataclass(frozen=True)
class LoopOptions:
    """What one run of the loop measures (see the module's docstring for the trial options).

    Attributes:
        layouts: (nodes, ranks per node) per layout, in run order.
        libraries: this library (``ray``, or ``ray@ALGORITHM``) and/or ``gloo``, in join and
            first-block order.
        collective: ``allreduce`` or ``reducescatter``.
        nbytes: the collective's size as the CLI names it (reducescatter: the whole list).
        iterations: timed calls per library, split over ``blocks``.
        warmup: untimed calls of each library after the first barrier.
        blocks: alternating blocks the timed calls are split into.
        timeout_s: the deadline of each step (actors, joins, one block).
        timing: ``per-call`` or ``back-to-back``.
        barrier: ``once`` or ``block``.
        actor: ``plain``, ``threaded`` or ``async``.
        cluster: ``bench`` or ``user``.
        placement: ``blocks``, ``alternate`` or ``unpinned``.
        gloo_group: ``named`` or ``default``.
        block_warmup: untimed calls at the start of every block, after its barrier.
        pause_s: seconds of sleep before each timed call.
        first_calls: calls of each new group timed one by one right after the joins.
        netbed: a link rate (``tc`` notation, or ``unlimited``): each layout runs on a network
            bed of its nodes with links of that rate; None: on this machine's own network.
        ray_address: a running cluster to drive instead of starting one (the bed's head, in
            the loop the bed runs).
    """

    layouts: Tuple[Tuple[int, int], ...] = ((2, 2), (1, 2), (1, 4))
    libraries: Tuple[str, ...] = LIBRARIES
    collective: str = "allreduce"
    nbytes: int = 8
    iterations: int = 200
    warmup: int = 20
    blocks: int = 4
    timeout_s: float = 120.0
    timing: str = "per-call"
    barrier: str = "once"
    actor: str = "plain"
    cluster: str = "bench"
    placement: str = "blocks"
    gloo_group: str = "named"
    block_warmup: int = 0
    pause_s: float = 0.0
    first_calls: int = 10
    netbed: Optional[str] = None
    ray_address: Optional[str] = None


def _nothing() -> None:
    """No barrier: the loop's barriers are placed by ``--barrier``."""


def _after_pause(pause_s: float, call) -> None:
    """``call`` after ``pause_s`` seconds of sleep (``--pause-ms``, back to back)."""
    time.sleep(pause_s)
    call()


def split_library(library: str) -> Tuple[str, str]:
    """``(ray or gloo, the algorithm forced on it or "")`` of a ``--libraries`` item."""
    name, _, forced = library.partition(FORCED)
    return name, forced


def block_elements(collective: str, nbytes: int, world_size: int) -> int:
    """Elements of each rank's result: allreduce's tensor, or reducescatter's block (its part
    of the whole list of ``nbytes``); at least one, as the CLI sizes its rows."""
    return message_layout(collective, nbytes, world_size, ITEMSIZE).elements_per_tensor


class LoopRank:
    """A user's rank actor: joins both groups and runs blocks of calls."""

    def __init__(self, rank: int, world_size: int, collective: str = "allreduce",
                 nbytes: int = 8) -> None:
        self.rank = rank
        self.world_size = world_size
        self.collective = collective
        self.elements = block_elements(collective, nbytes, world_size)
        self.buffers = self._buffers(0.0)
        self.groups: Dict[str, str] = {}

    def _buffers(self, value: float) -> Tuple[np.ndarray, List[np.ndarray]]:
        """The result and the inputs (reducescatter's list, else none) filled with ``value``."""
        result = np.full(self.elements, value, np.float32)
        parts = ([np.full(self.elements, value, np.float32) for _ in range(self.world_size)]
                 if self.collective == "reducescatter" else [])
        return result, parts

    def _call(self, library: str, buffers: Tuple[np.ndarray, List[np.ndarray]]
              ) -> functools.partial:
        """One call of the collective on ``library``'s group over ``buffers``."""
        module, group = self._module(library), self.groups[library]
        result, parts = buffers
        if self.collective == "reducescatter":
            return functools.partial(module.reducescatter, result, parts, group)
        return functools.partial(module.allreduce, result, group)

    def ready(self) -> dict:
        """Where this rank runs: its Ray node and process id."""
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def join(self, library: str, group_name: str, timeout_s: float) -> None:
        """Join ``library``'s group as this rank (``ray@ALGORITHM``: with the collective's
        algorithm forced, read once at the join)."""
        name, forced = split_library(library)
        if name == "ray":
            import ray_collective
            if forced:
                os.environ[ALGORITHM_VARIABLE] = f"{self.collective}={forced}"
            try:
                ray_collective.init_collective_group(self.world_size, self.rank, backend="ray",
                                                     group_name=group_name, timeout=timeout_s)
            finally:
                os.environ.pop(ALGORITHM_VARIABLE, None)
        else:
            import ray.util.collective
            ray.util.collective.init_collective_group(self.world_size, self.rank,
                                                      backend="gloo", group_name=group_name,
                                                      gloo_timeout=int(timeout_s * 1000))
        self.groups[library] = group_name

    def check_sum(self, library: str) -> List[float]:
        """One call on inputs of ``rank + 1`` on ``library``: what a user checks first."""
        buffers = self._buffers(float(self.rank + 1))
        self._call(library, buffers)()
        return buffers[0].tolist()

    def algorithm(self, library: str) -> Optional[str]:
        """The algorithm this library's last call ran, as its flight recorder has it (None for
        Gloo, which does not say)."""
        if split_library(library)[0] != "ray":
            return None
        trace = self._module(library).get_collective_trace(self.groups[library])
        return trace[-1]["algorithm"] if trace else None

    def _module(self, library: str) -> Any:
        if split_library(library)[0] == "ray":
            import ray_collective
            return ray_collective
        import ray.util.collective
        return ray.util.collective

    def barrier(self, library: str) -> None:
        """``library``'s own barrier."""
        self._module(library).barrier(self.groups[library])

    def warm_up(self, library: str, calls: int) -> None:
        """``calls`` untimed calls of ``library``."""
        call = self._call(library, self.buffers)
        for _ in range(calls):
            call()

    def run_block(self, library: str, iterations: int, timing: str, barrier_first: bool,
                  warmup: int = 0, pause_s: float = 0.0) -> dict:
        """Time ``iterations`` calls of ``library``, after ``warmup`` untimed ones.

        Args:
            library: the library whose group the calls are made on.
            iterations: calls timed.
            timing: ``per-call`` or ``back-to-back``.
            barrier_first: the library's barrier first.
            warmup: untimed calls after the barrier.
            pause_s: seconds of sleep before each call (a ``per-call`` timing times the call
                alone; ``back-to-back`` the sleep too).

        Returns:
            ``{"durations": seconds per call, "cpu_s": this process's CPU seconds over them}``.
        """
        module, group = self._module(library), self.groups[library]
        if barrier_first:
            module.barrier(group)
        call = self._call(library, self.buffers)
        # The CLI's two timers, without their barriers: "per-call" is perf_counter around
        # each call alone (the pause in the timer's barrier's place), "back-to-back"
        # completion to completion (the pause timed too).
        if timing == "per-call":
            pause = functools.partial(time.sleep, pause_s) if pause_s else _nothing
            timed = time_with_barriers(pause, call, warmup, iterations)
        else:
            if pause_s:
                call = functools.partial(_after_pause, pause_s, call)
            timed = time_back_to_back(_nothing, call, warmup, iterations)
        return {"durations": timed.durations, "cpu_s": timed.cpu_s}

    def first_calls(self, library: str, calls: int, start_at: Optional[float] = None) -> dict:
        """The first ``calls`` calls of a new group, timed one by one, the first at
        ``start_at`` (``time.time()``: the ranks share this machine's clock, so that the first
        call does not time how far apart Ray started the ranks' methods; None: at once).

        Returns:
            ``{"durations": seconds of each call, "late_s": how long after ``start_at`` this
            rank's method began (0 when it began in time)}``.
        """
        late_s = 0.0
        if start_at is not None:
            delay = start_at - time.time()
            if delay > 0:
                time.sleep(delay)
            late_s = max(0.0, -delay)
        durations = time_with_barriers(_nothing, self._call(library, self.buffers), 0,
                                       calls).durations
        return {"durations": durations, "late_s": late_s}

    def leave(self, library: str) -> None:
        """Destroy this rank's membership of ``library``'s group."""
        self._module(library).destroy_collective_group(self.groups.pop(library))


class AsyncLoopRank(LoopRank):
    """The same rank as an asyncio actor: Ray runs its methods on an event loop in the process
    (the collectives still block the loop's thread, as a user's sync calls would)."""

    async def run_block(self, library: str, iterations: int, timing: str,  # type: ignore[override]
                        barrier_first: bool) -> dict:
        return LoopRank.run_block(self, library, iterations, timing, barrier_first)


@contextlib.contextmanager
def ray_for(nodes: int, cluster: str,
            address: Optional[str] = None) -> Iterator[Optional[List[str]]]:
    """Ray for one layout, this process its driver; yields the node ids ranks are pinned to
    (None on one node: wherever Ray puts them).

    ``address``: the running cluster at that address (the network bed's), its nodes as
    ``benchmarks.nodes`` orders them.

    ``bench``: as ``python -m benchmarks`` starts it (one node: ``ray.init`` without the
    dashboard or the workers' logs; several: ``benchmarks.nodes``' cluster, head 1 CPU, the
    other nodes none). ``user``: as a user starts it, every default kept (the dashboard and
    its agents, the workers' logs streamed to the driver; ``Cluster``'s nodes 1 CPU each).
    """
    import ray
    bench = cluster == "bench"
    quiet = {"include_dashboard": False, "log_to_driver": False,
             "logging_level": logging.WARNING} if bench else {}
    if address is not None:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            yield pick_nodes(nodes) if nodes > 1 else None
        finally:
            ray.shutdown()
        return
    if nodes == 1:
        ray.init(address="local", **quiet)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    if bench:
        with local_cluster_driver(nodes):
            yield pick_nodes(nodes)
        return
    from ray.cluster_utils import Cluster
    local = Cluster(initialize_head=True, head_node_args={"resources": {"node0": 1}})
    for k in range(1, nodes):
        local.add_node(resources={f"node{k}": 1})
    local.wait_for_nodes()
    try:
        ray.init(address=local.address)
        yield pick_nodes(nodes)
    finally:
        ray.shutdown()
        local.shutdown()


def start_ranks(options: LoopOptions, nodes: int, ranks_per_node: int,
                node_ids: Optional[Sequence[str]]) -> Tuple[list, List[dict]]:
    """The rank actors of one layout, pinned to their nodes, and where each runs.

    Raises:
        RuntimeError: a rank did not start on the node it was pinned to.
    """
    import ray
    world_size = nodes * ranks_per_node
    body = AsyncLoopRank if options.actor == "async" else LoopRank
    concurrency = {"max_concurrency": 2} if options.actor == "threaded" else {}
    actor_class = ray.remote(num_cpus=0, **concurrency)(body)
    placement = [None] * world_size
    if node_ids and options.placement == "blocks":
        placement = [node_ids[node] for node in rank_nodes(world_size, nodes)]
    elif node_ids and options.placement == "alternate":
        placement = [node_ids[rank % nodes] for rank in range(world_size)]
    ranks = [actor_class.options(**pinned(node)).remote(rank, world_size, options.collective,
                                                        options.nbytes)
             for rank, node in enumerate(placement)]
    where = ray.get([rank.ready.remote() for rank in ranks], timeout=options.timeout_s)
    misplaced = [rank for rank, (node, answer) in enumerate(zip(placement, where))
                 if node is not None and answer["node_id"] != node]
    if misplaced:
        raise RuntimeError(f"ranks {misplaced} did not start on the node they were pinned to")
    if node_ids:
        for answer in where:
            answer["node"] = node_ids.index(answer["node_id"])
    return ranks, where


def group_name(library: str, options: LoopOptions, layout: Tuple[int, int]) -> str:
    """The group's name: Ray's ``"default"`` for ``--gloo-group default``, else its own."""
    if library == "gloo" and options.gloo_group == "default":
        return "default"
    return f"minimal-loop-{library.replace(FORCED, '-')}-{layout[0]}x{layout[1]}"


def measure_layout(options: LoopOptions, layout: Tuple[int, int],
                   node_ids: Optional[Sequence[str]]) -> dict:
    """Run the loop on one layout: join, barrier, warm up, timed blocks, leave.

    Returns:
        ``{"layout": "2x2", "pids": ..., "nodes": each rank's node, "block_order": the
        libraries of each block in turn, "libraries": {library: {"sum_right": whether one
        call on inputs of rank + 1 gave every rank the sum, "algorithm": the algorithm it ran
        on each rank (None for Gloo), "durations": per rank, "cpu_s": per rank, and with
        ``first_calls``: "first_calls": the new group's first calls per rank,
        "first_call_late_s": how late the latest rank began them}}}``.
    """
    import ray
    nodes, ranks_per_node = layout
    ranks, where = start_ranks(options, nodes, ranks_per_node, node_ids)
    deadline = options.timeout_s

    def everywhere(method: str, *args) -> list:
        return ray.get([getattr(rank, method).remote(*args) for rank in ranks],
                       timeout=deadline)

    measured: Dict[str, Dict[str, Any]] = {
        library: {"durations": [[] for _ in ranks], "cpu_s": [0.0] * len(ranks)}
        for library in options.libraries}
    block_order: List[List[str]] = []
    try:
        for library in options.libraries:
            everywhere("join", library, group_name(library, options, layout),
                       options.timeout_s)
        for library in options.libraries:
            if options.first_calls:
                answers = everywhere("first_calls", library, options.first_calls,
                                     time.time() + FIRST_CALL_DELAY_S)
                measured[library]["first_calls"] = [answer["durations"] for answer in answers]
                measured[library]["first_call_late_s"] = max(answer["late_s"]
                                                             for answer in answers)
        expected = float(len(ranks) * (len(ranks) + 1) // 2)
        for library in options.libraries:
            sums = everywhere("check_sum", library)
            measured[library]["sum_right"] = all(value == expected
                                                 for values in sums for value in values)
            measured[library]["algorithm"] = everywhere("algorithm", library)
        for library in options.libraries:
            everywhere("barrier", library)
            everywhere("warm_up", library, options.warmup)
        for index, iterations in enumerate(_split(options.iterations, options.blocks)):
            order = options.libraries if index % 2 == 0 else options.libraries[::-1]
            block_order.append(list(order))
            for library in order:
                answers = everywhere("run_block", library, iterations, options.timing,
                                     options.barrier == "block", options.block_warmup,
                                     options.pause_s)
                for rank, answer in enumerate(answers):
                    measured[library]["durations"][rank].extend(answer["durations"])
                    measured[library]["cpu_s"][rank] += answer["cpu_s"]
        for library in reversed(options.libraries):
            everywhere("leave", library)
    finally:
        for rank in ranks:
            ray.kill(rank, no_restart=True)
    return {"layout": f"{nodes}x{ranks_per_node}", "pids": [w["pid"] for w in where],
            "nodes": [w.get("node", 0) for w in where], "block_order": block_order,
            "libraries": measured}


def _split(iterations: int, blocks: int) -> List[int]:
    blocks = max(1, min(blocks, iterations))
    return [iterations // blocks + (1 if index < iterations % blocks else 0)
            for index in range(blocks)]


def summarize(durations_by_rank: Sequence[Sequence[float]], cpu_s_by_rank: Sequence[float]
              ) -> dict:
    """The loop's figures for one library on one layout.

    Args:
        durations_by_rank: each rank's seconds per timed call, in the same order.
        cpu_s_by_rank: each rank's CPU seconds over its timed calls.

    Returns:
        ``{"slowest_p50_s": p50 over iterations of the slowest rank's time,
        "rank_p50_s": each rank's own p50, "cpu_per_call_s": each rank's CPU per call}``.
    """
    slowest = iteration_latencies(durations_by_rank)
    return {"slowest_p50_s": percentiles(slowest)["p50"],
            "rank_p50_s": [percentiles(durations)["p50"] for durations in durations_by_rank],
            "cpu_per_call_s": [cpu / len(durations) for cpu, durations
                               in zip(cpu_s_by_rank, durations_by_rank)]}


def summarize_first_calls(durations_by_rank: Sequence[Sequence[float]]) -> dict:
    """The figures of a new group's first calls.

    Args:
        durations_by_rank: each rank's seconds of each of the first calls.

    Returns:
        ``{"first_call_s": the slowest rank's first call, "first_ten_p50_s": the median of
        the slowest rank's time over the first ten calls (or as many as were timed)}``.
    """
    slowest = iteration_latencies(durations_by_rank)
    return {"first_call_s": slowest[0], "first_ten_p50_s": float(np.median(slowest[:10]))}


def run(options: LoopOptions) -> List[dict]:
    """Every layout in turn, each on a Ray (or local cluster) of its own.

    Returns:
        Per layout: its name, the ranks' pids and per library the raw and summarized figures
        (``summarize``).
    """
    results = []
    for layout in options.layouts:
        if options.netbed is not None:
            from .netbed_bench import minimal_loop_on_bed
            measured = minimal_loop_on_bed(options, layout)
        else:
            with ray_for(layout[0], options.cluster, options.ray_address) as node_ids:
                measured = measure_layout(options, layout, node_ids)
        for figures in measured["libraries"].values():
            figures.update(summarize(figures["durations"], figures["cpu_s"]))
            if "first_calls" in figures:
                figures.update(summarize_first_calls(figures["first_calls"]))
        results.append(measured)
    return results


def format_results(results: Sequence[dict]) -> str:
    """One line per (layout, library): the slowest rank's p50, each rank's p50 and CPU."""
    lines = []
    for result in results:
        for library, figures in result["libraries"].items():
            ranks = " ".join(f"{p50 * 1e6:.0f}" for p50 in figures["rank_p50_s"])
            cpu = " ".join(f"{seconds * 1e6:.0f}" for seconds in figures["cpu_per_call_s"])
            wrong = "" if figures["sum_right"] else "   WRONG SUM"
            ran = sorted({name for name in figures.get("algorithm", []) if name})
            algorithm = f" ({', '.join(ran)})" if ran else ""
            first = ""
            if "first_call_s" in figures:
                first = (f"   first call {figures['first_call_s'] * 1e6:.0f} us, first ten "
                         f"p50 {figures['first_ten_p50_s'] * 1e6:.0f} us")
                if figures.get("first_call_late_s"):
                    first += f" (a rank began {figures['first_call_late_s'] * 1e3:.0f} ms late)"
            lines.append(f"{result['layout']:>4} {library:<5}{algorithm} nodes {result['nodes']} "
                         f"slowest rank p50 "
                         f"{figures['slowest_p50_s'] * 1e6:7.1f} us   per rank p50 [{ranks}] us"
                         f"   CPU/call [{cpu}] us{first}{wrong}")
    return "\n".join(lines)


def _library(text: str) -> str:
    """``ray``, ``gloo`` or ``ray@ALGORITHM`` (the algorithm is checked against the collective
    in ``main``)."""
    name, forced = split_library(text)
    if name not in LIBRARIES or (FORCED in text and (name != "ray" or not forced)):
        raise ValueError(f"{text!r} is not one of {', '.join(LIBRARIES)} or ray@ALGORITHM")
    return text


def _layout(text: str) -> Tuple[int, int]:
    nodes, _, ranks = text.lower().partition("x")
    if not nodes.isdigit() or not ranks.isdigit() or int(nodes) < 1 or int(ranks) < 1:
        raise ValueError(f"a layout is NODESxRANKS, e.g. 2x2, not {text!r}")
    if int(nodes) * int(ranks) < 2:
        raise ValueError(f"a layout needs 2 ranks at least, not {text!r}")
    return int(nodes), int(ranks)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.minimal_loop``."""
    defaults = LoopOptions()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.minimal_loop",
        description="The loop a user writes: this library and Ray's Gloo group in the same "
                    "plain actors, allreduce of two float32 (or --collective, --bytes) timed "
                    "call by call.")
    parser.add_argument("--layouts", type=comma_list(_layout), default=defaults.layouts,
                        help="NODESxRANKS per node, comma-separated (default 2x2,1x2,1x4)")
    parser.add_argument("--libraries", type=comma_list(_library), default=defaults.libraries,
                        help="join and first-block order (default ray,gloo); ray@ALGORITHM "
                             "forces the collective's algorithm")
    parser.add_argument("--collective", type=one_value(choice(COLLECTIVES)),
                        default=defaults.collective)
    parser.add_argument("--bytes", type=one_value(parse_size), default=defaults.nbytes,
                        help="the collective's size as the CLI's rows name it (default 8)")
    parser.add_argument("--iters", type=one_value(positive_int), default=defaults.iterations)
    parser.add_argument("--warmup", type=one_value(non_negative_int), default=defaults.warmup)
    parser.add_argument("--blocks", type=one_value(positive_int), default=defaults.blocks)
    parser.add_argument("--timeout", type=one_value(positive_int), default=120)
    parser.add_argument("--block-warmup", type=one_value(non_negative_int),
                        default=defaults.block_warmup,
                        help="untimed calls at the start of every block, after its barrier "
                             "(default 0)")
    parser.add_argument("--pause-ms", type=one_value(at_least(0)), default=0,
                        help="milliseconds of sleep before each timed call (default 0)")
    parser.add_argument("--first-calls", type=one_value(non_negative_int),
                        default=defaults.first_calls,
                        help="calls of each new group timed right after the joins (default 10)")
    for flag, values in (("--timing", TIMINGS), ("--barrier", BARRIERS), ("--actor", ACTORS),
                         ("--cluster", CLUSTERS), ("--placement", PLACEMENTS),
                         ("--gloo-group", GLOO_GROUPS)):
        parser.add_argument(flag, type=one_value(choice(values)), default=values[0],
                            help=f"trial option, of {', '.join(values)} (default {values[0]})")
    parser.add_argument("--netbed", default=None, metavar="LINK",
                        help="run each layout on a network bed of its nodes with links of "
                             "this rate (1gbit, 10gbit, unlimited): benchmarks.netbed")
    parser.add_argument("--json", type=str, default=None, help="write every figure here")
    parser.add_argument("--options", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the loop from the command line; print and optionally write the figures."""
    parser = build_parser()
    arguments = parser.parse_args(argv)
    for library in arguments.libraries:
        forced = split_library(library)[1]
        if forced and forced not in catalog.names(arguments.collective):
            parser.error(f"{library}: {arguments.collective} has no algorithm {forced!r} (it "
                         f"has {', '.join(catalog.names(arguments.collective))})")
    if arguments.netbed is not None:
        try:
            from . import netbed
            netbed.parse_rate(arguments.netbed)
        except ValueError as exc:
            parser.error(str(exc))
    options = LoopOptions(layouts=arguments.layouts, libraries=arguments.libraries,
                          collective=arguments.collective, nbytes=arguments.bytes,
                          iterations=arguments.iters, warmup=arguments.warmup,
                          blocks=arguments.blocks, timeout_s=float(arguments.timeout),
                          timing=arguments.timing, barrier=arguments.barrier,
                          actor=arguments.actor, cluster=arguments.cluster,
                          placement=arguments.placement, gloo_group=arguments.gloo_group,
                          block_warmup=arguments.block_warmup,
                          pause_s=arguments.pause_ms / 1000.0,
                          first_calls=arguments.first_calls, netbed=arguments.netbed)
    if arguments.options is not None:
        # The loop a network bed runs in its head node's namespace (``netbed_bench``).
        given = json.loads(arguments.options)
        options = LoopOptions(**dict(given, layouts=tuple(map(tuple, given["layouts"])),
                                     libraries=tuple(given["libraries"])))
    results = run(options)
    print(format_results(results))
    if arguments.json:
        with open(arguments.json, "w") as handle:
            command = " ".join(["python -m benchmarks.minimal_loop",
                                *(sys.argv[1:] if argv is None else argv)])
            json.dump({"options": asdict(options), "command": command, "results": results},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
