"""The flight recorder: each rank's last calls of a group, and the counts its metrics export.

A group's :class:`FlightRecorder` keeps the last ``trace_size`` calls of its rank (default 256,
``RAY_COLLECTIVE_TRACE_SIZE``; 0 turns it off) in a ring: per call its sequence number, its
:class:`CallShape` (collective, dtype, shape, bytes, algorithm, peers: the same object for every
call of one shape), its start, its end and its outcome (``"ok"`` or the error's class name).
``get_collective_trace`` returns them, oldest first, and every error that breaks the group
carries them (``CollectiveError.trace``), so a failure can be read after the fact.

It must stay cheap: a group runs a call of a known shape in about a microsecond, and recording
one costs two clock reads and one tuple in the ring. Where metrics are exported, each call also
counts itself on its shape (``CallShape.calls``, one integer increment); the metrics flush
(``metrics``) reads those counts and the ring from its own thread every few seconds, and the
caller's thread never waits for it. Only the caller's thread writes a count, only the flush
writes ``CallShape.flushed``, so neither needs a lock; the one lock guards the rare folding of
shapes (below) against a flush.

Shapes are interned per recorder (one object per distinct collective, dtype, shape, algorithm
and peers). A program whose shapes never repeat would grow the table forever: past
``MAX_SHAPES`` the recorder folds every shape's unflushed counts into per-collective totals,
forgets the shapes and tells the group to drop the caches that hold them (``on_fold``), so
that no count lands on a forgotten shape.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .errors import ArgumentValueError

TRACE_SIZE_VARIABLE = "RAY_COLLECTIVE_TRACE_SIZE"
"""How many calls each rank's flight recorder keeps (0: none, the recorder is off)."""
METRICS_VARIABLE = "RAY_COLLECTIVE_METRICS"
"""``0`` turns the metrics off (they are on by default where Ray can export them)."""
DEFAULT_TRACE_SIZE = 256
MAX_TRACE_SIZE = 1 << 20
DEFAULT_FLUSH_INTERVAL_S = 5.0
MAX_SHAPES = 4096
"""Distinct call shapes a recorder keeps before it folds their counts (see the module)."""

OK = "ok"
"""The outcome of a call that completed."""

clock = time.perf_counter
"""The recorder's clock: the cheapest here (a trace converts it to Unix time)."""


@dataclass(frozen=True)
class ObservingOptions:
    """What a group records about its calls.

    Attributes:
        trace_size: calls the flight recorder keeps (0: it is off, and so are the call
            metrics).
        metrics: export metrics through Ray's metrics API (where Ray runs in the process).
        flush_interval_s: seconds between two hand-overs of the counts to Ray.
    """

    trace_size: int = DEFAULT_TRACE_SIZE
    metrics: bool = True
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S

    @classmethod
    def from_environment(cls) -> "ObservingOptions":
        """The options ``RAY_COLLECTIVE_TRACE_SIZE`` and ``RAY_COLLECTIVE_METRICS`` ask for.

        Returns:
            The options (the defaults for unset variables).

        Raises:
            ArgumentValueError: a variable holds something else than the values it takes.
        """
        text = os.environ.get(TRACE_SIZE_VARIABLE, "").strip()
        size = DEFAULT_TRACE_SIZE
        if text:
            try:
                size = int(text)
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_TRACE_SIZE:
                raise ArgumentValueError(
                    f"{TRACE_SIZE_VARIABLE}={text!r}: set it to the number of calls each rank "
                    f"keeps in its flight recorder, 0 to {MAX_TRACE_SIZE} (0 turns it off)")
        switch = os.environ.get(METRICS_VARIABLE, "").strip().lower()
        if switch not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ArgumentValueError(
                f"{METRICS_VARIABLE}={switch!r}: set it to 0 to turn the metrics off, or 1 (or "
                f"leave it unset) to export them through Ray's metrics")
        return cls(size, switch not in ("0", "false", "no", "off"))


@dataclass(eq=False, slots=True)
class CallShape:
    """What every call of one shape shares, as the recorder and the metrics see it.

    Attributes:
        collective: the collective's name.
        dtype: the tensor's dtype name ("" without a tensor).
        shape: the tensor's shape.
        nbytes: the tensor's bytes (the first tensor of a list where the call takes lists).
        algorithm: the algorithm the backend runs it with ("" where it does not say).
        peers: the ranks this rank exchanges messages with in it.
        calls: calls of this shape so far, counted where metrics are exported.
        flushed: of those, how many the metrics have handed to Ray.
    """

    collective: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    algorithm: str
    peers: Tuple[int, ...]
    calls: int = field(default=0, init=False)
    flushed: int = field(default=0, init=False)

    def key(self) -> Tuple:
        """What makes two shapes the same."""
        return (self.collective, self.dtype, self.shape, self.algorithm, self.peers)


