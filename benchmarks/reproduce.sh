#!/usr/bin/env bash
# Reproduces the one-node, across-nodes and other tables and plots of benchmarks/README.md's
# results page (`make bench`) and the README's headline;
# `benchmarks/reproduce.sh across-nodes` (`make bench-nodes`) reruns only the across-nodes part.
# Heavy runs take a machine-wide lock so that two people's benchmarks never overlap on a shared
# machine. The three sweeps of the page time five backends in both timing modes (back to back,
# the headline, and with a barrier before every call); the whole script takes about an hour on
# the 2-core reference machine (an estimate: 25 minutes with four backends and one mode), and
# step 7 across nodes 17 minutes more with the join (2026-11-26, a quiet machine; 45 minutes
# on 2026-11-23, with other work on the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
LOCK="${BENCH_LOCK:-/tmp/ray_collective_bench.lock}"
RESULTS=benchmarks/results
PLOTS="$RESULTS/plots"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
heavy() { flock "$LOCK" "$PYTHON" "$@"; }

# 7. across nodes (`benchmarks/reproduce.sh across-nodes`, `make bench-nodes`, alone): a
#    ray.cluster_utils.Cluster of 2, then 4 nodes on this machine, ranks pinned to nodes
#    evenly (nodes x ranks per node = sizes; one sweep and one cluster each), `ray` with the
#    library's default transport between nodes and `ray-object-store` with
#    RAY_COLLECTIVE_CROSS_NODE=object_store, in the same actors as torch.distributed's Gloo,
#    ray.util.collective's Gloo and ray-plain; then the page from the JSON files alone. No
#    4x4: at 4x2 a rank's peak RSS was 1.4 GiB at 64 MiB (five backends' buffers), so 16
#    ranks could need 22 GiB of the reference machine's 23.5 GiB.
NODES_BACKENDS=ray,ray-object-store,torch,gloo,ray-plain
NODES_COLLECTIVES=allreduce,broadcast,allgather,reducescatter
NODES_SWEEPS="${NODES_SWEEPS:-2x2=8,1M,16M,64M 4x2=8,1M,16M,64M}"
across_nodes() {
    local sweep layout
    for sweep in $NODES_SWEEPS; do
        layout="${sweep%%=*}"
        heavy -m benchmarks --nodes "${layout%x*}" --ranks-per-node "${layout#*x}" \
            --collective "$NODES_COLLECTIVES" --backends "$NODES_BACKENDS" --baseline torch \
            --bytes "${sweep#*=}" --json "$RESULTS/nodes-$layout.json"
    done
    "$PYTHON" -m benchmarks.page
    # The join of a group spanning 4 nodes, streams against the object store.
    heavy -m benchmarks.join_nodes --nodes 4 --ranks-per-node 2 --repeats 3 \
        --json "$RESULTS/join-nodes-4x2.json"
    # Elastic groups over 4 nodes of 8 ranks: 10 kills, each shrunk and grown back.
    heavy -m benchmarks.elastic --ranks 32 --nodes 4 --kills 10 --json "$RESULTS/elastic-4x8.json" \
        || true
}
if [ "${1:-}" = "across-nodes" ]; then
    across_nodes
    exit 0
fi

BACKENDS=ray,torch,gloo,ray-plain,mpi4py
# 1. allreduce, every CPU backend, 2-8 ranks, 8 B to 64 MiB, iteration counts from the size.
heavy -m benchmarks --collective allreduce --backends "$BACKENDS" --timing both \
    --baseline torch --world-size 2,4,8 --bytes 8,1K,64K,1M,16M,64M \
    --json "$RESULTS/allreduce.json"
# 2. the same at 64 ranks: 10 timed iterations (one 16 MiB point cost ~10 s for four backends
#    in one mode), and 16 MiB at most: at 16 MiB the 64 ranks of four backends already held
#    22 of the 23.5 GiB (README); the torch peer adds its 16 MiB buffer per rank there.
heavy -m benchmarks --collective allreduce --backends "$BACKENDS" --timing both \
    --baseline torch --world-size 64 --bytes 8,1K,64K,1M,16M --iters 10 --warmup 2 \
    --json "$RESULTS/allreduce-64.json"
# 3. every collective at 4 ranks.
heavy -m benchmarks \
    --collective allreduce,reduce,broadcast,allgather,reducescatter,gather,scatter,alltoall,sendrecv,barrier \
    --backends "$BACKENDS" --timing both --baseline torch --world-size 4 --bytes 8,1M,16M \
    --json "$RESULTS/collectives.json"
# 4. plots from the JSON files alone.
rm -rf "$PLOTS/allreduce" "$PLOTS/collectives"
"$PYTHON" -m benchmarks.plots "$PLOTS/allreduce" "$RESULTS/allreduce.json" "$RESULTS/allreduce-64.json"
"$PYTHON" -m benchmarks.plots "$PLOTS/collectives" "$RESULTS/collectives.json"
# 5. the other benchmarks of the page: agent/observer beside torch.distributed.rpc,
#    batch_remote, elastic groups (10 kills, each shrunk and grown back, at 8 and 64 ranks on
#    one node; it exits 1 when a p95 misses its target, and the run goes on).
heavy -m benchmarks.agent_observer --world-size 5,17 --batch true,false \
    --iterations 300 --warmup 30 --json "$RESULTS/agent_observer-rpc.json"
heavy -m benchmarks.batch_remote --json "$RESULTS/batch_remote.json"
heavy -m benchmarks.elastic --ranks 8,64 --kills 10 --json "$RESULTS/elastic-1node-8-64.json" \
    || true
# 6. the library's own cost per call, apart from data: a world-size-1 allreduce, and finding a
#    prepared plan at 8, 512 and 4096 ranks (no Ray; seconds).
heavy -m benchmarks.call_overhead --json "$RESULTS/call_overhead.json"
# 7. across nodes (defined above).
across_nodes
# 8. every generated table of the results page, and the README's headline, from the files.
"$PYTHON" -m benchmarks.page
