"""Every algorithm by collective and name, with the signature each collective's ``run`` has.

=============  ==================================================
collective     ``run`` signature
=============  ==================================================
allreduce      ``run(team, buf, ctx, step0=0)``
reduce         ``run(team, buf, root, ctx, step0=0)``
broadcast      ``run(team, buf, root, ctx, step0=0)``
allgather      ``run(team, buf, blocks, ctx, step0=0)``
reducescatter  ``run(team, buf, blocks, ctx, step0=0)``
gather         ``run(team, buf, blocks, root, ctx, step0=0)``
scatter        ``run(team, buf, blocks, root, ctx, step0=0)``
alltoall       ``run(team, sendbuf, recvbuf, blocks, ctx, step0=0)``
barrier        ``run(team, ctx, step0=0)``
=============  ==================================================

``root`` is an index into ``team``; the buffer contracts are in each algorithm file.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional, Tuple

import numpy as np

from . import (allgather, allreduce, alltoall, barrier, broadcast, gather, hierarchical, reduce,
               reducescatter, scatter)
from .core import Algorithm, AlgorithmGen, Blocks, Chooser, Context, Team
from .rules import flat_algorithm_name


def _index(algorithms) -> Mapping[str, Mapping[str, Algorithm]]:
    table: dict = {}
    for algorithm in algorithms:
        table.setdefault(algorithm.collective, {})[algorithm.name] = algorithm
    return MappingProxyType({c: MappingProxyType(by_name) for c, by_name in table.items()})


_FLAT = _index(algorithm for module in (allreduce, reduce, broadcast, allgather, reducescatter,
                                        gather, scatter, alltoall, barrier)
               for algorithm in module.ALGORITHMS)


def flat_choice(itemsize: int, oversubscribed: bool = False) -> Chooser:
    """The ``Context.choose`` callback: the flat algorithm ``rules`` give a sub-team of a call
    whose elements are ``itemsize`` bytes (no forcing applies inside a composite algorithm).

    Args:
        itemsize: bytes per element.
        oversubscribed: some machine runs more ranks of the group than it has cores. The
            composites choose an allreduce only for ranks on different nodes (the leaders, or
            the i-th ranks of every node), so an allreduce is chosen by the rule between nodes.

    Returns:
        ``choose(collective, team_size, count)``, giving the catalog's algorithm.
    """
    def choose(collective: str, team_size: int, count: int) -> Algorithm:
        return _FLAT[collective][flat_algorithm_name(collective, count * itemsize, team_size,
                                                     oversubscribed, between_nodes=True)]
    return choose


ALGORITHMS: Mapping[str, Mapping[str, Algorithm]] = _index(
    [*(a for by_name in _FLAT.values() for a in by_name.values()),
     *hierarchical.algorithms(flat_choice)])


def names(collective: str) -> Tuple[str, ...]:
    """The algorithm names available for ``collective``."""
    return tuple(ALGORITHMS.get(collective, {}))


def lookup(collective: str, name: str) -> Algorithm:
    """The algorithm ``name`` of ``collective``.

    Raises:
        ValueError: no such algorithm; the message lists the available ones.
    """
    try:
        return ALGORITHMS[collective][name]
    except KeyError:
        raise ValueError(f"no algorithm {name!r} for {collective}; available: "
                         f"{', '.join(names(collective)) or 'none'}") from None


def start(algorithm: Algorithm, team: Team, ctx: Context, buf: Optional[np.ndarray] = None,
          blocks: Optional[Blocks] = None, root: int = -1,
          recvbuf: Optional[np.ndarray] = None) -> AlgorithmGen:
    """Call ``algorithm.run`` with the signature of its collective.

    Args:
        algorithm: what to run.
        team: the ranks taking part.
        ctx: the call's context.
        buf: the buffer (the send buffer for alltoall); unused by barrier.
        blocks: the block partition of ``buf`` (list collectives).
        root: the root's index in ``team`` (reduce, broadcast, gather, scatter).
        recvbuf: the receive buffer of alltoall.

    Returns:
        The algorithm's generator.
    """
    collective = algorithm.collective
    if collective == "barrier":
        return algorithm.run(team, ctx)
    if collective == "allreduce":
        return algorithm.run(team, buf, ctx)
    if collective in ("reduce", "broadcast"):
        return algorithm.run(team, buf, root, ctx)
    if collective in ("allgather", "reducescatter"):
        return algorithm.run(team, buf, blocks, ctx)
    if collective in ("gather", "scatter"):
        return algorithm.run(team, buf, blocks, root, ctx)
    if collective == "alltoall":
        return algorithm.run(team, buf, recvbuf, blocks, ctx)
    raise ValueError(f"unknown collective {collective!r}")
