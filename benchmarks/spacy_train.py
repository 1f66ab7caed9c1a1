"""spaCy's tok2vec + ner trained on N Ray workers: the parameter server against collectives.

``python -m benchmarks.spacy_train`` trains spaCy's own efficiency ``["tok2vec", "ner"]``
config (``spacy init config -p ner``) on the generated corpus (``ray_collective.integrations.
spacy.corpus``) with ``python -m spacy ray-collective``'s driver, for ``--steps`` updates at
each worker count and strategy, ``--trials`` times (trial ``i``: seed ``i``), each worker
taking ``--batch`` sentences per update (the global batch grows with the workers, as in
spacy-ray), strategies interleaved inside each (trial, workers) block:

- ``parameter-server``: spacy-ray's sharded parameter server (the baseline);
- ``allreduce``, ``reducescatter``: this library's collectives;
- ``gloo-allreduce``: the allreduce strategy over ``ray.util.collective``'s Gloo.

With ``--accuracy-steps S``, the accuracy runs at equal samples follow: one worker taking
``--accuracy-workers`` times the batch, and every strategy at ``--accuracy-workers`` workers,
``S`` updates each, so that all see the same number of sentences.

Each run's record has its time (first step to last step), the per-update compute and
communication of its workers (evaluation apart), and rank 0's last dev F-score. The table is
hours on a small machine: run it in parts (``--first-trial K --trials 1 --workers 8``), each to
its own ``--json``, and join them with ``--from-json A.json,B.json`` (as
``benchmarks/param_server.py`` does, whose joining and table helpers this uses).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from .cli import at_least, choice, comma_list, rerun_command
from .param_server import _mean_std, _meta, _table, document_of

STRATEGIES = ("parameter-server", "allreduce", "reducescatter", "gloo-allreduce")
"""The runs of each (trial, workers) block, in column order."""
BASELINE = "parameter-server"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.spacy_train``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spacy_train",
                                     description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--strategies", type=comma_list(choice(STRATEGIES)), default=STRATEGIES)
    add("--workers", type=comma_list(at_least(1)), default=(1, 2, 4, 8, 16))
    add("--steps", type=at_least(0), default=1000,
        help="updates per scaling run (1000; 0: only the accuracy runs)")
    add("--trials", type=at_least(1), default=3)
    add("--first-trial", type=at_least(0), default=0, help="the first trial's number and seed")
    add("--batch", type=at_least(1), default=32, help="sentences per worker and update (32)")
    add("--train-sentences", type=at_least(1), default=20000)
    add("--dev-sentences", type=at_least(1), default=500)
    add("--eval-frequency", type=at_least(1), default=200)
    add("--accuracy-workers", type=at_least(2), default=4)
    add("--accuracy-steps", type=at_least(0), default=0,
        help="updates of the accuracy runs at equal samples (0: none)")
    add("--timeout", type=float, default=3600.0)
    add("--json", type=pathlib.Path, help="write every run here")
    add("--markdown", type=pathlib.Path, help="also write the tables here")
    add("--from-json", type=comma_list(pathlib.Path),
        help="only print the tables of this file, or of these files joined")
    return parser


def _config(args: argparse.Namespace, corpus: pathlib.Path, seed: int, steps: int,
            batch: int):
    from spacy.cli.init_config import init_config
    config = init_config(lang="en", pipeline=["ner"], optimize="efficiency", silent=True)
    config["paths"]["train"] = str(corpus / "train.spacy")
    config["paths"]["dev"] = str(corpus / "dev.spacy")
    config["system"]["seed"] = seed
    config["training"]["batcher"] = {"@batchers": "spacy.batch_by_sequence.v1",
                                     "size": batch, "get_length": None}
    # spaCy's loop makes max_steps + 1 updates (steps 0 to max_steps).
    config["training"]["max_steps"] = steps - 1
    config["training"]["eval_frequency"] = min(args.eval_frequency, steps - 1)
    config["training"]["patience"] = 0
    return config


def _record(result, kind: str, strategy: str, seed: int, batch: int) -> dict:
    reports, steps = result.reports, result.reports[0].steps
    return {
        "kind": kind, "variant": strategy, "workers": len(reports), "steps": steps,
        "seed": seed, "per_worker_batch": batch, "seconds": result.seconds,
        "compute_s_per_update": float(np.mean([r.compute_seconds for r in reports])) / steps,
        "communication_s_per_update":
            float(np.mean([r.communication_seconds for r in reports])) / steps,
        "serve_s_per_update": float(np.mean([r.serve_seconds for r in reports])) / steps,
        "evaluation_s": float(np.mean([r.evaluation_seconds for r in reports])),
        "bus_bytes_per_update": float(np.mean([r.bus_bytes for r in reports])) / steps,
        "actor_calls_per_update": float(np.mean([r.actor_calls for r in reports])) / steps,
        "stale_share": (sum(r.grads_dropped for r in reports)
                        / max(1, sum(r.grads_dropped + r.grads_accepted for r in reports))),
        "ents_f": result.rows[-1]["other_scores"].get("ents_f") if result.rows else None,
        "parameters": reports[0].parameters,
    }


def _plan(args: argparse.Namespace) -> List[Tuple[str, int, int, str, int, int]]:
    """Every run in order: (kind, trial, workers, strategy, updates, batch per worker)."""
    plan = [("scaling", trial, workers, strategy, args.steps, args.batch)
            for trial in range(args.first_trial, args.first_trial + args.trials)
            for workers in args.workers for strategy in args.strategies if args.steps]
    if args.accuracy_steps:
        n = args.accuracy_workers
        plan.append(("accuracy", args.first_trial, 1, "allreduce", args.accuracy_steps,
                     n * args.batch))
        plan += [("accuracy", args.first_trial, n, strategy, args.accuracy_steps, args.batch)
                 for strategy in args.strategies]
    return plan


def run_all(args: argparse.Namespace, command: str) -> dict:
    """Every run of the plan, on one Ray instance; returns the JSON document.

    Args:
        args: the parsed command line.
        command: the command that reruns it, recorded in the document.

    Returns:
        ``{"meta": ..., "runs": [...]}``.
    """
    import io

    import ray
    import spacy
    from ray_collective.integrations.spacy import corpus, driver
    from ray_collective.integrations.spacy.settings import RunSettings
    records = []
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as directory:
            data = pathlib.Path(directory)
            corpus.write_corpus(data, args.train_sentences, args.dev_sentences, seed=0)
            for kind, trial, workers, strategy, steps, batch in _plan(args):
                library = ("ray.util.collective-gloo" if strategy == "gloo-allreduce"
                           else "ray_collective")
                settings = RunSettings(strategy.replace("gloo-", ""), workers,
                                       library=library, timeout_s=args.timeout)
                started = time.monotonic()
                result = driver.train(_config(args, data, trial, steps, batch), settings,
                                      stdout=io.StringIO())
                records.append(_record(result, kind, strategy, trial, batch))
                print(f"{kind} trial {trial} x{workers} {strategy}: {result.seconds:.1f} s, "
                      f"F {records[-1]['ents_f']} (wall {time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    return {"meta": dict(_meta(args, command), spacy=spacy.__version__), "runs": records}


def tables(document: dict) -> str:
    """Runtime, speed-up over the server, n·T1/Tn, F-score and communication per update.

    Args:
        document: the JSON document (one run's, or parts joined).

    Returns:
        Markdown.
    """
    runs = [run for run in document["runs"] if run["kind"] == "scaling"]
    out = _scaling(runs) if runs else []
    out += _accuracy([run for run in document["runs"] if run["kind"] == "accuracy"])
    out += [f"Model: {document['runs'][0]['parameters']:,} parameters in the trainable "
            f"components."]
    return "\n".join(out)


def _scaling(runs: List[dict]) -> List[str]:
    """The tables of the scaling runs (the same updates at every worker count)."""
    groups: Dict[Tuple[str, int], List[dict]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["workers"]), []).append(run)
    workers = sorted({run["workers"] for run in runs})
    strategies = [s for s in STRATEGIES if any(key[0] == s for key in groups)]

    def mean(strategy: str, n: int, key: str) -> Optional[Tuple[float, float]]:
        found = groups.get((strategy, n))
        return _mean_std([run[key] for run in found]) if found else None

    trials = sorted({len(group) for group in groups.values()})
    count = f"{trials[0]}" if trials[0] == trials[-1] else f"{trials[0]}–{trials[-1]}"
    out = [f"Runtime of {runs[0]['steps']} updates (s, mean ± std over {count} "
           f"trial{'s' if trials[-1] > 1 else ''}):", "",
           _table(["workers"] + strategies, ([str(n)] + [
               f"{s[0]:.1f} ± {s[1]:.1f}" if (s := mean(v, n, "seconds")) else "–"
               for v in strategies] for n in workers)), ""]
    others = [v for v in strategies if v != BASELINE]
    out += [f"Speed-up over `{BASELINE}` (its time / the strategy's time):", "",
            _table(["workers"] + others, ([str(n)] + [
                f"{b[0] / s[0]:.2f}x" if (s := mean(v, n, "seconds"))
                and (b := mean(BASELINE, n, "seconds")) else "–" for v in others]
                for n in workers)), ""]
    if 1 in workers:
        out += ["Absolute scalability n·T1/Tn:", "",
                _table(["workers"] + strategies, ([str(n)] + [
                    f"{n * one[0] / s[0]:.2f}" if (s := mean(v, n, "seconds"))
                    and (one := mean(v, 1, "seconds")) else "–" for v in strategies]
                    for n in workers if n > 1)), ""]
    out += ["Dev NER F-score after the run (rank 0, mean ± std):", "",
            _table(["workers"] + strategies, ([str(n)] + [
                f"{100 * f[0]:.2f} ± {100 * f[1]:.2f}" if (f := mean(v, n, "ents_f")) else "–"
                for v in strategies] for n in workers)), ""]
    out += ["Per update and worker: compute ms / communication ms (the server: submitting "
            "its calls; its serving apart) / serving ms / MiB sent by collectives / actor "
            "calls / stale gradients:", ""]
    rows = []
    for n in workers:
        for v in strategies:
            if (v, n) not in groups:
                continue
            cells = {key: mean(v, n, key)[0] for key in (
                "compute_s_per_update", "communication_s_per_update", "serve_s_per_update",
                "bus_bytes_per_update", "actor_calls_per_update", "stale_share")}
            rows.append([str(n), v, f"{1e3 * cells['compute_s_per_update']:.1f}",
                         f"{1e3 * cells['communication_s_per_update']:.1f}",
                         f"{1e3 * cells['serve_s_per_update']:.1f}",
                         f"{cells['bus_bytes_per_update'] / 2**20:.2f}",
                         f"{cells['actor_calls_per_update']:.1f}",
                         f"{100 * cells['stale_share']:.1f} %"])
    out += [_table(["workers", "strategy", "compute ms", "comm ms", "serving ms", "MiB",
                    "actor calls", "stale"], rows), ""]
    return out + _targets(mean, workers, strategies)


def _targets(mean, workers: List[int], strategies: List[str]) -> List[str]:
    """Communication per update: the server's (its serving included) and Gloo's over ours."""
    def comm(strategy: str, n: int) -> Optional[float]:
        found = mean(strategy, n, "communication_s_per_update")
        serving = mean(strategy, n, "serve_s_per_update")
        return found[0] + serving[0] if found else None

    rows = []
    for n in workers:
        if n == 1:
            continue
        ours = {v: comm(v, n) for v in ("allreduce", "reducescatter")}
        server, gloo = comm(BASELINE, n), comm("gloo-allreduce", n)
        rows.append([str(n)] + [f"{server / ours[v]:.1f}x" if server and ours[v] else "–"
                                for v in ours]
                    + [f"{gloo / ours['allreduce']:.2f}x" if gloo and ours["allreduce"]
                       else "–"])
    return ["Communication per update, the parameter server's (its serving included) and "
            "`ray.util.collective` Gloo's over this library's (above 1: ours is less):", "",
            _table(["workers", "server / allreduce", "server / reducescatter",
                    "Gloo allreduce / allreduce"], rows), ""]


def _accuracy(runs: List[dict]) -> List[str]:
    """Dev F-score at equal samples: each run against the one-worker run that takes its whole
    batch (workers × batch per worker sentences an update, as many updates)."""
    if not runs:
        return []
    alone = {(run["per_worker_batch"], run["steps"]): run for run in runs if run["workers"] == 1}
    rows = []
    for run in runs:
        one = alone.get((run["workers"] * run["per_worker_batch"], run["steps"]))
        rows.append([run["variant"], str(run["workers"]), str(run["per_worker_batch"]),
                     f"{100 * run['ents_f']:.2f}",
                     f"{100 * (run['ents_f'] - one['ents_f']):+.2f}" if one else "–"])
    steps = "/".join(str(n) for n in sorted({run["steps"] for run in runs}))
    return [f"Dev NER F-score at equal samples ({steps} updates; each group against one worker "
            f"taking its whole batch; target: within one point of it):", "",
            _table(["strategy", "workers", "batch per worker", "F-score",
                    "vs one worker (points)"], rows), ""]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (or read previous runs), print the tables, write JSON.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command = rerun_command(parser, argv)
    text = tables(document_of(args, functools.partial(run_all, command=command)))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
