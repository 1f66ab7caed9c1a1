"""Planning a sweep: what to measure (``SweepOptions``), which points it has, and how each
point's timed iterations are split into blocks whose backends alternate in order.

Nothing here touches Ray or the actors; ``harness`` runs the plan and ``rows`` summarizes what
it measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, TypeVar

from .collectives import COLLECTIVES
from .stats import IterationCounts, default_iteration_counts
from .worker import BACK_TO_BACK

Unit = TypeVar("Unit")


@dataclass(frozen=True)
class SweepOptions:
    """What to measure; every tuple is one axis of the sweep.

    Attributes:
        collectives: names of ``collectives.COLLECTIVES``.
        backends: names of ``peers.PEERS``, in the order the table shows them.
        world_sizes: rank counts.
        sizes: message sizes in bytes (nccl-tests "size"; barrier ignores them).
        dtype: numpy dtype name of the tensors.
        iterations: timed iterations per point; None: from the size
            (``stats.default_iteration_counts``).
        warmup: untimed iterations per point and backend; None: from the size.
        blocks: how many interleaved blocks the timed iterations are split into.
        baseline: the backend the speed-up is relative to (None: no speed-up column; the CLI
            defaults to the first of ``backends``).
        timeout_s: deadline of each step (actor start, group setup, one block), and the
            libraries' own per-call deadline.
        ray_address: a running Ray cluster to use; None starts a local one.
        timings: the timing modes, of ``worker.TIMINGS``, in the order the rows show them.
        nodes: spread each world's ranks evenly over this many nodes (``nodes.rank_nodes``),
            of a ``ray.cluster_utils.Cluster`` started on this machine or of the
            ``ray_address`` cluster; None: wherever Ray places them (one node, locally).
    """

    collectives: Tuple[str, ...]
    backends: Tuple[str, ...]
    world_sizes: Tuple[int, ...]
    sizes: Tuple[int, ...]
    dtype: str = "float32"
    iterations: Optional[int] = None
    warmup: Optional[int] = None
    blocks: int = 4
    baseline: Optional[str] = None
    timeout_s: float = 300.0
    ray_address: Optional[str] = None
    timings: Tuple[str, ...] = (BACK_TO_BACK,)
    nodes: Optional[int] = None

    def counts(self, nbytes: int) -> IterationCounts:
        """The warm-up and timed iterations for a point of ``nbytes``.

        Args:
            nbytes: the point's size.

        Returns:
            The overrides where given, else the size's defaults.
        """
        defaults = default_iteration_counts(nbytes)
        return IterationCounts(
            warmup=defaults.warmup if self.warmup is None else self.warmup,
            iterations=defaults.iterations if self.iterations is None else self.iterations)


def split_iterations(iterations: int, blocks: int) -> List[int]:
    """Split ``iterations`` into at most ``blocks`` near-equal positive parts.

    Args:
        iterations: timed iterations, >= 1.
        blocks: wanted number of blocks, >= 1.

    Returns:
        The block lengths, larger ones first, summing to ``iterations``.

    Raises:
        ValueError: an argument below 1.
    """
    if iterations < 1 or blocks < 1:
        raise ValueError(f"need iterations >= 1 and blocks >= 1, not {iterations}, {blocks}")
    count = min(iterations, blocks)
    base, extra = divmod(iterations, count)
    return [base + 1 if index < extra else base for index in range(count)]


def block_order(units: Sequence[Unit], block_index: int) -> List[Unit]:
    """The order the units run in during block ``block_index``: reversed every other block.

    Args:
        units: what still runs: backends, or (backend, timing mode) pairs.
        block_index: 0-based block number.

    Returns:
        The order.
    """
    return list(units) if block_index % 2 == 0 else list(reversed(units))


def sweep_points(options: SweepOptions, collective: str) -> Tuple[int, ...]:
    """The sizes swept for ``collective``: barrier moves nothing, so it has one point of 0 B.

    Args:
        options: the sweep.
        collective: the collective.

    Returns:
        The requested sizes.
    """
    return options.sizes if COLLECTIVES[collective].has_payload else (0,)


def count_points(options: SweepOptions) -> int:
    """How many (world size, collective, size) points the sweep measures.

    Args:
        options: the sweep.

    Returns:
        The count.
    """
    return len(options.world_sizes) * sum(len(sweep_points(options, collective))
                                          for collective in options.collectives)
