"""What each benchmarked collective moves: its buffers for a message size, and its bus factor.

Sizes follow nccl-tests (its ``PERFORMANCE.md``): the size of a row is the full message of the
collective — the tensor for allreduce, reduce and broadcast; the gathered output of allgather;
the whole input list of reducescatter and scatter, the gathered output of gather, one rank's
whole input list of alltoall, the tensor of a send/recv round trip — so that algorithm bandwidth is ``size / time`` and bus
bandwidth, ``algbw`` times the collective's factor, is comparable across collectives and rank
counts. A size that does not split into whole elements per rank is rounded down (at least one
element per rank), and the row reports the size actually moved.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Mapping


def _allreduce_factor(world_size: int) -> float:
    """A ring allreduce sends and receives ``2(n-1)/n`` of the buffer per rank."""
    return 2.0 * (world_size - 1) / world_size


def _partitioned_factor(world_size: int) -> float:
    """Allgather and reducescatter move every part but the rank's own: ``(n-1)/n``."""
    return (world_size - 1) / world_size


def _rooted_factor(world_size: int) -> float:
    """Broadcast and reduce: the root's whole buffer crosses once, whatever the ranks."""
    return 1.0


def _round_trip_factor(world_size: int) -> float:
    """A send/recv round trip between ranks 0 and 1: nccl-tests' sendrecv factor, 1."""
    return 1.0


def _no_payload_factor(world_size: int) -> float:
    """A barrier carries no payload; its bandwidths are reported as zero."""
    return 0.0


@dataclass(frozen=True)
class CollectiveSpec:
    """How one collective is sized and how its bus bandwidth is derived.

    Attributes:
        name: the collective as the CLI names it (``allreduce``, ...).
        bus_factor: ``busbw / algbw`` for a world size (nccl-tests definitions).
        partitioned: True when the size is split across ranks: each rank holds ``size / n``
            (allgather's input, reducescatter's output) and a list of ``n`` such parts.
        list_count: how many lists of ``n`` parts a rank holds (alltoall: an input and an
            output list); only for partitioned collectives.
        has_payload: False for barrier, which moves no tensor (its size is always 0).
    """

    name: str
    bus_factor: Callable[[int], float]
    partitioned: bool = False
    list_count: int = 1
    has_payload: bool = True


COLLECTIVES: Mapping[str, CollectiveSpec] = types.MappingProxyType({
    spec.name: spec for spec in (
        CollectiveSpec("allreduce", _allreduce_factor),
        CollectiveSpec("reduce", _rooted_factor),
        CollectiveSpec("broadcast", _rooted_factor),
        CollectiveSpec("allgather", _partitioned_factor, partitioned=True),
        CollectiveSpec("reducescatter", _partitioned_factor, partitioned=True),
        CollectiveSpec("gather", _partitioned_factor, partitioned=True),
        CollectiveSpec("scatter", _partitioned_factor, partitioned=True),
        CollectiveSpec("alltoall", _partitioned_factor, partitioned=True, list_count=2),
        CollectiveSpec("sendrecv", _round_trip_factor),
        CollectiveSpec("barrier", _no_payload_factor, has_payload=False),
    )
})
"""Every collective the harness can time, by name (read-only)."""


@dataclass(frozen=True)
class MessageLayout:
    """The buffers one rank needs for one (collective, size, world size, dtype) point.

    Attributes:
        elements_per_tensor: length of the single tensor (the part, for partitioned ones).
        list_length: how many parts each tensor list holds (0: the collective takes no list).
        nbytes: the size the row reports: what the collective moves, nccl-tests style.
        list_count: how many such lists a rank holds (alltoall: input and output).
    """

    elements_per_tensor: int
    list_length: int
    nbytes: int
    list_count: int = 0


def message_layout(collective: str, requested_bytes: int, world_size: int,
                   itemsize: int) -> MessageLayout:
    """The buffer shapes for a collective of ``requested_bytes`` at ``world_size`` ranks.

    Args:
        collective: a name of ``COLLECTIVES``.
        requested_bytes: the size asked for on the command line (nccl-tests "size").
        world_size: number of ranks.
        itemsize: bytes per element of the dtype.

    Returns:
        The layout; its ``nbytes`` may be below ``requested_bytes`` (rounded to whole
        elements per rank) or above it (at least one element per rank).

    Raises:
        KeyError: an unknown collective.
        ValueError: a negative size, or a world size or itemsize below 1.
    """
    spec = COLLECTIVES[collective]
    if requested_bytes < 0 or world_size < 1 or itemsize < 1:
        raise ValueError(f"need size >= 0, world size >= 1 and itemsize >= 1, not "
                         f"{requested_bytes}, {world_size}, {itemsize}")
    if not spec.has_payload:
        return MessageLayout(elements_per_tensor=0, list_length=0, nbytes=0)
    if spec.partitioned:
        part = max(1, requested_bytes // (world_size * itemsize))
        return MessageLayout(elements_per_tensor=part, list_length=world_size,
                             nbytes=part * world_size * itemsize, list_count=spec.list_count)
    count = max(1, requested_bytes // itemsize)
    return MessageLayout(elements_per_tensor=count, list_length=0, nbytes=count * itemsize)
