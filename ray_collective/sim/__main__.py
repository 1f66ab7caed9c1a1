"""Print the simulator's table: ``python -m ray_collective.sim --collective allreduce --ranks 400
--bytes 1048576``.

Every option takes a comma-separated list; one row per combination. ``--algorithm all`` runs
every algorithm of the collective that fits the rank count.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

import numpy as np

from ..algorithms.catalog import ALGORITHMS
from .runner import COLLECTIVES, SimReport, simulate

CHECK_LIMIT_BYTES = 1 << 30
"""Above this much payload over all ranks, results are not checked (zero-memory mode)."""

ALL_MAX_ROUNDS = 2048
"""``--algorithm all`` leaves out algorithms with more rounds than this (a ring over thousands
of ranks takes minutes to simulate); name one explicitly to run it anyway."""


def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part]


def _words(text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def format_table(reports: List[SimReport]) -> str:
    """The reports as an aligned text table, with each algorithm's formula beside the measure."""
    header = ("collective", "algorithm", "ranks", "tensor", "rounds", "formula",
              "max msgs", "max bytes sent", "formula bytes", "inter-node msgs/senders", "checked",
              "time")
    rows = [header]
    for r in reports:
        rows.append((r.collective, r.algorithm, str(r.ranks), _human(r.count * r.itemsize),
                     str(r.rounds), str(r.formula.rounds), str(r.max_messages),
                     f"{r.max_bytes_sent:,}", f"{r.formula.max_elements_sent * r.itemsize:,}",
                     f"{r.inter_node_messages}/{r.inter_node_senders}" if r.ranks_per_node
                     else "-",
                     "yes" if r.checked else "no", f"{r.seconds:.2f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse arguments, simulate every combination, print the table; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ray_collective.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", default="allreduce",
                        help=f"comma-separated, from: {', '.join(COLLECTIVES)}")
    parser.add_argument("--ranks", default="400", help="comma-separated rank counts")
    parser.add_argument("--bytes", default="1048576",
                        help="bytes of one rank's tensor (one block for list collectives)")
    parser.add_argument("--algorithm", default="auto",
                        help="'auto' (the selector), 'all', or comma-separated names")
    parser.add_argument("--dtype", default="float32", help="numpy dtype of the data")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="group ranks on pretend nodes of this size (0: one node)")
    parser.add_argument("--check", choices=("auto", "yes", "no"), default="auto",
                        help="compare results with numpy (auto: when the payload fits in 1 GiB)")
    args = parser.parse_args(argv)
    reports = []
    skipped: List[str] = []
    for collective in _words(args.collective):
        if collective not in COLLECTIVES:
            parser.error(f"unknown collective {collective!r}")
        for ranks in _ints(args.ranks):
            for nbytes in _ints(args.bytes):
                itemsize = np.dtype(args.dtype).itemsize
                count = max(nbytes // itemsize, 0)
                if args.algorithm == "auto":
                    names = [None]
                elif args.algorithm == "all":
                    names = []
                    for a in ALGORITHMS[collective].values():
                        if a.power_of_two_only and ranks & (ranks - 1):
                            continue
                        if a.node_aware and not args.ranks_per_node:
                            continue
                        rounds = a.cost(ranks, count, args.ranks_per_node or ranks,
                                        itemsize).rounds
                        if rounds > ALL_MAX_ROUNDS:
                            skipped.append(f"{collective}/{a.name} at {ranks} ranks "
                                           f"({rounds} rounds)")
                            continue
                        names.append(a.name)
                else:
                    names = _words(args.algorithm)
                payload = ranks * count * itemsize * (ranks if collective in (
                    "allgather", "reducescatter", "gather", "scatter", "alltoall") else 1)
                check = (args.check == "yes" or
                         (args.check == "auto" and payload <= CHECK_LIMIT_BYTES))
                for name in names:
                    reports.append(simulate(collective, ranks, count, algorithm=name,
                                            dtype=args.dtype, ranks_per_node=args.ranks_per_node,
                                            check=check))
    print(format_table(reports))
    if skipped:
        print(f"not simulated (more than {ALL_MAX_ROUNDS} rounds; name them with --algorithm to "
              f"run them): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
