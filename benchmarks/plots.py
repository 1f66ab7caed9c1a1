"""PNG plots of a sweep, with matplotlib's Agg backend (no display needed).

Three kinds, one line per backend, log scales, file names derived from the point:

- ``latency_<collective>_<n>ranks.png``: p50 latency against message size;
- ``busbw_<collective>_<n>ranks.png``: bus bandwidth against message size;
- ``time_<collective>_<size>.png``: p50 latency against world size (only when the sweep has
  more than one world size).

A plot with fewer than two points on every line says nothing and is not drawn. When the rows
hold both timing modes, each backend has a solid line for back-to-back and a dashed one, in
the same colour, for barrier-before-every-call.

``python -m benchmarks.plots OUT_DIR RUN.json [RUN.json ...]`` draws the plots of several runs'
rows together (e.g. a sweep at 2-8 ranks and one at 64 ranks with fewer iterations).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .report import format_size, row_timing
from .worker import BARRIER

DPI = 80
"""Modest resolution: the PNGs are committed with the results page."""


def _file_size(nbytes: int) -> str:
    return format_size(nbytes).replace(" ", "")


Line = Tuple[str, str]
"""A plotted line: (backend, timing mode)."""


def _series(rows: Sequence[dict], x_key: str, y: Callable[[dict], Optional[float]]
            ) -> Dict[Line, List[Tuple[float, float]]]:
    """Per (backend, timing) in first-seen order, its (x, y) points with a value, sorted by x."""
    lines: Dict[Line, List[Tuple[float, float]]] = {}
    for row in rows:
        line = lines.setdefault((row["backend"], row_timing(row)), [])
        value = y(row)
        if value is not None and value > 0:
            line.append((row[x_key], value))
    return {key: sorted(points) for key, points in lines.items()}


def draw(path: pathlib.Path, title: str, x_label: str, y_label: str,
          lines: Dict[Line, List[Tuple[float, float]]], x_ticks: Sequence[float],
          x_tick_labels: Sequence[str], log_x: bool) -> Optional[pathlib.Path]:
    """Draw one figure; None (and no file) when no line has two points."""
    if not any(len(points) >= 2 for points in lines.values()):
        return None
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    figure, axes = pyplot.subplots(figsize=(6.4, 4.0))
    colours = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    backends = list(dict.fromkeys(backend for backend, _ in lines))
    both_timings = len({timing for _, timing in lines}) > 1
    for (backend, timing), points in lines.items():
        if points:
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o",
                      color=colours[backends.index(backend) % len(colours)],
                      linestyle="--" if both_timings and timing == BARRIER else "-",
                      label=f"{backend} ({timing})" if both_timings else backend)
    if log_x:
        axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(list(x_ticks))
    axes.set_xticklabels(list(x_tick_labels), rotation=30 if len(x_ticks) > 6 else 0)
    axes.minorticks_off()
    axes.set_title(title)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    pyplot.close(figure)
    return path


def write_plots(rows: Sequence[dict], directory: pathlib.Path) -> List[pathlib.Path]:
    """Write every plot the rows support into ``directory`` (created if missing).

    Args:
        rows: the sweep's rows as dicts (``dataclasses.asdict`` of ``rows.Row``, or the
            JSON file's ``rows``).
        directory: where the PNGs go.

    Returns:
        The files written, in order.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written: List[pathlib.Path] = []
    collectives = list(dict.fromkeys(row["collective"] for row in rows))
    world_sizes = sorted({row["world_size"] for row in rows})
    for collective in collectives:
        of_collective = [row for row in rows if row["collective"] == collective]
        for world_size in world_sizes:
            at_size = [row for row in of_collective if row["world_size"] == world_size]
            sizes = sorted({row["nbytes"] for row in at_size})
            labels = [format_size(size) for size in sizes]
            title = f"{collective}, {world_size} ranks"
            written.append(draw(
                directory / f"latency_{collective}_{world_size}ranks.png", title,
                "message size", "p50 latency (s)", _series(at_size, "nbytes",
                                                           lambda row: row["p50_s"]),
                sizes, labels, log_x=True))
            written.append(draw(
                directory / f"busbw_{collective}_{world_size}ranks.png", title,
                "message size", "bus bandwidth (GB/s)",
                _series(at_size, "nbytes", lambda row: row["busbw_gbps"]), sizes, labels,
                log_x=True))
        if len(world_sizes) > 1:
            for nbytes in sorted({row["nbytes"] for row in of_collective}):
                of_size = [row for row in of_collective if row["nbytes"] == nbytes]
                present = sorted({row["world_size"] for row in of_size})
                written.append(draw(
                    directory / f"time_{collective}_{_file_size(nbytes)}.png",
                    f"{collective}, {format_size(nbytes)}", "ranks", "p50 latency (s)",
                    _series(of_size, "world_size", lambda row: row["p50_s"]), present,
                    [str(size) for size in present], log_x=True))
    return [path for path in written if path is not None]


def main(argv: Optional[List[str]] = None) -> int:
    """Write the plots of the rows of every JSON file given into one directory.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots",
                                     description="PNG plots from sweep JSON files.")
    parser.add_argument("directory", type=pathlib.Path, help="where the PNGs go")
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="JSON files of sweeps")
    arguments = parser.parse_args(argv)
    rows = [row for run in arguments.runs for row in json.loads(run.read_text())["rows"]]
    written = write_plots(rows, arguments.directory)
    print(f"wrote {len(written)} plots into {arguments.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
