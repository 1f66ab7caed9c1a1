"""The cost model of ``python -m benchmarks.scale``: features of a call, the fit, the prediction.

A call of an algorithm on p ranks that share ``cores`` cores is modelled as

    t = α·R + β·B + μ·s·max(M/c, Mmax) + ν·max(V/c, B),    c = min(p, cores), s = max(1, p/cores)

with, from the simulator: R the rounds on the critical path, B and Mmax the most bytes and
messages one rank sends, M and V the messages and bytes sent by all ranks together. α and β
are the classic latency and bandwidth terms of the critical path. The other two are there
because on a node with fewer cores than ranks the ranks' CPU work queues for the cores: every
message costs a process wake-up and some Python (μ), every byte a copy or a reduction (ν), and
the c cores share that work — but no faster than the busiest rank can do its own share on one
core, hence the max. A wake-up gets dearer the more runnable processes share a core (s):
measured on 2 cores, one round of recursive doubling at 8 B cost 0.2 ms at 2 ranks and 15 ms
at 64, far more than α·rounds can follow (the plain α–β fit is reported beside this one).

With one rank per core (cores = p, hence s = 1 and c = p) the max picks the busiest rank, and
the model becomes the classic one, t = α·R + (β+ν)·B + μ·Mmax; that is the assumption of every
extrapolated point: each rank on its own core, with this machine's per-round, per-message and
per-byte costs, all through shared memory. It is a cluster's compute with one node's
transport: no network, no hierarchy, no object store (which costs ~20× a shared-memory
message here).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import numpy as np

from .scale_costs import CallCosts

PARAMETERS = ("alpha_s", "beta_s_per_byte", "mu_s_per_message", "nu_s_per_byte")
"""The model's coefficients: α, β, μ, ν (see the module's docstring)."""

PLAIN_PARAMETERS = ("alpha_s", "beta_s_per_byte")
"""The plain α–β model: t = α·R + β·B, with no term for shared cores."""


@dataclass(frozen=True)
class Fit:
    """A least-squares fit with non-negative coefficients, on relative errors.

    Attributes:
        coefficients: name → value, in ``PARAMETERS`` (or ``PLAIN_PARAMETERS``) order.
        relative_residuals: (model − measured) / measured, one per point.
        rms_relative_error: the root mean square of those.
    """

    coefficients: Dict[str, float]
    relative_residuals: Tuple[float, ...]
    rms_relative_error: float


def features(costs: CallCosts, ranks: int, cores: int) -> np.ndarray:
    """The model's regressors (R, B, s·max(M/c, Mmax), max(V/c, B)) of one call.

    Args:
        costs: the call's counts from the simulator.
        ranks: world size p.
        cores: cores the p ranks share (p for one rank per core).

    Returns:
        A float array of 4 values, in ``PARAMETERS`` order.

    Raises:
        ValueError: ranks or cores below 1.
    """
    if ranks < 1 or cores < 1:
        raise ValueError(f"ranks and cores must be >= 1, got {ranks} and {cores}")
    sharing = min(ranks, cores)
    slowdown = max(1.0, ranks / cores)
    return np.array([costs.rounds, costs.max_bytes,
                     slowdown * max(costs.total_messages / sharing, costs.max_messages),
                     max(costs.total_bytes / sharing, costs.max_bytes)], dtype=float)


def fit_non_negative(design: np.ndarray, seconds: Sequence[float],
                     names: Sequence[str]) -> Fit:
    """Least squares on relative error with every coefficient >= 0.

    Times span three decades (0.2 ms to 300 ms), so each point's equation is divided by its
    measured time: a 10 % miss weighs the same anywhere. With a handful of coefficients the
    exact non-negative optimum is found by solving the unconstrained problem on every subset
    of them and keeping the best feasible one.

    Args:
        design: one row of regressors per point (columns in ``names`` order).
        seconds: measured time of each point (> 0).
        names: the coefficients' names.

    Returns:
        The :class:`Fit`.

    Raises:
        ValueError: shapes disagree, no points, or a non-positive time.
    """
    design = np.asarray(design, dtype=float)
    measured = np.asarray(seconds, dtype=float)
    if design.ndim != 2 or design.shape != (len(measured), len(names)) or len(measured) == 0:
        raise ValueError(f"need one row of {len(names)} regressors per point; got design "
                         f"{design.shape} for {len(measured)} points")
    if (measured <= 0).any():
        raise ValueError("measured times must be positive")
    weighted = design / measured[:, None]
    target = np.ones(len(measured))
    # Columns span many decades (rounds ~10, bytes ~1e8): scale them so lstsq is well posed.
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = weighted / scale
    best, best_error = np.zeros(len(names)), float(np.sum(target ** 2))
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), size):
            columns = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, columns], target, rcond=None)
            if (solution < 0).any():
                continue
            candidate = np.zeros(len(names))
            candidate[columns] = solution
            error = float(np.sum((scaled @ candidate - target) ** 2))
            if error < best_error - 1e-15:
                best, best_error = candidate, error
    coefficients = best / scale
    residuals = (design @ coefficients - measured) / measured
    return Fit(dict(zip(names, coefficients.tolist())), tuple(residuals.tolist()),
               float(np.sqrt(np.mean(residuals ** 2))))


def predict(fit: Fit, regressors: np.ndarray) -> float:
    """The modelled seconds of a call with these regressors (as :func:`features` gives)."""
    coefficients = np.array(list(fit.coefficients.values()), dtype=float)
    return float(np.asarray(regressors, dtype=float)[:len(coefficients)] @ coefficients)
