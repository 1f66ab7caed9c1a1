"""torch.distributed with backend ``ray_collective`` against Gloo, in the same rank actors.

    flock /tmp/ray_collective_bench.lock python -m benchmarks.torch_backend \
        [--world-sizes 2,4] [--bytes 8,1K,64K,1M,16M] [--params 1M,10M] [--blocks 3]
        [--nodes 2] [--json benchmarks/results/torch-backend.json]
    python -m benchmarks.torch_backend --table benchmarks/results/torch-backend.json

Each world size gets its own plain rank actors (``num_cpus=0``); with ``--nodes K``, on a local
cluster of K nodes (``benchmarks.nodes``), the ranks spread evenly in blocks. Each rank joins
``init_process_group("ray_collective")`` and, on the same ranks, a Gloo group
(``dist.new_group(backend="gloo")``); the library group under the torch one
(``ProcessGroupRayCollective.library_group``) is called directly as a third peer. Three parts:

- ``dist.all_reduce`` of float32 tensors, back to back (one barrier, then the loop; an
  iteration is the time from one call's return to the next's, for the slowest rank), the three
  peers taking turns block by block; p50, and for allreduce's bus bandwidth
  ``2 (n - 1) / n * bytes / p50``.
- Where the torch layer's time goes at 2 and 4 ranks: the library call timed directly and
  inside ``dist.all_reduce`` (``breakdown``).
- The torch layer alone: in one rank actor with groups of one, ``dist.all_reduce`` against
  ``col.allreduce`` of 8 B (no peer to wait for), p50 of the per-call time, with two points
  of reference: ``col.allreduce`` of the tensor's numpy array, and ``dist.all_reduce`` through
  a Python backend that does nothing; and the profile of the ``dist.all_reduce`` loop
  (cProfile's top functions by own time).
- DDP: a model of ``--params`` parameters (Linear layers of 1024) per backend, SGD, batches
  of 32, the backends' steps (with and without sync) taking turns step by step, every step
  begun by all ranks together (a barrier, not timed); steps per second with each backend, and the communication share, ``1 - t(no_sync) / t(step)``:
  the step without DDP's allreduce (``DistributedDataParallel.no_sync``) against the step.

``--table`` prints a run's tables from its results file and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import platform
import pstats
import socket
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Dict, List

import numpy as np

from .cli import comma_list, parse_size
from .nodes import local_cluster_driver, pick_nodes, pinned, rank_nodes
from .stats import iteration_latencies, percentiles

PEERS = ("ray_collective", "gloo", "col")
"""The torch backend, torch's Gloo, and the library called directly (the torch layer's floor)."""


def _iterations(nbytes: int) -> int:
    return 400 if nbytes <= 64 << 10 else 60 if nbytes <= 1 << 20 else 12


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Rank:
    """One rank: a torch group of each backend over the same processes."""

    def address(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def join(self, rank: int, size: int, init_method: str) -> str:
        import torch.distributed as dist

        import ray_collective.torch  # noqa: F401 - registers the backend
        dist.init_process_group("ray_collective", init_method=init_method, rank=rank,
                                world_size=size, timeout=timedelta(seconds=300))
        self.gloo = dist.new_group(backend="gloo")
        self.library_group = dist.group.WORLD.library_group
        return self.library_group

    def leave(self) -> None:
        import torch.distributed as dist
        dist.destroy_process_group()

    def _call(self, peer: str):
        import torch.distributed as dist

        import ray_collective as col
        if peer == "col":
            return lambda t: col.allreduce(t, self.library_group)
        group = self.gloo if peer == "gloo" else None
        return lambda t: dist.all_reduce(t, group=group)

    def allreduce_block(self, peer: str, nbytes: int, iterations: int) -> List[float]:
        import torch
        import torch.distributed as dist
        tensor = torch.ones(max(1, nbytes // 4))
        call = self._call(peer)
        for _ in range(3):
            call(tensor)
        dist.barrier(group=self.gloo if peer == "gloo" else None)
        durations, last = [], time.perf_counter()
        for _ in range(iterations):
            call(tensor)
            now = time.perf_counter()
            durations.append(now - last)
            last = now
        return durations

    def ddp_block(self, params: int, steps: int, order: List[str]) -> Dict[str, List[float]]:
        """Steps of one DDP model per backend, taking turns step by step in ``order``
        (``"ray_collective/sync"``, ``"gloo/no_sync"``, ...), every step begun by all ranks
        together; each key's step durations, the first two of each left out."""
        import contextlib

        import torch
        from torch.nn.parallel import DistributedDataParallel
        width = 1024
        trained = {}
        for peer in ("ray_collective", "gloo"):
            torch.manual_seed(0)
            layers = [torch.nn.Linear(width, width)
                      for _ in range(max(1, round(params / (width * width + width))))]
            model = DistributedDataParallel(torch.nn.Sequential(*layers),
                                            process_group=self.gloo if peer == "gloo" else None)
            trained[peer] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        x = torch.randn(32, width)
        durations: Dict[str, List[float]] = {key: [] for key in order}
        for step in range(steps + 2):
            for key in order:
                peer, mode = key.split("/")
                model, optimizer = trained[peer]
                # A rank still in its last step would otherwise count in this one's time of
                # the others.
                torch.distributed.barrier(group=self.gloo)
                start = time.perf_counter()
                optimizer.zero_grad()
                with contextlib.nullcontext() if mode == "sync" else model.no_sync():
                    model(x).square().mean().backward()
                optimizer.step()
                if step >= 2:
                    durations[key].append(time.perf_counter() - start)
        return durations

    def breakdown(self, iterations: int) -> Dict[str, float]:
        """Back to back on this group: per-call p50 of col.allreduce called directly, and of
        the same library call made inside the backend's all_reduce (its own time), of 8 B."""
        import torch
        import torch.distributed as dist

        import ray_collective.api as api
        tensor = torch.ones(2)
        direct, inside = [], []
        original = api.allreduce

        def timed(*args, **kwargs):
            start = time.perf_counter()
            original(*args, **kwargs)
            inside.append(time.perf_counter() - start)
        for _ in range(3):
            dist.barrier()
            for _ in range(iterations):
                start = time.perf_counter()
                original(tensor, self.library_group)
                direct.append(time.perf_counter() - start)
            api.allreduce = timed
            try:
                dist.barrier()
                for _ in range(iterations):
                    dist.all_reduce(tensor)
            finally:
                api.allreduce = original
        return {"col.allreduce_s": float(np.median(direct)),
                "col.allreduce_inside_dist.all_reduce_s": float(np.median(inside))}

    def layer_overhead(self, iterations: int) -> Dict[str, object]:
        """In a fresh process's groups of one: per-call p50 of dist.all_reduce and col.allreduce
        of 8 B, of col.allreduce of the tensor's numpy array and of dist.all_reduce through a
        Python backend that does nothing (torch's own share, the floor of any Python
        backend), and the profile of the first."""
        import torch
        import torch.distributed as dist

        import ray_collective as col
        import ray_collective.torch  # noqa: F401
        dist.init_process_group("ray_collective", init_method=self.address(), rank=0,
                                world_size=1)
        name = dist.group.WORLD.library_group
        dist.Backend.register_backend("empty_python", _empty_process_group, extended_api=True,
                                      devices=["cpu"])
        empty = dist.new_group(backend="empty_python")
        tensor = torch.ones(2)
        array = tensor.numpy()
        calls = {"dist.all_reduce": lambda: dist.all_reduce(tensor),
                 "col.allreduce": lambda: col.allreduce(tensor, name),
                 "col.allreduce of its numpy array": lambda: col.allreduce(array, name),
                 "dist.all_reduce, empty Python backend":
                     lambda: dist.all_reduce(tensor, group=empty)}
        times: Dict[str, List[float]] = {key: [] for key in calls}
        for _ in range(5):
            for key, call in calls.items():
                for _ in range(iterations // 5):
                    start = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - start)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        dist.destroy_process_group()
        return {"p50_s": {key: float(np.median(value)) for key, value in times.items()},
                "profile": text.getvalue()}


