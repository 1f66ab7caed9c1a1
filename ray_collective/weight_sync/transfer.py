"""The bytes of a sync: one publisher's buckets down one data group, pipelined.

A data group is one publisher (its rank 0) and every subscriber. The publisher first broadcasts
which of its buckets this sync sends (one byte per bucket), then each of those buckets, every
one a ``broadcast`` of the library (so the chain through the nodes, the copies out of shared
memory on a node and everything else the collectives do for a large broadcast apply), issued
with ``async_op=True`` so that the next bucket is packed, and the last one unpacked, while one
is in flight. At most two buckets are in flight per group; a bucket that is one piece of one
tensor moves from and into that tensor's memory, a fused one through one of two staging
buffers.

The publisher learns each sent bucket's digest while it is in flight (the core's digest runs
without the GIL), so that the next sync can skip what did not change.

Where the buckets live is the ``memory`` argument: :class:`HostBuckets` (host memory, the
``ray`` backend) or ``gpu.GpuBuckets`` (GPU memory, ``nccl``: device copies on streams of its
own, no digest); the loop is the same.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Any, Callable, Collection, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import api
from ..errors import CollectiveError
from .digest import combine, digest
from .plan import Bucket, SyncPlan

IN_FLIGHT = 2
"""Buckets a member has in flight per data group; also the staging buffers it holds."""


def segment_views(plan: SyncPlan, bucket: Bucket, bytes_of: Dict[str, np.ndarray]
                  ) -> List[np.ndarray]:
    """The caller's memory of each segment of ``bucket``, as uint8 views."""
    return [bytes_of[plan.tensors[s.tensor].name][s.offset:s.offset + s.nbytes]
            for s in bucket.segments]


def bucket_digest(plan: SyncPlan, bucket: Bucket, bytes_of: Dict[str, np.ndarray]) -> int:
    """The digest of the bytes ``bucket`` carries, read from the caller's tensors."""
    return combine(digest(view) for view in segment_views(plan, bucket, bytes_of))


def choose_buckets(plan: SyncPlan, buckets: Sequence[Bucket], bytes_of: Dict[str, np.ndarray],
                   unchanged: Optional[Collection[str]], use_digest: bool,
                   last: Dict[int, int], known: Dict[int, int]) -> List[bool]:
    """Which of a publisher's buckets go in a sync that is not full: with the digest, those
    the caller does not claim unchanged and those whose digest moved since ``last``; without
    it, those the caller does not claim unchanged.

    Args:
        plan, buckets: the sync's plan and this publisher's buckets.
        bytes_of: the publisher's tensors as uint8 views.
        unchanged: the names the caller claims unchanged, or None.
        use_digest: whether to check the digest.
        last: ``{bucket index: digest}`` of what the subscribers hold.
        known: filled with the digests computed here, so that sending does not compute them
            again.

    Returns:
        For each bucket, whether it goes.
    """
    claimed = None if unchanged is None else set(unchanged)
    send = []
    for bucket in buckets:
        said_unchanged = claimed is not None and all(
            name in claimed for name in plan.tensors_of(bucket))
        if not use_digest or (claimed is not None and not said_unchanged):
            send.append(not said_unchanged)
        elif bucket.index not in last:
            send.append(True)
        else:
            known[bucket.index] = bucket_digest(plan, bucket, bytes_of)
            send.append(known[bucket.index] != last[bucket.index])
    return send


class _Staging:
    """Two staging buffers of one data group, made on first use at the largest fused bucket's
    size, each reused once the broadcast that last used it is done."""

    def __init__(self, nbytes: int):
        self._buffers = [None] * IN_FLIGHT
        self._nbytes = nbytes

    def buffer(self, slot: int, nbytes: int) -> np.ndarray:
        if self._buffers[slot] is None:
            self._buffers[slot] = np.empty(self._nbytes, np.uint8)
        return self._buffers[slot][:nbytes]

    @staticmethod
    def pack(slot: int, views: Sequence[np.ndarray], payload: np.ndarray) -> None:
        offset = 0
        for view in views:
            payload[offset:offset + view.nbytes] = view
            offset += view.nbytes

    @staticmethod
    def unpack(slot: int, views: Sequence[np.ndarray], payload: np.ndarray) -> None:
        offset = 0
        for view in views:
            view[...] = payload[offset:offset + view.nbytes]
            offset += view.nbytes


def _largest_fused(buckets: Sequence[Bucket]) -> int:
    return max((b.nbytes for b in buckets if not b.in_place), default=0)


class HostBuckets:
    """Where a member's buckets live on the ``ray`` backend: host memory, the caller's tensors
    as uint8 numpy views, packing and unpacking by numpy copies (``gpu.GpuBuckets`` is the
    same on the GPU)."""

    def views(self, plan: SyncPlan, bucket: Bucket, bytes_of: Dict[str, np.ndarray]
              ) -> List[np.ndarray]:
        """The caller's memory of each segment of ``bucket``."""
        return segment_views(plan, bucket, bytes_of)

    @staticmethod
    def tensor(memory: np.ndarray) -> np.ndarray:
        """What a collective takes for ``memory``."""
        return memory

    @staticmethod
    def staging(nbytes: int) -> _Staging:
        """A data group's two staging buffers of ``nbytes`` each."""
        return _Staging(nbytes)

    @staticmethod
    def issuing(slot: int):
        """The context a bucket's broadcast is submitted in."""
        return nullcontext()

    def finish(self, deadline: float) -> None:
        """Wait until the copies queued by this sync are done (none on the host)."""

    @staticmethod
    def allgather(words: np.ndarray, group: str, world: int, timeout: Optional[float]
                  ) -> np.ndarray:
        """Every member's ``words``, one row per rank of ``group``."""
        rows = [np.empty_like(words) for _ in range(world)]
        api.allgather(rows, words, group, timeout=timeout)
        return np.stack(rows)

    @staticmethod
    def broadcast_words(words: np.ndarray, group: str, timeout: Optional[float]) -> np.ndarray:
        """Rank 0's ``words`` of ``group``, in every rank's ``words``."""
        api.broadcast(words, 0, group, timeout=timeout)
        return words


