"""The in-process transport: N ranks of one group inside one Python process.

A :class:`LocalFabric` holds one FIFO mailbox per (source, destination, channel); each rank
talks to it through its own :class:`LocalTransport`. Sends are eager (the payload is copied
into the mailbox, so the send completes at once); a receive completes when its message is at
the head of its mailbox, after the header check.

Two ways to run it:
- threads, one per rank, blocking in :meth:`LocalTransport.wait` (the API-level tests);
- cooperatively, with ``deferred=True``: messages posted during a superstep become visible
  only after :meth:`LocalFabric.flush`, which is how the simulator measures rounds.
With ``move_data=False`` payloads are not copied at all (the simulator's zero-memory mode for
thousands of ranks with large buffers); only sizes and headers travel.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import GroupBrokenError
from .base import RecvRequest, Request, SendRequest, Transport
from .wire import CallStamp, mismatch


class _Message:
    __slots__ = ("stamp", "step", "payload", "count")

    def __init__(self, stamp: CallStamp, step: int, payload: Optional[np.ndarray], count: int):
        self.stamp = stamp
        self.step = step
        self.payload = payload
        self.count = count


class LocalFabric:
    """The shared mailboxes of one in-process group.

    Args:
        world_size: number of ranks.
        group_name: the group's name, for error messages.
        deferred: hold posted messages until :meth:`flush` (cooperative, superstep mode).
        move_data: copy payloads; False moves only sizes and headers.
        node_of: an optional pretend node of every rank, for counting inter-node messages.

    Attributes:
        messages_sent, elements_sent, inter_node_messages: per-rank counters of what each rank
            sent.
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
        self.node_of = tuple(node_of) if node_of is not None else None
        self._mailboxes: Dict[Tuple[int, int, Hashable], deque] = defaultdict(deque)
        self._staged: List[Tuple[Tuple[int, int, Hashable], _Message]] = []
        self._cond = threading.Condition()
        self._broken: Optional[BaseException] = None
        self._started_seq = [-1] * world_size

    def transport(self, rank: int) -> "LocalTransport":
        """The transport of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        return LocalTransport(self, rank)

    def flush(self) -> set:
        """Make the messages staged in deferred mode visible; returns the ranks that got mail."""
        staged, self._staged = self._staged, []
        receivers = set()
        for key, message in staged:
            self._mailboxes[key].append(message)
            receivers.add(key[1])
        return receivers

    def pending_messages(self) -> int:
        """Messages posted but not yet received (stale messages left by a failed call)."""
        return sum(len(box) for box in self._mailboxes.values()) + len(self._staged)

    def _post(self, key, message: _Message) -> None:
        if self.deferred:
            self._staged.append((key, message))
            return
        with self._cond:
            self._mailboxes[key].append(message)
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

    def isend(self, peer: int, channel: Hashable, stamp: CallStamp, step: int,
              data: np.ndarray) -> Request:
        fabric = self.fabric
        payload = data.copy() if fabric.move_data else None
        fabric.messages_sent[self.rank] += 1
        fabric.elements_sent[self.rank] += len(data)
        if fabric.node_of is not None and fabric.node_of[peer] != fabric.node_of[self.rank]:
            fabric.inter_node_messages[self.rank] += 1
        fabric._post((self.rank, peer, channel), _Message(stamp, step, payload, len(data)))
        return SendRequest(peer, done=True)

    def irecv(self, peer: int, channel: Hashable, stamp: CallStamp, step: int,
              out: np.ndarray,
              combine: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> Request:
        return RecvRequest(peer, (peer, self.rank, channel), stamp, step, out, combine)

    def test(self, request: Request) -> bool:
        if request.done:
            return True
        box = self.fabric._mailboxes.get(request.key)
        if not box:
            return False
        message = box.popleft()
        if (message.stamp.packed != request.stamp.packed or message.step != request.step
                or message.count != len(request.out)):
            raise mismatch(self.rank, request.peer, request.stamp, request.step,
                           len(request.out), message.stamp.packed, message.step, message.count)
        if message.payload is not None:
            if request.combine is None:
                request.out[...] = message.payload
            else:
                request.combine(request.out, message.payload)
        request.done = True
        return True

    def wait(self, requests: Sequence[Request], deadline: float) -> Sequence[Request]:
        fabric = self.fabric
        with fabric._cond:
            while True:
                if fabric._broken is not None:
                    raise GroupBrokenError(fabric.group_name, self.rank, fabric._broken)
                pending = [r for r in requests if not self.test(r)]
                if not pending:
                    return ()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return pending
                fabric._cond.wait(remaining)

    def arrive(self, stamp: CallStamp) -> None:
        started = self.fabric._started_seq
        started[self.rank] = max(started[self.rank], stamp.seq)

    def absent_ranks(self, seq: int) -> Optional[Sequence[int]]:
        return [rank for rank, started in enumerate(self.fabric._started_seq) if started < seq]

    def abort(self, error: BaseException) -> None:
        self.fabric._abort(error)
