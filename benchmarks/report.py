"""The sweep's output: a terminal table, a progress bar, and the JSON file (plots: ``plots``)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import List, Optional, Sequence, TextIO

from .rows import Row, SweepResult
from .worker import BACK_TO_BACK, BARRIER, PACED

_BINARY_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))

_COLUMNS = ("collective", "ranks", "size", "timing", "backend", "p50", "p75", "p90", "p95",
            "algbw GB/s", "busbw GB/s", "speed-up", "CPU/call max", "CPU/call med", "peak RSS",
            "procs", "iters")
_RIGHT_ALIGNED = frozenset(_COLUMNS) - {"collective", "timing", "backend"}

TIMING_MEANINGS = {
    BACK_TO_BACK: "back-to-back: one barrier, then the calls in a loop; an iteration is the "
                  "time from one call's return to the next's",
    BARRIER: "barrier: the backend's barrier before every call; an iteration is the call alone",
    PACED: "paced: one barrier, then a sleep before every call (a training step's compute); "
           "an iteration is the call alone",
}
"""What each timing mode measures, in one line (the table's legend, the results page)."""


CPU_MEANING = ("CPU/call: a rank process's CPU time (user + system) over the timed calls / "
               "their number; max: the busiest rank, med: the median over ranks")
"""What the CPU columns mean, in one line (the table's legend, the results page)."""


def row_timing(row: dict) -> str:
    """The timing mode of a JSON row; ``barrier`` for files from before the modes existed,
    when the harness timed every call after a barrier.

    Args:
        row: a row of a ``python -m benchmarks --json`` file (or ``asdict`` of a ``Row``).

    Returns:
        A name of ``worker.TIMINGS``.
    """
    return row.get("timing") or BARRIER


def format_size(nbytes: int) -> str:
    """A byte count in the largest binary unit that divides it exactly (``64 MiB``, ``8 B``).

    Args:
        nbytes: bytes.

    Returns:
        The text.
    """
    for unit_bytes, unit in _BINARY_UNITS:
        if nbytes >= unit_bytes and nbytes % unit_bytes == 0:
            return f"{nbytes // unit_bytes} {unit}"
    return f"{nbytes} B"


def format_seconds(seconds: Optional[float]) -> str:
    """A latency in µs, ms or s with three to four significant digits ('-' for None).

    Args:
        seconds: the latency.

    Returns:
        The text.
    """
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def _format_number(value: Optional[float], suffix: str = "") -> str:
    return "-" if value is None else f"{value:.3g}{suffix}"


def format_mib(nbytes: Optional[int]) -> str:
    """Bytes as whole MiB (``'-'`` for None).

    Args:
        nbytes: bytes.

    Returns:
        The text, e.g. ``"281 MiB"``.
    """
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def format_ranks(world_size: int, nodes: Optional[int] = None, short: bool = False) -> str:
    """How many ranks, and over how many nodes if they were spread over nodes.

    Args:
        world_size: number of ranks.
        nodes: the nodes they were spread over evenly, or None.
        short: the table's cell (``4``, ``2×2``) instead of the text (``4 ranks``,
            ``2 nodes × 2 ranks``).

    Returns:
        The text.
    """
    if nodes is None:
        return str(world_size) if short else f"{world_size} ranks"
    per_node = world_size // nodes
    return f"{nodes}×{per_node}" if short else f"{nodes} nodes × {per_node} ranks"


def _cells(row: Row) -> List[str]:
    return [row.collective, format_ranks(row.world_size, row.nodes, short=True),
            format_size(row.nbytes), row.timing,
            row.backend,
            format_seconds(row.p50_s), format_seconds(row.p75_s), format_seconds(row.p90_s),
            format_seconds(row.p95_s), _format_number(row.algbw_gbps),
            _format_number(row.busbw_gbps), _format_number(row.speedup, "x"),
            format_seconds(row.cpu_per_call_max_s), format_seconds(row.cpu_per_call_median_s),
            format_mib(row.peak_rss_bytes), "-" if row.processes is None else f"+{row.processes}",
            str(row.iterations)]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, errors on their own lines, and a legend.

    Args:
        rows: the sweep's rows.

    Returns:
        The table.
    """
    table = [list(_COLUMNS)] + [_cells(row) for row in rows]
    widths = [max(len(line[index]) for line in table) for index in range(len(_COLUMNS))]

    def render(cells: Sequence[str]) -> str:
        return "  ".join(cell.rjust(width) if name in _RIGHT_ALIGNED else cell.ljust(width)
                         for name, cell, width in zip(_COLUMNS, cells, widths)).rstrip()

    lines = [render(table[0]), render(["-" * width for width in widths])]
    for row, cells in zip(rows, table[1:]):
        lines.append(render(cells))
        if row.error:
            lines.append(f"    error: {row.error}")
        if row.note:
            lines.append(f"    note: {row.note}")
    baselines = sorted({row.baseline for row in rows if row.baseline})
    legend = ["p50..p95: latency of one call, the slowest rank's, over the timed iterations."]
    legend.extend(f"timing {TIMING_MEANINGS[timing]}."
                  for timing in dict.fromkeys(row.timing for row in rows))
    legend += [
              "algbw = size / p50, busbw = algbw x bus factor (nccl-tests); GB/s = 10^9 B/s.",
              f"{CPU_MEANING}.",
              "peak RSS: largest peak resident memory of a process running a rank (the rank "
              "actors are shared by ray, torch, gloo and ray-plain; mpi4py has its own "
              "processes).",
              "procs: processes the backend started besides the rank actors."]
    legend.extend(f"speed-up = {name} p50 / backend p50 in the same timing mode (> 1: faster "
                  f"than {name}; equal to busbw / {name} busbw)." for name in baselines)
    return "\n".join(lines + [""] + legend)


def _progress_part(row: Row) -> str:
    """``"ray 45.1 µs (3.1x)"``, ``"gloo failed"`` or ``"gloo n/a"``."""
    if row.error:
        return f"{row.backend} failed"
    if row.note:
        return f"{row.backend} n/a"
    ratio = "" if row.speedup is None or row.backend == row.baseline else \
        f" ({row.speedup:.2f}x)"
    return f"{row.backend} {format_seconds(row.p50_s)}{ratio}"


def format_progress(rows: Sequence[Row]) -> str:
    """One line for a point that has just been measured.

    Args:
        rows: the point's rows (one per timing mode and backend).

    Returns:
        ``"allreduce 4 ranks 8 B: ray 45.1 µs (3.1x), gloo 140.2 µs"``, errors marked; with
        several timing modes, one group per mode led by its name
        (``"...: back-to-back: ray 45.1 µs, ...; barrier: ray 60.2 µs, ..."``).
    """
    first = rows[0]
    by_timing: dict = {}
    for row in rows:
        by_timing.setdefault(row.timing, []).append(_progress_part(row))
    if len(by_timing) == 1:
        text = ", ".join(*by_timing.values())
    else:
        text = "; ".join(f"{timing}: {', '.join(parts)}" for timing, parts in by_timing.items())
    return (f"{first.collective} {format_ranks(first.world_size, first.nodes)} "
            f"{format_size(first.nbytes)}: {text}")


def to_json(result: SweepResult) -> str:
    """The result as JSON text: ``{"metadata": ..., "rows": [...], "notes": [...]}``.

    Args:
        result: the sweep's result.

    Returns:
        Indented JSON.
    """
    document = {"metadata": result.metadata, "rows": [asdict(row) for row in result.rows],
                "notes": list(result.notes)}
    return json.dumps(document, indent=1)


class ProgressBar:
    """A one-line text progress bar on a stream, redrawn in place on a terminal.

    On a terminal the line is rewritten (``\\r``); otherwise (a log file) every update is its
    own line, so the log shows each point's result.

    Args:
        total: how many points the sweep has.
        stream: where to draw (stderr).
        width: characters of the bar itself.
    """

    def __init__(self, total: int, stream: TextIO, width: int = 24) -> None:
        self._total = max(total, 1)
        self._done = 0
        self._stream = stream
        self._width = width
        self._started = time.monotonic()
        self._in_place = stream.isatty()

    def render(self, message: str) -> str:
        """The bar's text after ``self._done`` points, with the time left and ``message``.

        Args:
            message: the latest point's summary.

        Returns:
            ``"[#####-------]  5/12  1m20s left  allreduce 4 ranks 8 B: ..."``.
        """
        filled = self._width * self._done // self._total
        elapsed = time.monotonic() - self._started
        left = elapsed / self._done * (self._total - self._done) if self._done else 0.0
        return (f"[{'#' * filled}{'-' * (self._width - filled)}] {self._done}/{self._total}  "
                f"{int(left) // 60}m{int(left) % 60:02d}s left  {message}")

    def advance(self, message: str) -> None:
        """Count one more point and redraw.

        Args:
            message: the point's summary (``format_progress``).
        """
        self._done += 1
        text = self.render(message)
        if self._in_place:
            self._stream.write("\r\033[K" + text + ("\n" if self._done >= self._total else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