class FlightRecorder:
    """One rank's record of its calls on one group.

    Args:
        group_name: the group.
        rank: this rank.
        backend: the backend's name (metrics label it).
        size: calls kept (at least 1).
        counting: count calls per shape for the metrics.
        on_fold: called after the shapes were folded (see the module), so that the group drops
            the caches that hold them.

    Attributes:
        errors: failed calls by error class name, counted where metrics are exported.
        retired: per collective, ``[calls, bytes]`` of shapes folded before the metrics read
            them.
    """

    def __init__(self, group_name: str, rank: int, backend: str, size: int, counting: bool,
                 on_fold: Callable[[], None] = lambda: None):
        self.group_name = group_name
        self.rank = rank
        self.backend = backend
        self.size = size
        self.counting = counting
        self.errors: Dict[str, int] = {}
        self.retired: Dict[str, List[int]] = {}
        self.lock = threading.Lock()
        self._on_fold = on_fold
        self._shapes: Dict[Tuple, CallShape] = {}
        # A deque drops its oldest entry itself.
        self._ring: Deque[tuple] = collections.deque(maxlen=size)
        self._append = self._ring.append
        self._unix_offset = time.time() - clock()
        # Chosen once: the call that counts costs one increment more than the one that does not.
        self.finished = self._finished_counting if counting else self._finished

    # ------------------------------------------------------------------ the caller's thread

    def shape(self, collective: str, dtype: str, shape: Tuple[int, ...], nbytes: int,
              algorithm: str = "", peers: Tuple[int, ...] = ()) -> CallShape:
        """The recorder's one object for calls of this shape (made at its first call).

        Args:
            collective, dtype, shape, nbytes, algorithm, peers: as in :class:`CallShape`.

        Returns:
            The shape.
        """
        key = (collective, dtype, shape, algorithm, peers)
        known = self._shapes.get(key)
        if known is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._fold()
            known = self._shapes[key] = CallShape(collective, dtype, shape, nbytes, algorithm,
                                                  peers)
        return known

    def _finished(self, shape: CallShape, seq: int, start: float) -> None:
        """Record that call ``seq`` of ``shape``, started at ``start`` (``perf_counter``),
        completed now."""
        self._append((shape, seq, start, clock(), OK))

    def _finished_counting(self, shape: CallShape, seq: int, start: float) -> None:
        self._append((shape, seq, start, clock(), OK))
        shape.calls += 1

    def failed(self, shape: CallShape, seq: int, start: float, error: BaseException) -> None:
        """Record that call ``seq`` of ``shape``, started at ``start``, failed now with
        ``error`` (it counts among the calls and the errors of its kind)."""
        kind = type(error).__name__
        self._append((shape, seq, start, clock(), kind))
        if self.counting:
            shape.calls += 1
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def _fold(self) -> None:
        with self.lock:
            for shape in self._shapes.values():
                unflushed = shape.calls - shape.flushed
                if unflushed:
                    totals = self.retired.setdefault(shape.collective, [0, 0])
                    totals[0] += unflushed
                    totals[1] += unflushed * shape.nbytes
                shape.flushed = shape.calls
            self._shapes = {}
        self._on_fold()

    # ------------------------------------------------------------------ any thread

    def entries(self, after: Optional[tuple] = None) -> List[tuple]:
        """The ring's entries, oldest first: all of them, or those recorded after ``after``.

        Args:
            after: an entry returned before (entries are told apart by identity); when it has
                left the ring, every entry is newer.

        Returns:
            The entries, each ``(shape, seq, start, end, outcome)``.
        """
        ring = _copy(self._ring)
        if after is not None:
            for index in range(len(ring) - 1, -1, -1):
                if ring[index] is after:
                    return ring[index + 1:]
        return ring

    def shapes(self) -> List[CallShape]:
        """The shapes known now (the metrics read their counts)."""
        return list(self._shapes.values())

    def trace(self) -> List[Dict[str, Any]]:
        """The calls kept, oldest first, as dictionaries.

        Returns:
            One dict per call, with ``seq``, ``collective``, ``dtype``, ``shape``, ``nbytes``,
            ``algorithm``, ``peers``, ``start`` and ``end`` (Unix time, seconds),
            ``duration_s`` and ``outcome`` (``"ok"`` or the error's class name).
        """
        offset = self._unix_offset
        return [{"seq": seq, "collective": shape.collective, "dtype": shape.dtype,
                 "shape": list(shape.shape), "nbytes": shape.nbytes,
                 "algorithm": shape.algorithm, "peers": list(shape.peers),
                 "start": start + offset, "end": end + offset, "duration_s": end - start,
                 "outcome": outcome}
                for shape, seq, start, end, outcome in self.entries()]


def _copy(ring: Deque[tuple]) -> List[tuple]:
    """The ring's entries, oldest first, while the caller's thread may append to it."""
    while True:
        try:
            return list(ring)
        except RuntimeError:  # "deque mutated during iteration": it moved on, look again
            continue


def shape_of(recorder: FlightRecorder, collective: str, view: Optional[Any],
             details: Tuple[str, Tuple[int, ...]]) -> CallShape:
    """The recorder's shape of a call on tensors like ``view`` (a ``TensorView``, or None).

    Args:
        recorder: the recorder.
        collective: the collective's name.
        view: the call's tensor (or first tensor of its list), None for none.
        details: ``(algorithm, peers)`` as the backend describes the call.

    Returns:
        The shape.
    """
    if view is None:
        return recorder.shape(collective, "", (), 0, *details)
    count = 1
    for extent in view.shape:
        count *= extent
    return recorder.shape(collective, view.dtype_name, tuple(view.shape),
                          count * view.wire_dtype.itemsize, *details)
