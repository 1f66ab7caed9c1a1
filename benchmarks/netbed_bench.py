"""Collectives on the network bed (``benchmarks.netbed``): every node behind a link of a set
rate, this library beside ``torch.distributed``'s Gloo and ``ray.util.collective``'s Gloo in the
same run, each row with the time its link bound allows and the ratio to it.

``python -m benchmarks.netbed_bench --nodes 2 --ranks-per-node 2 --links 1gbit,10gbit,unlimited
--json benchmarks/results/netbed-2x2.json`` brings one bed up, and for each link rate sets it on
every node (``tc``, both directions) and runs ``python -m benchmarks`` in the head node's
namespace against the bed's cluster (``--ray-address``: rank r on node ``r // R``), small sizes
with the CLI's iteration counts and large ones with few (a 256 MiB call takes seconds at
1 Gbit/s); the bed is removed at the end, also on failure.

The link bound of a row is the bytes the busiest link must carry, in one direction, for the
collective, whatever the algorithm, divided by the rate (every link full duplex at ``rate``):

- allreduce of S bytes over N nodes: each node sends (and receives) ``2 (N-1)/N S``;
- broadcast: the root's node sends S, every other node receives S;
- allgather (S the gathered output) and reducescatter (S the input): ``(N-1)/N S``;
- sendrecv (``benchmarks.peers.round_trip``: rank 0 sends S to rank 1, which sends it back):
  2 S, one way and then the other, so the round trip takes at least 2 S over the rate (run it
  with one rank per node, or ranks 0 and 1 share a node and no link).

``ratio_to_bound`` is the row's p50 over that time (1.0: the link's speed, never below);
``bound_fraction`` its inverse, the share of the link bound's bandwidth reached. An unlimited
link (veth at memory speed, on this machine's cores) has no bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from . import netbed
from .cli import module_parser

LINK_BYTES = {
    "allreduce": lambda nbytes, nodes: 2 * (nodes - 1) / nodes * nbytes,
    "broadcast": lambda nbytes, nodes: float(nbytes),
    "allgather": lambda nbytes, nodes: (nodes - 1) / nodes * nbytes,
    "reducescatter": lambda nbytes, nodes: (nodes - 1) / nodes * nbytes,
    "sendrecv": lambda nbytes, nodes: 2.0 * nbytes,
}
"""Bytes the busiest link carries one way, by collective, for ``nbytes`` over ``nodes`` (the
round trip's two ways one after the other, as if one way)."""
LARGE_BYTES = 16 << 20
"""From this size on, a point runs ``--large-iters`` timed iterations."""
SWEEP_TIMEOUT_S = 3600


def link_bound_s(collective: str, nbytes: int, nodes: int, rate: Optional[str]) -> Optional[float]:
    """Seconds the busiest link needs for ``collective`` of ``nbytes`` over ``nodes`` nodes.

    Args:
        collective: one of :data:`LINK_BYTES`.
        nbytes: the size as the CLI counts it (``benchmarks.collectives``).
        nodes: nodes, one link each.
        rate: the links' rate (``tc`` notation), or None for unlimited.

    Returns:
        Seconds, or None on an unlimited link or a collective without a bound.
    """
    bits = netbed.parse_rate(rate)
    if bits is None or collective not in LINK_BYTES or nodes < 2:
        return None
    return LINK_BYTES[collective](nbytes, nodes) * 8 / bits


def annotate(rows: List[dict], nodes: int, rate: Optional[str],
             label: Optional[str] = None) -> List[dict]:
    """The rows with their link's rate, link bound and ratio to it.

    Args:
        rows: ``python -m benchmarks --json``'s rows.
        nodes: the bed's nodes.
        rate: the rate of the slowest link (it sets the bound), or None for unlimited.
        label: what the rows' ``link`` says (default: ``rate``).

    Returns:
        New rows with ``link``, ``link_bound_s``, ``ratio_to_bound`` and ``bound_fraction``.
    """
    annotated = []
    for row in rows:
        bound = link_bound_s(row["collective"], row["nbytes"], nodes, rate)
        p50 = row.get("p50_s")
        ratio = p50 / bound if bound and p50 else None
        annotated.append(dict(row, link=label or rate or "unlimited", link_bound_s=bound,
                              ratio_to_bound=ratio,
                              bound_fraction=1 / ratio if ratio else None))
    return annotated


def _sweep(bed: netbed.Bed, arguments: argparse.Namespace, sizes: List[str],
           iterations: List[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", dir=bed.layout.directory) as out:
        argv = [sys.executable, "-m", "benchmarks", "--nodes", str(arguments.nodes),
                "--ranks-per-node", str(arguments.ranks_per_node), "--ray-address",
                bed.layout.head_address, "--backends", arguments.backends, "--collective",
                arguments.collectives, "--bytes", ",".join(sizes), "--timeout",
                str(arguments.timeout), "--json", out.name, "--quiet", *iterations]
        done = bed.run(argv, timeout=SWEEP_TIMEOUT_S)
        if done.returncode:
            raise netbed.BedError(f"the sweep failed ({done.returncode}): "
                                  f"{done.stderr[-3000:]}")
        print(done.stdout, flush=True)
        return json.loads(pathlib.Path(out.name).read_text())


def run(arguments: argparse.Namespace) -> dict:
    """Bring a bed up, sweep every link rate, remove the bed.

    Returns:
        ``{"metadata": ..., "rows": [...], "notes": [...]}`` (rows annotated).
    """
    from .cli import parse_size
    sizes = [text for text in arguments.bytes.split(",") if text]
    small = [s for s in sizes if parse_size(s) < LARGE_BYTES]
    large = [s for s in sizes if parse_size(s) >= LARGE_BYTES]
    rows: List[dict] = []
    notes: List[str] = []
    metadata: Dict[str, object] = {}
    rates = [None if netbed.parse_rate(link) is None else link
             for link in arguments.links.split(",")]
    with netbed.Bed(arguments.nodes, rates[0]) as bed:
        for rate in rates:
            for node in range(arguments.nodes):
                netbed.set_rate(bed.layout, node, rate)
            label, bound_rate = rate, rate
            if arguments.slow_node is not None:
                netbed.set_rate(bed.layout, arguments.slow_node, arguments.slow_link)
                label = f"{rate or 'unlimited'}, node {arguments.slow_node} {arguments.slow_link}"
                bound_rate = arguments.slow_link
            for part, iterations in ((small, []), (large, [
                    "--iters", str(arguments.large_iters), "--warmup", "1", "--blocks", "2"])):
                if not part:
                    continue
                result = _sweep(bed, arguments, part, iterations)
                rows += annotate(result["rows"], arguments.nodes, bound_rate, label)
                notes += result.get("notes", [])
                metadata = result["metadata"]
    metadata = dict(metadata, netbed={"nodes": arguments.nodes,
                                      "ranks_per_node": arguments.ranks_per_node,
                                      "links": arguments.links, "pin_cores": True,
                                      "slow_node": arguments.slow_node,
                                      "slow_link": arguments.slow_link,
                                      "command": " ".join(["python -m benchmarks.netbed_bench",
                                                           *sys.argv[1:]])})
    return {"metadata": metadata, "rows": rows, "notes": notes}


def format_rows(rows: List[dict]) -> str:
    """A plain table of the annotated rows."""
    lines = [f"{'link':>9} {'collective':>10} {'bytes':>10} {'backend':>8} {'p50 ms':>9} "
             f"{'bound ms':>9} {'p50/bound':>9} {'busbw GB/s':>10}"]
    for row in rows:
        if row.get("timing") not in (None, "back-to-back"):
            continue
        p50 = row.get("p50_s")
        bound = row.get("link_bound_s")
        lines.append(
            f"{row['link']:>9} {row['collective']:>10} {row['nbytes']:>10} {row['backend']:>8} "
            f"{(p50 * 1e3 if p50 else float('nan')):>9.3f} "
            f"{(bound * 1e3 if bound else float('nan')):>9.3f} "
            f"{(row['ratio_to_bound'] or float('nan')):>9.2f} "
            f"{(row.get('busbw_gbps') or float('nan')):>10.3f}"
            + (f"  error: {row['error'][:80]}" if row.get("error") else ""))
    return "\n".join(lines)


def minimal_loop_on_bed(options, layout: Tuple[int, int]) -> dict:
    """``python -m benchmarks.minimal_loop --netbed LINK``'s layout: the loop a user writes on a
    network bed of the layout's nodes, links at ``options.netbed``, re-run as the driver in the
    head node's namespace (its options passed as JSON), the bed removed afterwards, also on
    failure.

    Args:
        options: the loop's ``LoopOptions``.
        layout: (nodes, ranks per node).

    Returns:
        As ``minimal_loop.measure_layout``, with the ``link``.

    Raises:
        RuntimeError: the loop on the bed failed (its output's end is in the message).
    """
    rate = None if netbed.parse_rate(options.netbed) is None else options.netbed
    with netbed.Bed(layout[0], rate, env=netbed.checkout_environment()) as bed:
        inner = dataclasses.replace(options, layouts=(layout,), netbed=None,
                                    ray_address=bed.layout.head_address)
        out = f"{bed.layout.directory}/minimal-loop.json"
        done = bed.run([sys.executable, "-m", "benchmarks.minimal_loop", "--options",
                        json.dumps(dataclasses.asdict(inner)), "--json", out],
                       timeout=options.timeout_s * (4 + options.blocks))
        if done.returncode:
            raise RuntimeError(f"the loop on the bed failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr)[-3000:]}")
        with open(out) as handle:
            return dict(json.load(handle)["results"][0], link=options.netbed)


PAGE_SIZES = (8, 64 << 20, 256 << 20)
"""The sizes the page shows, one column pair each; only those of :data:`BOUNDED_BYTES` or more
get a bound (a small call is latency, which the bed does not model)."""
BOUNDED_BYTES = 1 << 20
PEERS = ("torch", "gloo")


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"


def _bounded(nbytes: int) -> bool:
    return nbytes >= BOUNDED_BYTES


def _point_cells(rows: Dict[str, dict], nbytes: int) -> List[str]:
    """This library's p50 (with its ratio to the link bound, from :data:`BOUNDED_BYTES` on)
    and the peers' p50 over it."""
    ray = rows.get("ray")
    if ray is None:
        return ["–", "–"]
    ratio = ray.get("ratio_to_bound") if _bounded(nbytes) else None
    own = _ms(ray["p50_s"]) + (f" ({ratio:.2f}×)" if ratio else "")
    peers = " / ".join(f"{rows[b]['p50_s'] / ray['p50_s']:.2f}×" if b in rows else "–"
                       for b in PEERS)
    return [own, peers]


def page_table(documents: List[dict]) -> List[str]:
    """The results page's table: one row per world, link and collective; per size of
    :data:`PAGE_SIZES`, this library's p50 with its ratio to the link bound, and each peer's
    p50 over this library's.

    Args:
        documents: this module's JSON documents.

    Returns:
        Markdown lines.
    """
    heads = [f"{_size(n)}: ray p50{' (/ bound)' if _bounded(n) else ''} | vs torch / gloo"
             for n in PAGE_SIZES]
    lines = ["| ranks | link | collective | " + " | ".join(heads) + " |",
             "|---|---|---|" + "---|---|" * len(PAGE_SIZES)]
    for document in documents:
        bed = document["metadata"]["netbed"]
        world = f"{bed['nodes']}×{bed['ranks_per_node']}"
        by_point: Dict[tuple, Dict[int, Dict[str, dict]]] = {}
        for row in document["rows"]:
            if row.get("timing") == "back-to-back" and not row.get("error"):
                point = by_point.setdefault((row["link"], row["collective"]), {})
                point.setdefault(row["nbytes"], {})[row["backend"]] = row
        for (link, collective), sizes in by_point.items():
            cells = [world, link, collective]
            for nbytes in PAGE_SIZES:
                cells += _point_cells(sizes.get(nbytes, {}), nbytes)
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.netbed_bench``: see the module's docstring.

    Returns:
        The exit status.
    """
    parser = module_parser("benchmarks.netbed_bench", __doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--links", default="1gbit,10gbit,unlimited",
                        help="link rates to sweep, in tc's notation, or unlimited")
    parser.add_argument("--collectives", default="allreduce,broadcast")
    parser.add_argument("--backends", default="ray,torch,gloo")
    parser.add_argument("--bytes", default="8,64M,256M")
    parser.add_argument("--large-iters", type=int, default=6,
                        help=f"timed iterations of a point of {LARGE_BYTES >> 20} MiB or more")
    parser.add_argument("--slow-node", type=int, default=None,
                        help="give this node --slow-link instead (its link sets the bound)")
    parser.add_argument("--slow-link", default="1gbit")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", type=pathlib.Path, default=None)
    arguments = parser.parse_args(argv)
    reason = netbed.unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    os.environ.setdefault("PYTHONPATH", str(pathlib.Path(__file__).resolve().parent.parent))
    result = run(arguments)
    print(format_rows(result["rows"]))
    if arguments.json_path is not None:
        arguments.json_path.parent.mkdir(parents=True, exist_ok=True)
        arguments.json_path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {arguments.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
