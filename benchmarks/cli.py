"""The command line: ``python -m benchmarks --collective allreduce --world-size 2,4 ...``; and
what every benchmark's own command line shares (argument types, its parser, its output)."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .collectives import COLLECTIVES
from .harness import run_sweep
from .sweep import SweepOptions, count_points
from .peers import PEERS
from .report import ProgressBar, format_progress, format_table, to_json
from .worker import BACK_TO_BACK, BARRIER, PACE_S, PACED

DEFAULT_BACKENDS = ("ray", "torch", "gloo", "ray-plain", "mpi4py")
"""Every CPU backend, this library first."""

DEFAULT_NODES_BACKENDS = ("ray", "ray-object-store", "torch", "gloo", "ray-plain")
"""The backends across nodes (``--nodes``): every one that runs in Ray actors, this library
with each of its transports between nodes first."""

DEFAULT_WORLD_SIZES = (2, 4, 8)
"""``--world-size`` without ``--nodes``."""

DEFAULT_RANKS_PER_NODE = (2,)
"""``--ranks-per-node`` with ``--nodes``."""

TIMING_CHOICES = {BACK_TO_BACK: (BACK_TO_BACK,), BARRIER: (BARRIER,), PACED: (PACED,),
                  "both": (BACK_TO_BACK, BARRIER)}
"""``--timing``'s values and the timing modes each one runs."""

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_MULTIPLIERS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """A byte count: an integer with an optional binary suffix (``8``, ``1K``, ``64MiB``).

    Args:
        text: the text.

    Returns:
        Bytes.

    Raises:
        ValueError: not a size.
    """
    match = _SIZE_PATTERN.match(text)
    if not match:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 8, 4096, 1K, 64M)")
    return int(match.group(1)) * _SIZE_MULTIPLIERS[match.group(2).lower()]


def at_least(minimum: int, parse: Callable[[str], int] = int) -> Callable[[str], int]:
    """An argparse type: a number ``parse`` reads from the text, at least ``minimum``."""
    def check(text: str) -> int:
        value = parse(text)
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, not {value}")
        return value
    return check


positive_int = at_least(1)
non_negative_int = at_least(0)


def choice(choices: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of ``choices``."""
    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return check


def one_value(item: Callable) -> Callable:
    """An argparse type for one value ``item`` parses, its ``ValueError`` the message shown."""
    def parse(text: str):
        try:
            return item(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def comma_list(item: Callable) -> Callable[[str], Tuple]:
    """An argparse type for a comma-separated list whose items ``item`` parses, no duplicates."""
    def parse(text: str) -> Tuple:
        try:
            values = tuple(item(part.strip()) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"repeated values in {text!r}")
        return values
    return parse


def module_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, described by the first paragraph of its
    docstring.

    Args:
        module: the benchmark's module (``benchmarks.elastic``).
        doc: its docstring.

    Returns:
        The parser, without arguments yet.
    """
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])


def print_and_save(table: str, figures: Any, json_path: Optional[str]) -> None:
    """Print a benchmark's table and, where a path was given, write its figures there as JSON.

    Args:
        table: what to print.
        figures: what to write (anything ``json.dump`` takes).
        json_path: the file, or None (or "") to write nothing.
    """
    print(table)
    if json_path:
        with open(json_path, "w") as out:
            json.dump(figures, out, indent=1)


