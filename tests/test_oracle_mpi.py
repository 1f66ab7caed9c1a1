"""The MPI oracle: the same seeded random inputs through mpi4py (MPICH, under the virtual
environment's mpiexec) and through this library on Ray actors must give the same results:
bit-exact for integers, MIN, MAX and PRODUCT, and for float sums and averages within the
rounding bound of float64 (``support.reference``: MPI and this library may add in different
orders; on two ranks they must agree bit for bit).

Cases (``oracle_cases``): allreduce, reduce and reducescatter (MPI's Reduce_scatter_block) with
SUM on float64 and int32, MIN, MAX, PRODUCT, and AVG on float64 and int32 (MPI's side sums and
divides as ReduceOp.AVG does); broadcast, allgather, gather, scatter and
alltoall on float64 and int32; lengths 1, 7, 1003, 20_003; roots rotating over the ranks. Each
world size is one mpiexec run and one round trip to the actors.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import ray_collective as col
from support import extras
from support.helpers import run_in
from support.oracle_cases import LIST_OUTPUT, SEED, Case, cases, rank_input
from support.paths import python_path
from support.reference import rounding_bound

MPI_TIMEOUT_S = 60


def run_case(rank: int, world_size: int, group: str, case: Case, data: np.ndarray):
    """This rank's output of ``case`` through this library (the layout of oracle_cases)."""
    p, n, root = world_size, case.length, case.root
    op = col.ReduceOp[case.op] if case.op else None
    blocks = np.split(data, p)
    tensor = data[:n].copy()
    parts = [np.empty(n, data.dtype) for _ in range(p)]
    collective = case.collective
    if collective == "allreduce":
        col.allreduce(tensor, group, op)
    elif collective == "reduce":
        col.reduce(tensor, root, group, op)
    elif collective == "broadcast":
        col.broadcast(tensor, root, group)
    elif collective == "reducescatter":
        col.reducescatter(tensor, blocks, group, op)
    elif collective == "scatter":
        col.scatter(tensor, blocks if rank == root else None, root, group)
    elif collective == "allgather":
        col.allgather(parts, tensor, group)
    elif collective == "gather":
        col.gather(parts if rank == root else None, tensor, root, group)
    elif collective == "alltoall":
        col.alltoall(parts, blocks, group)
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return np.concatenate(parts) if collective in LIST_OUTPUT else tensor


def run_every_case(rank: int, world_size: int, group: str, seed: int):
    """Inside a member: every case of ``world_size``, keyed like the MPI side's outputs."""
    outputs = {}
    for case in cases(world_size):
        out = run_case(rank, world_size, group, case, rank_input(seed, case, rank, world_size))
        if case.has_output(rank):
            outputs[case.output_key(rank)] = out
    return outputs


def mpi_outputs(world_size: int, output_dir) -> dict:
    """Every rank's outputs of every case, computed by mpi4py under mpiexec."""
    mpiexec = extras.need_mpiexec("the MPI oracle")
    command = [mpiexec, "-n", str(world_size), sys.executable,
               "-m", "support.mpi_oracle", str(SEED), str(output_dir)]
    finished = subprocess.run(command, check=False, capture_output=True, text=True,
                              timeout=MPI_TIMEOUT_S,
                              env=dict(os.environ, PYTHONPATH=python_path()))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    outputs = {}
    for rank in range(world_size):
        with np.load(os.path.join(output_dir, f"rank{rank}.npz")) as saved:
            outputs.update(saved)
    return outputs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_same_results_as_mpi(ray_session, members, world_size, tmp_path):
    expected = mpi_outputs(world_size, tmp_path)
    actors = members[:world_size]
    group = f"oracle-{world_size}"
    col.declare_collective_group(actors, backend="ray", group_name=group)
    try:
        results = run_in(ray_session, actors, run_every_case, world_size, group, SEED)
    finally:
        col.destroy_collective_group(group)
    got = {key: out for per_rank in results for key, out in per_rank.items()}
    assert got.keys() == expected.keys()
    for case in cases(world_size):
        for key in [case.output_key(r) for r in range(world_size) if case.has_output(r)]:
            assert got[key].dtype == expected[key].dtype, key
            if case.exact:
                np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
                continue
            rank = int(key.rsplit("@", 1)[1])
            bound = rounding_bound(case.reduced_inputs(SEED, rank, world_size), case.op)
            off = np.abs(got[key] - expected[key])
            assert np.all(off <= bound), (key, np.max(off - bound))
