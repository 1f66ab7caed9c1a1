"""PyTorch's own distributed tests run against backend ``ray_collective``, in Ray actors.

    flock /tmp/ray_collective_bench.lock python -m benchmarks.torch_backend_peer_suite \
        [--world-size 3] [--match all_reduce,broadcast,...] [--limit N]
        [--json benchmarks/results/torch-backend-peer-suite.json]

``torch.testing._internal.distributed.distributed_test`` holds the tests every backend is run
through (``DistributedTest._DistTestBase``); torch starts each rank as a process of its own
(``TestDistBackend._run``). This harness does what ``_run`` does inside one Ray actor per rank
instead, since the backend needs Ray: the environment the module reads (``BACKEND``,
``WORLD_SIZE``, ``TEMP_DIR``), ``init_process_group`` with the ``file://`` init method, the
tests' own file barrier, the test method, and the barrier and destroy after it. A test is
**passed** when every rank returned, **not applicable** when a rank was told to skip (torch's
skip decorators: a ``SkipTest`` or the ``sys.exit`` code of ``TEST_SKIPS``, with the reason),
and **failed** otherwise, with the first rank's error. A test that does not end within
``--test-timeout`` seconds fails as a hang, and its ranks are replaced. Nothing of torch's
test code is copied: the harness imports it, and with it ``expecttest``, which torch's test
modules need: the ``bench`` extras install it (``pip install -e '.[bench]'``), the test
extras do not, so the suite does not run the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Dict, List, Optional, Tuple

from .torch_backend import finish, free_port, parse_with_report, print_report

DEFAULT_MATCH = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                 "all_to_all", "barrier", "send_recv", "isend", "irecv", "batch_isend_irecv",
                 "new_subgroups", "DistributedDataParallel", "ddp")


class PeerRank:
    """One rank of torch's distributed tests."""

    def setup(self, world_size: int, temp_dir: str) -> None:
        os.environ.update(BACKEND="ray_collective", WORLD_SIZE=str(world_size),
                          TEMP_DIR=temp_dir, MASTER_ADDR="127.0.0.1")
        import ray_collective.torch  # noqa: F401 - registers the backend
        from torch.testing._internal.distributed import distributed_test as suite
        self.suite = suite

        class Case(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
            pass
        self.case_class = Case

    def names(self) -> List[str]:
        return sorted(n for n in dir(self.case_class) if n.startswith("test_"))

    def run(self, rank: int, name: str, init_file: str, port: int) -> Tuple[str, str]:
        """(outcome, reason) of one test on this rank: passed, skipped or failed (``port``:
        MASTER_PORT, for the tests that make a group of their own with ``env://``)."""
        import unittest
        from datetime import timedelta

        import torch.distributed as dist
        from torch.testing._internal import common_utils
        from torch.testing._internal.common_distributed import TEST_SKIPS
        case = self.case_class(name)
        case.rank, case.file_name = rank, init_file
        os.environ["MASTER_PORT"] = str(port)
        skips = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
        try:
            dist.init_process_group(init_method=f"file://{init_file}", backend="ray_collective",
                                    world_size=int(os.environ["WORLD_SIZE"]), rank=rank,
                                    timeout=timedelta(seconds=60))
            case._barrier()
            common_utils.set_rng_seed()  # as torch's run_test: every rank the same seed
            getattr(case, name)()
            case._barrier()
            return "passed", ""
        except unittest.SkipTest as skip:
            return "skipped", str(skip)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else -1
            return ("skipped", skips[code]) if code in skips else ("failed", f"exit {code}")
        except Exception as error:  # noqa: BLE001 - the outcome being counted
            return "failed", f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _outcome(per_rank: List[Tuple[str, str]]) -> Tuple[str, str]:
    for kind in ("failed", "skipped"):
        for outcome, reason in per_rank:
            if outcome == kind:
                return ("not applicable" if kind == "skipped" else kind), reason
    return "passed", ""


def summary(result: dict) -> str:
    """docs/torch-backend.md's account of a run: the counts, then each failure with its reason.

    Args:
        result: what ``--json`` wrote.

    Returns:
        Markdown.
    """
    counts = result["counts"]
    lines = [f"From `{result['command']}`, {result['world_size']} ranks, "
             f"{result.get('run', len(result['tests']))} of "
             f"{result.get('selected', len(result['tests']))} selected tests run: "
             f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
             f"{counts.get('not applicable', 0)} not applicable.", "",
             "| failed test | reason |", "|---|---|"]
    for name, test in sorted(result["tests"].items()):
        if test["outcome"] == "failed":
            reason = test["reason"].replace("|", "/")[:160]
            lines.append(f"| `{name}` | {reason} |")
    reasons: Dict[str, int] = {}
    for test in result["tests"].values():
        if test["outcome"] == "not applicable":
            reasons[test["reason"][:60]] = reasons.get(test["reason"][:60], 0) + 1
    lines += ["", "Not applicable, by torch's reason: " + "; ".join(
        f"{reason or 'no reason given'} ({count})"
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1])) + "."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--match", default=",".join(DEFAULT_MATCH),
                        help="run the tests whose name holds one of these (comma-separated)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many tests")
    parser.add_argument("--test-timeout", type=float, default=120.0)
    args = parse_with_report(parser, argv, "--summary", "print the docs page's account")
    if args.summary:
        print_report(args.summary, summary)
        return

    import ray
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    temp_dir = tempfile.mkdtemp(prefix="torch-peer-suite-")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(temp_dir, sub), exist_ok=True)
    rank_actor = ray.remote(num_cpus=0)(PeerRank)

    def fresh_ranks():
        ranks = [rank_actor.remote() for _ in range(args.world_size)]
        ray.get([r.setup.remote(args.world_size, temp_dir) for r in ranks])
        return ranks

    ranks = fresh_ranks()
    words = [w for w in args.match.split(",") if w]
    names = [n for n in ray.get(ranks[0].names.remote()) if any(w in n for w in words)]
    if args.limit:
        names = names[:args.limit]
    tests: Dict[str, dict] = {}
    started = time.perf_counter()
    for index, name in enumerate(names):
        barrier_dir = os.path.join(temp_dir, "barrier")
        for leftover in os.listdir(barrier_dir):
            os.remove(os.path.join(barrier_dir, leftover))
        init_file = os.path.join(temp_dir, "init_dir", f"{index}")
        port = free_port()
        refs = [r.run.remote(rank, name, init_file, port) for rank, r in enumerate(ranks)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=args.test_timeout)
        if len(ready) < len(refs):
            outcome, reason = "failed", f"hang: not done in {args.test_timeout:g} s"
            for r in ranks:
                ray.kill(r)
            ranks = fresh_ranks()
        else:
            outcome, reason = _outcome(ray.get(refs))
        tests[name] = {"outcome": outcome, "reason": reason}
        print(f"{outcome:15} {name} {reason[:160]}", flush=True)
        result = _record(argv, args.world_size, started, tests, len(names))
        if args.json:  # after every test, so that a run cut short still leaves its counts
            with open(args.json, "w") as out:
                json.dump(result, out, indent=1)
    result = _record(argv, args.world_size, started, tests, len(names))
    print(json.dumps(result["counts"]))
    finish(ray, result, args.json)


def _record(argv, world_size: int, started: float, tests: Dict[str, dict],
            selected: int) -> dict:
    counts: Dict[str, int] = {}
    for test in tests.values():
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return {"command": "python -m benchmarks.torch_backend_peer_suite " + " ".join(
        sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size, "seconds": time.perf_counter() - started,
        "selected": selected, "run": len(tests), "counts": counts, "tests": tests}


if __name__ == "__main__":
    main()