def _empty_process_group(options, backend_options=None):
    """A torch process group whose all_reduce does nothing and hands torch no work (as
    ``ray_collective``'s does for a call its caller waits for): what torch's wrapper costs
    any backend written in Python."""
    import torch.distributed as dist

    class EmptyProcessGroup(dist.ProcessGroup):
        def allreduce(self, tensors, opts):
            return None

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "empty_python"
    return EmptyProcessGroup(options.group_rank, options.group_size)


def _allreduce_rows(ray, actors, sizes, blocks) -> List[dict]:
    size = len(actors)
    rows = []
    for nbytes in sizes:
        iterations = _iterations(nbytes)
        latencies: Dict[str, List[float]] = {peer: [] for peer in PEERS}
        for block in range(blocks):
            order = PEERS if block % 2 == 0 else PEERS[::-1]
            for peer in order:
                durations = ray.get([a.allreduce_block.remote(peer, nbytes, iterations)
                                     for a in actors])
                latencies[peer].extend(iteration_latencies(durations))
        p50 = {peer: percentiles(latencies[peer])["p50"] for peer in PEERS}
        factor = 2 * (size - 1) / size
        rows.append({"ranks": size, "bytes": nbytes, "iterations": iterations * blocks,
                     "p50_s": p50,
                     "busbw_GBps": {peer: factor * nbytes / p50[peer] / 1e9 for peer in PEERS},
                     "ray_collective_over_gloo": p50["ray_collective"] / p50["gloo"],
                     "torch_layer_s": p50["ray_collective"] - p50["col"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _ddp_rows(ray, actors, params_list, steps, blocks) -> List[dict]:
    rows = []
    for params in params_list:
        step_s: Dict[str, List[float]] = {}
        keys = [f"{peer}/{mode}" for peer in ("ray_collective", "gloo")
                for mode in ("sync", "no_sync")]
        for block in range(blocks):
            order = keys if block % 2 == 0 else keys[::-1]
            by_rank = ray.get([a.ddp_block.remote(params, steps, order) for a in actors])
            for key in keys:
                step_s.setdefault(key, []).extend(
                    iteration_latencies([durations[key] for durations in by_rank]))
        median = {key: float(np.median(value)) for key, value in step_s.items()}
        # The step without sync computes the same with either backend: pooled, its median is
        # steadier than either one's on a shared machine.
        local = float(np.median(step_s["ray_collective/no_sync"] + step_s["gloo/no_sync"]))
        row = {"ranks": len(actors), "params": params, "steps": steps * blocks,
               "step_s": median, "compute_s": local}
        for peer in ("ray_collective", "gloo"):
            step = median[f"{peer}/sync"]
            row[f"{peer}_steps_per_s"] = 1 / step
            row[f"{peer}_comm_s"] = max(0.0, step - local)
            row[f"{peer}_comm_share"] = max(0.0, 1 - local / step)
        row["comm_ratio"] = (row["ray_collective_comm_s"] / row["gloo_comm_s"]
                             if row["gloo_comm_s"] > 0 else None)
        row["step_ratio"] = median["ray_collective/sync"] / median["gloo/sync"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def markdown_tables(result: dict) -> str:
    """A run's tables from its results file.

    Args:
        result: what ``--json`` wrote.

    Returns:
        Markdown: the source line, the all_reduce table, the torch layer, the DDP table.
    """
    lines = [f"From `{result['command']}`, {result['date']} (torch {result['machine']['torch']},"
             f" Ray {result['machine']['ray']}, {result['machine']['cpus']} cores shared with "
             f"other work).", "",
             "| ranks | size | ray_collective p50 | Gloo p50 | col.allreduce p50 | "
             "vs Gloo | busbw ray_collective | busbw Gloo |", "|---" * 8 + "|"]
    for row in result["allreduce"]:
        p50, busbw = row["p50_s"], row["busbw_GBps"]
        lines.append(f"| {row['ranks']} | {_size(row['bytes'])} | {_time(p50['ray_collective'])}"
                     f" | {_time(p50['gloo'])} | {_time(p50['col'])} | "
                     f"{1 / row['ray_collective_over_gloo']:.2f}× | "
                     f"{busbw['ray_collective']:.2f} GB/s | {busbw['gloo']:.2f} GB/s |")
    layer = result["layer_overhead"]["p50_s"]
    lines += ["", f"The torch layer alone (a group of one, 8 B): `dist.all_reduce` "
              f"{_time(layer['dist.all_reduce'])}, `col.allreduce` {_time(layer['col.allreduce'])}"
              f", so {_time(layer['dist.all_reduce'] - layer['col.allreduce'])} per call."]
    if "dist.all_reduce, empty Python backend" in layer:
        lines.append(f"`col.allreduce` of the tensor's numpy array "
                     f"{_time(layer['col.allreduce of its numpy array'])}; `dist.all_reduce` "
                     f"through a Python backend that does nothing (torch's own share) "
                     f"{_time(layer['dist.all_reduce, empty Python backend'])}.")
    for ranks, by_rank in sorted(result.get("breakdown", {}).items()):
        direct = max(r["col.allreduce_s"] for r in by_rank)
        inside = max(r["col.allreduce_inside_dist.all_reduce_s"] for r in by_rank)
        lines.append(f"At {ranks} ranks, back to back, the library's call of 8 B takes "
                     f"{_time(direct)} called directly and {_time(inside)} inside "
                     f"`dist.all_reduce` (slowest rank's p50).")
    lines += ["",
              "| ranks | parameters | steps/s ray_collective | steps/s Gloo | communication "
              "per step, ray_collective (share) | Gloo (share) | communication vs Gloo | "
              "step vs Gloo |",
              "|---" * 8 + "|"]
    for row in result["ddp"]:
        ratio = "–" if not row["comm_ratio"] else f"{1 / row['comm_ratio']:.2f}×"
        lines.append(
            f"| {row['ranks']} | {row['params'] / 1e6:.1f}M | "
            f"{row['ray_collective_steps_per_s']:.1f} | {row['gloo_steps_per_s']:.1f} | "
            f"{_time(row['ray_collective_comm_s'])} ({row['ray_collective_comm_share']:.0%}) | "
            f"{_time(row['gloo_comm_s'])} ({row['gloo_comm_share']:.0%}) | {ratio} | "
            f"{1 / row['step_ratio']:.2f}× |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=comma_list(int), default=[2, 4])
    parser.add_argument("--bytes", type=comma_list(parse_size),
                        default=[8, 1 << 10, 64 << 10, 1 << 20, 16 << 20])
    parser.add_argument("--params", type=comma_list(parse_size), default=[1 << 20, 10 << 20])
    parser.add_argument("--ddp-ranks", type=comma_list(int), default=[4])
    parser.add_argument("--ddp-steps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--overhead-iters", type=int, default=20000)
    parser.add_argument("--nodes", type=int, default=1,
                        help="a local cluster of this many nodes, the ranks spread in blocks")
    args = parse_with_report(parser, argv, "--table", "print a run's tables")
    if args.table:
        print_report(args.table, markdown_tables)
        return
    if args.nodes < 1 or any(size % args.nodes for size in args.world_sizes + args.ddp_ranks):
        parser.error(f"--nodes {args.nodes} must divide every world size")
    with contextlib.ExitStack() as stack:
        if args.nodes > 1:
            stack.enter_context(local_cluster_driver(args.nodes))
        else:
            import ray
            ray.init(address="local", include_dashboard=False, logging_level="ERROR")
            stack.callback(ray.shutdown)
        _run(args, argv)


def _run(args: argparse.Namespace, argv) -> None:
    import ray
    import torch
    result = {"command": "python -m benchmarks.torch_backend " + " ".join(
        sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "ray": ray.__version__},
        "nodes": args.nodes, "allreduce": [], "ddp": []}
    rank_actor = ray.remote(num_cpus=0)(Rank)
    node_ids = pick_nodes(args.nodes)
    lone = rank_actor.remote()
    result["layer_overhead"] = ray.get(lone.layer_overhead.remote(args.overhead_iters))
    print(json.dumps(result["layer_overhead"]["p50_s"]), flush=True)
    ray.kill(lone)
    for size in sorted(set(args.world_sizes) | set(args.ddp_ranks)):
        actors = [rank_actor.options(**pinned(node_ids[node])).remote()
                  for node in rank_nodes(size, args.nodes)]
        init_method = ray.get(actors[0].address.remote())
        ray.get([a.join.remote(r, size, init_method) for r, a in enumerate(actors)])
        if size in args.world_sizes:
            result["allreduce"] += _allreduce_rows(ray, actors, args.bytes, args.blocks)
            result.setdefault("breakdown", {})[str(size)] = ray.get(
                [a.breakdown.remote(300) for a in actors])
        if size in args.ddp_ranks:
            result["ddp"] += _ddp_rows(ray, actors, args.params, args.ddp_steps, args.blocks)
        ray.get([a.leave.remote() for a in actors])
        for actor in actors:
            ray.kill(actor)
    write_json(result, args.json)


def parse_with_report(parser: argparse.ArgumentParser, argv, flag: str, what: str):
    """``parser``'s arguments with ``--json PATH`` and ``flag RESULTS`` (``what``, from a
    results file, running nothing) added."""
    parser.add_argument("--json", default=None)
    parser.add_argument(flag, default=None, metavar="RESULTS",
                        help=f"{what} from a results file, run nothing")
    return parser.parse_args(argv)


def print_report(path: str, render) -> None:
    """Print ``render(results)`` of the results file at ``path``."""
    with open(path) as results:
        print(render(json.load(results)))


def finish(ray, result: dict, path) -> None:
    """Stop Ray, then write ``result`` to ``path`` (if one was given) as indented JSON."""
    ray.shutdown()
    write_json(result, path)


def write_json(result: dict, path) -> None:
    """Write ``result`` to ``path`` (if one was given) as indented JSON."""
    if path:
        with open(path, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
