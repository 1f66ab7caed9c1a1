"""Drives an algorithm generator over a transport: post each round, wait for it, resume.

This is the one place where algorithms (which yield rounds of Send/Recv) meet a transport
(which moves messages). The simulator has its own cooperative driver for thousands of ranks
in one thread (``sim.engine``); both post operations through :func:`post_round`.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, List, Optional

import numpy as np

from .algorithms.core import AlgorithmGen, Recv, Round
from .errors import CollectiveTimeoutError
from .transport.base import COLLECTIVE_CHANNEL, CallHeader, Request, Transport


def post_round(transport: Transport, round_: Round, channel: Hashable, header: CallHeader,
               combine: Optional[Callable[[np.ndarray, np.ndarray], None]]) -> List[Request]:
    """Post every operation of one round on ``transport``; returns their requests."""
    requests = []
    for op in round_:
        if isinstance(op, Recv):
            requests.append(transport.irecv(op.peer, channel, header, op.step, op.out,
                                            combine if op.reduce else None))
        else:
            requests.append(transport.isend(op.peer, channel, header, op.step, op.data))
    return requests


def drive(algorithm: AlgorithmGen, transport: Transport, channel: Hashable, header: CallHeader,
          combine: Optional[Callable[[np.ndarray, np.ndarray], None]], timeout: float,
          what: str):
    """Run one rank's algorithm to completion, blocking; returns the generator's return value.

    ``what`` names the call in a timeout error (``"recv"`` rather than the channel's name). A
    timed-out collective names the ranks that never started it when the transport knows them,
    else the peers this rank was still waiting for.

    Raises:
        CollectiveTimeoutError: a round was still incomplete ``timeout`` seconds after the start.
        CollectiveMismatchError, PeerDiedError, GroupBrokenError: from the transport.
    """
    deadline = time.monotonic() + timeout
    collective = channel == COLLECTIVE_CHANNEL
    if collective:
        transport.arrive(header)
    try:
        round_ = next(algorithm)
        while True:
            requests = post_round(transport, round_, channel, header, combine)
            pending = transport.wait(requests, deadline)
            if pending:
                absent = transport.absent_ranks(header) if collective else None
                raise CollectiveTimeoutError(header.group, transport.rank, what, header.seq,
                                             absent or [r.peer for r in pending], timeout)
            round_ = algorithm.send(None)
    except StopIteration as stop:
        return stop.value
