"""The vocabulary every algorithm speaks: rounds of Send/Recv operations over a Team.

An algorithm is a generator. Each ``yield`` hands the driver one *round*: a tuple of
:class:`Send` and :class:`Recv` operations that the driver posts together (nonblocking) and
waits for together. The generator resumes once every operation of the round has completed,
and may return a value (composite algorithms use ``yield from`` and pass ``step0`` on).

Rules every algorithm keeps, so that any transport (an in-process mailbox, shared memory read
in place by the peer) can run it:

- A ``Send``'s data must not be modified, and a ``Recv``'s ``out`` must not be read, until the
  round that holds them has completed.
- Within one round, no ``Recv.out`` overlaps the data of a ``Send`` (a zero-copy transport may
  let the peer read the send buffer while this rank writes its receive buffer).
- Every ``Send`` is matched by exactly one ``Recv`` on the peer with the same ``step`` and the
  same number of elements; messages between two ranks of one call are matched in posting order.
- Buffers are 1-D contiguous numpy arrays of the call's wire dtype; lengths are in elements.
- Scratch memory comes from ``ctx.alloc`` (the simulator hands out zero-memory stand-ins), and
  local reductions go through ``ctx.combine``; algorithms never import Ray or a transport.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable, Generator, Hashable, Optional, Tuple, Union

import numpy as np


@dataclass(frozen=True)
class Send:
    """Send ``data`` to the real rank ``peer``; ``step`` labels the message for checking."""

    peer: int
    data: np.ndarray
    step: int


@dataclass(frozen=True)
class Recv:
    """Receive from the real rank ``peer`` into ``out``.

    With ``reduce=True`` the incoming elements are combined into ``out`` with the call's reduce
    op (``out = op(out, incoming)``) instead of overwriting it; a transport may do this straight
    out of the peer's buffer without a copy.
    """

    peer: int
    out: np.ndarray
    step: int
    reduce: bool = False


Op = Union[Send, Recv]
Round = Tuple[Op, ...]
AlgorithmGen = Generator[Round, None, object]
Chooser = Callable[[str, int, int], "Algorithm"]
"""``choose(collective, team_size, count)``: the algorithm a composite runs on a sub-team."""


class Rotated(Sequence):
    """``members`` renumbered so that index 0 is ``members[shift]``; O(1) to build and index."""

    __slots__ = ("members", "shift")

    def __init__(self, members: Sequence[int], shift: int):
        self.members = members
        self.shift = shift

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.members[(i + self.shift) % len(self.members)]


@dataclass(frozen=True)
class Team:
    """The ranks taking part in an algorithm, in the algorithm's (virtual) order.

    ``members[v]`` is the real rank of virtual rank ``v``; ``index`` is this rank's virtual rank.
    ``members`` is any sequence with O(1) indexing (a ``range`` for the whole group, a lazy view
    for a rotation or the survivors of a fold): algorithms must not copy it, since the
    simulator builds one team per rank for thousands of ranks.
    Sub-algorithms (the node-local reduce of the hierarchical allreduce, ...) run on sub-teams.
    """

    members: Sequence[int]
    index: int

    @classmethod
    def world(cls, world_size: int, rank: int) -> "Team":
        return cls(range(world_size), rank)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        """This rank's real rank."""
        return self.members[self.index]

    def peer(self, virtual: int) -> int:
        """Real rank of a virtual rank, taken modulo the team size."""
        return self.members[virtual % len(self.members)]

    def rotated(self, root: int) -> "Team":
        """The same team renumbered so that virtual rank 0 is the member at index ``root``."""
        if root == 0:
            return self
        return Team(Rotated(self.members, root), (self.index - root) % len(self.members))


@dataclass(frozen=True)
class Blocks:
    """A partition of a flat buffer into consecutive blocks: block i is [offsets[i], offsets[i+1])."""

    offsets: Tuple[int, ...]

    @classmethod
    @functools.lru_cache(maxsize=64)
    def even(cls, count: int, parts: int) -> "Blocks":
        """``parts`` blocks covering ``count`` elements; sizes differ by at most one.

        Cached (blocks are immutable): every simulated rank asks for the same partition.
        """
        base, extra = divmod(count, parts)
        offsets = [0]
        for i in range(parts):
            offsets.append(offsets[-1] + base + (1 if i < extra else 0))
        return cls(tuple(offsets))

    @classmethod
    @functools.lru_cache(maxsize=64)
    def uniform(cls, block_count: int, parts: int) -> "Blocks":
        """``parts`` blocks of exactly ``block_count`` elements each."""
        return cls(tuple(block_count * i for i in range(parts + 1)))

    @property
    def parts(self) -> int:
        return len(self.offsets) - 1

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def size(self, first: int, stop: Optional[int] = None) -> int:
        """Elements in blocks ``first .. stop-1`` (just block ``first`` when stop is None)."""
        stop = first + 1 if stop is None else stop
        return self.offsets[stop] - self.offsets[first]

    def view(self, buf: np.ndarray, first: int, stop: Optional[int] = None) -> np.ndarray:
        """The slice of ``buf`` holding blocks ``first .. stop-1`` (just ``first`` when stop is None)."""
        stop = first + 1 if stop is None else stop
        return buf[self.offsets[first]:self.offsets[stop]]

    def sub(self, first: int, stop: int) -> "Blocks":
        """The blocks ``first .. stop-1`` as a partition of their own slice."""
        base = self.offsets[first]
        return Blocks(tuple(o - base for o in self.offsets[first:stop + 1]))


