"""The sweep's output: a terminal table, one progress line per point, and the JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import List, Optional, Sequence

from .harness import Row, SweepResult

_BINARY_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))

_COLUMNS = ("collective", "ranks", "size", "backend", "p50", "p90", "algbw GB/s", "busbw GB/s",
            "speed-up", "iters")
_RIGHT_ALIGNED = frozenset({"ranks", "size", "p50", "p90", "algbw GB/s", "busbw GB/s",
                            "speed-up", "iters"})


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


def _cells(row: Row) -> List[str]:
    return [row.collective, str(row.world_size), format_size(row.nbytes), row.backend,
            format_seconds(row.p50_s), format_seconds(row.p90_s),
            _format_number(row.algbw_gbps), _format_number(row.busbw_gbps),
            _format_number(row.speedup, "x"), str(row.iterations)]


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
    baselines = sorted({row.baseline for row in rows if row.baseline})
    legend = ["p50/p90: latency of one call, the slowest rank's, over the timed iterations.",
              "algbw = size / p50, busbw = algbw x bus factor (nccl-tests); GB/s = 10^9 B/s."]
    legend.extend(f"speed-up = {name} p50 / backend p50 (> 1: faster than {name}; equal to "
                  f"busbw / {name} busbw)." for name in baselines)
    return "\n".join(lines + [""] + legend)


def format_progress(rows: Sequence[Row]) -> str:
    """One line for a point that has just been measured.

    Args:
        rows: the point's rows (one per backend).

    Returns:
        ``"allreduce 4 ranks 8 B: ray 45.1 µs (3.1x), gloo 140.2 µs"``, errors marked.
    """
    first = rows[0]
    parts = []
    for row in rows:
        if row.error:
            parts.append(f"{row.backend} failed")
            continue
        ratio = "" if row.speedup is None or row.backend == row.baseline else \
            f" ({row.speedup:.2f}x)"
        parts.append(f"{row.backend} {format_seconds(row.p50_s)}{ratio}")
    return (f"{first.collective} {first.world_size} ranks {format_size(first.nbytes)}: "
            + ", ".join(parts))


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
