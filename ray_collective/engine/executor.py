"""Runs algorithms over a transport: a recorded plan for a call, a generator for the simulator.

This is the one place where algorithms (rounds of Send/Recv) meet a transport (which moves
messages). A call replays its :class:`~ray_collective.engine.plan.Plan` (:func:`run_plan`): post
each round's messages, wait for all of them, run the local operations between rounds. The simulator
drives the generators themselves, thousands of ranks in one thread (``sim.lockstep``), and posts
their rounds through :func:`post_round`.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..algorithms.core import Recv, Round
from ..errors import CollectiveTimeoutError
from ..transport.base import COLLECTIVE_TAG, Request, Transport
from ..transport.wire import CallStamp
from .plan import Local, Plan

Combine = Callable[[np.ndarray, np.ndarray], None]
RoundInCore = Callable[[int, Sequence[np.ndarray], CallStamp, float], Optional[Sequence[int]]]
"""Runs one round of a plan in the native core where it can (``run_plan``'s ``rounds``)."""


def post_round(transport: Transport, round_: Round, tag: int, stamp: CallStamp,
               combine: Optional[Combine]) -> List[Request]:
    """Post every operation of one generator round on ``transport``; returns their requests."""
    requests = []
    for op in round_:
        if isinstance(op, Recv):
            requests.append(transport.irecv(op.peer, tag, stamp, op.step, op.out,
                                            combine if op.reduce else None))
        else:
            requests.append(transport.isend(op.peer, tag, stamp, op.step, op.data))
    return requests


def run_plan(plan: Plan, slots: Sequence[np.ndarray], transport: Transport, tag: int,
             stamp: CallStamp, combine: Optional[Combine], timeout: float, what: str,
             watch: Optional[Callable[[], None]] = None, watch_every_s: float = 0.05,
             rounds: Optional[RoundInCore] = None) -> None:
    """Run one rank's part of a call by replaying ``plan`` on ``slots``, blocking.

    Args:
        plan: the call shape's plan.
        slots: the call's arrays (``plan.slots(...)``).
        transport: this rank's transport.
        tag: ``COLLECTIVE_TAG`` or a point-to-point call's tag.
        stamp: the call's header.
        combine: the call's reduction (for receives that reduce, and local combines).
        timeout: seconds the whole call may take.
        what: the call's name in a timeout error (``"recv"`` rather than the tag).
        watch: called every ``watch_every_s`` while a round waits: a check that raises what
            the transport cannot see (a peer's part of another call on the native core).
        watch_every_s: seconds between two calls of ``watch``.
        rounds: runs a round itself where it can (the native core over the streams between
            nodes, ``engine.stream_rounds``): given the round's index in ``plan.steps``, the slots,
            the stamp and the deadline, it returns None where it cannot (the round then goes
            over ``transport``), else the peers still pending at the deadline (empty: done).

    Raises:
        CollectiveTimeoutError: a round was still incomplete ``timeout`` seconds after the start;
            it names the ranks that hold the call up (never started it, or stalled in it) when
            the transport knows them, else the peers this rank was still waiting for.
        CollectiveMismatchError, PeerDiedError, GroupBrokenError: from the transport.
    """
    deadline = time.monotonic() + timeout
    collective = tag == COLLECTIVE_TAG
    if collective:
        transport.arrive(stamp)
    isend, irecv = transport.isend, transport.irecv
    for index, step in enumerate(plan.steps):
        if type(step) is Local:
            step.run(slots, combine)
            continue
        if rounds is not None:
            late = rounds(index, slots, stamp, deadline)
            if late:
                raise _timed_out(transport, stamp, collective, what, late, timeout)
            if late is not None:
                continue
        requests = []
        for is_send, peer, number, (slot, start, stop), reduce in step:
            buffer = slots[slot][start:stop]
            if is_send:
                requests.append(isend(peer, tag, stamp, number, buffer))
            else:
                requests.append(irecv(peer, tag, stamp, number, buffer,
                                      combine if reduce else None))
        # A round whose every request completed as it was posted (small sends, messages
        # that came early) needs no wait: most rounds of a small collective are such.
        for request in requests:
            if not request.done:
                break
        else:
            continue
        if watch is None:
            pending = transport.wait(requests, deadline)
        else:
            pending = transport.wait(requests, min(deadline, time.monotonic() + watch_every_s))
            while pending and time.monotonic() < deadline:
                watch()
                pending = transport.wait(pending,
                                         min(deadline, time.monotonic() + watch_every_s))
        if pending:
            raise _timed_out(transport, stamp, collective, what, [r.peer for r in pending],
                             timeout)
    if collective:
        transport.complete(stamp)


def _timed_out(transport: Transport, stamp: CallStamp, collective: bool, what: str,
               waited_for: Sequence[int], timeout: float) -> CollectiveTimeoutError:
    """The error of a call whose round was still incomplete at its deadline: it names the ranks
    that hold the call up where the transport knows them, else ``waited_for``."""
    absent = transport.absent_ranks(stamp.seq) if collective else None
    return CollectiveTimeoutError(stamp.template.group, transport.rank, what, stamp.seq,
                                  absent or waited_for, timeout)
