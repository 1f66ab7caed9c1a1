"""The central actor of the ``ray-plain`` peer: collectives the way a user writes them with Ray.

Without a collective library, a Ray user moves tensors through actor tasks and the object store
and lets one actor combine them — Ray's compiled-graph CPU communicator (``CPUCommBarrier``)
works this way. ``PlainRayHub`` is that actor: every rank calls ``exchange`` with its part and
waits; when the last rank's part arrives the hub computes every rank's answer and all calls
return. Reductions are summed here with numpy; a sum larger than Ray's inline limit, which
every rank receives, is put into the object store once and handed out by reference, as a user
would do rather than return one copy per rank. For the collectives that only move data the
ranks hand in lists of items — large tensors already ``ray.put`` by their owner — and the hub
routes the items without touching the payload. ``post``/``take`` are a mailbox for send/recv.

It is an asyncio actor: the ranks' calls wait concurrently on one event loop, one process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .peers import BROADCAST_ROOT, BY_REFERENCE_BYTES


@dataclass
class _Exchange:
    """One collective call in progress: the parts that have arrived and, once all have, the
    answers."""

    contributions: List[Any]
    arrived: int = 0
    collected: int = 0
    answers: Optional[List[Any]] = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _sum(arrays: List[np.ndarray]) -> np.ndarray:
    """The elementwise sum of ``arrays`` in one fresh array (in-place adds, no stacking)."""
    total = np.array(arrays[0], copy=True)
    for array in arrays[1:]:
        total += array
    return total


def combine(collective: str, contributions: List[Any]) -> List[Any]:
    """Every rank's answer to ``collective`` from every rank's part (None: nothing to copy).

    Args:
        collective: a name of ``collectives.COLLECTIVES``.
        contributions: rank i's part at index i: a tensor (allreduce, reduce), a list of
            tensors (reducescatter), a list of items — tensors or ObjectRefs — to route
            (broadcast and scatter: one item, or one per rank, from the root and None
            elsewhere; allgather and gather: one item; alltoall: one per rank), or None.

    Returns:
        Rank i's answer at index i: a tensor, a list of items, or None; ranks that share an
        answer share the same object.

    Raises:
        KeyError: an unknown collective.
    """
    world_size = len(contributions)
    root = BROADCAST_ROOT
    nobody = [None] * world_size
    if collective == "allreduce":
        return [_sum(contributions)] * world_size
    if collective == "reduce":
        return [_sum(contributions) if rank == root else None for rank in range(world_size)]
    if collective == "broadcast":
        return [None if rank == root else contributions[root] for rank in range(world_size)]
    if collective == "allgather":
        return [[items[0] for items in contributions]] * world_size
    if collective == "reducescatter":
        return [_sum([parts[rank] for parts in contributions]) for rank in range(world_size)]
    if collective == "gather":
        return [[items[0] for items in contributions] if rank == root else None
                for rank in range(world_size)]
    if collective == "scatter":
        return [[contributions[root][rank]] for rank in range(world_size)]
    if collective == "alltoall":
        return [[parts[rank] for parts in contributions] for rank in range(world_size)]
    if collective == "barrier":
        return nobody
    raise KeyError(f"the plain-Ray hub does not run {collective}")


def _answer_bytes(answer: Any) -> int:
    if isinstance(answer, np.ndarray):
        return answer.nbytes
    if isinstance(answer, list):
        return sum(_answer_bytes(item) for item in answer)
    return 0


class PlainRayHub:
    """The central actor of one ``ray-plain`` group (``ray.remote`` with ``num_cpus=0``).

    Args:
        world_size: number of ranks.
        timeout_s: how long a call waits for the other ranks.
    """

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._exchanges: Dict[Tuple[str, int], _Exchange] = {}
        self._mailboxes: Dict[Tuple[int, int], asyncio.Queue] = {}

    async def exchange(self, collective: str, sequence: int, rank: int,
                       contribution: Any) -> Any:
        """Hand in rank ``rank``'s part of call ``sequence``; return its answer.

        Args:
            collective: the collective; every rank's call ``sequence`` must name the same.
            sequence: the rank's count of exchanges so far (the same on every rank).
            rank: the caller's rank.
            contribution: its part (tensor, list of tensors, or None).

        Returns:
            The rank's answer: a value, an ObjectRef to a shared one, or None.

        Raises:
            asyncio.TimeoutError: the other ranks did not arrive within the timeout.
        """
        import ray
        key = (collective, sequence)
        if key not in self._exchanges:
            self._exchanges[key] = _Exchange(contributions=[None] * self._world_size)
        call = self._exchanges[key]
        call.contributions[rank] = contribution
        call.arrived += 1
        if call.arrived == self._world_size:
            answers = combine(collective, call.contributions)
            shared: Dict[int, Any] = {}
            for index, answer in enumerate(answers):
                if _answer_bytes(answer) >= BY_REFERENCE_BYTES:
                    if id(answer) not in shared:
                        shared[id(answer)] = ray.put(answer)
                    answers[index] = shared[id(answer)]
            call.answers = answers
            call.contributions = []
            call.done.set()
        else:
            await asyncio.wait_for(call.done.wait(), self._timeout_s)
        answer = call.answers[rank]
        call.collected += 1
        if call.collected == self._world_size:
            del self._exchanges[key]
        return answer

    def _mailbox(self, source: int, destination: int) -> asyncio.Queue:
        return self._mailboxes.setdefault((source, destination), asyncio.Queue())

    async def post(self, source: int, destination: int, tensor: Any) -> None:
        """Leave ``tensor`` for ``destination``; returns at once.

        Args:
            source: the sender's rank.
            destination: the receiver's rank.
            tensor: the message.
        """
        self._mailbox(source, destination).put_nowait(tensor)

    async def take(self, source: int, destination: int) -> Any:
        """The oldest message from ``source`` to ``destination``, waiting for one.

        Args:
            source: the sender's rank.
            destination: the receiver's rank.

        Returns:
            The tensor.

        Raises:
            asyncio.TimeoutError: nothing arrived within the timeout.
        """
        return await asyncio.wait_for(self._mailbox(source, destination).get(), self._timeout_s)
