"""spacy-ray's parameter server against collectives: the design document's tables, on this machine.

``python -m benchmarks.param_server`` runs the example of ``examples/parameter_server`` (a thinc
MLP of 1.06 M parameters on scikit-learn's digits) and writes one JSON file, the markdown
tables and a plot:

- **Scaling** (the design document's two tables): every variant at 1, 2, 4, 8, 16 workers for
  ``--steps`` updates, ``--trials`` times (trial ``i`` uses seed ``i``: initial weights and data
  order), each worker taking ``--per-worker-batch`` rows per update (so the global batch grows
  with the workers, as in spacy-ray). Variants are interleaved inside each (trial, workers)
  block, on one pool of worker actors reused by every run.
- **Accuracy at equal samples**: at ``--accuracy-workers`` workers and a fixed global batch,
  every variant and the single-process reference (``local``, the whole global batch in one
  process) for ``--accuracy-steps`` updates, ``--accuracy-seeds`` seeds; rank 0 measures test
  accuracy every ``--eval-every`` updates, which also gives the time to ``--target-accuracy``.

``--from-json RUN.json`` redraws the tables and the plot from a file alone; given several files
(``A.json,B.json``), it joins them into one table. The whole table at 1000 updates takes hours
on a small machine; it can be run in parts, each a trial (``--first-trial K --trials 1``) or a
set of worker counts, the accuracy runs in one of them (``--accuracy-steps 0`` in the others),
and joined afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .cli import at_least, choice, comma_list, module_parser, rerun_command

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_WORKERS = (1, 2, 4, 8, 16)
SCALING_VARIANTS = ("ps-async", "ps-sync", "allreduce-flat", "rs-ag", "allreduce-per-array",
                    "gloo-allreduce-flat", "gloo-rs-ag", "torch-allreduce-flat", "torch-rs-ag")
"""The variants of the scaling tables, in column order (``local`` is only the reference)."""
BASELINE = "ps-async"
"""What the speed-ups are relative to: spacy-ray as it is."""
GLOO_PEERS = {"allreduce-flat": ("gloo-allreduce-flat", "torch-allreduce-flat"),
              "rs-ag": ("gloo-rs-ag", "torch-rs-ag")}
"""This library's variants and the Gloo runs of the same scheme they must beat."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.param_server``.

    Returns:
        The parser.
    """
    parser = module_parser("benchmarks.param_server", __doc__)
    add = parser.add_argument
    add("--variants", type=comma_list(choice(SCALING_VARIANTS)), default=SCALING_VARIANTS,
        help="variants of the scaling tables (default: all)")
    add("--workers", type=comma_list(at_least(1)), default=DEFAULT_WORKERS,
        help="worker counts (default 1,2,4,8,16)")
    add("--steps", type=at_least(1), default=1000, help="updates per scaling run (1000)")
    add("--trials", type=at_least(1), default=3, help="scaling trials (3)")
    add("--first-trial", type=at_least(0), default=0,
        help="the first trial's number, and seed (0): a table run in parts")
    add("--per-worker-batch", type=at_least(1), default=16, help="rows per worker per update")
    add("--width", type=at_least(1), default=384, help="hidden units per layer (384)")
    add("--depth", type=at_least(1), default=8, help="hidden layers (8)")
    add("--accuracy-workers", type=at_least(2), default=4,
        help="workers of the accuracy runs (4)")
    add("--accuracy-global-batch", type=at_least(1), default=128,
        help="global batch of the accuracy runs (128)")
    add("--accuracy-steps", type=at_least(0), default=150,
        help="updates of the accuracy runs (150; 0 skips them)")
    add("--accuracy-seeds", type=at_least(1), default=3, help="seeds of the accuracy runs (3)")
    add("--eval-every", type=at_least(1), default=10,
        help="accuracy runs: rank 0 measures test accuracy every this many updates (10)")
    add("--target-accuracy", type=float, default=0.95,
        help="the accuracy whose time is reported (0.95)")
    add("--timeout", type=float, default=3600.0, help="seconds any phase of a run may take")
    add("--json", type=pathlib.Path, help="write every run here")
    add("--plot", type=pathlib.Path, help="write the throughput plot (PNG) here")
    add("--markdown", type=pathlib.Path, help="also write the tables here")
    add("--from-json", type=comma_list(pathlib.Path),
        help="only print the tables (and plot) of this file, or of these files joined")
    add("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


# ------------------------------------------------------------------ running


def _summarise(result: Any) -> dict:
    """One run's record for the JSON file: per-worker means and the run's totals."""
    reports, options = result.reports, result.options
    steps, workers = options.steps, options.workers
    accepted = sum(r.grads_accepted for r in reports)
    dropped = sum(r.grads_dropped for r in reports)
    updates = [count for r in reports for count in r.updates_per_key.values()]
    return {
        "variant": options.variant, "workers": workers, "steps": steps,
        "seed": options.task.seed, "per_worker_batch": options.task.per_worker_batch,
        "seconds": result.seconds,
        "compute_s_per_update": float(np.mean([r.compute_seconds for r in reports])) / steps,
        "communication_s_per_update":
            float(np.mean([r.communication_seconds for r in reports])) / steps,
        "serve_s_per_update": float(np.mean([r.serve_seconds for r in reports])) / steps,
        "bus_bytes_per_update": float(np.mean([r.bus_bytes for r in reports])) / steps,
        "actor_bytes_per_update": float(np.mean([r.bytes_sent for r in reports])) / steps,
        "actor_calls_per_update": float(np.mean([r.actor_calls for r in reports])) / steps,
        "grads_accepted": accepted, "grads_dropped": dropped,
        "stale_share": dropped / (accepted + dropped) if accepted + dropped else 0.0,
        "updates_per_key_per_step": float(np.mean(updates)) / steps if updates else None,
        "final_accuracy": reports[0].final_accuracy,
        "accuracy_curve": [list(point) for point in reports[0].accuracy_curve],
        "first_loss": reports[0].losses[0], "last_loss": reports[0].losses[-1],
        "parameters": reports[0].parameters,
    }


def _plan(args: argparse.Namespace) -> List[Tuple[str, Any]]:
    """Every run, in execution order: (kind, RunOptions)."""
    from examples.parameter_server.task import TaskConfig
    from examples.parameter_server.training import RunOptions
    runs: List[Tuple[str, Any]] = []
    for trial in range(args.first_trial, args.first_trial + args.trials):
        task = TaskConfig(width=args.width, depth=args.depth,
                          per_worker_batch=args.per_worker_batch, seed=trial)
        for workers in args.workers:
            for variant in args.variants:
                runs.append(("scaling", RunOptions(variant, workers, args.steps, task,
                                                   timeout_s=args.timeout)))
    if args.accuracy_steps:
        workers, batch = args.accuracy_workers, args.accuracy_global_batch
        if batch % workers:
            raise ValueError(f"--accuracy-global-batch {batch} is not a multiple of "
                             f"--accuracy-workers {workers}")
        for seed in range(args.accuracy_seeds):
            base = TaskConfig(width=args.width, depth=args.depth, seed=seed)
            runs.append(("accuracy", RunOptions(
                "local", 1, args.accuracy_steps,
                dataclasses.replace(base, per_worker_batch=batch),
                eval_every=args.eval_every, timeout_s=args.timeout)))
            for variant in args.variants:
                runs.append(("accuracy", RunOptions(
                    variant, workers, args.accuracy_steps,
                    dataclasses.replace(base, per_worker_batch=batch // workers),
                    eval_every=args.eval_every, timeout_s=args.timeout)))
    return runs


def run_all(args: argparse.Namespace, command: str) -> dict:
    """Run the plan on one pool of worker actors; returns the JSON document.

    Args:
        args: the parsed command line.
        command: the command that reruns it, recorded in the document.

    Returns:
        ``{"meta": ..., "runs": [...]}``.
    """
    import ray

    from examples.parameter_server.task import load_digits
    from examples.parameter_server.training import run_variant, start_workers
    plan = _plan(args)
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH", "")]))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": path}})
    records = []
    try:
        data = ray.put(load_digits())
        pool = start_workers(max(options.workers for _, options in plan))
        for serial, (kind, options) in enumerate(plan):
            started = time.monotonic()
            record = dict(_summarise(run_variant(options, data, pool, serial)), kind=kind)
            records.append(record)
            if not args.quiet:
                print(f"[{serial + 1}/{len(plan)}] {kind} {options.variant} "
                      f"x{options.workers} seed {options.task.seed}: "
                      f"{record['seconds']:.2f} s (wall {time.monotonic() - started:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    return {"meta": _meta(args, command), "runs": records}


def _meta(args: argparse.Namespace, command: str) -> dict:
    import ray
    import thinc
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "ray": ray.__version__, "numpy": np.__version__, "thinc": thinc.__version__,
            "cpus": os.cpu_count(), "command": command,
            "options": {key: (str(value) if isinstance(value, pathlib.Path) else value)
                        for key, value in vars(args).items()}}
    try:
        meta["load_average"] = os.getloadavg()
    except OSError:
        pass
    return meta


# ------------------------------------------------------------------ tables


def _runs(document: dict, kind: str) -> List[dict]:
    return [run for run in document["runs"] if run["kind"] == kind]


def _group(runs: Iterable[dict]) -> Dict[Tuple[str, int], List[dict]]:
    groups: Dict[Tuple[str, int], List[dict]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["workers"]), []).append(run)
    return groups


def _mean_std(values: Sequence[float]) -> Tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _present(groups: dict, workers: Sequence[int], variants: Sequence[str]) -> List[str]:
    return [v for v in variants if any((v, n) in groups for n in workers)]


def scaling_tables(document: dict) -> str:
    """The runtime, speed-up, scalability and per-update tables of the scaling runs.

    Args:
        document: the JSON document.

    Returns:
        Markdown.
    """
    runs = _runs(document, "scaling")
    if not runs:
        return ""
    groups = _group(runs)
    workers = sorted({run["workers"] for run in runs})
    variants = _present(groups, workers, SCALING_VARIANTS)
    steps = runs[0]["steps"]

    def seconds(variant: str, n: int) -> Optional[Tuple[float, float]]:
        found = groups.get((variant, n))
        return _mean_std([run["seconds"] for run in found]) if found else None

    trials = sorted({len(group) for group in groups.values()})
    trial_count = (f"{trials[0]} trial{'s' if trials[0] > 1 else ''}" if trials[0] == trials[-1]
                   else f"{trials[0]}–{trials[-1]} trials, each cell's count in the JSON")
    out = [f"Runtime of {steps} updates (s, mean ± std over {trial_count}):", "",
           _table(["workers"] + variants, (
               [str(n)] + [f"{s[0]:.2f} ± {s[1]:.2f}" if (s := seconds(v, n)) else "–"
                           for v in variants] for n in workers)), ""]
    if BASELINE in variants:
        out += [f"Speed-up over `{BASELINE}` (its time / the variant's time):", "",
                _table(["workers"] + [v for v in variants if v != BASELINE], (
                    [str(n)] + [f"{seconds(BASELINE, n)[0] / s[0]:.2f}x"
                                if (s := seconds(v, n)) and seconds(BASELINE, n) else "–"
                                for v in variants if v != BASELINE] for n in workers)), ""]
    if 1 in workers:
        out += ["Absolute scalability n·T1/Tn (each variant against its own 1-worker time):", "",
                _table(["workers"] + variants, (
                    [str(n)] + [f"{n * seconds(v, 1)[0] / s[0]:.2f}"
                                if (s := seconds(v, n)) and seconds(v, 1) else "–"
                                for v in variants] for n in workers if n > 1)), ""]
    out += ["Per update and worker (means over workers and trials): compute ms / communication "
            "ms / bytes sent / actor calls:", ""]
    rows = []
    for n in workers:
        for v in variants:
            found = groups.get((v, n))
            if not found:
                continue
            mean = {key: float(np.mean([run[key] for run in found])) for key in (
                "compute_s_per_update", "communication_s_per_update", "serve_s_per_update",
                "bus_bytes_per_update", "actor_bytes_per_update", "actor_calls_per_update",
                "stale_share")}
            per_key = [run["updates_per_key_per_step"] for run in found
                       if run["updates_per_key_per_step"] is not None]
            is_ps = v.startswith("ps-")
            sent = mean["actor_bytes_per_update"] if is_ps else mean["bus_bytes_per_update"]
            rows.append([str(n), v, f"{mean['compute_s_per_update'] * 1e3:.1f}",
                         f"{mean['communication_s_per_update'] * 1e3:.1f}",
                         f"{mean['serve_s_per_update'] * 1e3:.1f}" if is_ps else "–",
                         f"{sent / 2**20:.2f} MiB",
                         f"{mean['actor_calls_per_update']:.1f}",
                         f"{100 * mean['stale_share']:.1f} %" if is_ps else "–",
                         f"{np.mean(per_key):.2f}" if is_ps and per_key else "–"])
    out += [_table(["workers", "variant", "compute ms", "comm ms", "serving ms",
                    "bytes sent", "actor calls", "stale grads", "updates/key/step"], rows), ""]
    out += _targets(groups, workers)
    return "\n".join(out)


def _targets(groups: dict, workers: Sequence[int]) -> List[str]:
    """The issue's communication targets, checked on the measured means."""
    def comm(variant: str, n: int) -> Optional[float]:
        found = groups.get((variant, n))
        return float(np.mean([run["communication_s_per_update"] + run["serve_s_per_update"]
                              for run in found])) if found else None

    lines = ["Communication per update, the parameter server (`ps-async`, its serving "
             "included) over each collective variant (target: >= 5x at 8 and 16 workers); and "
             "each Gloo run over this library's run of the same scheme (target: > 1x):", ""]
    rows = []
    for n in workers:
        if n == 1:
            continue
        cells = [str(n)]
        for variant in ("allreduce-flat", "rs-ag", "allreduce-per-array"):
            ps, mine = comm(BASELINE, n), comm(variant, n)
            cells.append(f"{ps / mine:.1f}x" if ps and mine else "–")
        for variant, peers in GLOO_PEERS.items():
            mine = comm(variant, n)
            for peer in peers:
                theirs = comm(peer, n)
                cells.append(f"{theirs / mine:.2f}x" if theirs and mine else "–")
        rows.append(cells)
    header = ["workers", "PS / allreduce-flat", "PS / rs-ag", "PS / per-array",
              "ray.util gloo / allreduce-flat", "torch gloo / allreduce-flat",
              "ray.util gloo / rs-ag", "torch gloo / rs-ag"]
    return lines + [_table(header, rows), ""]


