"""Weight sync against what users build by hand: a model-shaped state dict from one or two
publishers to N subscribers, seconds per sync, GB/s per subscriber, and the ratio to the limit.

    python -m benchmarks.weight_sync --nodes 1 --subscribers 4 --model-mib 256
    python -m benchmarks.weight_sync --nodes 4 --subscribers 7 --model-mib 1024

Peers, each done the way its users do it, in the same actors and on the same tensors,
interleaved trial by trial:

- ``weight_sync``: this library's ``publish_weights`` / ``receive_weights`` (every tensor
  changes between versions, so every bucket goes; ``--changed`` adds a version where only that
  fraction of the tensors changed, the rest skipped by the digest);
- ``object_store``: ``ray.put`` of the state dict once, each subscriber ``ray.get``s it and
  copies into its own tensors;
- ``gloo``: ``ray.util.collective`` with Gloo, the first publisher broadcasting tensor by
  tensor to a group of itself and the subscribers;
- ``torch`` / ``torch_bucketed``: ``torch.distributed``'s Gloo group, per tensor, and with the
  tensors flattened into 25 MiB buckets (DDP's default bucket size);
- ``broadcast``: this library's own ``broadcast``, tensor by tensor.

The limit on one node is the machine's copy bandwidth: a plain copy of the model's bytes in one
subscriber, timed in the run, times the subscribers (each subscriber's bytes are copied at
least once); the table gives each peer's time over that bound. Times are the driver's, from the
first call to the last member's return (an idle barrier on every group first), median of the
trials.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import statistics
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .nodes import local_cluster_driver, pick_nodes, pinned

PEERS = ("weight_sync", "object_store", "gloo", "torch", "torch_bucketed", "broadcast")
TORCH_BUCKET_BYTES = 25 << 20


def model_shapes(total_bytes: int, tensors: int = 300, itemsize: int = 4) -> Dict[str, tuple]:
    """A model-shaped state dict's shapes: ``tensors`` tensors from 4 KiB up, log-uniform, a
    few large ones (embeddings) capped at 128 MiB, about ``total_bytes`` in all."""
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(4 << 10), np.log(16 << 20), tensors))
    sizes *= total_bytes / sizes.sum()
    sizes = np.minimum(sizes, 128 << 20)
    sizes[0] += total_bytes - sizes.sum()
    elements = np.maximum(1, (sizes // itemsize).astype(int))
    return {f"layer.{i:03d}.weight": (int(n),) for i, n in enumerate(elements)}


class SyncMember:
    """One member actor: its state dict and each peer's part."""

    def __init__(self, shapes: Dict[str, tuple], dtype: str, seed: int):
        import torch
        self.torch = torch
        gen = torch.Generator().manual_seed(seed)
        kind = getattr(torch, dtype)
        self.weights = {k: torch.randn(s, generator=gen).to(kind) for k, s in shapes.items()}
        self.rank = None

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def join(self, rank: Optional[int], world: int) -> None:
        """Join the per-tensor peers' groups (the weight sync is declared by the driver)."""
        import datetime

        import ray.util.collective as ray_col
        import torch.distributed as dist

        import ray_collective as col
        self.rank = rank
        if rank is None:
            return
        col.init_collective_group(world, rank, backend="ray", group_name="per-tensor",
                                  timeout=600)
        ray_col.init_collective_group(world, rank, backend="gloo", group_name="gloo",
                                      gloo_timeout=600_000)
        # ray.util.collective's Gloo made torch's default group: torch's own is a new one.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))

    def align(self) -> None:
        import ray.util.collective as ray_col
        import torch.distributed as dist

        import ray_collective as col
        if self.rank is not None:
            col.barrier("per-tensor")
            ray_col.barrier("gloo")
            dist.barrier(group=self.group)

    def step(self, fraction: float) -> None:
        """A training step: ``fraction`` of the tensors change (every one for 1.0)."""
        names = sorted(self.weights)
        for name in names[:max(1, int(round(len(names) * fraction)))]:
            self.weights[name].add_(1)

    def weight_sync(self, role: str, version: int) -> int:
        import ray_collective as col
        if role == "publisher":
            return col.publish_weights(self.weights, "bench", version=version)
        return col.receive_weights(self.weights, "bench")

    def moved(self) -> int:
        import ray_collective as col
        return col.weight_sync_report("bench").moved_bytes

    def put(self) -> list:
        import ray
        return [ray.put({k: v.numpy() if v.dtype != self.torch.bfloat16 else
                         v.view(self.torch.int16).numpy() for k, v in self.weights.items()})]

    def get(self, boxed: list) -> None:
        import ray
        got = ray.get(boxed[0])
        for k, v in self.weights.items():
            target = v.numpy() if v.dtype != self.torch.bfloat16 else v.view(
                self.torch.int16).numpy()
            np.copyto(target, got[k])

    def gloo(self) -> None:
        import ray.util.collective as ray_col
        for v in self.weights.values():
            ray_col.broadcast(v, 0, "gloo")

    def torch_per_tensor(self) -> None:
        import torch.distributed as dist
        for v in self.weights.values():
            dist.broadcast(v, 0, group=self.group)

    def torch_bucketed(self) -> None:
        import torch.distributed as dist
        torch = self.torch
        bucket: List = []
        size = 0
        items = list(self.weights.values())
        for i, v in enumerate(items):
            bucket.append(v)
            size += v.numel() * v.element_size()
            if size >= TORCH_BUCKET_BYTES or i == len(items) - 1:
                flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else \
                    bucket[0].reshape(-1)
                dist.broadcast(flat, 0, group=self.group)
                if len(bucket) > 1 and self.rank:
                    offset = 0
                    for t in bucket:
                        t.reshape(-1).copy_(flat[offset:offset + t.numel()])
                        offset += t.numel()
                bucket, size = [], 0

    def broadcast(self) -> None:
        import ray_collective as col
        for v in self.weights.values():
            col.broadcast(v, 0, "per-tensor")

    def copy_seconds(self) -> float:
        """A plain copy of the model's bytes, warm, timed here: the copy bound's unit."""
        torch = self.torch
        flat = [v.reshape(-1) for v in self.weights.values()]
        copies = [torch.empty_like(v) for v in flat]
        for c, v in zip(copies, flat):
            c.copy_(v)
        start = time.perf_counter()
        for c, v in zip(copies, flat):
            c.copy_(v)
        return time.perf_counter() - start

    def die_at_bucket(self, bucket: int, path: str) -> None:
        """SIGKILL this process as it comes to its ``bucket``-th bucket of the next sync,
        writing the wall-clock time of its death to ``path`` first."""
        import os
        import signal

        from ray_collective.weight_sync import transfer
        original, seen = transfer.segment_views, [0]

        def views(*args):
            seen[0] += 1
            if seen[0] > bucket:
                with open(path, "w") as out:
                    out.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)

        transfer.segment_views = views

    def sync_until_failure(self, role: str, version: int) -> tuple:
        """A sync that is expected to fail: (the error's type, wall-clock time it returned)."""
        try:
            self.weight_sync(role, version)
            return "delivered", time.time()
        except Exception as err:  # the sync's error is the measurement
            return type(err).__name__, time.time()

    def fingerprint(self) -> str:
        import hashlib
        h = hashlib.sha256()
        for k in sorted(self.weights):
            h.update(self.weights[k].view(self.torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _timed(refs_of) -> float:
    import ray
    start = time.perf_counter()
    ray.get(refs_of())
    return time.perf_counter() - start


def measure(options: argparse.Namespace, nodes: int, subscribers: int) -> dict:
    """One configuration: every peer, ``options.trials`` interleaved trials."""
    import ray

    import ray_collective as col
    shapes = model_shapes(options.model_mib << 20, options.tensors,
                          2 if options.dtype == "bfloat16" else 4)
    publishers = options.publishers
    node_ids = pick_nodes(nodes) if nodes > 1 else [None]
    members = publishers + subscribers
    # Publishers on the first nodes, one each where there are enough; the subscribers after.
    placement = [node_ids[i % len(node_ids)] for i in range(members)]
    actor = ray.remote(num_cpus=0)(SyncMember)
    # Publishers are replicas of one model (one seed); each subscriber starts from its own.
    actors = [actor.options(**pinned(node)).remote(shapes, options.dtype,
                                                   0 if i < publishers else i)
              for i, node in enumerate(placement)]
    ray.get([a.node.remote() for a in actors])
    pubs, subs = actors[:publishers], actors[publishers:]
    # The per-tensor peers' groups: the first publisher and every subscriber.
    world = 1 + subscribers
    ray.get([a.join.remote(0 if i == 0 else (None if i < publishers else i - publishers + 1),
                           world) for i, a in enumerate(actors)])
    col.declare_weight_sync(pubs, subs, name="bench", timeout=600)
    version = [0]

    def sync_all():
        version[0] += 1
        return ([p.weight_sync.remote("publisher", version[0]) for p in pubs]
                + [s.weight_sync.remote("subscriber", 0) for s in subs])

    runs = {
        "weight_sync": sync_all,
        "object_store": lambda: [s.get.remote(pubs[0].put.remote()) for s in subs],
        "gloo": lambda: [a.gloo.remote() for a in [pubs[0]] + subs],
        "torch": lambda: [a.torch_per_tensor.remote() for a in [pubs[0]] + subs],
        "torch_bucketed": lambda: [a.torch_bucketed.remote() for a in [pubs[0]] + subs],
        "broadcast": lambda: [a.broadcast.remote() for a in [pubs[0]] + subs],
    }
    peers = [p for p in options.peers if p in runs]
    times: Dict[str, List[float]] = {p: [] for p in peers}
    ray.get(sync_all())                                   # the first, full version
    changed: List[float] = []
    for _ in range(options.trials):
        for peer in peers:
            ray.get([a.step.remote(1.0) for a in pubs])
            ray.get([a.align.remote() for a in [pubs[0]] + subs])
            times[peer].append(_timed(runs[peer]))
            if peer == "weight_sync" and options.changed:
                # The next version, right after this one: only ``changed`` of it differs.
                ray.get([a.step.remote(options.changed) for a in pubs])
                changed.append(_timed(sync_all))
    if options.membership:
        result_extra = membership_costs(pubs, subs, version, shapes, options)
    else:
        result_extra = {}
    truth = ray.get(pubs[0].fingerprint.remote())
    correct = all(f == truth for f in ray.get([s.fingerprint.remote() for s in subs]))
    copy_s = statistics.median(ray.get([subs[0].copy_seconds.remote() for _ in range(3)]))
    model_bytes = sum(int(np.prod(s)) for s in shapes.values()) * (
        2 if options.dtype == "bfloat16" else 4)
    col.destroy_weight_sync("bench")
    for a in set(actors) | set(subs):
        ray.kill(a)
    medians = {p: statistics.median(t) for p, t in times.items()}
    result = {"nodes": nodes, "publishers": publishers, "subscribers": subscribers,
              "model_bytes": model_bytes, "tensors": len(shapes), "dtype": options.dtype,
              "trials": options.trials, "seconds": times, "median_s": medians,
              "copy_bound_s": copy_s * subscribers, "subscribers_hold_the_model": correct,
              **result_extra}
    if changed:
        result["changed_fraction"] = options.changed
        result["changed_median_s"] = statistics.median(changed)
    return result


def membership_costs(pubs: list, subs: list, version: list, shapes: dict,
                     options: argparse.Namespace) -> dict:
    """Seconds to add one subscriber between versions, and how long after a subscriber's
    SIGKILL mid-sync every other member returns (then the next version to the survivors)."""
    import os
    import tempfile

    import ray

    import ray_collective as col
    node = ray.get(subs[-1].node.remote())
    newcomer = ray.remote(num_cpus=0)(SyncMember).options(**pinned(
        node if options.nodes > 1 else None)).remote(shapes, options.dtype, 99)
    subs.append(newcomer)       # a subscriber from now on (the caller checks its tensors)
    ray.get(newcomer.node.remote())
    start = time.perf_counter()
    col.add_weight_subscribers("bench", [newcomer])
    add_s = time.perf_counter() - start
    members = list(subs)
    version[0] += 1
    ray.get([p.weight_sync.remote("publisher", version[0]) for p in pubs]
            + [s.weight_sync.remote("subscriber", 0) for s in members])
    victim, survivors = members[0], members[1:]
    subs.remove(victim)
    path = os.path.join(tempfile.mkdtemp(), "death")
    ray.get(victim.die_at_bucket.remote(2, path))
    ray.get([a.step.remote(1.0) for a in pubs])
    version[0] += 1
    refs = ([p.sync_until_failure.remote("publisher", version[0]) for p in pubs]
            + [s.sync_until_failure.remote("subscriber", 0) for s in survivors])
    victim.weight_sync.remote("subscriber", 0)
    outcomes = ray.get(refs, timeout=300)
    with open(path) as source:
        died = float(source.read())
    version[0] += 1
    start = time.perf_counter()
    ray.get([p.weight_sync.remote("publisher", version[0]) for p in pubs]
            + [s.weight_sync.remote("subscriber", 0) for s in survivors])
    return {"add_subscriber_s": add_s,
            "after_death": [kind for kind, _ in outcomes],
            "returned_after_death_s": max(t for _, t in outcomes) - died,
            "next_version_to_survivors_s": time.perf_counter() - start}


def format_result(r: dict) -> str:
    """One configuration as a table."""
    mib = r["model_bytes"] / (1 << 20)
    lines = [f"{mib:.0f} MiB ({r['tensors']} tensors, {r['dtype']}), {r['publishers']} "
             f"publisher(s) -> {r['subscribers']} subscribers on {r['nodes']} node(s); copy "
             f"bound {r['copy_bound_s']:.3f} s; subscribers hold the model: "
             f"{r['subscribers_hold_the_model']}",
             "| peer | s per sync | GB/s per subscriber | x copy bound | x weight_sync |",
             "|---|---|---|---|---|"]
    ours = r["median_s"].get("weight_sync")
    for peer, s in r["median_s"].items():
        ratio = f"{s / ours:.2f}" if ours else "-"
        lines.append(f"| {peer} | {s:.3f} | {r['model_bytes'] / s / 1e9:.2f} | "
                     f"{s / r['copy_bound_s']:.2f} | {ratio} |")
    if "link_bound_s" in r:
        lines.append(f"link {r['link']}: bound {r['link_bound_s']:.3f} s; weight_sync at "
                     f"{ours / r['link_bound_s']:.2f}x the bound")
    if "changed_median_s" in r:
        lines.append(f"a version with {r['changed_fraction']:.0%} of the tensors changed: "
                     f"{r['changed_median_s']:.3f} s ({r['changed_median_s'] / ours:.1%} of a "
                     f"full sync)")
    if "add_subscriber_s" in r:
        lines.append(f"adding a subscriber: {r['add_subscriber_s']:.3f} s; a subscriber killed "
                     f"mid-sync: every other member returned {r['returned_after_death_s']:.3f} s "
                     f"after its death ({', '.join(sorted(set(r['after_death'])))}); the next "
                     f"version to the survivors {r['next_version_to_survivors_s']:.3f} s")
    return "\n".join(lines)


PAGE_PEERS = ("object_store", "gloo", "torch", "torch_bucketed", "broadcast")


def page_lines(documents: Sequence[dict]) -> List[str]:
    """The results page's table: one row per configuration of every results file."""
    lines = ["| nodes | model | publishers → subscribers | weight_sync | GB/s per subscriber | "
             "× bound | " + " | ".join(f"{p} / weight_sync" for p in PAGE_PEERS)
             + " | 2 % changed / full | add a subscriber | others return after a death |",
             "|" + "---|" * (9 + len(PAGE_PEERS))]
    for document in documents:
        for r in document["results"]:
            ours = r["median_s"]["weight_sync"]
            if "link_bound_s" in r:
                bound = f"{ours / r['link_bound_s']:.2f} (link)"
            else:
                bound = f"{ours / r['copy_bound_s']:.2f} (copy)" if r["nodes"] == 1 else "–"
            where = f"{r['nodes']}" + (f", {r['link']} links" if "link" in r else "")
            cells = [where, f"{round(r['model_bytes'] / (1 << 20))} MiB {r['dtype']}",
                     f"{r['publishers']} → {r['subscribers']}", f"{ours:.3f} s",
                     f"{r['model_bytes'] / ours / 1e9:.2f}", bound]
            cells += [f"{r['median_s'][p] / ours:.2f}×" if p in r["median_s"] else "–"
                      for p in PAGE_PEERS]
            cells.append(f"{r['changed_median_s'] / ours:.0%}" if "changed_median_s" in r
                         else "–")
            cells.append(f"{r['add_subscriber_s']:.2f} s" if "add_subscriber_s" in r else "–")
            cells.append(f"{r['returned_after_death_s']:.2f} s" if "returned_after_death_s" in r
                         else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--subscribers", default="4",
                        help="comma-separated subscriber counts")
    parser.add_argument("--publishers", type=int, default=1)
    parser.add_argument("--model-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--changed", type=float, default=0.02,
                        help="also time a version where this fraction changed (0: not)")
    parser.add_argument("--membership", action="store_true",
                        help="also time adding a subscriber and a subscriber's death mid-sync")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--ray-address", help="run on this cluster (nodes carrying the "
                                              "resources node0, node1, ...) instead of "
                                              "starting one")
    parser.add_argument("--netbed-link", metavar="RATE",
                        help="run on the network bed (benchmarks.netbed): --nodes nodes, each "
                             "behind a link of RATE (tc notation, e.g. 1gbit)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    import ray
    options = build_parser().parse_args(argv)
    options.peers = [p.strip() for p in options.peers.split(",") if p.strip()]
    unknown = sorted(set(options.peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    if options.netbed_link:
        return on_bed(options)
    results = []
    counts = [int(n) for n in options.subscribers.split(",")]
    if options.ray_address:
        ray.init(address=options.ray_address, log_to_driver=False)
        try:
            results = [measure(options, options.nodes, n) for n in counts]
        finally:
            ray.shutdown()
    elif options.nodes > 1:
        with local_cluster_driver(options.nodes):
            results = [measure(options, options.nodes, n) for n in counts]
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            results = [measure(options, 1, n) for n in counts]
        finally:
            ray.shutdown()
    for r in results:
        print(format_result(r))
    if options.json:
        with open(options.json, "w") as out:
            json.dump({"command": "python -m benchmarks.weight_sync " + " ".join(
                argv if argv is not None else sys.argv[1:]), "results": results}, out, indent=1)
    return 0


def link_bound_s(result: dict, rate_bps: float) -> float:
    """The least time the bed's links allow a sync: every node with subscribers takes the model
    in but what a publisher on it holds, every publisher's node sends its share (publishers on
    nodes 0..P-1, subscriber i on node (P + i) mod N, as ``measure`` places them)."""
    publishers, nodes = result["publishers"], result["nodes"]
    share = result["model_bytes"] / publishers
    taking = {(publishers + i) % nodes for i in range(result["subscribers"])}
    into = result["model_bytes"] - (share if taking <= set(range(publishers)) else 0)
    return max(into, share) * 8 / rate_bps


def on_bed(options: argparse.Namespace) -> int:
    """Bring a network bed up, run this benchmark in its head node's namespace against its
    cluster, give every result its link and link bound, remove the bed."""
    from . import netbed
    problem = netbed.unavailable()
    if problem:
        raise SystemExit(f"the network bed cannot run here: {problem}")
    rate = netbed.parse_rate(options.netbed_link)
    with netbed.Bed(options.nodes, options.netbed_link) as bed:
        out = os.path.join(bed.layout.directory, "weight-sync.json")
        inner = [sys.executable, "-m", "benchmarks.weight_sync", "--nodes", str(options.nodes),
                 "--subscribers", options.subscribers, "--publishers", str(options.publishers),
                 "--model-mib", str(options.model_mib), "--tensors", str(options.tensors),
                 "--dtype", options.dtype, "--peers", ",".join(options.peers),
                 "--trials", str(options.trials), "--changed", str(options.changed),
                 "--ray-address", bed.layout.head_address, "--json", out]
        if options.membership:
            inner.append("--membership")
        done = bed.run(inner, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"the run on the bed failed ({done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        with open(out) as source:
            document = json.load(source)
    for result in document["results"]:
        result["link"] = options.netbed_link
        if rate:
            result["link_bound_s"] = link_bound_s(result, rate)
        print(format_result(result))
    if options.json:
        document["command"] = "python -m benchmarks.weight_sync " + " ".join(sys.argv[1:])
        with open(options.json, "w") as target:
            json.dump(document, target, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
