"""``python -m examples.parameter_server``: train with some variants and print what they reached.

Example (what ``make ps-example`` runs)::

    python -m examples.parameter_server --workers 4 --steps 100

On GPUs, ``--backend nccl --device gpu`` runs this library's variants with NCCL and thinc on
CuPy: nothing else changes (never run on this project's machines, which have no GPU).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import List, Optional

from .task import TaskConfig, load_digits
from .training import VARIANTS, RunOptions, run_variant, start_workers

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_VARIANTS = ("local", "ps-async", "ps-sync", "allreduce-flat", "rs-ag",
                    "allreduce-per-array")


def main(argv: Optional[List[str]] = None) -> int:
    """Run the chosen variants one after the other on one pool of workers.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m examples.parameter_server",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="updates (global batches)")
    parser.add_argument("--global-batch", type=int, default=128,
                        help="rows per update, split evenly among the workers")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="ray", help="this library's backend (ray, nccl)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.global_batch % args.workers:
        parser.error(f"--global-batch {args.global_batch} does not split among "
                     f"{args.workers} workers")

    import ray
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH", "")]))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        data = ray.put(load_digits())
        pool = start_workers(args.workers)
        print(f"{'variant':<22}{'workers':>8}{'seconds':>9}{'first loss':>12}"
              f"{'last loss':>11}{'test acc':>10}")
        for serial, variant in enumerate(variants):
            workers = 1 if variant == "local" else args.workers
            task = TaskConfig(width=args.width, depth=args.depth, seed=args.seed,
                              per_worker_batch=args.global_batch // workers)
            result = run_variant(RunOptions(variant, workers, args.steps, task,
                                            backend=args.backend, device=args.device),
                                 data, pool, serial)
            rank0 = result.reports[0]
            print(f"{variant:<22}{workers:>8}{result.seconds:>9.2f}{rank0.losses[0]:>12.3f}"
                  f"{rank0.losses[-1]:>11.3f}{100 * rank0.final_accuracy:>9.1f}%", flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
