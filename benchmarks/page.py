"""The results page, benchmarks/README.md: every table on it made from benchmarks/results/.

    python -m benchmarks.page            # rewrite every generated part (and README.md's headline)
    python -m benchmarks.page --check    # exit 1 naming each part that differs from its files

The page's text is written by hand and holds no figure; each figure lies in a part between
``<!-- results-page:NAME:begin ... -->`` and ``<!-- results-page:NAME:end -->`` that
:data:`PARTS` makes from the result files alone, so the page can be regenerated at any time and
``--check`` (run by the suite) shows that no figure on it lacks its file. Every ratio is a
peer's time over this library's: above 1, this library is faster.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import netbed_bench, weight_sync
from .cli import module_parser
from .report import format_seconds, format_size
from .report_page import brief_section, markers, replace_between_markers
from .scale_real import markdown as scale_markdown, merged_reports
from .worker import BACK_TO_BACK

BENCHMARKS = pathlib.Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
PAGE = BENCHMARKS / "README.md"
FRONT_PAGE = BENCHMARKS.parent / "README.md"

MIB = 1 << 20


def _load(results: pathlib.Path, name: str):
    return json.loads((results / name).read_text())


def _sweep_p50(document: dict, collective: str, world_size: int, nbytes: int,
               backend: str, **match) -> Optional[float]:
    """The back-to-back p50 of one point of a sweep's file, or None."""
    for row in document["rows"]:
        if (row["collective"], row["world_size"], row["nbytes"], row["backend"]) == (
                collective, world_size, nbytes, backend) and row.get("timing") in (
                BACK_TO_BACK, None) and all(row.get(k) == v for k, v in match.items()):
            return row.get("p50_s")
    return None


def _times(ours: Optional[float], peers: Sequence[Optional[float]]) -> List[str]:
    return ["–" if ours is None or peer is None else f"{peer / ours:.2f}×" for peer in peers]


def _mean_seconds(document: dict, variant: str, workers: int) -> Optional[float]:
    seconds = [run["seconds"] for run in document["runs"] if run.get("kind") == "scaling"
               and run["variant"] == variant and run["workers"] == workers]
    return statistics.mean(seconds) if seconds else None


PS_FILE = "param_server-1000steps.json"
SPACY_FILE = "spacy-train-1000steps.json"


