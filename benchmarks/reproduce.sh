#!/usr/bin/env bash
# Reproduces every table and plot of benchmarks/README.md's results page (`make bench`).
# Heavy runs take a machine-wide lock so that two people's benchmarks never overlap on a shared
# machine; the whole script takes about 25 minutes on the 2-core reference machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
LOCK="${BENCH_LOCK:-/tmp/ray_collective_bench.lock}"
RESULTS=benchmarks/results
PLOTS="$RESULTS/plots"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
heavy() { flock "$LOCK" "$PYTHON" "$@"; }

# 1. allreduce, every CPU backend, 2-8 ranks, 8 B to 64 MiB, iteration counts from the size.
heavy -m benchmarks --collective allreduce --backends ray,gloo,ray-plain,mpi4py \
    --baseline gloo --world-size 2,4,8 --bytes 8,1K,64K,1M,16M,64M \
    --json "$RESULTS/allreduce.json"
# 2. the same at 64 ranks: 10 timed iterations (one 16 MiB point costs ~10 s for all four),
#    and 16 MiB at most: at 16 MiB the 64 ranks already held 22 of the 23.5 GiB (README).
heavy -m benchmarks --collective allreduce --backends ray,gloo,ray-plain,mpi4py \
    --baseline gloo --world-size 64 --bytes 8,1K,64K,1M,16M --iters 10 --warmup 2 \
    --json "$RESULTS/allreduce-64.json"
# 3. every collective at 4 ranks.
heavy -m benchmarks \
    --collective allreduce,reduce,broadcast,allgather,reducescatter,gather,scatter,alltoall,sendrecv,barrier \
    --backends ray,gloo,ray-plain,mpi4py --baseline gloo --world-size 4 --bytes 8,1M,16M \
    --json "$RESULTS/collectives.json"
# 4. plots and the page's tables, from the JSON files alone.
rm -rf "$PLOTS/allreduce" "$PLOTS/collectives"
"$PYTHON" -m benchmarks.plots "$PLOTS/allreduce" "$RESULTS/allreduce.json" "$RESULTS/allreduce-64.json"
"$PYTHON" -m benchmarks.plots "$PLOTS/collectives" "$RESULTS/collectives.json"
"$PYTHON" -m benchmarks.report_page \
    "$RESULTS/allreduce.json+$RESULTS/allreduce-64.json=$PLOTS/allreduce" \
    "$RESULTS/collectives.json=$PLOTS/collectives" --write benchmarks/README.md
# 5. the other benchmarks of the page: scale and cost model, agent/observer, batch_remote.
heavy -m benchmarks.scale --json "$RESULTS/scale.json" --plots "$PLOTS"
heavy -m benchmarks.agent_observer --world-size 2,4,8,16 --batch true,false \
    --json "$RESULTS/agent_observer.json"
heavy -m benchmarks.batch_remote --json "$RESULTS/batch_remote.json"
