"""The groups' metrics, handed to Ray's own metrics API (``ray.util.metrics``) in batches.

Ray exports them wherever its metrics go (each node's Prometheus endpoint, the dashboard,
Grafana), with its own labels (node, worker) beside ours (``group``, ``rank``, ``collective``,
``backend``, and ``kind`` for errors). Ray names them with its ``ray_`` prefix:

- ``ray_collective_calls_total``: calls, failed ones included;
- ``ray_collective_bytes_total``: bytes of the calls' tensors (the first of a list);
- ``ray_collective_errors_total``: failed calls, by error class (``kind``);
- ``ray_collective_call_seconds``: a histogram of call durations. Ray takes a histogram one
  observation at a time (a call into Ray's core, about 2 us here), so it is fed from the
  flight recorder's ring: every call while a rank makes fewer calls per flush than the ring
  holds (``RAY_COLLECTIVE_TRACE_SIZE``, 256: 51 calls a second at the 5 s interval), else the
  last ones of each interval (its count is then below the calls').

No Ray call is made per collective: a call only counts itself on its shape (``recorder``), and
one :class:`MetricsFlush` per process (the group registry's) reads the counts from its own
thread every ``flush_interval_s`` and hands the differences to Ray. The thread is a daemon
(it never keeps a process alive), starts with the first group that exports metrics and stops
with the last; with ``RAY_COLLECTIVE_METRICS=0``, or where Ray cannot export metrics (not
initialized in the process, or installed without its metrics agent: ``ray[default]``), there is
neither thread nor counting.

The labels are bounded: a process is one rank of each of its groups (``rank`` adds no series
beyond the ``WorkerId`` Ray puts on each already, save one per shrink or grow that renumbers
it), ``collective`` and ``kind`` take a fixed set of values, and ``group`` takes the names of
at most ``MAX_GROUP_LABELS`` groups per process: a process that makes groups of ever new
names (one per step) labels those beyond as ``OTHER_GROUPS``, rather than growing the
cluster's metrics without end.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Dict, List, Optional

from .recorder import FlightRecorder

LATENCY_BOUNDARIES_S = [1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3,
                        1.0, 3.0, 10.0, 30.0, 100.0]
"""The histogram's bucket bounds, in seconds: half decades from a microsecond to 100 s."""

CALLS, BYTES, ERRORS, SECONDS = ("collective_calls", "collective_bytes", "collective_errors",
                                 "collective_call_seconds")
"""The names handed to Ray (which adds ``ray_`` and, to counters, ``_total``)."""

MAX_GROUP_LABELS = 64
"""How many group names one process's metrics carry; the groups named after them share
``OTHER_GROUPS``."""

OTHER_GROUPS = "_other"


AGENT_PACKAGES = ("aiohttp", "aiohttp_cors", "prometheus_client")
"""Packages without which Ray starts its nodes' agents minimal, without metrics (the
dependencies of ``ray[default]`` that Ray itself looks for)."""


