"""Simulate one collective call on N virtual ranks: check the result, measure rounds and bytes.

Every rank gets its own inputs (small random integers, so reductions are exact), the algorithm
runs for all ranks in one thread (``lockstep.run_lockstep``), and each rank's output is compared
with numpy's own computation of the collective. With ``check=False`` no memory is spent on
payloads: buffers are zero-stride stand-ins and only sizes travel, which lets 4096 ranks move
megabytes each in seconds; rounds and bytes are exact either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..algorithms.catalog import flat_choice, start
from ..algorithms.core import Blocks, Context, Cost, Team
from ..algorithms.selector import forced_algorithms, select
from ..reductions import combiner
from ..transport.base import COLLECTIVE_TAG
from ..transport.wire import CallHeader, CallStamp
from ..transport.local import LocalFabric
from ..types import ReduceOp
from .lockstep import run_lockstep

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reducescatter", "gather",
               "scatter", "alltoall", "barrier")

_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum}


@dataclass(frozen=True)
class SimReport:
    """What one simulated call did.

    Attributes:
        collective, algorithm: what ran.
        ranks: number of virtual ranks; ranks_per_node: ranks per pretend node (0: one node).
        count: elements of one rank's tensor (one block for list collectives); itemsize: bytes.
        rounds: critical path in rounds; formula: the algorithm's :class:`Cost` for comparison.
        max_messages, max_bytes_sent: the most any one rank sent.
        total_messages, total_bytes: messages and bytes sent by all ranks together.
        inter_node_messages: messages that crossed nodes, over all ranks.
        inter_node_senders: how many ranks sent anything to another node.
        node_bytes_sent, node_bytes_received: per node, the bytes its ranks sent to and
            received from ranks on other nodes (what each node's link carries each way).
        checked: whether results were compared with numpy (False in zero-memory mode).
        seconds: wall time of the simulation.
    """

    collective: str
    algorithm: str
    ranks: int
    ranks_per_node: int
    count: int
    itemsize: int
    rounds: int
    formula: Cost
    max_messages: int
    max_bytes_sent: int
    total_messages: int
    total_bytes: int
    inter_node_messages: int
    inter_node_senders: int
    checked: bool
    seconds: float
    node_bytes_sent: Tuple[int, ...] = ()
    node_bytes_received: Tuple[int, ...] = ()


def _phantom(count: int, dtype: np.dtype) -> np.ndarray:
    """A writable array of ``count`` elements that occupies one element of memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), (count,), (0,))


def _noop(*_args) -> None:
    return None


def _buffer_length(collective: str, ranks: int, count: int) -> int:
    if collective in ("allreduce", "reduce", "broadcast"):
        return count
    if collective == "barrier":
        return 0
    return ranks * count