LATE_EVALUATIONS = 5
"""How many of the last accuracy evaluations the steadier accuracy column averages."""


def _late_accuracy(run: dict) -> float:
    """The mean test accuracy of a run's last ``LATE_EVALUATIONS`` evaluations (or final)."""
    late = [point[2] for point in run["accuracy_curve"][-LATE_EVALUATIONS:]]
    return float(np.mean(late)) if late else run["final_accuracy"]


def _time_to(curve: Sequence[Sequence[float]], target: float) -> Optional[float]:
    for _, seconds, accuracy in curve:
        if accuracy >= target:
            return seconds
    return None


def accuracy_table(document: dict) -> str:
    """Test accuracy at equal samples and the time to the target accuracy.

    Args:
        document: the JSON document.

    Returns:
        Markdown.
    """
    runs = _runs(document, "accuracy")
    if not runs:
        return ""
    options = document["meta"]["options"]
    target = options["target_accuracy"]
    groups = _group(runs)
    reference = [run for run in runs if run["variant"] == "local"]
    local_mean = float(np.mean([run["final_accuracy"] for run in reference]))
    local_late = float(np.mean([100 * _late_accuracy(run) for run in reference])) / 100
    order = ["local"] + [v for v in SCALING_VARIANTS if any(k[0] == v for k in groups)]
    rows = []
    for variant in order:
        found = [run for key, group in groups.items() if key[0] == variant for run in group]
        accuracy = _mean_std([100 * run["final_accuracy"] for run in found])
        late = _mean_std([100 * _late_accuracy(run) for run in found])
        times = [_time_to(run["accuracy_curve"], target) for run in found]
        reached = [t for t in times if t is not None]
        rows.append([variant, str(found[0]["workers"]),
                     f"{accuracy[0]:.2f} ± {accuracy[1]:.2f}",
                     f"{accuracy[0] - 100 * local_mean:+.2f}",
                     f"{late[0]:.2f} ± {late[1]:.2f}",
                     f"{late[0] - 100 * local_late:+.2f}",
                     f"{np.mean(reached):.2f}" if reached else "not reached",
                     f"{len(reached)}/{len(times)}"])
    run = runs[0]
    samples = options["accuracy_global_batch"] * options["accuracy_steps"]
    return "\n".join([
        f"Test accuracy after {options['accuracy_steps']} updates of a global batch of "
        f"{options['accuracy_global_batch']} ({samples} samples, "
        f"{len(reference)} seeds), and seconds to {100 * target:.0f} % (rank 0 measures "
        f"every {options['eval_every']} updates; its evaluation time is left out):", "",
        _table(["variant", "workers", "final accuracy %", "vs local (points)",
                f"last {LATE_EVALUATIONS} evaluations %", "vs local (points)",
                f"s to {100 * target:.0f} %", "seeds reaching it"], rows), "",
        f"The final accuracy of one step swings by ±2 points on 360 test images; the mean of the "
        f"last {LATE_EVALUATIONS} evaluations is the steadier comparison.", "",
        f"Model: {run['parameters']:,} parameters."])


