"""What one collective call costs each algorithm in messages, bytes and rounds, for any world size.

The counts come from the simulator's engine, in its zero-memory mode (payloads are zero-stride
stand-ins, only sizes travel: ``ray_collective.sim.runner.simulate(check=False)``), so rounds
and bytes are exact for any number of ranks.

A ring over thousands of ranks makes millions of simulated messages (400 ranks: 4 s, 4096
ranks: six minutes); where the simulation would pass ``SIMULATION_EVENT_LIMIT`` (rounds × ranks,
from the algorithm's own formula), the algorithm's formula is used instead, with every rank
sending what the busiest one sends (true of the symmetric algorithms where it happens, ring).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ray_collective.algorithms.catalog import lookup
from ray_collective.sim.runner import simulate

SIMULATION_EVENT_LIMIT = 150_000
"""Largest rounds × ranks simulated; beyond it the algorithm's formula gives the counts."""

_ROOTED = ("reduce", "broadcast", "gather", "scatter")


@dataclass(frozen=True)
class CallCosts:
    """What one call of one algorithm sends.

    Attributes:
        rounds: rounds on the critical path.
        max_messages: the most messages any one rank sends.
        max_bytes: the most bytes any one rank sends.
        total_messages: messages sent by all ranks together.
        total_bytes: bytes sent by all ranks together.
        source: ``"simulator"`` or ``"formula"`` (see the module's docstring).
    """

    rounds: int
    max_messages: int
    max_bytes: int
    total_messages: int
    total_bytes: int
    source: str


@functools.lru_cache(maxsize=None)
def call_costs(collective: str, algorithm: str, ranks: int, count: int,
               dtype: str = "float32") -> CallCosts:
    """Rounds, messages and bytes of one call (cached: the same point is asked for often).

    Args:
        collective: the collective's name.
        algorithm: the algorithm's name in ``ray_collective.algorithms.catalog``.
        ranks: world size, one node.
        count: elements of one rank's tensor (one block for the list collectives).
        dtype: numpy dtype name of the data.

    Returns:
        The :class:`CallCosts`.

    Raises:
        ValueError: unknown algorithm, or one that cannot run on ``ranks`` ranks.
    """
    chosen = lookup(collective, algorithm)
    if chosen.power_of_two_only and ranks & (ranks - 1):
        raise ValueError(f"{collective} {algorithm} needs a power-of-two number of ranks, "
                         f"not {ranks}")
    itemsize = np.dtype(dtype).itemsize
    formula = chosen.cost(ranks, count, ranks, itemsize)
    if formula.rounds * ranks > SIMULATION_EVENT_LIMIT:
        max_bytes = formula.max_elements_sent * itemsize
        return CallCosts(formula.rounds, formula.rounds, max_bytes, formula.rounds * ranks,
                         max_bytes * ranks, "formula")
    report = simulate(collective, ranks, count, algorithm=chosen.name, dtype=dtype, check=False)
    return CallCosts(report.rounds, report.max_messages, report.max_bytes_sent,
                     report.total_messages, report.total_bytes, "simulator")