def rerun_command(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> str:
    """The ``python -m`` line that reruns a benchmark with these arguments, to record beside
    its results (not the script's path, nor the caller's ``sys.argv`` when ``argv`` is given).

    Args:
        parser: the benchmark's parser (its ``prog`` is the ``python -m`` part).
        argv: the arguments it parsed, or None for ``sys.argv[1:]``.

    Returns:
        The command.
    """
    return " ".join([parser.prog, *(sys.argv[1:] if argv is None else argv)])


def _dtype_name(text: str) -> str:
    try:
        return np.dtype(text).name
    except TypeError as exc:
        raise argparse.ArgumentTypeError(f"not a numpy dtype: {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m benchmarks``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time collectives on Ray actors over ray_collective and its peers, "
                    "interleaved in one run. Comma-separated lists are axes of the sweep.")
    parser.add_argument("--collective", "--collectives", dest="collectives",
                        type=comma_list(choice(tuple(COLLECTIVES))), default=("allreduce",),
                        help=f"collectives, of: {','.join(COLLECTIVES)} (default: allreduce)")
    parser.add_argument("--backends", type=comma_list(choice(tuple(PEERS))),
                        default=None,
                        help="in table order, of: ray (this library), ray-object-store (this "
                             "library with RAY_COLLECTIVE_CROSS_NODE=object_store), torch "
                             "(torch.distributed's own Gloo process group), gloo "
                             "(ray.util.collective with torch.distributed Gloo), ray-plain "
                             "(ray.put/ray.get and one central actor), mpi4py (MPICH under "
                             f"mpiexec, one node only) (default: {','.join(DEFAULT_BACKENDS)}; "
                             f"with --nodes: {','.join(DEFAULT_NODES_BACKENDS)})")
    parser.add_argument("--world-size", dest="world_sizes", type=comma_list(positive_int),
                        default=None,
                        help="ranks, one actor each (default: "
                             f"{','.join(map(str, DEFAULT_WORLD_SIZES))}; not with --nodes)")
    parser.add_argument("--nodes", type=one_value(positive_int), default=None,
                        help="spread the ranks over this many Ray nodes: a "
                             "ray.cluster_utils.Cluster of that many nodes started on this "
                             "machine, or the nodes of --ray-address's cluster (default: one "
                             "local node)")
    parser.add_argument("--ranks-per-node", type=comma_list(positive_int), default=None,
                        help="with --nodes: ranks on each node, rank r on node r // R; each "
                             "value is one world size of nodes x R ranks (default: "
                             f"{','.join(map(str, DEFAULT_RANKS_PER_NODE))})")
    parser.add_argument("--bytes", dest="sizes", type=comma_list(parse_size),
                        default=(8, 2**20, 64 * 2**20),
                        help="message sizes as nccl-tests counts them: allreduce/broadcast/"
                             "reduce the tensor, allgather the gathered output, reducescatter "
                             "the input list; suffixes K, M, G are binary "
                             "(default: 8,1M,64M)")
    parser.add_argument("--dtype", type=_dtype_name, default="float32",
                        help="numpy dtype of the tensors (default: float32)")
    parser.add_argument("--iters", dest="iterations", type=positive_int, default=None,
                        help="timed iterations per point (default: from the size, 200 for "
                             "<= 64 KiB down to 20 above 16 MiB)")
    parser.add_argument("--warmup", type=non_negative_int, default=None,
                        help="untimed iterations per point and backend (default: from the "
                             "size, 20 down to 5)")
    parser.add_argument("--timing", type=choice(tuple(TIMING_CHOICES)), default=BACK_TO_BACK,
                        help="back-to-back: one barrier per block, then the calls in a loop, "
                             "each timed from the previous call's return to its own; barrier: "
                             "the backend's barrier before every call, the call alone timed; "
                             f"paced: one barrier, then {PACE_S * 1e3:g} ms of sleep before "
                             "every call (a training step's compute), the call alone timed; "
                             "both: back-to-back and barrier, as rows of their own (default: "
                             "back-to-back)")
    parser.add_argument("--blocks", type=positive_int, default=4,
                        help="interleaved blocks the timed iterations are split into "
                             "(default: 4)")
    parser.add_argument("--baseline", default=None,
                        help="backend the speed-up (baseline p50 / backend p50) is relative "
                             "to, or 'none' (default: the first of --backends)")
    parser.add_argument("--timeout", dest="timeout_s", type=float, default=300.0,
                        help="seconds any one step may take: actor start, group setup, one "
                             "block; also the libraries' per-call deadline (default: 300)")
    parser.add_argument("--ray-address", default=None,
                        help="use this running Ray cluster instead of starting a local one")
    parser.add_argument("--json", dest="json_path", type=pathlib.Path, default=None,
                        help="write every row and the run's metadata to this file")
    parser.add_argument("--plots", dest="plots_path", type=pathlib.Path, default=None,
                        help="write PNG plots (latency and bus bandwidth against size, time "
                             "against world size) into this directory")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar on stderr")
    return parser


def options_from_arguments(arguments: argparse.Namespace,
                           parser: argparse.ArgumentParser) -> SweepOptions:
    """The sweep options the parsed command line asks for.

    Args:
        arguments: from ``build_parser().parse_args``.
        parser: for reporting a bad combination (exits with status 2).

    Returns:
        The options.
    """
    world_sizes, backends = sweep_shape(arguments, parser)
    if arguments.baseline is None:
        baseline = backends[0]
    else:
        baseline = None if arguments.baseline.lower() == "none" else arguments.baseline
    if baseline is not None and baseline not in backends:
        parser.error(f"--baseline {baseline} is not among --backends "
                     f"{','.join(backends)} (or give --baseline none)")
    if arguments.timeout_s <= 0:
        parser.error(f"--timeout must be positive, not {arguments.timeout_s}")
    return SweepOptions(collectives=arguments.collectives, backends=backends,
                        world_sizes=world_sizes, sizes=arguments.sizes,
                        dtype=arguments.dtype, iterations=arguments.iterations,
                        warmup=arguments.warmup, blocks=arguments.blocks, baseline=baseline,
                        timeout_s=arguments.timeout_s, ray_address=arguments.ray_address,
                        timings=TIMING_CHOICES[arguments.timing], nodes=arguments.nodes)


def sweep_shape(arguments: argparse.Namespace,
                parser: argparse.ArgumentParser) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """The world sizes and backends the command line asks for, its defaults filled in.

    On one node the world sizes are ``--world-size``'s; across nodes (``--nodes K``) they are
    K times each of ``--ranks-per-node``, and the backends those that run in Ray actors.

    Args:
        arguments: from ``build_parser().parse_args``.
        parser: for reporting a bad combination (exits with status 2).

    Returns:
        (world sizes, backends).
    """
    if arguments.nodes is None:
        if arguments.ranks_per_node is not None:
            parser.error("--ranks-per-node needs --nodes (on one node give --world-size)")
        return (arguments.world_sizes or DEFAULT_WORLD_SIZES,
                arguments.backends or DEFAULT_BACKENDS)
    if arguments.world_sizes is not None:
        parser.error(f"with --nodes give --ranks-per-node, not --world-size: the world sizes "
                     f"are --nodes x each of --ranks-per-node (e.g. --nodes "
                     f"{arguments.nodes} --ranks-per-node 2,4)")
    backends = arguments.backends or DEFAULT_NODES_BACKENDS
    one_node_only = [backend for backend in backends if PEERS[backend].runs_in_mpiexec]
    if one_node_only:
        parser.error(f"--nodes cannot run {','.join(one_node_only)}: its mpiexec job runs "
                     f"on one machine, outside Ray; leave it out of --backends")
    ranks_per_node = arguments.ranks_per_node or DEFAULT_RANKS_PER_NODE
    return tuple(arguments.nodes * ranks for ranks in ranks_per_node), backends


def main(argv: Optional[List[str]] = None) -> int:
    """Run the sweep the command line asks for, print the table, write the JSON.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 once the sweep has run, even if some rows report errors (the table and the JSON
        say which); argparse exits with 2 on bad arguments.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    arguments = parser.parse_args(argv)
    options = options_from_arguments(arguments, parser)

    bar = ProgressBar(count_points(options), sys.stderr)

    def progress(rows) -> None:
        if not arguments.quiet:
            bar.advance(format_progress(rows))

    result = run_sweep(options, command=shlex.join(["python", "-m", "benchmarks", *argv]),
                       on_rows=progress)
    print(format_table(result.rows))
    for note in result.notes:
        print(f"note: {note}")
    if arguments.json_path is not None:
        arguments.json_path.parent.mkdir(parents=True, exist_ok=True)
        arguments.json_path.write_text(to_json(result) + "\n")
        print(f"wrote {arguments.json_path}")
    if arguments.plots_path is not None:
        from dataclasses import asdict

        from .plots import write_plots
        written = write_plots([asdict(row) for row in result.rows], arguments.plots_path)
        print(f"wrote {len(written)} plots into {arguments.plots_path}")
    return 0
