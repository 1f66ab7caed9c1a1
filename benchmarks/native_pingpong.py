"""The native core alone against MPICH: allreduce on one node, processes, no Ray.

``python -m benchmarks.native_pingpong [--ranks 2,4,8] [--bytes 8] [--large-bytes 1M,16M]
[--spin-ns 0,2000,20000] [--iters 2000] [--warmup 200] [--repeats 3] [--json PATH]``

Every rank is a spawned process with its own ``native.Node`` over one tmpfs directory; it runs
the allreduce the selector picks (float32 SUM, ``oversubscribed`` when the ranks outnumber the
cores, as the backend would), back to back: each iteration stamps the call's header, starts the
call and progresses it to DONE, which is what the Python layer above the core must at least do.
Beside it, in the same run and alternating with it repeat by repeat, MPICH through mpi4py
(``mpiexec -n N python -m benchmarks.native_pingpong --mpi ...``, ``Allreduce(IN_PLACE, x)``
on the same float32 array). Each iteration counts for its slowest rank (its rank-by-rank
durations, maximum over the ranks); the figures are the p50 over iterations, the median over
repeats, and the ratio native / MPICH. CPU time per call and rank (user + system, from
``getrusage``) is reported beside the latency. ``--large-bytes`` sizes run at 2 ranks only.

Run it under ``flock /tmp/ray_collective_bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Sequence

import numpy as np

from benchmarks.mpi_job import mpiexec_path

RING_BYTES = 4 << 20
PART_BYTES = 256 << 10
SLICE_S = 0.1


def parse_bytes(text: str) -> int:
    """``8``, ``64K``, ``1M``, ``16M`` as a byte count."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale != 1 else text) * scale


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def native_rank(directory: str, rank: int, world: int, nbytes: int, spin_ns: int, iters: int,
                warmup: int) -> Dict[str, object]:
    """One rank of the native run: durations of the timed iterations (ns) and CPU per call."""
    from ray_collective.algorithms.catalog import flat_choice
    from ray_collective.algorithms.core import Blocks, Context, Team
    from ray_collective.algorithms.selector import select
    from ray_collective.native import _core
    from ray_collective.native.codes import dtype_code, encode_plan, op_code
    from ray_collective.plan import record
    from ray_collective.tensors import combiner
    from ray_collective.transport.wire import CallHeader, HeaderTemplate
    from ray_collective.types import ReduceOp

    count = max(1, nbytes // 4)
    crowded = world > (os.cpu_count() or 1)
    algorithm = select("allreduce", count, 4, world, oversubscribed=crowded)
    ctx = Context(np.dtype(np.float32), combiner(ReduceOp.SUM, "float32"),
                  choose=flat_choice(4, crowded), oversubscribed=crowded)
    plan = record(algorithm, Team.world(world, rank), np.float32, count,
                  Blocks.uniform(count, world), -1, ctx)
    code = encode_plan(plan)
    slots = plan.slots(np.zeros(count, np.float32))
    template = HeaderTemplate(CallHeader("bench", 0, 0, "allreduce", algorithm.name, "float32",
                                         count, (count,), -1, "SUM"))
    dtype, op = dtype_code("float32"), op_code(ReduceOp.SUM, "float32")
    durations = []
    with _core.Node(directory, rank, world, RING_BYTES, PART_BYTES, spin_ns) as node:
        start, progress, pending = node.start, node.progress, _core.PENDING
        cpu_before = 0.0
        for i in range(warmup + iters):
            if i == warmup:
                cpu_before = _cpu_s()
            began = time.perf_counter_ns()
            start(code, slots, template.stamp(i).packed, dtype, op)
            while progress(SLICE_S) == pending:
                pass
            durations.append(time.perf_counter_ns() - began)
        cpu = (_cpu_s() - cpu_before) / iters
    return {"durations": durations[warmup:], "cpu_s": cpu, "algorithm": algorithm.name}


def mpi_rank(nbytes: int, iters: int, warmup: int) -> None:
    """One rank of the MPICH run (under mpiexec); rank 0 prints every rank's results as JSON."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    x = np.zeros(max(1, nbytes // 4), np.float32)
    durations = []
    comm.Barrier()
    cpu_before = 0.0
    for i in range(warmup + iters):
        if i == warmup:
            cpu_before = _cpu_s()
        began = time.perf_counter_ns()
        comm.Allreduce(MPI.IN_PLACE, x)
        durations.append(time.perf_counter_ns() - began)
    cpu = (_cpu_s() - cpu_before) / iters
    gathered = comm.gather({"durations": durations[warmup:], "cpu_s": cpu}, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps(gathered))


def summarize(per_rank: Sequence[Dict[str, object]]) -> Dict[str, float]:
    """p50 of the slowest rank per iteration (µs), and the mean CPU per call and rank (µs)."""
    slowest = np.max(np.array([r["durations"] for r in per_rank]), axis=0)
    return {"p50_us": float(np.percentile(slowest, 50)) / 1e3,
            "p95_us": float(np.percentile(slowest, 95)) / 1e3,
            "cpu_us": 1e6 * statistics.mean(r["cpu_s"] for r in per_rank)}


def run_native(ranks, world: int, nbytes: int, spin_ns: int, iters: int, warmup: int):
    from ray_collective.native.processes import node_directory
    with node_directory() as directory:
        args = [(directory, rank, world, nbytes, spin_ns, iters, warmup) for rank in range(world)]
        per_rank = ranks.run(native_rank, args, timeout=600)
    return dict(summarize(per_rank), algorithm=per_rank[0]["algorithm"])


def run_mpi(world: int, nbytes: int, iters: int, warmup: int) -> Dict[str, float]:
    command = [mpiexec_path(), "-n", str(world), sys.executable, "-m",
               "benchmarks.native_pingpong", "--mpi", "--bytes", str(nbytes), "--iters",
               str(iters), "--warmup", str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return summarize(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--bytes", default="8")
    parser.add_argument("--large-bytes", default="1M,16M")
    parser.add_argument("--spin-ns", default="0,2000,20000")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mpi:
        mpi_rank(int(args.bytes), args.iters, args.warmup)
        return
    from ray_collective.native.processes import ProcessRanks

    points = [(world, parse_bytes(b)) for world in map(int, args.ranks.split(","))
              for b in args.bytes.split(",")]
    points += [(2, parse_bytes(b)) for b in args.large_bytes.split(",") if b]
    spins = [int(s) for s in args.spin_ns.split(",")]
    rows = []
    with ProcessRanks(max(world for world, _ in points)) as ranks:
        for world, nbytes in points:
            large = nbytes >= 1 << 20
            iters, warmup = (max(20, args.iters // 50), 5) if large else (args.iters, args.warmup)
            runs: Dict[str, List[Dict[str, float]]] = {"mpich": []}
            for repeat in range(args.repeats):
                for spin in spins:
                    runs.setdefault(f"native spin {spin}", []).append(
                        run_native(ranks, world, nbytes, spin, iters, warmup))
                runs["mpich"].append(run_mpi(world, nbytes, iters, warmup))
            mpich = statistics.median(r["p50_us"] for r in runs["mpich"])
            for name, results in runs.items():
                p50 = statistics.median(r["p50_us"] for r in results)
                row = {"ranks": world, "bytes": nbytes, "engine": name, "p50_us": p50,
                       "p50_us_per_repeat": [round(r["p50_us"], 2) for r in results],
                       "p95_us": statistics.median(r["p95_us"] for r in results),
                       "cpu_us_per_call": statistics.median(r["cpu_us"] for r in results),
                       "ratio_to_mpich": p50 / mpich, "iters": iters,
                       "algorithm": results[0].get("algorithm", "")}
                rows.append(row)
                print(f"{world} ranks {nbytes:>9} B  {name:<18} p50 {p50:9.1f} us  "
                      f"(repeats {row['p50_us_per_repeat']})  cpu/call "
                      f"{row['cpu_us_per_call']:8.1f} us  x MPICH {row['ratio_to_mpich']:.2f}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
