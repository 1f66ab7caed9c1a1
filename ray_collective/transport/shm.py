"""Shared memory for large messages on one node: a sender's arena and a receiver's mappings.

A sender copies each large payload once into its :class:`SendArena`, an anonymous shared
memory segment (``memfd``) that it hands to each receiver once, as a file descriptor over the
Unix socket. The receiver maps it (:class:`PeerSegments`) and reduces or copies straight out of
the sender's memory, then tells the sender it is done with that message (a release). Anonymous
segments leave nothing behind in the file system, even if a process is killed.

Sizing follows the messages in flight, not the number of ranks: the arena starts empty, places
each payload in the first free gap of its segment, grows (doubling) only when a payload does not
fit beside the messages still unreleased (after collecting the releases that have arrived), and
retires a smaller segment once its last message is released. Steady state is one segment at
least as large as the volume a rank has in flight at once; it is freed when the group is
destroyed.
"""

from __future__ import annotations

import mmap
import os
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

_PAGE = mmap.PAGESIZE
_ALIGN = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Segment:
    __slots__ = ("id", "fd", "size", "map", "array", "live")

    def __init__(self, segment_id: int, size: int, name: str):
        self.id = segment_id
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.size = size
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.map, np.uint8)
        self.live: Dict[int, int] = {}

    def gap(self, nbytes: int) -> Optional[int]:
        """The lowest offset with ``nbytes`` free after it (first fit), or None."""
        start = 0
        for offset in sorted(self.live):
            if offset - start >= nbytes:
                return start
            start = self.live[offset]
        return start if self.size - start >= nbytes else None

    def close(self) -> None:
        self.array = None
        _unmap(self.map)
        os.close(self.fd)


MEMFD_NAME_BYTES = 249
"""The longest name ``memfd_create`` takes (longer ones fail with EINVAL)."""


def memfd_name(name: str) -> str:
    """``name`` as ``memfd_create`` takes it: no NUL, at most ``MEMFD_NAME_BYTES`` bytes of
    UTF-8 (cut at a character's boundary)."""
    encoded = name.replace("\0", "?").encode("utf-8", "replace")[:MEMFD_NAME_BYTES]
    return encoded.decode("utf-8", "ignore")


def _unmap(segment: mmap.mmap) -> None:
    try:
        segment.close()
    except BufferError:
        pass  # a caller still holds a view; the mapping goes when that view is collected


class SendArena:
    """One sender's shared memory for large payloads.

    Args:
        name: a name for the segments (shows in ``/proc/PID/maps``; not a file); cut to
            ``MEMFD_NAME_BYTES`` bytes, a NUL shown as ``?``.
    """

    def __init__(self, name: str):
        self.name = memfd_name(name)
        self._next_id = 0
        self._current: Optional[_Segment] = None
        self._draining: Dict[int, _Segment] = {}

    def place(self, data: np.ndarray,
              reclaim: Optional[Callable[[], None]] = None) -> Tuple[int, int, int]:
        """Copy ``data`` into the arena.

        Args:
            data: the payload.
            reclaim: called once when the payload does not fit beside the unreleased ones,
                to collect releases that have arrived, before the arena grows.

        Returns:
            ``(segment id, segment fd, byte offset)``; the caller owes one :meth:`release` of
            that place once the receiver has read the payload.
        """
        nbytes = max(data.nbytes, 1)
        segment, offset = self._room_for(nbytes, reclaim)
        segment.live[offset] = offset + _round_up(nbytes, _ALIGN)
        np.copyto(segment.array[offset:offset + data.nbytes], data.view(np.uint8).reshape(-1))
        return segment.id, segment.fd, offset

    def release(self, segment_id: int, offset: int) -> None:
        """A receiver is done with the payload placed at ``offset`` of ``segment_id``."""
        segment = self._current
        if segment is None or segment.id != segment_id:
            segment = self._draining.get(segment_id)
            if segment is None:
                return
        segment.live.pop(offset, None)
        if not segment.live and segment is not self._current:
            del self._draining[segment_id]
            segment.close()

    def _room_for(self, nbytes: int, reclaim) -> Tuple[_Segment, int]:
        current = self._current
        if current is not None:
            offset = current.gap(nbytes)
            if offset is None and reclaim is not None:
                reclaim()
                offset = current.gap(nbytes)
            if offset is not None:
                return current, offset
            if current.live:
                self._draining[current.id] = current
            else:
                current.close()
        size = _round_up(max(nbytes, 2 * (current.size if current else 0), 1 << 20), _PAGE)
        self._current = _Segment(self._next_id, size, self.name)
        self._next_id += 1
        return self._current, 0

    def live_payloads(self) -> int:
        """Payloads placed and not yet released by their receiver."""
        segments = [self._current, *self._draining.values()]
        return sum(len(s.live) for s in segments if s is not None)

    def close(self) -> None:
        """Unmap and close every segment (receivers' own mappings stay valid until they unmap)."""
        for segment in [self._current, *self._draining.values()]:
            if segment is not None:
                segment.close()
        self._current, self._draining = None, {}


class PeerSegments:
    """The segments a receiver has mapped, by (sender, segment id).

    A sender only ever moves forward to a new segment id, so a mapping is dropped once a newer
    segment of that sender has been seen and no unread message still points into it.
    """

    def __init__(self):
        self._maps: Dict[Tuple[int, int], List] = {}
        self._latest: Dict[int, int] = {}

    def add(self, sender: int, segment_id: int, fd: int) -> None:
        """Map a segment received as ``fd`` (which this call closes)."""
        try:
            size = os.fstat(fd).st_size
            segment = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[(sender, segment_id)] = [segment, np.frombuffer(segment, np.uint8), 0]
        self._latest[sender] = max(self._latest.get(sender, -1), segment_id)
        for key in [k for k, entry in self._maps.items()
                    if k[0] == sender and k[1] < self._latest[sender] and entry[2] == 0]:
            self._drop(key)

    def hold(self, sender: int, segment_id: int) -> None:
        """Note one more unread message pointing into the segment."""
        self._maps[(sender, segment_id)][2] += 1

    def view(self, sender: int, segment_id: int, offset: int, nbytes: int) -> np.ndarray:
        """The payload's bytes, read-only, straight from the sender's memory."""
        return self._maps[(sender, segment_id)][1][offset:offset + nbytes]

    def done(self, sender: int, segment_id: int) -> None:
        """One message of the segment has been read; unmap it when it is stale and unused."""
        key = (sender, segment_id)
        entry = self._maps[key]
        entry[2] -= 1
        if entry[2] == 0 and self._latest[sender] > segment_id:
            self._drop(key)

    def _drop(self, key: Tuple[int, int]) -> None:
        entry = self._maps.pop(key)
        entry[1] = None
        _unmap(entry[0])

    def close(self) -> None:
        """Unmap everything."""
        for key in list(self._maps):
            self._drop(key)
