"""What each rank brings to a join, compared before it waits for the rest.

A rank that waits for peers which can never form its group (another ``world_size``, a rank
claimed twice, another backend, another forced algorithm) would otherwise wait out the whole
deadline and then name ranks that did call. So every joining rank first announces its
*terms* in Ray's key-value store, as the key
``<job id>/#arrivals/<group>/<scope>/<rank>/<nonce>/<node>/<pid>/<until>/<terms...>`` (``#`` is
percent-encoded in group names, so no group's keys start so; everything is in the key, so
one listing reads every rank's terms, as the rendezvous reads its members), and lists those
already there. The scope is the incarnation a rank was given (a declared group's, a shrink's
or a grow's), or ``open`` for the ranks that follow the group's current one: a grow's new
rank waits, following, while the members still shrink the incarnation they were given with
another world size, and neither is the other's mistake.

- The rank whose announcement meets a disagreement raises at once, and marks every live
  arrival of its scope with a ``<job id>/#conflicts/<group>/<nonce>`` key holding the same
  message.
- A rank already waiting looks for its own conflict key (one read, at the rendezvous's
  recheck interval, half a second in groups up to 100 ranks) and raises that message.

The ``ray`` backend announces (``backends.ray.factory``), and so does the ``nccl`` backend when
its ranks meet through Ray (``backends.nccl.rendezvous.RayRendezvous``; it looks for its
conflict key while it waits for its peers' records): ``backend`` (the factory's ``name``) tells
them apart, so a rank that names ``nccl`` beside ranks that name ``ray`` is refused on both
sides at once. Ranks that meet in one process (``InProcessRendezvous``, the tests' threads)
do not announce.

A rank withdraws its announcement once its join ends, joined or not. One that died joining
never does: an arrival whose process is gone from this node is ignored, and so is one of
another node whose join's deadline (``until``, seconds of the epoch) passed more than
``CLOCK_SKEW_S`` ago, so a crashed join does not refuse a restarted rank for longer than the
dead one's timeout. The keys start with the job id: the sweep of finished jobs removes what a
dead process left.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, astuple, dataclass
from typing import Dict, List, Optional, Set
from urllib.parse import quote, unquote

from ..errors import JoinMismatchError
from ..transport.processes import process_alive
from .key_value import KeyValue


@dataclass(frozen=True)
class Terms:
    """What the ranks of one group must agree on before they wait for each other.

    Attributes:
        world_size: the ranks of the group.
        backend: the backend's name.
        algorithm: the algorithms ``RAY_COLLECTIVE_ALGORITHM`` forces, as ``collective=name``
            items sorted and joined by commas ("" when none): ranks running different
            algorithms for one call would exchange messages the others do not expect.
    """

    world_size: int
    backend: str
    algorithm: str = ""


CLOCK_SKEW_S = 60.0
"""How far two nodes' clocks may differ when one reads another's deadline."""


@dataclass(frozen=True)
class _Arrival:
    rank: int
    nonce: str
    node: str
    pid: int
    until: int
    terms: Terms


class Arrivals:
    """One rank's announcement of its terms for one join of one group.

    Args:
        kv: the store.
        job_id: the Ray job.
        group_name: the group.
        rank: this rank.
        terms: what it brings.
        node: its node id (an arrival of a dead process on this node is ignored).
        pid: its process id.
        timeout: the seconds its join may wait.
        scope: the incarnation it was given, or ``open`` (see the module).
    """

    def __init__(self, kv: KeyValue, job_id: str, group_name: str, rank: int, terms: Terms,
                 node: str, pid: int, timeout: float, scope: str = "open"):
        self.kv = kv
        self.group_name = group_name
        self.me = _Arrival(rank, uuid.uuid4().hex, node, pid,
                           int(min(time.time() + timeout, 2 ** 62)), terms)
        self._arrivals = f"{job_id}/#arrivals/{quote(group_name, safe='')}/{scope}/"
        self._conflicts = f"{job_id}/#conflicts/{quote(group_name, safe='')}/"
        self.seen: Set[int] = set()

    def announce(self) -> None:
        """Put this rank's terms and compare them with those of every rank already there.

        Raises:
            JoinMismatchError: a live arrival disagrees (another world size, backend or
                forced algorithm) or claims this rank; every live arrival is told.
        """
        me = self.me
        terms = "/".join(quote(str(value), safe="") for value in astuple(me.terms))
        self.kv.put(f"{self._arrivals}{me.rank}/{me.nonce}/{me.node}/{me.pid}/{me.until}/"
                    f"{terms}")
        others = [a for a in self._live() if a.nonce != me.nonce]
        self.seen |= {a.rank for a in others}
        message = _disagreement(self.group_name, me, others)
        if message is not None:
            for arrival in others:
                self.kv.put(self._conflicts + arrival.nonce, message)
            self.withdraw()
            raise JoinMismatchError(message)

    def look(self) -> None:
        """Raise the disagreement a later rank found with this one, if any.

        Raises:
            JoinMismatchError: a rank that came later disagrees with this one's terms.
        """
        message = self.kv.get(self._conflicts + self.me.nonce)
        if message is not None:
            self.withdraw()
            raise JoinMismatchError(message)

    def present(self) -> Set[int]:
        """The ranks seen joining while this one waited, this one's included."""
        self.seen |= {a.rank for a in self._live()}
        return self.seen | {self.me.rank}

    def withdraw(self) -> None:
        """Remove this rank's announcement and its conflict mark."""
        self.kv.delete_prefix(f"{self._arrivals}{self.me.rank}/{self.me.nonce}/")
        self.kv.delete_prefix(self._conflicts + self.me.nonce)

    def _live(self) -> List[_Arrival]:
        found = []
        now = time.time()
        for key in self.kv.keys(self._arrivals):
            rank, nonce, node, pid, until, world_size, backend, algorithm = \
                key[len(self._arrivals):].split("/")
            arrival = _Arrival(int(rank), nonce, node, int(pid), int(until),
                               Terms(int(world_size), unquote(backend), unquote(algorithm)))
            if arrival.node == self.me.node and not process_alive(arrival.pid):
                continue
            if arrival.until + CLOCK_SKEW_S < now:
                continue
            found.append(arrival)
        return found


def _disagreement(group_name: str, me: _Arrival, others: List[_Arrival]) -> Optional[str]:
    """The message naming the first of ``others`` that cannot join one group with ``me``."""
    mine: Dict[str, object] = asdict(me.terms)
    for other in sorted(others, key=lambda a: a.rank):
        if other.rank == me.rank:
            return (f"group '{group_name}': rank {me.rank} was claimed by two processes "
                    f"(pid {other.pid} on node {other.node[:12]} and pid {me.pid} on node "
                    f"{me.node[:12]}); give every member its own rank in "
                    f"[0, {me.terms.world_size})")
        theirs = asdict(other.terms)
        for name, value in mine.items():
            if theirs[name] != value:
                shown = {"algorithm": "RAY_COLLECTIVE_ALGORITHM"}.get(name, name)
                return (f"group '{group_name}': rank {other.rank} joins with "
                        f"{shown}={theirs[name]!r}, rank {me.rank} with {shown}={value!r}; "
                        f"every rank of a group must pass the same {shown}")
    return None