def plot_throughput(document: dict, path: pathlib.Path) -> None:
    """Samples per second against workers, one line per variant (scaling runs).

    Args:
        document: the JSON document.
        path: the PNG to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = _runs(document, "scaling")
    groups = _group(runs)
    workers = sorted({run["workers"] for run in runs})
    figure, axes = plt.subplots(figsize=(8, 5))
    for variant in _present(groups, workers, SCALING_VARIANTS):
        points = [(n, float(np.mean([n * r["per_worker_batch"] * r["steps"] / r["seconds"]
                                     for r in groups[(variant, n)]])))
                  for n in workers if (variant, n) in groups]
        style = "--" if variant.startswith(("gloo-", "torch-")) else "-"
        if variant.startswith("ps-"):
            style = ":"
        axes.plot(*zip(*points), style, marker="o", label=variant)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(workers, [str(n) for n in workers])
    axes.set_xlabel("workers (one actor each, all on this 2-core machine)")
    axes.set_ylabel("training samples per second")
    axes.set_title("MLP (1.06 M parameters) on digits: throughput against workers")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def join_documents(documents: Sequence[dict]) -> dict:
    """One document of a table run in parts (trials, or worker counts, apart).

    Args:
        documents: the parts' JSON documents.

    Returns:
        Their runs together; the meta of the part with the accuracy runs (else the first),
        with every part's under ``parts``.

    Raises:
        ValueError: the parts' scaling runs differ in updates or batch, or two parts ran the
            same variant, workers and trial.
    """
    if len(documents) == 1:
        return documents[0]
    runs = [run for document in documents for run in document["runs"]]
    scaling = _runs({"runs": runs}, "scaling")
    shapes = {(run["steps"], run["per_worker_batch"]) for run in scaling}
    if len(shapes) > 1:
        raise ValueError(f"the parts' scaling runs differ in (updates, batch per worker): "
                         f"{sorted(shapes)}; join only parts of one table")
    seen = set()
    for run in scaling:
        key = (run["variant"], run["workers"], run["seed"])
        if key in seen:
            raise ValueError(f"two parts ran {run['variant']} at {run['workers']} workers, "
                             f"trial {run['seed']}; leave one of them out")
        seen.add(key)
    with_accuracy = [d for d in documents if _runs(d, "accuracy")] or list(documents)
    return {"meta": dict(with_accuracy[0]["meta"], parts=[d["meta"] for d in documents]),
            "runs": runs}


def _measured(meta: dict) -> str:
    load = meta.get("load_average")
    return meta["date"] + (f" (load average at the end {', '.join(f'{x:.1f}' for x in load)})"
                           if load else "")


def report(document: dict) -> str:
    """Every table of a JSON document.

    Args:
        document: the JSON document (one run's, or parts joined by ``join_documents``).

    Returns:
        Markdown.
    """
    meta = document["meta"]
    parts = meta.get("parts", [meta])
    head = (f"Measured {'; '.join(_measured(part) for part in parts)}: Ray {meta['ray']}, "
            f"thinc {meta['thinc']}, numpy {meta['numpy']}, {meta['cpus']} CPUs.")
    return "\n\n".join(filter(None, [head, scaling_tables(document), accuracy_table(document)]))


def document_of(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict]) -> dict:
    """The document to report: the ``--from-json`` files joined, or a new run (written to
    ``--json`` if given).

    Args:
        args: the parsed command line (``from_json``, ``json``).
        run: makes a new document from ``args``.

    Returns:
        The document.
    """
    if args.from_json:
        return join_documents([json.loads(path.read_text()) for path in args.from_json])
    document = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
    return document


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (or read a previous run), print the tables, write JSON and plot.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command = rerun_command(parser, argv)
    document = document_of(args, functools.partial(run_all, command=command))
    tables = report(document)
    print(tables)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(tables + "\n")
    if args.plot:
        plot_throughput(document, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