def simulate(collective: str, ranks: int, count: int, *, algorithm: Optional[str] = None,
             dtype: str = "int64", op: ReduceOp = ReduceOp.SUM, root: int = 0,
             ranks_per_node: int = 0, check: bool = True, seed: int = 0,
             node_of: Optional[Sequence[int]] = None) -> SimReport:
    """Run ``collective`` for ``ranks`` virtual ranks and report what it cost.

    Args:
        collective: one of ``COLLECTIVES``.
        ranks: number of virtual ranks (1 to thousands).
        count: elements of one rank's tensor (one block for the list collectives).
        algorithm: force an algorithm; None lets the selector choose.
        dtype: numpy dtype name of the data.
        op: reduce op (SUM, PRODUCT, MIN, MAX) of the reducing collectives.
        root: root rank of reduce, broadcast, gather and scatter.
        ranks_per_node: group ranks on pretend nodes of this many (0: one node).
        check: move real data and compare every rank's result with numpy; False moves only
            sizes (zero memory) and checks nothing.
        seed: seed of the random inputs.
        node_of: each rank's pretend node (0, 1, ...), instead of ``ranks_per_node``.

    Returns:
        A :class:`SimReport`.

    Raises:
        ValueError: bad arguments or an unusable forced algorithm.
        AssertionError: a rank's result differs from numpy's.
        SimulationDeadlockError, CollectiveMismatchError: the algorithm is broken.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {COLLECTIVES}")
    if ranks < 1 or count < 0 or not 0 <= root < ranks:
        raise ValueError(f"need ranks >= 1, count >= 0 and 0 <= root < ranks; got ranks={ranks}, "
                         f"count={count}, root={root}")
    if op is ReduceOp.AVG:
        raise ValueError("the simulator checks SUM, PRODUCT, MIN and MAX; AVG is SUM followed "
                         "by a local division")
    wire = np.dtype(dtype)
    if node_of is not None:
        node_of = tuple(int(n) for n in node_of)
        if len(node_of) != ranks:
            raise ValueError(f"node_of has {len(node_of)} entries for {ranks} ranks")
    elif ranks_per_node:
        node_of = tuple(r // ranks_per_node for r in range(ranks))
    chosen = select(collective, count, wire.itemsize, ranks, node_of,
                    forced=algorithm or forced_algorithms().get(collective))
    combine = combiner(op, wire.name) if check else _noop
    ctx = Context(wire, combine, alloc=None if check else (lambda n: _phantom(n, wire)),
                  copy=None if check else _noop, node_of=node_of,
                  choose=flat_choice(wire.itemsize))
    length = _buffer_length(collective, ranks, count)
    blocks = Blocks.uniform(count, ranks)
    inputs = _inputs(collective, ranks, length, wire, op, seed) if check else None
    bufs: List[np.ndarray] = []
    recvbufs: List[Optional[np.ndarray]] = []
    for rank in range(ranks):
        buf = inputs[rank].copy() if check else _phantom(length, wire)
        bufs.append(buf)
        recvbufs.append((np.zeros(length, wire) if check else _phantom(length, wire))
                        if collective == "alltoall" else None)
    fabric = LocalFabric(ranks, "sim", deferred=True, move_data=check, node_of=node_of)
    stamp = CallStamp.of(CallHeader(
        "sim", 0, 0, collective, chosen.name, wire.name, count, (count,),
        root if collective in ("reduce", "broadcast", "gather", "scatter") else -1, op.name))
    started = time.perf_counter()
    generators = [start(chosen, Team.world(ranks, rank), ctx, bufs[rank], blocks, root,
                        recvbufs[rank]) for rank in range(ranks)]
    rounds = run_lockstep(fabric, generators, COLLECTIVE_TAG, [stamp] * ranks, combine)
    seconds = time.perf_counter() - started
    if check:
        _check(collective, inputs, bufs, recvbufs, blocks, root, op, wire)
    return SimReport(
        collective, chosen.name, ranks, ranks_per_node, count, wire.itemsize, rounds,
        chosen.cost(ranks, count, ranks_per_node or ranks, wire.itemsize), max(fabric.messages_sent),
        max(fabric.elements_sent) * wire.itemsize, sum(fabric.messages_sent),
        sum(fabric.elements_sent) * wire.itemsize,
        sum(fabric.inter_node_messages), sum(1 for m in fabric.inter_node_messages if m), check,
        seconds, *_node_bytes(fabric, node_of, wire.itemsize))


def _node_bytes(fabric: LocalFabric, node_of: Optional[Tuple[int, ...]], itemsize: int
                ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Per node, the bytes sent to and received from other nodes (empty on one node)."""
    if node_of is None:
        return (), ()
    nodes = max(node_of) + 1
    sent = [0] * nodes
    for rank, elements in enumerate(fabric.inter_node_elements):
        sent[node_of[rank]] += elements * itemsize
    received = [0] * nodes
    for rank, elements in enumerate(fabric.inter_node_received):
        received[node_of[rank]] += elements * itemsize
    return tuple(sent), tuple(received)


def _inputs(collective: str, ranks: int, length: int, wire: np.dtype, op: ReduceOp,
            seed: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    # PRODUCT over many ranks overflows quickly: keep its factors at 1 or 2 for some ranks only.
    high = 3 if op is ReduceOp.PRODUCT else 100
    data = []
    for rank in range(ranks):
        if wire == np.bool_:
            values = rng.integers(0, 2, length).astype(bool)
        elif op is ReduceOp.PRODUCT and rank >= 8:
            values = np.ones(length, wire)
        else:
            values = rng.integers(1 if op is ReduceOp.PRODUCT else 0, high, length).astype(wire)
        data.append(values)
    return data


def _check(collective: str, inputs, bufs, recvbufs, blocks: Blocks, root: int, op: ReduceOp,
           wire: np.dtype) -> None:
    ranks = len(bufs)
    stacked = np.stack(inputs) if inputs else None

    def expect(rank: int, got: np.ndarray, want: np.ndarray, what: str) -> None:
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(f"{collective}: rank {rank} {what} differs from numpy at "
                                 f"{len(bad)} elements (first index {bad[0]}: got {got[bad[0]]}, "
                                 f"want {want[bad[0]]})")

    if collective in ("allreduce", "reduce", "reducescatter"):
        reduced = _UFUNC[op].reduce(stacked, axis=0, dtype=wire)
        for rank in range(ranks):
            if collective == "allreduce":
                expect(rank, bufs[rank], reduced, "result")
            elif collective == "reduce":
                expect(rank, bufs[rank], reduced if rank == root else inputs[rank],
                       "result" if rank == root else "input (must be unchanged)")
            else:
                expect(rank, blocks.view(bufs[rank], rank), blocks.view(reduced, rank),
                       "block")
    elif collective == "broadcast":
        for rank in range(ranks):
            expect(rank, bufs[rank], inputs[root], "result")
    elif collective in ("allgather", "gather"):
        whole = np.concatenate([blocks.view(inputs[r], r) for r in range(ranks)])
        for rank in range(ranks):
            if collective == "allgather" or rank == root:
                expect(rank, bufs[rank], whole, "gathered buffer")
    elif collective == "scatter":
        for rank in range(ranks):
            expect(rank, blocks.view(bufs[rank], rank), blocks.view(inputs[root], rank), "block")
    elif collective == "alltoall":
        for rank in range(ranks):
            want = np.concatenate([blocks.view(inputs[src], rank) for src in range(ranks)])
            expect(rank, recvbufs[rank], want, "received blocks")
