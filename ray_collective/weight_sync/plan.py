"""The plan of a sync: which publisher sends which bytes, cut into which buckets.

Pure arithmetic on the members' layouts (no Ray, no transport), so that every member computes
the same plan from the same descriptions, and the simulator can run it for thousands of
subscribers.

- **The model** is the union of the publishers' tensors. Publishers that all hold the same set
  are *replicas*: the buckets are cut from the whole model and dealt out so that each publisher
  sends about 1/P of the bytes. Publishers whose sets are disjoint are *shards*: each cuts its
  own tensors into buckets and sends them. Anything in between is refused, naming a tensor two
  publishers share and one that only one of them has.
- **Buckets** fuse the small tensors (below ``IN_PLACE_MIN_BYTES``) in name order up to
  ``bucket_bytes``; a larger tensor has buckets of its own, cut into pieces of
  ``bucket_bytes``. A bucket that is one piece of one tensor is sent from and received into
  the tensor's own memory; a fused one goes through a staging buffer on both sides (at most two
  per member and publisher, so that the next bucket can be packed while the last one is in
  flight).
- **Bucket size** (:func:`bucket_size`): about 1/``BUCKETS_PER_MODEL`` of the model, between
  ``MIN_BUCKET_BYTES`` and ``MAX_BUCKET_BYTES``: large enough that a bucket's fixed cost (a
  broadcast's rounds) is small against its bytes, small enough that a pipeline of buckets fills
  the chain between nodes early and the staging buffers stay small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .layout import Layout, TensorSpec

MIN_BUCKET_BYTES = 4 << 20
MAX_BUCKET_BYTES = 32 << 20
BUCKETS_PER_MODEL = 32
"""A model is cut into about this many buckets, within the bounds above."""
IN_PLACE_MIN_BYTES = 1 << 20
"""A tensor this large goes in buckets of its own, moved from and into its memory: packing it
would cost two copies, more than a broadcast's fixed cost."""


class PlanError(ValueError):
    """The publishers' layouts do not make one model; the message says why."""


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + nbytes)`` of the model's tensor number ``tensor``."""

    tensor: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One broadcast of a sync: its segments, in order, sent by publisher ``owner``."""

    index: int
    owner: int
    segments: Tuple[Segment, ...]
    nbytes: int

    @property
    def in_place(self) -> bool:
        """Whether it is one piece of one tensor, moved from and into the tensor's memory."""
        return len(self.segments) == 1


@dataclass(frozen=True)
class SyncPlan:
    """Every member's plan of one model's syncs.

    Attributes:
        tensors: the model's tensors, sorted by name.
        holders: for each tensor, the publishers that hold it.
        replicas: whether the publishers all hold the whole model.
        buckets: every bucket, in the order they are sent.
        bucket_bytes: the size buckets are cut to.
    """

    tensors: Tuple[TensorSpec, ...]
    holders: Tuple[Tuple[int, ...], ...]
    replicas: bool
    buckets: Tuple[Bucket, ...]
    bucket_bytes: int

    @property
    def nbytes(self) -> int:
        """The model's bytes."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def model(self) -> Layout:
        """The model as a layout, what every subscriber must hold."""
        return Layout(self.tensors)

    def buckets_of(self, publisher: int) -> Tuple[Bucket, ...]:
        """The buckets ``publisher`` sends, in order."""
        return tuple(b for b in self.buckets if b.owner == publisher)

    def tensors_of(self, bucket: Bucket) -> Tuple[str, ...]:
        """The names of the tensors ``bucket`` carries bytes of."""
        return tuple(dict.fromkeys(self.tensors[s.tensor].name for s in bucket.segments))


def bucket_size(model_bytes: int) -> int:
    """The size a model of ``model_bytes`` is cut into buckets of (see the module docstring)."""
    per_bucket = -(-model_bytes // BUCKETS_PER_MODEL)
    rounded = -(-per_bucket // (1 << 20)) << 20
    return max(MIN_BUCKET_BYTES, min(MAX_BUCKET_BYTES, rounded))


def _cut(tensors: Sequence[int], specs: Sequence[TensorSpec], bucket_bytes: int,
         in_place_min: int) -> List[Tuple[Segment, ...]]:
    """The buckets' segments for ``tensors`` (indices into ``specs``), in order."""
    buckets: List[Tuple[Segment, ...]] = []
    fused: List[Segment] = []
    fused_bytes = 0
    for index in tensors:
        size = specs[index].nbytes
        if size >= min(in_place_min, bucket_bytes):
            buckets.extend((Segment(index, offset, min(bucket_bytes, size - offset)),)
                           for offset in range(0, size, bucket_bytes))
            continue
        if fused and fused_bytes + size > bucket_bytes:
            buckets.append(tuple(fused))
            fused, fused_bytes = [], 0
        fused.append(Segment(index, 0, size))
        fused_bytes += size
    if fused:
        buckets.append(tuple(fused))
    return buckets


def _holders(publishers: Sequence[Layout]) -> Tuple[Tuple[TensorSpec, ...], List[List[int]]]:
    """The model's tensors and the publishers holding each; PlanError where they disagree."""
    seen = {}
    holders = {}
    for p, layout in enumerate(publishers):
        for spec in layout.tensors:
            first = seen.setdefault(spec.name, (p, spec))
            if first[1] != spec:
                raise PlanError(f"tensor {spec.name!r} is {first[1].text()} in publisher "
                                f"{first[0]} but {spec.text()} in publisher {p}")
            holders.setdefault(spec.name, []).append(p)
    names = sorted(seen)
    return tuple(seen[n][1] for n in names), [holders[n] for n in names]


def make_plan(publishers: Sequence[Layout], bucket_bytes: Optional[int] = None) -> SyncPlan:
    """The plan for publishers holding ``publishers`` (in publisher order).

    Args:
        publishers: each publisher's layout (none with an error).
        bucket_bytes: the size to cut buckets to; None for :func:`bucket_size`'s.

    Returns:
        The plan.

    Raises:
        PlanError: the publishers disagree on a tensor's dtype or shape, or some but not all
            of them hold a tensor that another one holds with others (neither replicas nor
            shards).
    """
    specs, holders = _holders(publishers)
    count = len(publishers)
    replicas = all(len(h) == count for h in holders)
    if not replicas:
        shared = [i for i, h in enumerate(holders) if len(h) > 1]
        if shared:
            i = shared[0]
            absent = sorted(set(range(count)) - set(holders[i]))
            raise PlanError(
                f"tensor {specs[i].name!r} is held by publishers {holders[i]} but not by "
                f"{absent}: publishers must all hold the same tensors (replicas) or disjoint "
                f"ones (shards)")
    size = bucket_bytes or bucket_size(sum(s.nbytes for s in specs))
    buckets: List[Bucket] = []
    if replicas:
        load = [0] * count
        for segments in _cut(range(len(specs)), specs, size, IN_PLACE_MIN_BYTES):
            nbytes = sum(s.nbytes for s in segments)
            owner = min(range(count), key=lambda p: (load[p], p))
            load[owner] += nbytes
            buckets.append(Bucket(len(buckets), owner, segments, nbytes))
    else:
        for p in range(count):
            mine = [i for i, h in enumerate(holders) if h == [p]]
            for segments in _cut(mine, specs, size, IN_PLACE_MIN_BYTES):
                buckets.append(Bucket(len(buckets), p, segments,
                                      sum(s.nbytes for s in segments)))
    return SyncPlan(specs, tuple(tuple(h) for h in holders), replicas, tuple(buckets), size)