def exportable() -> bool:
    """Whether Ray can export metrics from this process: it is initialized here, and installed
    with its metrics agent (``ray[default]``). Nothing is imported to find out (Ray's own check
    imports the dashboard's dependencies, megabytes this process would then hold)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return all(importlib.util.find_spec(name) is not None for name in AGENT_PACKAGES)


class MetricsFlush:
    """Hands the counts of every recorder added to it to Ray, from a thread of its own.

    Args:
        interval_s: seconds between two hand-overs.
    """

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._recorders: List[FlightRecorder] = []
        self._read_up_to: Dict[int, Optional[tuple]] = {}
        self._errors_seen: Dict[int, Dict[str, int]] = {}
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ray_metrics = None
        self._group_labels: Dict[str, str] = {}

    def group_label(self, group_name: str) -> str:
        """The ``group`` label of ``group_name``'s metrics: its name (as :func:`label` spells
        it) for the first ``MAX_GROUP_LABELS`` names this process exports, else
        ``OTHER_GROUPS``."""
        with self._lock:
            found = self._group_labels.get(group_name)
            if found is None:
                found = label(group_name) if len(self._group_labels) < MAX_GROUP_LABELS \
                    else OTHER_GROUPS
                self._group_labels[group_name] = found
            return found

    def add(self, recorder: FlightRecorder) -> None:
        """Export ``recorder``'s counts from now on (starts the thread if it is not running)."""
        with self._lock:
            self._recorders.append(recorder)
            self._read_up_to[id(recorder)] = None
            self._errors_seen[id(recorder)] = {}
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ray_collective-metrics")
                self._thread.start()

    def remove(self, recorder: FlightRecorder) -> None:
        """Hand ``recorder``'s last counts to Ray and forget it; the thread stops with the last
        recorder. Leaving a group never fails for its metrics."""
        try:
            self.flush(recorder)
        except Exception:  # noqa: BLE001 - Ray shutting down: those counts are lost, the group goes
            pass
        with self._lock:
            if recorder in self._recorders:
                self._recorders.remove(recorder)
            self._read_up_to.pop(id(recorder), None)
            self._errors_seen.pop(id(recorder), None)
            thread = self._thread if not self._recorders else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval_s)

    @property
    def running(self) -> bool:
        """Whether the flush thread runs."""
        return self._thread is not None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                recorders = list(self._recorders)
            for recorder in recorders:
                try:
                    self.flush(recorder)
                except Exception:  # noqa: BLE001 - Ray shutting down: the next flush retries
                    pass

    def flush(self, recorder: FlightRecorder) -> None:
        """Hand what ``recorder`` counted since the last flush to Ray."""
        with self._flushing:  # the thread's flush and a leaving group's, one at a time
            self._flush(recorder)

    def _flush(self, recorder: FlightRecorder) -> None:
        calls, sent_bytes, errors, seconds = self._metrics()
        tags_of = _Tags(recorder, self.group_label(recorder.group_name))
        with recorder.lock:
            per_collective: Dict[str, List[int]] = {}
            for shape in recorder.shapes():
                fresh = shape.calls - shape.flushed
                if fresh:
                    totals = per_collective.setdefault(shape.collective, [0, 0])
                    totals[0] += fresh
                    totals[1] += fresh * shape.nbytes
                    shape.flushed += fresh
            for collective, (count, nbytes) in recorder.retired.items():
                totals = per_collective.setdefault(collective, [0, 0])
                totals[0] += count
                totals[1] += nbytes
            recorder.retired.clear()
        for collective, (count, nbytes) in per_collective.items():
            if count:
                calls.inc(count, tags_of(collective))
            if nbytes:
                sent_bytes.inc(nbytes, tags_of(collective))
        seen = self._errors_seen.get(id(recorder))
        if seen is not None:
            for kind, count in dict(recorder.errors).items():
                if count > seen.get(kind, 0):
                    errors.inc(count - seen.get(kind, 0), dict(tags_of.common(), kind=kind))
                    seen[kind] = count
        if id(recorder) in self._read_up_to:
            entries = recorder.entries(self._read_up_to[id(recorder)])
            if entries:
                self._read_up_to[id(recorder)] = entries[-1]
            for shape, _, start, end, _ in entries:
                seconds.observe(end - start, tags_of(shape.collective))

    def _metrics(self):
        """Ray's metric objects, made at the first flush (in the process whose Ray exports
        them)."""
        if self._ray_metrics is None:
            from ray.util.metrics import Counter, Histogram
            keys = ("group", "rank", "collective", "backend")
            self._ray_metrics = (
                Counter(CALLS, "collective calls (failed ones included)", keys),
                Counter(BYTES, "bytes of the collective calls' tensors", keys),
                Counter(ERRORS, "failed collective calls, by error class",
                        ("group", "rank", "backend", "kind")),
                Histogram(SECONDS, "duration of collective calls, in seconds (sampled beyond "
                          "the flight recorder's size per flush)", LATENCY_BOUNDARIES_S, keys))
        return self._ray_metrics


def label(text: str) -> str:
    """``text`` as a label Ray takes: ASCII (a group's name may be any text), other characters
    escaped as Python does (``\\u00e9``)."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


class _Tags:
    """The labels of one flush of one recorder's metrics, one dict per collective (made once).

    Args:
        recorder: the group's recorder (its rank is read now: a shrink or grow renumbers it).
        group: the group's label (``MetricsFlush.group_label``).
    """

    def __init__(self, recorder: FlightRecorder, group: str):
        self._common = {"group": group, "rank": str(recorder.rank),
                        "backend": recorder.backend}
        self._made: Dict[str, Dict[str, str]] = {}

    def common(self) -> Dict[str, str]:
        """The labels every metric of the recorder carries."""
        return dict(self._common)

    def __call__(self, collective: str) -> Dict[str, str]:
        tags = self._made.get(collective)
        if tags is None:
            tags = self._made[collective] = dict(self._common, collective=collective)
        return tags
