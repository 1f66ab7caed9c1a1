"""batch_remote against the foreach loop: the four tables of the batch-remote proposal.

``python -m benchmarks.batch_remote [--json PATH]`` measures, side by side in one run,

1. a parameter-size sweep at a fixed actor count (``--sizes`` at ``--actors``);
2. an actor-count sweep with a 1 MiB argument (``--actor-counts``);
3. the same actor counts with no argument;
4. the same actor counts with an ObjectRef argument,

each row as ``[actor.method.remote(arg) for actor in actors]`` against
``ray_collective.batch_remote(actors).method.remote(arg)``. The two alternate call by call, in
reversed order every other call, so that drift of a shared machine falls on both alike. Each
call is timed twice: **submit**, the time the driver spends in the call (what the proposal's
tables report), and **done**, until every actor's result is back. Between calls every result
is fetched and dropped, so the object store starts each call empty.

The actors run a method that returns at once (``num_cpus=0``, as many as the machine holds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

PERCENTILES = (50, 90)


class Worker:
    """The actor: a method that does nothing, so only the call path is timed."""

    def compute(self, *args) -> None:
        return None


@dataclass(frozen=True)
class Row:
    """One table row: foreach and batch_remote timings for one (table, actors, size) point.

    Attributes:
        table: ``size``, ``actors``, ``no_args`` or ``object_ref``.
        actors: actors called.
        size: argument bytes (0: no argument; the ObjectRef table: bytes behind the ref).
        repeats: timed calls of each way.
        foreach_submit_ms, batch_submit_ms: submit time percentiles, in milliseconds.
        foreach_done_ms, batch_done_ms: time until every result is back, percentiles in ms.
        submit_speedup: foreach p50 / batch p50 of the submit time.
        done_speedup: the same for the time until done.
    """

    table: str
    actors: int
    size: int
    repeats: int
    foreach_submit_ms: dict = field(default_factory=dict)
    batch_submit_ms: dict = field(default_factory=dict)
    foreach_done_ms: dict = field(default_factory=dict)
    batch_done_ms: dict = field(default_factory=dict)
    submit_speedup: float = 0.0
    done_speedup: float = 0.0


def _percentiles(seconds: Sequence[float]) -> dict:
    return {f"p{q}": float(np.percentile(np.asarray(seconds) * 1e3, q)) for q in PERCENTILES}


def _time_call(ray, submit: Callable[[], list]) -> tuple:
    started = time.perf_counter()
    refs = submit()
    submitted = time.perf_counter()
    ray.get(refs, timeout=600)
    return submitted - started, time.perf_counter() - started


def measure_row(ray, actors: Sequence, table: str, size: int, repeats: int,
                warmup: int = 2) -> Row:
    """Time foreach against batch_remote for one argument on ``actors``, interleaved.

    Args:
        ray: the initialized ray module.
        actors: the Worker actors.
        table: which table the row belongs to (decides the argument).
        size: argument bytes.
        repeats: timed calls of each way.
        warmup: untimed calls of each way first.

    Returns:
        The row.
    """
    from ray_collective import batch_remote

    if table == "no_args":
        args: tuple = ()
    elif table == "object_ref":
        args = (ray.put(np.zeros(size, dtype=np.uint8)),)
    else:
        args = (np.zeros(size, dtype=np.uint8),)
    ways = {
        "foreach": lambda: [actor.compute.remote(*args) for actor in actors],
        "batch": lambda: batch_remote(actors).compute.remote(*args),
    }
    times = {name: ([], []) for name in ways}
    for call in range(warmup + repeats):
        order = list(ways) if call % 2 == 0 else list(reversed(ways))
        for name in order:
            submit_s, done_s = _time_call(ray, ways[name])
            if call >= warmup:
                times[name][0].append(submit_s)
                times[name][1].append(done_s)
    foreach_submit, foreach_done = times["foreach"]
    batch_submit, batch_done = times["batch"]
    return Row(table, len(actors), size, repeats,
               foreach_submit_ms=_percentiles(foreach_submit),
               batch_submit_ms=_percentiles(batch_submit),
               foreach_done_ms=_percentiles(foreach_done),
               batch_done_ms=_percentiles(batch_done),
               submit_speedup=float(np.median(foreach_submit) / np.median(batch_submit)),
               done_speedup=float(np.median(foreach_done) / np.median(batch_done)))


def repeats_for(size: int, actors: int) -> int:
    """Timed calls per way: fewer where a foreach call moves hundreds of megabytes."""
    moved = size * actors
    if moved >= 256 * 2**20:
        return 8
    if moved >= 32 * 2**20:
        return 15
    return 30


@dataclass(frozen=True)
class Options:
    """What to run.

    Attributes:
        sizes: argument sizes of the size table, in bytes.
        size_table_actors: actors of the size table.
        actor_counts: actor counts of the other three tables.
        count_table_size: argument bytes of the actor-count table.
        object_ref_size: bytes behind the ObjectRef of the ObjectRef table.
        repeats: timed calls per way and row; None: from the bytes a foreach call moves.
        tables: which tables to run.
    """

    sizes: tuple = (10, 1024, 100 * 1024, 512 * 1024, 2**20, 2 * 2**20, 4 * 2**20, 8 * 2**20)
    size_table_actors: int = 64
    actor_counts: tuple = (16, 32, 64, 128)
    count_table_size: int = 2**20
    object_ref_size: int = 2**20
    repeats: Optional[int] = None
    tables: tuple = ("size", "actors", "no_args", "object_ref")


def _points(options: Options) -> List[tuple]:
    """(table, actors, size) for every row, grouped so that actors are started once per
    count."""
    points = []
    counts = sorted(set(options.actor_counts) | ({options.size_table_actors}
                                                 if "size" in options.tables else set()))
    for count in counts:
        if "size" in options.tables and count == options.size_table_actors:
            points += [("size", count, size) for size in options.sizes]
        if count in options.actor_counts:
            for table, size in (("actors", options.count_table_size), ("no_args", 0),
                                ("object_ref", options.object_ref_size)):
                if table in options.tables:
                    points.append((table, count, size))
    return points


def run(ray, options: Options, progress: Callable[[str], None] = lambda line: None
        ) -> List[Row]:
    """Run every row of ``options`` on the running Ray; actors are killed at the end.

    Args:
        ray: the initialized ray module.
        options: what to run.
        progress: called with a line after each row.

    Returns:
        The rows, grouped by actor count.
    """
    worker = ray.remote(num_cpus=0)(Worker)
    rows: List[Row] = []
    actors: list = []
    try:
        for table, count, size in _points(options):
            if len(actors) != count:
                for actor in actors:
                    ray.kill(actor)
                actors = [worker.remote() for _ in range(count)]
                ray.get([a.compute.remote() for a in actors], timeout=600)
            repeats = options.repeats or repeats_for(size, count)
            row = measure_row(ray, actors, table, size, repeats)
            rows.append(row)
            progress(f"{table:<10} {count:>4} actors {size:>9} B: submit "
                     f"{row.submit_speedup:6.2f}x, done {row.done_speedup:6.2f}x")
    finally:
        for actor in actors:
            ray.kill(actor)
    return rows


def format_tables(rows: Sequence[Row]) -> str:
    """The rows as markdown tables, one per table kind, as the results page shows them."""
    titles = {"size": "Argument size sweep", "actors": "Actor count sweep, 1 MiB argument",
              "no_args": "Actor count sweep, no argument",
              "object_ref": "Actor count sweep, ObjectRef argument"}
    out = []
    for table, title in titles.items():
        chosen = [r for r in rows if r.table == table]
        if not chosen:
            continue
        out += [f"**{title}** (p50 in ms; speed-up = foreach / batch_remote)", "",
                "| actors | argument | foreach submit | batch submit | speed-up | "
                "foreach done | batch done | speed-up |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in chosen:
            argument = "none" if table == "no_args" else _human(r.size)
            out.append(f"| {r.actors} | {argument} | {r.foreach_submit_ms['p50']:.2f} | "
                       f"{r.batch_submit_ms['p50']:.2f} | {r.submit_speedup:.2f}x | "
                       f"{r.foreach_done_ms['p50']:.2f} | {r.batch_done_ms['p50']:.2f} | "
                       f"{r.done_speedup:.2f}x |")
        out.append("")
    return "\n".join(out)


def _human(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.batch_remote``."""
    from .cli import at_least, comma_list, parse_size, positive_int
    defaults = Options()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.batch_remote",
        description="batch_remote against a foreach loop of .remote() calls, interleaved.")
    parser.add_argument("--sizes", type=comma_list(at_least(1, parse_size)), default=defaults.sizes,
                        help="argument sizes of the size table (K, M suffixes are binary)")
    parser.add_argument("--actors", type=int, default=defaults.size_table_actors,
                        help="actors of the size table")
    parser.add_argument("--actor-counts", type=comma_list(positive_int), default=defaults.actor_counts,
                        help="actor counts of the other tables")
    parser.add_argument("--tables", default=",".join(defaults.tables),
                        help="which of size,actors,no_args,object_ref to run")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per way and row (default: from the bytes moved)")
    parser.add_argument("--json", default=None, help="write rows and metadata here")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark on a local Ray it starts; print the tables; write JSON if asked."""
    import ray

    from .rows import machine_metadata
    parser = build_parser()
    arguments = parser.parse_args(argv)
    tables = tuple(t for t in arguments.tables.split(",") if t)
    unknown = set(tables) - set(Options().tables)
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; choose from {list(Options().tables)}")
    options = Options(sizes=arguments.sizes, size_table_actors=arguments.actors,
                      actor_counts=arguments.actor_counts, repeats=arguments.repeats,
                      tables=tables)
    ray.init(address="local", include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        rows = run(ray, options, progress=lambda line: print(line, file=sys.stderr))
        metadata = machine_metadata()
    finally:
        ray.shutdown()
    print(format_tables(rows))
    if arguments.json:
        command = "python -m benchmarks.batch_remote " + " ".join(argv or sys.argv[1:])
        with open(arguments.json, "w") as out:
            json.dump({"metadata": dict(metadata, command=command.strip()),
                       "options": asdict(options), "rows": [asdict(r) for r in rows]},
                      out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