def headline(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """One line per question: this library's time and each peer's time over it."""
    lines = ["| question | setting | this library | `torch`'s Gloo | Ray's Gloo | MPICH | "
             "plain Ray / a server |", "|---|---|---|---|---|---|---|"]
    one = _load(results, "collectives.json")    # the latest one-node run
    for nbytes, size in ((8, "8 B"), (16 * MIB, "16 MiB")):
        ours = _sweep_p50(one, "allreduce", 4, nbytes, "ray")
        peers = [_sweep_p50(one, "allreduce", 4, nbytes, b)
                 for b in ("torch", "gloo", "mpi4py", "ray-plain")]
        lines.append(f"| one node | allreduce {size}, 4 ranks | {format_seconds(ours)} | "
                     + " | ".join(_times(ours, peers)) + " |")
    nodes = _load(results, "nodes-4x2.json")
    for nbytes, size in ((8, "8 B"), (64 * MIB, "64 MiB")):
        ours = _sweep_p50(nodes, "allreduce", 8, nbytes, "ray")
        peers = [_sweep_p50(nodes, "allreduce", 8, nbytes, b) for b in ("torch", "gloo")]
        plain = _sweep_p50(nodes, "allreduce", 8, nbytes, "ray-plain")
        lines.append(f"| across nodes | allreduce {size}, 4 nodes × 2 ranks | "
                     f"{format_seconds(ours)} | " + " | ".join(_times(ours, peers))
                     + " | – | " + _times(ours, [plain])[0] + " |")
    bed = _load(results, "netbed-4x2.json")
    for collective in ("allreduce", "broadcast"):
        ours = _sweep_p50(bed, collective, 8, 256 * MIB, "ray", link="1gbit")
        peers = [_sweep_p50(bed, collective, 8, 256 * MIB, b, link="1gbit")
                 for b in ("torch", "gloo")]
        lines.append(f"| network test bed | {collective} 256 MiB, 4 nodes × 2 ranks, 1 Gbit/s "
                     f"links | {format_seconds(ours)} | " + " | ".join(_times(ours, peers))
                     + " | – | – |")
    [sync] = _load(results, "weight-sync-4nodes.json")["results"]
    ours = sync["median_s"]["weight_sync"]
    peers = [sync["median_s"].get(p) for p in ("torch", "gloo", "object_store")]
    cells = _times(ours, peers)
    lines.append(f"| weight sync | 1 GiB model, 1 → 8 subscribers on 4 nodes | "
                 f"{format_seconds(ours)} | {cells[0]} | {cells[1]} | – | {cells[2]} |")
    ps = _load(results, PS_FILE)
    ours = _mean_seconds(ps, "allreduce-flat", 16)
    cells = _times(ours, [_mean_seconds(ps, v, 16) for v in
                          ("torch-allreduce-flat", "gloo-allreduce-flat", "ps-async")])
    lines.append(f"| parameter server job | 1000 updates of a 1.06 M-parameter MLP, 16 workers | "
                 f"{format_seconds(ours)} | {cells[0]} | {cells[1]} | – | {cells[2]} |")
    spacy = _load(results, SPACY_FILE)
    ours = _mean_seconds(spacy, "allreduce", 8)
    cells = _times(ours, [_mean_seconds(spacy, v, 8)
                          for v in ("gloo-allreduce", "parameter-server")])
    lines.append(f"| spaCy training | 1000 updates of tok2vec + ner, 8 workers | "
                 f"{format_seconds(ours)} | – | {cells[0]} | – | {cells[1]} |")
    return lines


def _sweeps(names: Sequence[str], plots: Optional[str], collectives: Optional[set] = None,
            sizes: Optional[set] = None) -> Callable[[pathlib.Path, pathlib.Path], List[str]]:
    """A part made of sweeps' files by :func:`benchmarks.report_page.brief_section`, with
    only the given collectives and sizes."""
    def part(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
        documents = []
        for name in names:
            document = _load(results, name)
            document["rows"] = [row for row in document["rows"]
                                if (collectives is None or row["collective"] in collectives)
                                and (sizes is None or row["nbytes"] in sizes)]
            documents.append(document)
        return brief_section(documents, results / plots if plots else None, page_dir)[:-1]
    return part


def netbed(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """The network bed's table (:func:`benchmarks.netbed_bench.page_table`)."""
    return netbed_bench.page_table([_load(results, name) for name in (
        "netbed-2x2.json", "netbed-4x2.json", "netbed-4x2-slow-node.json")])


WEIGHT_SYNC_FILES = ("weight-sync-1node.json", "weight-sync-4nodes.json",
                     "weight-sync-netbed-2x1gbit-1.json", "weight-sync-netbed-2x1gbit-2.json",
                     "weight-sync-netbed-4x1gbit.json",
                     "weight-sync-netbed-4x1gbit-1gib.json")


def weight_sync_table(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """The weight-sync table (:func:`benchmarks.weight_sync.page_lines`)."""
    return weight_sync.page_lines([_load(results, name) for name in WEIGHT_SYNC_FILES])


def _training_table(document: dict, variants: Sequence[str], ours: str,
                    compared: Sequence[Tuple[str, str]]) -> List[str]:
    workers = sorted({run["workers"] for run in document["runs"] if run.get("kind") == "scaling"})
    trials = len({run["seed"] for run in document["runs"] if run.get("kind") == "scaling"})
    lines = ["| workers | " + " | ".join(f"{v} s" for v in variants) + " | "
             + " | ".join(f"vs {title}" for _, title in compared) + " |",
             "|---|" + "---|" * (len(variants) + len(compared))]
    for count in workers:
        means = {v: _mean_seconds(document, v, count) for v in variants}
        cells = ["–" if means[v] is None else f"{means[v]:.1f}" for v in variants]
        mine = means[ours]
        cells += _times(mine, [_mean_seconds(document, v, count) for v, _ in compared])
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return lines + ["", f"Runtime of 1000 updates, the mean of {trials} trials; "
                        f"\"vs X\": X's runtime over `{ours}`'s."]


def param_server(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """spacy-ray's parameter server against collectives (``benchmarks.param_server``)."""
    return _training_table(_load(results, PS_FILE),
                           ("ps-async", "allreduce-flat", "rs-ag", "gloo-allreduce-flat",
                            "torch-allreduce-flat"), "allreduce-flat",
                           (("ps-async", "the server"), ("gloo-allreduce-flat", "Ray's Gloo"),
                            ("torch-allreduce-flat", "`torch`'s Gloo")))


def spacy(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """spaCy's own training on Ray workers (``benchmarks.spacy_train``)."""
    lines = _training_table(_load(results, SPACY_FILE),
                            ("parameter-server", "allreduce", "reducescatter", "gloo-allreduce"),
                            "allreduce", (("parameter-server", "the server"),
                                          ("gloo-allreduce", "Ray's Gloo")))
    accuracy = _load(results, "spacy-train-accuracy.json")["runs"]
    scores = ", ".join(f"{run['variant']} {100 * run['ents_f']:.2f}" for run in accuracy
                       if run["workers"] > 1)
    one = [run for run in accuracy if run["workers"] == 1]
    return lines + ["", f"At equal samples (100 updates, {max(r['workers'] for r in accuracy)} "
                        f"workers against one taking the whole batch, dev F-score): one worker "
                        f"{100 * one[0]['ents_f']:.2f}; {scores}."]


DDP_FILE = "torch-backend.json"


def _bytes(row: dict) -> int:
    return row["bytes"]


def ddp(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """DistributedDataParallel over this library against Gloo (``benchmarks.torch_backend``)."""
    if not (results / DDP_FILE).is_file():
        return ["No results file yet."]
    document = _load(results, DDP_FILE)
    lines = [f"- Run {document['date']}: `{document['command']}`", "",
             "| ranks | parameters | step, this library | step, Gloo | vs Gloo | "
             "communication's share of a step: this library / Gloo |", "|---|---|---|---|---|---|"]
    for row in document["ddp"]:
        ours, gloo = row["step_s"]["ray_collective/sync"], row["step_s"]["gloo/sync"]
        lines.append(f"| {row['ranks']} | {row['params'] / 1e6:.1f} M | {format_seconds(ours)} | "
                     f"{format_seconds(gloo)} | {gloo / ours:.2f}× | "
                     f"{row['ray_collective_comm_share']:.0%} / {row['gloo_comm_share']:.0%} |")
    ends = {}
    for row in document["allreduce"]:
        ends.setdefault(row["ranks"], []).append(row)
    ratios = "; ".join(
        f"{ranks} ranks: {format_size(low['bytes'])} {1 / low['ray_collective_over_gloo']:.2f}×, "
        f"{format_size(high['bytes'])} {1 / high['ray_collective_over_gloo']:.2f}×"
        for ranks, rows in sorted(ends.items())
        for low, high in [(min(rows, key=_bytes), max(rows, key=_bytes))])
    layer = document["layer_overhead"]["p50_s"]
    overhead = (layer["dist.all_reduce"] - layer["col.allreduce"]) * 1e6
    return lines + ["", f"`dist.all_reduce` of float32 against Gloo's, back to back: {ratios}; "
                        f"the torch layer adds {overhead:.1f} µs to a call (a group of one)."]


LARGE_GROUP_ROWS = ("", "join, imperative (s)", "join, declared (s)",
                    "destroy, imperative / declared (s)", "allreduce 8 B, p50 (p95)",
                    "allreduce 1 MiB, p50 (p95)", "broadcast 1 MiB, p50 (p95)",
                    "allgather 64 KiB, p50 (p95)", "barrier, p50 (p95)",
                    "results differing from numpy", "memory per rank: import / join (MiB)")
"""The rows of :func:`benchmarks.scale_real.markdown` the page shows."""


def large_groups(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """Real groups of 64 to 400 ranks (``benchmarks.scale_real``) and its plot."""
    report = merged_reports([str(results / "scale-real-64-256.json"),
                             str(results / "scale-real-largest.json")])
    plot = (results / "plots" / "scale-real-400.png").relative_to(page_dir)
    rows = [line for line in scale_markdown(report).splitlines()
            if not line.startswith("| ") or line.split(" | ")[0][2:] in LARGE_GROUP_ROWS]
    return rows + ["", f"![time against ranks]({plot})", "",
                   "Beside both Gloos at 64 ranks (the most with torch in every rank that fit "
                   "in memory):", ""] + _sweeps(("scale-gloo-64.json",), None)(results, page_dir)


MINIMAL_LOOP_MODES = (
    ("minimal-loop-back-to-back.json", "20 warm-ups, then back to back"),
    ("minimal-loop-one-warmup.json", "1 warm-up per block, after Gloo's block"),
    ("minimal-loop-pause-5ms.json", "5 ms of sleep before each call, 2 warm-ups a block"),
)
"""The minimal loop's files of the modes of a user's history, and how each mode runs."""


def across_nodes(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """The sweeps across nodes, then one line of the loop a user writes in each mode of a
    user's history (``benchmarks.minimal_loop``): this library's p50, Gloo's over it in the
    same actors, and a new group's first call and first ten calls' median."""
    lines = _sweeps(("nodes-2x2.json", "nodes-4x2.json"), None,
                    sizes={8, 16, 32, 64, 64 * MIB})(results, page_dir)
    modes = []
    for name, mode in MINIMAL_LOOP_MODES:
        for result in _load(results, name)["results"]:
            ours, gloo = result["libraries"]["ray"], result["libraries"]["gloo"]
            modes.append(f"{mode}, {result['layout'].replace('x', '×')}: "
                         f"{format_seconds(ours['slowest_p50_s'])} "
                         f"({gloo['slowest_p50_s'] / ours['slowest_p50_s']:.2f}×; "
                         f"{format_seconds(ours['first_call_s'])}, "
                         f"{format_seconds(ours['first_ten_p50_s'])})")
    return lines + ["- The loop a user writes, 8 B, ray p50 (gloo / ray in the same actors; a new "
                    "group's first call, its first ten's median): " + "; ".join(modes)
                    + " (`minimal-loop-{back-to-back,one-warmup,pause-5ms}.json`)"]


def _span(values: Sequence[float], digits: str = ".2f") -> str:
    low, high = min(values), max(values)
    return f"{low:{digits}}" if f"{low:{digits}}" == f"{high:{digits}}" else (
        f"{low:{digits}}–{high:{digits}}")


def others(results: pathlib.Path, page_dir: pathlib.Path) -> List[str]:
    """One line per other question, its answer from its file."""
    lines = ["| question | answer | file |", "|---|---|---|"]
    rpc = _load(results, "agent_observer-rpc.json")["observer_p50_ratios"]
    lines.append("| an agent serving 4 and 16 observers, against `torch.distributed.rpc` "
                 f"(observer p50) | {_span([1 / r['ray_over_torch_rpc'] for r in rpc])}× faster "
                 "| agent_observer-rpc.json |")
    batch = [row for row in _load(results, "batch_remote.json")["rows"]
             if row["table"] == "actors" and row["actors"] == 64 and row["size"] == MIB]
    if batch:
        lines.append(f"| `batch_remote` against a foreach loop, 64 actors, 1 MiB argument | "
                     f"submit {batch[0]['submit_speedup']:.1f}×, all done "
                     f"{batch[0]['done_speedup']:.1f}× sooner | batch_remote.json |")
    join = _load(results, "join-nodes-4x2.json")["median"]
    lines.append(f"| joining a group over 4 nodes × 2 ranks (median) | "
                 f"{join['streams']['join_s']:.2f} s, with the first allreduce "
                 f"{join['streams']['join_and_call_s']:.2f} s | join-nodes-4x2.json |")
    elastic = [row for name in ("elastic-1node-8-64.json", "elastic-4x8.json")
               for row in _load(results, name)]
    lines.append("| elastic groups, a rank killed: to the survivors' first correct allreduce "
                 "(p50 / p95), and growing back by one (p50) | " + "; ".join(
                     f"{row['world_size']} ranks on {row['nodes']} node(s) "
                     f"{row['kill_to_correct_allreduce']['p50_s']:.2f} / "
                     f"{row['kill_to_correct_allreduce']['p95_s']:.2f} s, "
                     f"{row['grow_by_one']['p50_s']:.2f} s" for row in elastic)
                 + " | elastic-1node-8-64.json, elastic-4x8.json |")
    kills = _load(results, "fault_detection.json")
    lines.append(f"| a rank SIGKILLed among {kills[0]['world_size']} during allreduce: to every "
                 f"survivor's `PeerDiedError` (p50 / p95) | " + "; ".join(
                     f"{format_size(row['bytes'])} {row['p50_s'] * 1e3:.0f} / "
                     f"{row['p95_s'] * 1e3:.0f} ms" for row in kills) + " | fault_detection.json |")
    cuts = _load(results, "netbed-cuts.json")
    worst = [t for point in cuts["summary"].values() for t in point["worst_s"]]
    lines.append(f"| a node's cable cut on the test bed ({cuts['cuts']} cuts): until every rank "
                 f"elsewhere names the cut node's ranks | median "
                 f"{statistics.median(worst):.2f} s, at most {max(worst):.2f} s | "
                 f"netbed-cuts.json |")
    cost = _load(results, "call_overhead.json")
    largest = cost["plan_choice"][-1]
    lines.append(f"| the call path alone: allreduce 8 B in a group of one rank; finding a "
                 f"prepared plan at {largest['ranks']} ranks | "
                 f"{cost['world_size_one']['allreduce_s'] * 1e6:.1f} µs (numpy's add "
                 f"{cost['world_size_one']['np_add_s'] * 1e6:.1f} µs); "
                 f"{largest['choice_s'] * 1e6:.2f} µs | call_overhead.json |")
    return lines


PARTS: Dict[str, Callable[[pathlib.Path, pathlib.Path], List[str]]] = {
    "headline": headline,
    "one-node": _sweeps(("allreduce.json", "allreduce-64.json"), "plots/allreduce",
                        sizes={8, 64 << 10, MIB, 64 * MIB}),
    "collectives": _sweeps(("collectives.json",), "plots/collectives",
                           {"reduce", "broadcast", "allgather", "reducescatter", "gather",
                            "scatter", "alltoall", "sendrecv", "barrier"}, {0, 8, 16, 16 * MIB}),
    "across-nodes": across_nodes,
    "netbed": netbed,
    "weight-sync": weight_sync_table,
    "param-server": param_server,
    "spacy": spacy,
    "ddp": ddp,
    "large-groups": large_groups,
    "others": others,
}
"""Each generated part of the page: its name and what makes its lines from the results."""

FRONT_PAGE_PARTS = ("headline",)
"""The parts README.md shows too."""


def generated(name: str, results: pathlib.Path, page_dir: pathlib.Path) -> str:
    """One part, markers included.

    Args:
        name: a key of :data:`PARTS`.
        results: the results directory.
        page_dir: the directory the page's links are relative to.

    Returns:
        The part's text.
    """
    begin, end = markers(name)
    return "\n".join([begin, "", *PARTS[name](results, page_dir), "", end])


def regenerate(page: pathlib.Path, results: pathlib.Path,
               names: Sequence[str]) -> Tuple[str, List[str]]:
    """The page with the given parts made anew from ``results``.

    Args:
        page: the markdown file.
        results: the results directory.
        names: the parts to make.

    Returns:
        The new text and the names of the parts that changed.

    Raises:
        ValueError: the page lacks a part's markers.
    """
    text = page.read_text()
    changed = []
    for name in names:
        new = replace_between_markers(text, generated(name, results, page.parent.resolve()),
                                      name)
        if new != text:
            changed.append(name)
        text = new
    return text, changed


def main(argv: Optional[List[str]] = None) -> int:
    """Rewrite, or with ``--check`` compare, every generated part of the pages.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when ``--check`` finds a part that differs from its files.
    """
    parser = module_parser("benchmarks.page", __doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a part differs from its files")
    arguments = parser.parse_args(sys.argv[1:] if argv is None else argv)
    status = 0
    for page, names in ((PAGE, list(PARTS)), (FRONT_PAGE, FRONT_PAGE_PARTS)):
        text, changed = regenerate(page, RESULTS, names)
        if arguments.check:
            if changed:
                print(f"{page.name}: {', '.join(changed)} differ from benchmarks/results/; "
                      f"run python -m benchmarks.page")
                status = 1
        else:
            page.write_text(text)
            print(f"wrote {page}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
