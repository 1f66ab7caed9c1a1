"""Cooperative lockstep driver: every rank's algorithm in one thread, superstep by superstep.

In superstep k every rank whose posted round can complete (all its receives find a message
posted before superstep k) completes it and posts its next round; messages posted in superstep
k become visible in superstep k+1. A round therefore costs at least one superstep and a message
one superstep of latency, so the number of supersteps is the critical path of the algorithm in
rounds, the quantity the algorithms' formulas give. Only ranks that got mail or just posted are
looked at in a superstep, which keeps 4096 ranks cheap.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..algorithms.core import AlgorithmGen, Recv
from ..errors import SimulationDeadlockError
from ..engine.executor import post_round
from ..transport.base import Request
from ..transport.wire import CallStamp
from ..transport.local import LocalFabric


def run_lockstep(fabric: LocalFabric, algorithms: Sequence[Optional[AlgorithmGen]],
                 tag: int, stamps: Sequence[CallStamp],
                 combine: Optional[Callable[[np.ndarray, np.ndarray], None]],
                 max_supersteps: int = 1_000_000) -> int:
    """Run one algorithm generator per rank (None: the rank takes no part) to completion.

    Args:
        fabric: a ``LocalFabric`` created with ``deferred=True``.
        algorithms: one generator per rank.
        tag: the tag every message uses.
        stamps: the header each rank posts and expects.
        combine: the reduction used by ``Recv(reduce=True)``.
        max_supersteps: a bound that turns a livelock into an error.

    Returns:
        The number of supersteps (rounds on the critical path).

    Raises:
        SimulationDeadlockError: no rank can progress while some have not finished.
        CollectiveMismatchError: a message did not match its receiver's expectation.
    """
    if not fabric.deferred:
        raise ValueError("run_lockstep needs a LocalFabric(deferred=True)")
    transports = [fabric.transport(rank) for rank in range(fabric.world_size)]
    pending: Dict[int, List[Request]] = {}
    waiting_on: Dict[int, List[int]] = {}

    def advance(rank: int, first: bool) -> None:
        algorithm = algorithms[rank]
        try:
            round_ = next(algorithm) if first else algorithm.send(None)
            while not round_:
                round_ = algorithm.send(None)
        except StopIteration:
            pending.pop(rank, None)
            waiting_on.pop(rank, None)
            return
        pending[rank] = post_round(transports[rank], round_, tag, stamps[rank], combine)
        waiting_on[rank] = [op.peer for op in round_ if isinstance(op, Recv)]

    for rank, algorithm in enumerate(algorithms):
        if algorithm is not None:
            advance(rank, first=True)
    just_posted = set(pending)
    supersteps = 0
    while pending:
        if supersteps >= max_supersteps:
            raise SimulationDeadlockError(waiting_on, f"no completion in {max_supersteps} rounds")
        got_mail = fabric.flush()
        candidates = (got_mail | just_posted) & pending.keys()
        just_posted = set()
        for rank in sorted(candidates):
            transport = transports[rank]
            if all([transport.test(request) for request in pending[rank]]):
                advance(rank, first=False)
                if rank in pending:
                    just_posted.add(rank)
        if not just_posted and not got_mail and not candidates:
            raise SimulationDeadlockError(waiting_on)
        supersteps += 1
    unreceived = fabric.pending_messages()
    if unreceived:
        raise SimulationDeadlockError({}, f"{unreceived} messages never received")
    return supersteps
