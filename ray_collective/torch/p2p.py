"""Sends and receives of a ``ray_collective`` process group: one library group per direction.

A library group runs its calls one after another, so a ``recv`` waiting in it would hold up a
``send`` made after it on the same rank; torch code does exactly that (``irecv`` from the
left, ``send`` to the right, ``wait``). Each direction between two ranks therefore gets a
library group of its own, of two members (the sender is rank 0, the receiver rank 1), joined
by both on their first ``send``/``recv`` between them; and each side runs its calls for one
peer on a thread of its own, so that neither the join nor a wait holds up the caller or the
other peers. Calls between two ranks in one direction keep their order; tags match as the
library's ``send``/``recv`` match them (same tag, in order).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Tuple

import torch

from .. import api as col


class PointToPoint:
    """The sends and receives of one rank of one torch group."""

    def __init__(self, base_name: str, rank: int, timeout: float):
        self._base_name = base_name
        self._rank = rank
        self._timeout = timeout
        self._lock = threading.Lock()
        self._threads: Dict[Tuple[str, int], ThreadPoolExecutor] = {}
        self._joined: Dict[str, bool] = {}

    def _thread(self, kind: str, peer: int) -> ThreadPoolExecutor:
        with self._lock:
            thread = self._threads.get((kind, peer))
            if thread is None:
                thread = ThreadPoolExecutor(
                    1, thread_name_prefix=f"ray_collective.torch[{self._base_name}].{kind}{peer}")
                self._threads[(kind, peer)] = thread
            return thread

    def _pair(self, src: int, dst: int) -> str:
        # Only the thread of this direction and peer joins it, so once is checked without a lock.
        name = f"{self._base_name}.p2p.{src}-{dst}"
        if name not in self._joined:
            col.init_collective_group(2, 0 if self._rank == src else 1, backend="ray",
                                      group_name=name, timeout=self._timeout)
            self._joined[name] = True
        return name

    def post(self, kind: str, tensor: torch.Tensor, peer: int, tag: int,
             timeout: float) -> Future:
        """Send ``tensor`` to group rank ``peer`` (``kind="send"``) or receive into it from
        ``peer`` (``"recv"``) on that direction's thread; the future ends with the call.

        Args:
            kind: ``"send"`` or ``"recv"``.
            tensor: contiguous; a send's is not to be written, a recv's not read, until the
                future ends.
            peer: the other rank of the torch group.
            tag: matched by the other side's call of the same tag.
            timeout: the call's deadline in seconds.

        Returns:
            A future of None.
        """
        if kind == "send":
            return self._thread(kind, peer).submit(
                lambda: col.send(tensor, 1, self._pair(self._rank, peer), tag, timeout=timeout))
        return self._thread(kind, peer).submit(
            lambda: col.recv(tensor, 0, self._pair(peer, self._rank), tag, timeout=timeout))

    def close(self) -> None:
        """Stop the threads (after their calls end) and leave every pair group."""
        with self._lock:
            threads, self._threads = list(self._threads.values()), {}
        for thread in threads:
            thread.shutdown(wait=True)
        for name in self._joined:
            if col.is_group_initialized(name):
                col.destroy_collective_group(name)
        self._joined.clear()