def send_buckets(plan: SyncPlan, buckets: Sequence[Bucket], send: Sequence[bool],
                 bytes_of: Dict[str, Any], group: str, timeout: Optional[float],
                 known: Dict[int, int], memory: Any) -> None:
    """Send this publisher's ``buckets`` where ``send`` says so, after the flags themselves.

    Args:
        plan: the sync's plan.
        buckets: this publisher's buckets, in order.
        send: for each, whether it goes out this sync.
        bytes_of: the publisher's tensors' memory (uint8 views, or device bytes), by name.
        group: the data group (this publisher is its rank 0).
        timeout: each broadcast's deadline.
        known: ``{bucket index: digest}`` computed already; filled in for every bucket sent
            (on the host only: the GPU path keeps no digest).
        memory: where the buckets live (:class:`HostBuckets`, ``gpu.GpuBuckets``).

    Raises:
        CollectiveError: a broadcast failed.
    """
    memory.broadcast_words(np.array(send, np.uint8), group, timeout)

    def issued(bucket: Bucket) -> None:
        if isinstance(memory, HostBuckets) and bucket.index not in known:
            known[bucket.index] = bucket_digest(plan, bucket, bytes_of)  # while in flight

    _broadcast_all(plan, buckets, send, bytes_of, group, timeout, memory, True, issued)


def receive_buckets(plan: SyncPlan, buckets: Sequence[Bucket], bytes_of: Dict[str, Any],
                    group: str, timeout: Optional[float], memory: Any) -> int:
    """Receive what one publisher sends this sync into this subscriber's tensors.

    Args:
        plan: the sync's plan.
        buckets: that publisher's buckets, in order.
        bytes_of: this subscriber's tensors' memory, by name.
        group: the publisher's data group.
        timeout: each broadcast's deadline.
        memory: where the buckets live (:class:`HostBuckets`, ``gpu.GpuBuckets``).

    Returns:
        The bytes received.

    Raises:
        CollectiveError: a broadcast failed (the tensors then hold a mix of versions).
    """
    flags = memory.broadcast_words(np.zeros(len(buckets), np.uint8), group, timeout)
    _broadcast_all(plan, buckets, flags, bytes_of, group, timeout, memory, False, _ignore)
    return sum(b.nbytes for b, goes in zip(buckets, flags) if goes)


def _broadcast_all(plan: SyncPlan, buckets: Sequence[Bucket], goes: Sequence,
                   bytes_of: Dict[str, Any], group: str, timeout: Optional[float],
                   memory: Any, sending: bool, issued: Callable[[Bucket], None]) -> None:
    """Broadcast every bucket that goes from rank 0 of ``group``, at most ``IN_FLIGHT`` at
    once. A fused bucket goes through staging buffer ``slot``: the publisher packs it before
    its broadcast is issued, a subscriber unpacks it once it is done; ``issued(bucket)`` runs
    once it is in flight."""
    staging = memory.staging(_largest_fused(buckets))
    in_flight: Deque[Tuple[object, Callable[[], None]]] = deque()
    slot = 0
    try:
        for bucket, go in zip(buckets, goes):
            if not go:
                continue
            views = memory.views(plan, bucket, bytes_of)
            if len(in_flight) == IN_FLIGHT:
                work, done = in_flight.popleft()
                work.wait()
                done()
            mine, done = slot, _nothing
            if bucket.in_place:
                payload = views[0]
            else:
                payload = staging.buffer(slot, bucket.nbytes)
                if sending:
                    staging.pack(slot, views, payload)
                else:
                    done = _unpacking(staging, slot, views, payload)
                slot = (slot + 1) % IN_FLIGHT
            with memory.issuing(mine):
                work = api.broadcast(memory.tensor(payload), 0, group, async_op=True,
                                     timeout=timeout)
            in_flight.append((work, done))
            issued(bucket)
        while in_flight:
            work, done = in_flight.popleft()
            work.wait()
            done()
    except BaseException:
        _drain(in_flight)
        try:    # no copy may still write into a staging buffer once it is given back
            memory.finish(timeout)
        except CollectiveError:
            pass   # the first failure is the one raised
        raise
    memory.finish(timeout)


def _unpacking(staging, slot: int, views: Sequence, payload) -> Callable[[], None]:
    return lambda: staging.unpack(slot, views, payload)


def _nothing() -> None:
    return None


def _ignore(_bucket: Bucket) -> None:
    return None


def _drain(in_flight: Deque) -> None:
    """Wait out what is still in flight after a failure, so that no broadcast writes into a
    buffer the caller has taken back; its errors are the group's, raised already."""
    while in_flight:
        try:
            in_flight.popleft()[0].wait()
        except Exception:  # the first failure is the one raised; the group is broken
            pass
