"""The MPI side of the oracle: runs every case of ``oracle_cases.cases(world size)`` through mpi4py
and writes this rank's outputs to ``<output dir>/rank<r>.npz`` (keys ``Case.output_key``).

Usage: mpiexec -n P python -m support.mpi_oracle SEED OUTPUT_DIR (with ``tests/`` on PYTHONPATH)
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from support.oracle_cases import LIST_OUTPUT, Case, cases, rank_input
from support.reference import average_of_sum

MPI_OPS = {"SUM": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX, "PRODUCT": MPI.PROD,
           "AVG": MPI.SUM}
"""MPI has no average: AVG sums, and :func:`main` divides the sum."""


def run_case(comm, case: Case, data: np.ndarray) -> np.ndarray:
    """This rank's output of ``case`` on input ``data`` (see oracle_cases for the layout)."""
    p, rank, n, root = comm.Get_size(), comm.Get_rank(), case.length, case.root
    tensor = data[:n].copy()
    op = MPI_OPS.get(case.op)
    collective = case.collective
    if collective == "broadcast":
        comm.Bcast(tensor, root)
        return tensor
    out = np.empty((p if collective in LIST_OUTPUT else 1) * n, data.dtype)
    if collective == "allreduce":
        comm.Allreduce(tensor, out, op)
    elif collective == "reduce":
        comm.Reduce(tensor, out, op, root)
    elif collective == "reducescatter":
        comm.Reduce_scatter_block(data, out, op)
    elif collective == "allgather":
        comm.Allgather(tensor, out)
    elif collective == "gather":
        comm.Gather(tensor, out, root)
    elif collective == "scatter":
        comm.Scatter(data if rank == root else None, out, root)
    elif collective == "alltoall":
        comm.Alltoall(data, out)
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return out


def main(seed: int, output_dir: str) -> None:
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    outputs = {}
    for case in cases(p):
        out = run_case(comm, case, rank_input(seed, case, rank, p))
        if case.has_output(rank):
            outputs[case.output_key(rank)] = average_of_sum(out, p) if case.op == "AVG" else out
    np.savez(os.path.join(output_dir, f"rank{rank}.npz"), **outputs)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
