"""The in-process carrier: N ranks of one group inside one Python process.

A :class:`LocalFabric` connects the ranks; each talks to it through its own
:class:`LocalTransport`, whose receiving side is the wire protocol's
:class:`~ray_collective.transport.wire.Inbox` -- the same matcher and header checks the
``ray`` backend runs, so the API tests, the thread-based contract bindings and the simulator
exercise the real matching. A send hands the receiver's inbox one part holding a copy of the
payload (so it completes at once); a receive completes once its part has been matched.

Two ways to run it:
- threads, one per rank, blocking in :meth:`LocalTransport.wait` (the API-level tests); every
  inbox is then touched under the fabric's lock;
- cooperatively, with ``deferred=True``: parts sent during a superstep reach their inbox only
  at :meth:`LocalFabric.flush`, which is how the simulator measures rounds.
With ``move_data=False`` payloads are not copied at all (the simulator's zero-memory mode for
thousands of ranks with large buffers): parts carry their sizes and headers, not their bytes
(``wire.SIZES_ONLY``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import GroupBrokenError
from .base import Request, SendRequest, Transport
from .wire import INLINE, SIZES_ONLY, CallStamp, Inbox, Part, Receive


def _no_segments(part: Part) -> np.ndarray:
    raise ValueError("the in-process carrier has no shared-memory segments")


def _nothing_to_release(part: Part) -> None:
    return None


class LocalFabric:
    """What connects the ranks of one in-process group.

    Args:
        world_size: number of ranks.
        group_name: the group's name, for error messages.
        deferred: hold sent parts until :meth:`flush` (cooperative, superstep mode).
        move_data: copy payloads; False moves only sizes and headers.
        node_of: an optional pretend node of every rank, for counting inter-node messages.

    Attributes:
        messages_sent, elements_sent, inter_node_messages, inter_node_elements: per-rank
            counters of what each rank sent (the last two: to ranks on other nodes).
        inter_node_received: per rank, the elements it was sent from other nodes.
    """

    def __init__(self, world_size: int, group_name: str = "local", deferred: bool = False,
                 move_data: bool = True, node_of: Optional[Sequence] = None):
        self.world_size = world_size
        self.group_name = group_name
        self.deferred = deferred
        self.move_data = move_data
        self.messages_sent = [0] * world_size
        self.elements_sent = [0] * world_size
        self.inter_node_messages = [0] * world_size
        self.inter_node_elements = [0] * world_size
        self.inter_node_received = [0] * world_size
        self.node_of = tuple(node_of) if node_of is not None else None
        self.inboxes = [Inbox(rank, _no_segments, _nothing_to_release)
                        for rank in range(world_size)]
        self._staged: List[Tuple[int, Tuple[int, int], Part]] = []
        self._cond = threading.Condition()
        self._broken: Optional[BaseException] = None
        self._started_seq = [-1] * world_size

    def transport(self, rank: int) -> "LocalTransport":
        """The transport of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        return LocalTransport(self, rank)

    def flush(self) -> set:
        """Hand the parts staged in deferred mode to their inboxes; returns the ranks that got
        mail."""
        staged, self._staged = self._staged, []
        for receiver, key, part in staged:
            self.inboxes[receiver].arrive(key, part)
        return {receiver for receiver, _, _ in staged}

    def pending_messages(self) -> int:
        """Parts sent but not yet received (stale messages left by a failed call)."""
        return sum(inbox.unexpected_parts() for inbox in self.inboxes) + len(self._staged)

    def _post(self, receiver: int, key: Tuple[int, int], part: Part) -> None:
        if self.deferred:
            self._staged.append((receiver, key, part))
            return
        with self._cond:
            self.inboxes[receiver].arrive(key, part)
            self._cond.notify_all()

    def _abort(self, error: BaseException) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()


class LocalTransport(Transport):
    """One rank's endpoint on a :class:`LocalFabric`."""

    def __init__(self, fabric: LocalFabric, rank: int):
        self.fabric = fabric
        self.rank = rank
        self.world_size = fabric.world_size
        self._inbox = fabric.inboxes[rank]

    def isend(self, peer: int, tag: int, stamp: CallStamp, step: int,
              data: np.ndarray) -> Request:
        fabric = self.fabric
        nbytes = data.nbytes
        if fabric.move_data:
            segment, payload = INLINE, data.tobytes()
        else:
            segment, payload = SIZES_ONLY, None
        fabric.messages_sent[self.rank] += 1
        fabric.elements_sent[self.rank] += len(data)
        if fabric.node_of is not None and fabric.node_of[peer] != fabric.node_of[self.rank]:
            fabric.inter_node_messages[self.rank] += 1
            fabric.inter_node_elements[self.rank] += len(data)
            fabric.inter_node_received[peer] += len(data)
        part = Part(step, len(data), nbytes, 0, nbytes, segment, 0, stamp.packed, payload, None)
        fabric._post(peer, (self.rank, tag), part)
        return SendRequest(peer, done=True)

    def irecv(self, peer: int, tag: int, stamp: CallStamp, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        receive = Receive(peer, stamp, step, out, combine)
        if self.fabric.deferred:
            self._inbox.post((peer, tag), receive)
        else:
            with self.fabric._cond:
                self._inbox.post((peer, tag), receive)
        return receive

    def test(self, request: Request) -> bool:
        if not request.done:
            self._raise_mismatch([request])
        return request.done

    def _raise_mismatch(self, requests: Sequence[Request]) -> None:
        """Raise the inbox's mismatch, once: the failed call's receives are forgotten, so
        that a later call on this transport starts clean."""
        error = self._inbox.error
        if error is not None:
            self._inbox.error = None
            self._inbox.drop([r for r in requests if not r.done])
            raise error

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        fabric = self.fabric
        with fabric._cond:
            while True:
                if fabric._broken is not None:
                    raise GroupBrokenError(fabric.group_name, self.rank, fabric._broken)
                self._raise_mismatch(requests)
                pending = [r for r in requests if not r.done]
                if not pending:
                    return ()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return pending
                fabric._cond.wait(remaining)

    def check_failures(self, requests: Sequence[Request]) -> None:
        if self.fabric._broken is not None:
            raise GroupBrokenError(self.fabric.group_name, self.rank, self.fabric._broken)
        # A part of the current call with another header, come while this rank waited on the
        # native core (a group that spans nodes), as the ray transport's check raises it.
        with self.fabric._cond:
            self._raise_mismatch(())

    def arrive(self, stamp: CallStamp) -> None:
        started = self.fabric._started_seq
        started[self.rank] = max(started[self.rank], stamp.seq)
        if self.fabric.deferred:
            self._inbox.begin(stamp)
        else:
            with self.fabric._cond:
                self._inbox.begin(stamp)

    def complete(self, stamp: CallStamp) -> None:
        # A mismatch found on a part that arrived while no receive waited (another thread
        # delivered it) belongs to this call, even if its rounds completed without a wait.
        with self.fabric._cond:
            self._raise_mismatch(())

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        return [rank for rank, started in enumerate(self.fabric._started_seq) if started < seq]

    def abort(self, error: BaseException) -> None:
        self.fabric._abort(error)
