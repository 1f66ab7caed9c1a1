"""The MPI oracle's cases and inputs, shared by both sides of the comparison: ``mpi_oracle.py``
(mpi4py under mpiexec) and ``test_oracle_mpi.py`` (this library on Ray actors), so that both run
the same calls on the same data.

Every (case, rank) gets one seeded input array of ``world_size * length`` elements: its first
``length`` elements are the rank's tensor, and its ``world_size`` consecutive blocks are the
rank's input list (reducescatter, scatter on the root, alltoall). Each side records one flat
output per (case, rank) where the output is defined: a list output (allgather, gather,
alltoall) is its tensors concatenated in rank order; reduce and gather only on the root.
"""

from dataclasses import dataclass

import numpy as np

SEED = 20240611

REDUCTIONS = (("float64", "SUM"), ("int32", "SUM"), ("float32", "MIN"), ("int64", "MAX"),
              ("int32", "PRODUCT"), ("float64", "AVG"), ("int32", "AVG"))
"""(dtype, op) of the reducing collectives: float sums and averages compare within their
rounding bound (``support.reference``), the rest bit for bit. MPI has no average: its side sums,
then divides as ReduceOp.AVG does (``reference.average_of_sum``)."""

MOVED_DTYPES = ("float64", "int32")
"""dtypes of the collectives that only move data (compared exactly)."""

LENGTHS = (1, 7, 1003, 20_003)
"""7, 1003 and 20_003 divide by none of 2, 3, 4; 20_003 float64 (160 KB) exceeds the
transport's 64 KiB inline limit and the selector's small-message threshold."""

REDUCING = ("allreduce", "reduce", "reducescatter")
MOVING = ("broadcast", "allgather", "gather", "scatter", "alltoall")
ROOTED_OUTPUT = ("reduce", "gather")
"""Collectives whose output is defined on the root only."""
LIST_OUTPUT = ("allgather", "gather", "alltoall")
"""Collectives whose output is one tensor per rank, recorded concatenated in rank order."""


@dataclass(frozen=True)
class Case:
    """One call: the collective, its dtype, its op ("" when it does not reduce), the length of
    one tensor (one block for the list collectives) and the root (for rooted collectives)."""

    index: int
    collective: str
    dtype: str
    op: str
    length: int
    root: int

    @property
    def key(self) -> str:
        return f"{self.index}-{self.collective}-{self.dtype}-{self.op or 'none'}-{self.length}"

    def output_key(self, rank: int) -> str:
        return f"{self.key}@{rank}"

    def has_output(self, rank: int) -> bool:
        return self.collective not in ROOTED_OUTPUT or rank == self.root

    @property
    def exact(self) -> bool:
        """Whether both sides must agree bit for bit (all but float sums and averages)."""
        return not (self.op in ("SUM", "AVG") and np.dtype(self.dtype).kind == "f")

    def reduced_inputs(self, seed: int, rank: int, world_size: int) -> list:
        """The arrays (one per rank) whose reduction is rank ``rank``'s output of this
        reducing case: every rank's tensor, or for reducescatter every rank's block ``rank``."""
        inputs = [rank_input(seed, self, r, world_size) for r in range(world_size)]
        if self.collective == "reducescatter":
            return [np.split(data, world_size)[rank] for data in inputs]
        return [data[:self.length] for data in inputs]


def cases(world_size: int) -> list[Case]:
    """Every case run at ``world_size``; roots rotate over the ranks."""
    combos = ([(c, dtype, op) for c in REDUCING for dtype, op in REDUCTIONS]
              + [(c, dtype, "") for c in MOVING for dtype in MOVED_DTYPES])
    specs = [(c, dtype, op, n) for c, dtype, op in combos for n in LENGTHS]
    return [Case(i, c, dtype, op, n, i % world_size) for i, (c, dtype, op, n) in enumerate(specs)]


def rank_input(seed: int, case: Case, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s input of ``case``: normal floats spread over several magnitudes (so float
    sums round), wide integers (sums stay clear of int32 overflow, whose wrapping MPI leaves
    undefined), and factors from {-2, -1, 1, 2} for products (exact, never zero)."""
    rng = np.random.default_rng([seed, case.index, rank])
    size = world_size * case.length
    dtype = np.dtype(case.dtype)
    if case.op == "PRODUCT":
        values = rng.choice(np.array([-2, -1, 1, 2]), size)
    elif dtype.kind == "f":
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)
    else:
        values = rng.integers(-(1 << 20), 1 << 20, size)
    return values.astype(dtype)