class Context:
    """What an algorithm may ask of whoever runs it: scratch memory, local reduction, topology.

    Args:
        dtype: the wire dtype of the call's buffers.
        combine: ``combine(acc, incoming)`` reduces ``incoming`` into ``acc`` in place.
        alloc: ``alloc(count)`` returns a fresh 1-D scratch array of ``count`` elements.
        copy: ``copy(dst, src)`` copies a local block (``dst[...] = src``).
        node_of: node id of every real rank (equal ids share a node); None means one node.
        choose: ``choose(collective, team_size, count)`` returns the :class:`Algorithm` a
            composite (the hierarchical allreduce) runs on a sub-team of that size.
        topology: ``node_of`` grouped by node, when the caller has it already (a group builds
            it once); else computed from ``node_of`` on first use.
        oversubscribed: some machine runs more ranks than it has cores (the same answer on
            every rank): overlap between ranks then buys nothing beyond the cores, and an
            algorithm that trades rounds for it (the pipelined broadcast) takes fewer rounds.
    """

    __slots__ = ("dtype", "combine", "alloc", "copy", "node_of", "choose", "_topology",
                 "oversubscribed")

    def __init__(self, dtype: np.dtype, combine: Callable[[np.ndarray, np.ndarray], None],
                 alloc: Optional[Callable[[int], np.ndarray]] = None,
                 copy: Optional[Callable[[np.ndarray, np.ndarray], None]] = None,
                 node_of: Optional[Sequence[int]] = None,
                 choose: Optional[Chooser] = None,
                 topology: Optional["Topology"] = None,
                 oversubscribed: bool = False):
        self.dtype = np.dtype(dtype)
        self.combine = combine
        self.alloc = alloc if alloc is not None else (lambda count: np.empty(count, self.dtype))
        self.copy = copy if copy is not None else np.copyto
        self.node_of = tuple(node_of) if node_of is not None else None
        self.choose = choose
        self._topology = topology
        self.oversubscribed = oversubscribed

    @property
    def topology(self) -> "Topology":
        """The ranks grouped by node, computed once per context (shared by simulated ranks)."""
        if self._topology is None:
            self._topology = Topology.from_node_of(self.node_of or ())
        return self._topology


@dataclass(frozen=True)
class Topology:
    """Ranks grouped by node: ``nodes[i]`` lists the real ranks on node i in rank order, nodes
    ordered by their lowest rank; ``node_index[r]`` is the node of real rank r; ``leaders[i]``
    is the lowest rank of node i."""

    nodes: Tuple[Tuple[int, ...], ...]
    node_index: Tuple[int, ...]
    leaders: Tuple[int, ...]

    @classmethod
    def from_node_of(cls, node_of: Sequence[Hashable]) -> "Topology":
        order: dict = {}
        members: list = []
        node_index = []
        for rank, node in enumerate(node_of):
            if node not in order:
                order[node] = len(members)
                members.append([])
            members[order[node]].append(rank)
            node_index.append(order[node])
        return cls(tuple(tuple(m) for m in members), tuple(node_index),
                   tuple(m[0] for m in members))

    @property
    def max_ranks_per_node(self) -> int:
        return max((len(n) for n in self.nodes), default=1)

    @property
    def uniform(self) -> bool:
        """Whether every node holds as many ranks as every other."""
        return len({len(n) for n in self.nodes}) <= 1

    @property
    def is_multi_node(self) -> bool:
        """More than one node, and at least one node with several ranks to aggregate."""
        return len(self.nodes) > 1 and self.max_ranks_per_node > 1


@dataclass(frozen=True)
class Cost:
    """What an algorithm costs one call: rounds on the critical path and the most elements any
    one rank sends. Rounds count as the simulator counts them (a round takes at least one
    superstep; a message takes one superstep to arrive)."""

    rounds: int
    max_elements_sent: int


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of one collective, as the selector and the simulator see it.

    Attributes:
        collective: the collective's name (``Collective.value``).
        name: the algorithm's name, as forced with ``RAY_COLLECTIVE_ALGORITHM``.
        run: the generator function; its signature is fixed per collective (see ``catalog``).
        cost: ``cost(p, count, ranks_per_node, itemsize)`` for a team of p ranks; ``count`` is
            the element count of one rank's tensor (one block for the list collectives);
            composites use ``itemsize`` to know which sub-algorithm the selector gives them.
        power_of_two_only: True when ``run`` needs p to be a power of two.
        node_aware: True when ``run`` needs the rank-to-node map (``Context.topology``).
    """

    collective: str
    name: str
    run: Callable[..., AlgorithmGen]
    cost: Callable[[int, int, int, int], Cost]
    power_of_two_only: bool = False
    node_aware: bool = False


def one_round_with_root(team: Team, root: int, view_of: Callable[[int], np.ndarray],
                        step0: int, to_root: bool) -> AlgorithmGen:
    """One round between member ``root`` and every other member v, whose message is
    ``view_of(v)`` on both sides: to the root (``to_root``: gather) or from it (scatter,
    broadcast). The root takes the others from its next member on, so that no member comes
    first for every root."""
    v, p = team.index, team.size
    if p == 1:
        return
    if v != root:
        yield ((Send if to_root else Recv)(team.peer(root), view_of(v), step0),)
        return
    message = Recv if to_root else Send
    yield tuple(message(team.peer(w), view_of(w), step0)
                for w in ((root + s) % p for s in range(1, p)))
