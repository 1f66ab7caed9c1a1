"""Scale: fit a cost model to measured runs, extrapolate every algorithm to hundreds of ranks.

```
python -m benchmarks.scale --json MEASURED.json[=ALGORITHM] [--json ...] --plots DIR
    [--out benchmarks/results/scale.json] [--ranks 400,1000,4096] [--collective allreduce]
    [--bytes 8,1M,64M] [--backend ray] [--timing barrier] [--json-before-rule PATH ...]
```

Reads the rows of ``python -m benchmarks ... --json`` files for one backend, collective and
timing mode (``barrier`` by default: the earlier files it is fitted to, which cannot be measured
again, were all timed with a barrier before every call; rows without a mode count as that),
works out which algorithm ran at each measured point, gets that algorithm's rounds, messages and
bytes from the simulator, fits the model of :mod:`benchmarks.scale_model` to the measured
p50s, and predicts every algorithm of the collective at the measured world sizes (on the
measuring machine's cores) and at ``--ranks`` (one rank per core: see the model's docstring
for what that assumes). Prints a table, writes JSON and one log-log PNG per message size.

Which algorithm ran at a measured point: the file's ``=ALGORITHM`` suffix if given (for runs
made with ``RAY_COLLECTIVE_ALGORITHM``), else the row's ``algorithm`` field if it has one, else
the selector asked as the backend asks it: ``oversubscribed`` when the world size exceeds the
file's usable cores. Files given with ``--json-before-rule`` were measured before the selector
learnt that rule (commit a8e8976, 04:22 UTC on 2026-11-22: ``issue3-*.json``,
``default-8B.json``); for them it is asked with ``oversubscribed=False``, as it then behaved.

Exit status: 0 on success, 2 for bad arguments or unusable input (missing file, bad JSON, no
rows of the backend and collective).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ray_collective.algorithms.catalog import lookup, names
from ray_collective.algorithms.selector import select
from ray_collective.sim.runner import COLLECTIVES

from .cli import at_least, choice, comma_list, parse_size
from .report import row_timing
from .worker import BARRIER, TIMINGS
from .scale_costs import call_costs
from .scale_model import PARAMETERS, PLAIN_PARAMETERS, Fit, features, fit_non_negative, predict

EXTRAPOLATION_ASSUMPTION = (
    "extrapolated points assume one rank per core, each with this machine's measured "
    "per-round, per-message and per-byte costs over shared memory: a cluster's compute with "
    "one node's transport (no network, no node hierarchy, no object store)")

PARTITIONED_COLLECTIVES = ("allgather", "reducescatter", "gather", "scatter", "alltoall")
"""Collectives whose size is the whole list: each rank's block is size / ranks."""

_SUFFIXES = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}


class InputError(ValueError):
    """Unusable input: the CLI prints it and exits with status 2."""


@dataclass(frozen=True)
class InputFile:
    """One measured JSON file.

    Attributes:
        path: the file.
        algorithm: the algorithm all its rows ran (forced when measured), or None.
        oversubscription_rule: whether the selector had its oversubscribed-node rule then.
    """

    path: str
    algorithm: Optional[str] = None
    oversubscription_rule: bool = True


@dataclass(frozen=True)
class ScaleOptions:
    """What ``python -m benchmarks.scale`` reads, fits and writes.

    Attributes:
        inputs: the measured files.
        plots_dir: where the PNGs go (None: no plots).
        out_path: the JSON output (None: none).
        extrapolate_ranks: world sizes predicted with one rank per core.
        collective: the collective modelled.
        sizes: message sizes in bytes (empty: those measured).
        backend: the rows' backend.
        timing: the rows' timing mode, of ``worker.TIMINGS``.
    """

    inputs: Tuple[InputFile, ...]
    plots_dir: Optional[str] = None
    out_path: Optional[str] = None
    extrapolate_ranks: Tuple[int, ...] = (400, 1000, 4096)
    collective: str = "allreduce"
    sizes: Tuple[int, ...] = ()
    backend: str = "ray"
    timing: str = BARRIER


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured row the model is fitted to.

    Attributes:
        source: the file it came from.
        world_size, nbytes, dtype: the point.
        cores: usable cores of the machine that measured it.
        algorithm: the algorithm that ran (see the module's docstring).
        p50_s: its median latency.
    """

    source: str
    world_size: int
    nbytes: int
    dtype: str
    cores: int
    algorithm: str
    p50_s: float


def format_size(nbytes: int) -> str:
    """``64M`` for 64 MiB, ``8B`` for 8 bytes: the inverse of ``cli.parse_size``."""
    for suffix, factor in sorted(_SUFFIXES.items(), key=lambda item: -item[1]):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{suffix}"
    return f"{nbytes}B"


def elements_per_rank(collective: str, nbytes: int, dtype: str, ranks: int) -> int:
    """The simulator's ``count`` for a row's size, which is counted as nccl-tests count it.

    Args:
        collective: the collective.
        nbytes: the row's size: the tensor of allreduce, reduce and broadcast; the whole
            gathered output or input list of the partitioned collectives.
        dtype: numpy dtype name.
        ranks: world size.

    Returns:
        Elements of one rank's tensor (one block for the partitioned collectives), at least 1,
        and 0 for barrier.
    """
    if collective == "barrier":
        return 0
    itemsize = np.dtype(dtype).itemsize
    if collective in PARTITIONED_COLLECTIVES:
        return max(1, nbytes // (ranks * itemsize))
    return max(1, nbytes // itemsize)


def _measured_algorithm(collective: str, row: dict, source: InputFile, cores: int) -> str:
    if source.algorithm:
        return source.algorithm
    if row.get("algorithm"):
        return row["algorithm"]
    oversubscribed = source.oversubscription_rule and row["world_size"] > cores
    return select(collective,
                  elements_per_rank(collective, row["nbytes"], row["dtype"], row["world_size"]),
                  np.dtype(row["dtype"]).itemsize, row["world_size"],
                  oversubscribed=oversubscribed).name


def load_points(options: ScaleOptions) -> List[MeasuredPoint]:
    """The measured points of ``options.backend`` and ``options.collective`` in every input.

    Args:
        options: the run.

    Returns:
        The points, in file and row order.

    Raises:
        InputError: a file is missing or not a benchmark JSON, or no usable row is found.
    """
    points: List[MeasuredPoint] = []
    for source in options.inputs:
        path = source.path
        if source.algorithm is not None:
            lookup(options.collective, source.algorithm)
        try:
            with open(path) as handle:
                document = json.load(handle)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: cannot read benchmark JSON ({exc})") from None
        if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
            raise InputError(f"{path}: not the JSON of 'python -m benchmarks --json' (no rows)")
        metadata = document.get("metadata") or {}
        cores = int(metadata.get("usable_cpus") or metadata.get("cpu_count") or os.cpu_count())
        for row in document["rows"]:
            if (row.get("backend") != options.backend or row.get("collective") != options.collective
                    or row_timing(row) != options.timing or row.get("error")
                    or not row.get("p50_s")):
                continue
            points.append(MeasuredPoint(
                path, int(row["world_size"]), int(row["nbytes"]), row.get("dtype", "float32"),
                cores, _measured_algorithm(options.collective, row, source, cores),
                float(row["p50_s"])))
    if not points:
        raise InputError(f"no measured {options.collective} rows of backend "
                         f"'{options.backend}' timed {options.timing} in "
                         f"{', '.join(s.path for s in options.inputs)}")
    return points


def _regressors(collective: str, algorithm: str, ranks: int, nbytes: int, dtype: str,
                cores: int) -> np.ndarray:
    count = elements_per_rank(collective, nbytes, dtype, ranks)
    return features(call_costs(collective, algorithm, ranks, count, dtype), ranks, cores)


def fit_points(collective: str, points: Sequence[MeasuredPoint]) -> Tuple[Fit, Fit]:
    """The model fitted to the points, and the plain α–β fit for comparison.

    Args:
        collective: the collective measured.
        points: the measured points.

    Returns:
        (full model fit, plain α–β fit).
    """
    design = np.array([_regressors(collective, p.algorithm, p.world_size, p.nbytes, p.dtype,
                                   p.cores) for p in points])
    seconds = [p.p50_s for p in points]
    full = fit_non_negative(design, seconds, PARAMETERS)
    plain = fit_non_negative(design[:, :len(PLAIN_PARAMETERS)], seconds, PLAIN_PARAMETERS)
    return full, plain


def model_algorithms(collective: str) -> Tuple[str, ...]:
    """The collective's algorithms the model covers: all but the node-aware ones, which need a
    rank→node map and inter-node costs that one machine cannot measure (on one node the
    selector never picks them)."""
    return tuple(n for n in names(collective) if not lookup(collective, n).node_aware)


def predicted_seconds(fit: Fit, collective: str, algorithm: str, ranks: int, nbytes: int,
                      dtype: str, cores: int) -> Optional[float]:
    """The model's time for one call, or None where the algorithm cannot run on ``ranks``.

    Args:
        fit: the fitted model.
        collective, algorithm: what runs.
        ranks: world size.
        nbytes: message size.
        dtype: numpy dtype name.
        cores: cores the ranks share (``ranks`` for one rank per core).

    Returns:
        Seconds, or None.
    """
    if lookup(collective, algorithm).power_of_two_only and ranks & (ranks - 1):
        return None
    return predict(fit, _regressors(collective, algorithm, ranks, nbytes, dtype, cores))


def build_predictions(options: ScaleOptions, fit: Fit, points: Sequence[MeasuredPoint]) -> List[dict]:
    """Every algorithm's predicted time at every size, measured world size and extrapolated one.

    Args:
        options: the run.
        fit: the fitted model.
        points: the measured points (their world sizes, dtype and cores).

    Returns:
        One dict per (size, world size, placement) with ``seconds_by_algorithm``, the selector's
        pick, the model's fastest and, at measured points, the measured time.
    """
    dtype = points[0].dtype
    cores = max(p.cores for p in points)
    sizes = options.sizes or tuple(sorted({p.nbytes for p in points}))
    measured_sizes = sorted({p.world_size for p in points})
    rows = []
    for nbytes in sizes:
        placements = ([(ranks, min(cores, ranks), "this machine") for ranks in measured_sizes]
                      + [(ranks, ranks, "one rank per core") for ranks in options.extrapolate_ranks])
        for ranks, sharing_cores, placement in placements:
            seconds = {name: predicted_seconds(fit, options.collective, name, ranks, nbytes,
                                               dtype, sharing_cores)
                       for name in model_algorithms(options.collective)}
            available = {name: value for name, value in seconds.items() if value is not None}
            picked = select(options.collective,
                            elements_per_rank(options.collective, nbytes, dtype, ranks),
                            np.dtype(dtype).itemsize, ranks,
                            oversubscribed=ranks > sharing_cores).name
            measured = [p for p in points if p.world_size == ranks and p.nbytes == nbytes]
            rows.append({
                "nbytes": nbytes, "world_size": ranks, "cores": sharing_cores,
                "placement": placement, "seconds_by_algorithm": seconds,
                "selector_pick": picked, "model_fastest": min(available, key=available.get),
                "measured": [{"algorithm": p.algorithm, "p50_s": p.p50_s, "source": p.source}
                             for p in measured]})
    return rows


def _cell(seconds: Optional[float]) -> str:
    if seconds is None:
        return f"{'-':>10}"
    return f"{seconds * 1e3:>10.3g}"


def format_report(options: ScaleOptions, points: Sequence[MeasuredPoint], full: Fit,
                  plain: Fit, predictions: Sequence[dict]) -> str:
    """The fit, its residuals and the predictions as text tables (times in ms)."""
    lines = [f"cost model of {options.collective} ({options.backend} backend), fitted to "
             f"{len(points)} measured p50s", "", "fitted coefficients:"]
    units = {"alpha_s": ("α per round", 1e6, "µs"), "beta_s_per_byte": ("β per byte", 1e9, "ns"),
             "mu_s_per_message": ("μ per message (CPU)", 1e6, "µs"),
             "nu_s_per_byte": ("ν per byte (CPU)", 1e9, "ns")}
    for name, value in full.coefficients.items():
        label, factor, unit = units[name]
        lines.append(f"  {label:<22}{value * factor:>10.4g} {unit}")
    lines.append(f"  rms relative error {full.rms_relative_error:.1%}; plain α–β fit "
                 f"(α={plain.coefficients['alpha_s'] * 1e6:.4g} µs, "
                 f"β={plain.coefficients['beta_s_per_byte'] * 1e9:.4g} ns/B): "
                 f"{plain.rms_relative_error:.1%}")
    lines += ["", f"{'ranks':>6}{'size':>6} {'algorithm':<20}{'measured ms':>12}{'model ms':>10}"
                  f"{'error':>8}{'α–β ms':>10}"]
    for point, residual, plain_residual in zip(points, full.relative_residuals,
                                               plain.relative_residuals):
        lines.append(f"{point.world_size:>6}{format_size(point.nbytes):>6} {point.algorithm:<20}"
                     f"{point.p50_s * 1e3:>12.4g}{point.p50_s * (1 + residual) * 1e3:>10.4g}"
                     f"{residual:>+8.0%}{point.p50_s * (1 + plain_residual) * 1e3:>10.4g}")
    algorithms = model_algorithms(options.collective)
    for nbytes in sorted({row["nbytes"] for row in predictions}):
        rows = [row for row in predictions if row["nbytes"] == nbytes]
        lines += ["", f"{options.collective} {format_size(nbytes)}, ms: 'here' = the model on "
                      f"the measuring machine's {max(p.cores for p in points)} cores, "
                      f"'1/core' = one rank per core",
                  f"{'':<20}" + "".join(
                      f"{str(row['world_size']) + (' here' if row['placement'] == 'this machine' else ' 1/core'):>12}"
                      for row in rows)]
        measured_cells = []
        for row in rows:
            measured = [m["p50_s"] for m in row["measured"]]
            measured_cells.append(f"{min(measured) * 1e3:>12.3g}" if measured else f"{'':>12}")
        lines.append(f"{'measured p50 (min)':<20}" + "".join(measured_cells))
        for name in algorithms:
            lines.append(f"{name:<20}" + "".join(
                f"{_cell(row['seconds_by_algorithm'][name]):>12}" for row in rows))
        lines.append(f"{'selector picks':<20}" + "".join(
            f"{_short(row['selector_pick']):>12}" for row in rows))
        lines.append(f"{'model fastest':<20}" + "".join(
            f"{_short(row['model_fastest']):>12}" for row in rows))
    lines += ["", f"note: {EXTRAPOLATION_ASSUMPTION}."]
    return "\n".join(lines)


def _short(name: str) -> str:
    return {"recursive_doubling": "rec.doubl.", "reduce_broadcast": "red+bcast",
            "rabenseifner": "rabenseif."}.get(name, name)


def write_plots(options: ScaleOptions, fit: Fit, points: Sequence[MeasuredPoint],
                predictions: Sequence[dict]) -> List[str]:
    """One log-log PNG per message size: measured points and every algorithm's model.

    Dashed lines: the model on the measuring machine's cores, over the measured world sizes
    (what was fitted). Solid lines: one rank per core, up to the largest ``--ranks``.

    Args:
        options: the run (``plots_dir`` must be set).
        fit: the fitted model.
        points: the measured points.
        predictions: from :func:`build_predictions` (for the sizes).

    Returns:
        The paths written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(options.plots_dir, exist_ok=True)
    dtype = points[0].dtype
    cores = max(p.cores for p in points)
    measured_max = max(p.world_size for p in points)
    top = max((*options.extrapolate_ranks, measured_max))
    grid_here = sorted({*[2 ** k for k in range(1, 13) if 2 ** k <= measured_max],
                        *[p.world_size for p in points]})
    grid_cluster = sorted({*[2 ** k for k in range(1, 13) if 2 ** k <= top],
                           *options.extrapolate_ranks, *grid_here})
    algorithms = model_algorithms(options.collective)
    colors = dict(zip(algorithms, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    written = []
    for nbytes in sorted({row["nbytes"] for row in predictions}):
        figure, axes = plt.subplots(figsize=(8, 5.5))
        for name in algorithms:
            for grid, sharing, style, label in (
                    (grid_here, lambda p: min(p, cores), "--", f"{name} ({cores} cores)"),
                    (grid_cluster, lambda p: p, "-", f"{name} (1 rank/core)")):
                xs, ys = [], []
                for ranks in grid:
                    value = predicted_seconds(fit, options.collective, name, ranks, nbytes,
                                              dtype, sharing(ranks))
                    if value is not None:
                        xs.append(ranks)
                        ys.append(value)
                axes.plot(xs, ys, style, color=colors[name], label=label, linewidth=1.4)
        for point in points:
            if point.nbytes == nbytes:
                axes.plot(point.world_size, point.p50_s, "o", color=colors.get(point.algorithm, "k"),
                          markeredgecolor="black", markersize=8)
        axes.plot([], [], "o", color="white", markeredgecolor="black",
                  label="measured p50 (fill = algorithm)")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("world size (ranks)")
        axes.set_ylabel("seconds per call")
        axes.set_title(f"{options.collective} {format_size(nbytes)} ({options.backend} backend): "
                       f"measured on {cores} cores, model extrapolated\n"
                       "solid: one rank per core (a cluster's compute, one node's transport)",
                       fontsize=10)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        path = os.path.join(options.plots_dir,
                            f"scale-{options.collective}-{format_size(nbytes)}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def _input(text: str) -> InputFile:
    path, _, algorithm = text.partition("=")
    return InputFile(path, algorithm.strip() or None)


def _input_before_rule(text: str) -> InputFile:
    return InputFile(text, None, oversubscription_rule=False)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``python -m benchmarks.scale``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description="Fit a latency/bandwidth/CPU cost model to measured benchmark JSON and "
                    "extrapolate every algorithm to large world sizes.")
    parser.add_argument("--json", dest="inputs", type=_input, action="append", default=[],
                        metavar="PATH[=ALGORITHM]",
                        help="a 'python -m benchmarks --json' file; '=ALGORITHM' when its runs "
                             "forced one (repeatable)")
    parser.add_argument("--json-before-rule", dest="inputs", type=_input_before_rule,
                        action="append", metavar="PATH",
                        help="a file measured before the selector's oversubscribed-node rule "
                             "(commit a8e8976) (repeatable)")
    parser.add_argument("--plots", metavar="DIR", help="write one PNG per message size here")
    parser.add_argument("--out", metavar="PATH", help="write the fit and predictions as JSON")
    parser.add_argument("--ranks", type=comma_list(at_least(2)), default=(400, 1000, 4096),
                        help="world sizes to extrapolate to, one rank per core "
                             "(default 400,1000,4096)")
    parser.add_argument("--collective", default="allreduce",
                        help="the collective to model (default allreduce)")
    parser.add_argument("--bytes", type=comma_list(at_least(1, parse_size)), default=(),
                        help="message sizes to predict, e.g. 8,1M,64M (default: those measured)")
    parser.add_argument("--backend", default="ray", help="the rows' backend (default ray)")
    parser.add_argument("--timing", type=choice(TIMINGS), default=BARRIER,
                        help="the rows' timing mode (default barrier, that of the earlier "
                             "files the model is fitted to)")
    return parser


def parse_options(argv: Optional[Sequence[str]] = None) -> ScaleOptions:
    """The options from the command line.

    Raises:
        SystemExit: bad arguments (status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.inputs:
        parser.error("give at least one --json or --json-before-rule file")
    if args.collective not in COLLECTIVES:
        parser.error(f"unknown collective {args.collective!r}")
    return ScaleOptions(inputs=tuple(args.inputs), plots_dir=args.plots, out_path=args.out,
                        extrapolate_ranks=args.ranks, collective=args.collective,
                        sizes=args.bytes, backend=args.backend, timing=args.timing)


def run(options: ScaleOptions, command: str) -> Tuple[str, dict]:
    """Load, fit, predict; write plots.

    Args:
        options: the run.
        command: the command line, for the JSON.

    Returns:
        (text report, JSON document).

    Raises:
        InputError: unusable input.
        ValueError: a forced algorithm that does not exist.
    """
    points = load_points(options)
    full, plain = fit_points(options.collective, points)
    predictions = build_predictions(options, full, points)
    plots = write_plots(options, full, points, predictions) if options.plots_dir else []
    document = {
        "metadata": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds"),
                     "command": command, "options": asdict(options),
                     "model": "t = alpha*R + beta*B + mu*s*max(M/c, Mmax) + nu*max(V/c, B); R "
                              "rounds, B and Mmax the most bytes and messages a rank sends, "
                              "M and V messages and bytes sent by all ranks, "
                              "c = min(p, cores), s = max(1, p/cores)",
                     "extrapolation_assumption": EXTRAPOLATION_ASSUMPTION,
                     "plots": plots},
        "fit": {"coefficients": full.coefficients, "rms_relative_error": full.rms_relative_error,
                "plain_alpha_beta": {"coefficients": plain.coefficients,
                                     "rms_relative_error": plain.rms_relative_error},
                "points": [{**asdict(point), "relative_residual": residual,
                            "plain_relative_residual": plain_residual}
                           for point, residual, plain_residual in
                           zip(points, full.relative_residuals, plain.relative_residuals)]},
        "predictions": predictions}
    return format_report(options, points, full, plain, predictions), document


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run from the command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on bad arguments or unusable input.
    """
    options = parse_options(argv)
    command = shlex.join(["python", "-m", "benchmarks.scale",
                          *(sys.argv[1:] if argv is None else argv)])
    try:
        report, document = run(options, command)
    except (InputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    if options.out_path:
        os.makedirs(os.path.dirname(options.out_path) or ".", exist_ok=True)
        with open(options.out_path, "w") as handle:
            json.dump(document, handle, indent=1)
        print(f"wrote {options.out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
