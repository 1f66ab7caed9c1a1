"""How the ranks of a ``ray`` group find each other: Ray's internal key-value store.

Keys live in the namespace ``ray_collective`` (``backends.key_value``) under
``<job id>/<group name>/``, so two Ray jobs may use the same group name. One incarnation of a
group is identified by a random token:

- ``<prefix>token`` holds the current token. Whoever opens an incarnation (rank 0 of an
  imperative group, or the driver of a declared one) first clears the prefix, so keys left by a
  crashed earlier incarnation cannot pose as members.
- ``<prefix><token>/member/<rank>/<node id>/<pid>/<cores>/<cross node>/<engine>/<host>``
  announces one member (``cores``: the CPUs its process may run on; ``cross node``: the
  transport it asks for between nodes, ``streams`` or ``object_store``; ``engine``: ``native``
  when it can run collectives on the C core, else ``python``; ``host``: its node's address as
  Ray knows it). Everything a peer needs is in the key itself, so one ``list`` call reads the
  whole membership.
- ``<prefix><token>/complete`` is written by the rank whose registration completed the
  membership (it is the one that finds all ``world_size`` keys when it lists them after its
  own); the others poll this one key rather than list the whole membership again and again,
  which at 400 ranks would be 400 listings of 400 keys per poll.
- ``<prefix><token>/stream/<rank>/<host>/<port>`` is where a member of a group that spans
  nodes listens for streams from other nodes, published right after the membership is
  complete and read by a peer when it first connects.
- ``<prefix><token>/left/<rank>`` marks a member that destroyed its membership; the last one to
  leave deletes the incarnation's keys.
- ``<prefix><token>/broken`` marks an incarnation that can never complete a call again: a
  member raised a collective error in it (the key holds that error's record, which ranks
  waiting on other nodes read: see ``RayPostOffices.published_abort``), or a joining rank
  found it dead.

A rank that registered under a token that then changes (it joined before rank 0 reopened the
group) registers again under the new one; a registered rank looks for that (and for a broken
mark) every ``RECHECK_S``, and otherwise polls only the ``complete`` key. A rank never
registers under a token it has left (a re-init after a destroy waits for the next
incarnation), and a rank whose join times out withdraws its member key.

Rebuilding after a crash works in any join order. A member that died never leaves, so its key
stays under the old token until rank 0 (or the driver) opens the next incarnation; a rank that
comes first and finds its rank taken does not count the old incarnation as live when it is
marked broken, when a member of it on this node is a dead process, or when every other rank
has left it: it marks it broken and waits for the next. Only a rank taken by a live member of a
live incarnation is refused (``ValueError``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple
from urllib.parse import quote

from ...errors import CollectiveTimeoutError
from ...transport.processes import process_alive
from ..key_value import KeyValue

@dataclass(frozen=True)
class Member:
    """One rank as the rendezvous records it."""

    rank: int
    node: str
    pid: int
    cores: int = 1
    cross_node: str = "streams"
    host: str = ""
    """The node's address as Ray knows it: Ray nodes at one address share one machine's cores
    (a ``ray.cluster_utils.Cluster``, several raylets started on one host)."""
    engine: str = "python"
    """The engine it can run collectives on: ``native`` (the C core was built and is not
    turned off) or ``python``; a group of one node runs on the native core when every member
    can."""


def group_prefix(job_id: str, group_name: str) -> str:
    """The key prefix of ``group_name`` in job ``job_id``.

    The name is percent-encoded, so that no group's prefix is the start of another's (group
    ``a`` and group ``a/b``) and a name never adds a level to the key's path.
    """
    return f"{job_id}/{quote(group_name, safe='')}/"


def sweep_finished_jobs(kv: KeyValue, finished_jobs: Set[str]) -> Set[str]:
    """Delete the group keys of the jobs in ``finished_jobs``.

    Members that die with their job (its driver exited) never leave their groups; the next
    incarnation opened by a live job removes what they left.

    Returns:
        The job ids whose keys were deleted.
    """
    swept = {key.split("/", 1)[0] for key in kv.keys("")} & finished_jobs
    for job_id in swept:
        kv.delete_prefix(f"{job_id}/")
    return swept


def open_incarnation(kv: KeyValue, prefix: str) -> str:
    """Start a new incarnation of the group: clear old keys and publish a fresh token."""
    kv.delete_prefix(prefix)
    token = uuid.uuid4().hex
    kv.put(prefix + "token", token)
    return token


def join(kv: KeyValue, prefix: str, group_name: str, world_size: int, me: Member,
         timeout: float, on_token: Callable[[str], None],
         token: Optional[str] = None) -> Tuple[str, List[Member]]:
    """Register ``me`` and wait until all ``world_size`` ranks have.

    Args:
        kv: the key-value store.
        prefix: the group's key prefix.
        group_name: the group (errors).
        world_size: ranks to wait for.
        me: this rank.
        timeout: seconds to wait for the others.
        on_token: called with each token before registering under it (the caller prepares
            what peers will look for, such as its socket, first).
        token: the incarnation to join; None follows ``<prefix>token``.

    Returns:
        The token joined and every member, by rank.

    Raises:
        CollectiveTimeoutError: some ranks did not register in time (it names them).
        ValueError: another live process registered as the same rank.
    """
    deadline = time.monotonic() + timeout
    registered = None
    abandoned: Set[str] = set()
    pauses = _pauses(_longest_pause(world_size))
    members: List[Member] = []
    # The ranks seen registered in this incarnation while this rank waited: one whose own
    # deadline passed first withdrew its key, but it came, and is not named as missing.
    seen: Set[int] = set()
    next_recheck = 0.0
    while True:
        # A registered rank polls one key; whether its incarnation was replaced or broken
        # is looked at only every RECHECK_S (each look is a request to Ray's control store,
        # which 400 waiting ranks would otherwise keep busy).
        if registered is None or time.monotonic() >= next_recheck:
            next_recheck = time.monotonic() + RECHECK_S
            current = token or kv.get(prefix + "token")
            if registered is not None and kv.get(f"{prefix}{registered}/broken") is not None:
                kv.delete_prefix(_member_key(prefix, registered, me))
                abandoned.add(registered)
                registered, members, seen = None, [], set()
            # Never rejoin an incarnation this rank left: a re-init after a destroy waits for
            # the next one, which rank 0 opens once it has left too.
            if current is not None and current != registered and current not in abandoned \
                    and kv.get(f"{prefix}{current}/left/{me.rank}") is None:
                if kv.get(f"{prefix}{current}/broken") is not None:
                    abandoned.add(current)
                else:
                    registered = _register(kv, prefix, current, group_name, world_size, me,
                                           on_token)
                    if registered is None:
                        abandoned.add(current)
                    else:
                        # The store is linearizable: the rank whose key went in last sees
                        # every key here, and tells the others with one key they can poll.
                        members = registered_members(kv, prefix, registered)
                        seen = {m.rank for m in members}
                        if len(members) >= world_size:
                            kv.put(f"{prefix}{registered}/complete")
                            return registered, sorted(members, key=lambda m: m.rank)
        if registered is not None and kv.get(f"{prefix}{registered}/complete") is not None:
            members = registered_members(kv, prefix, registered)
            return registered, sorted(members, key=lambda m: m.rank)
        if time.monotonic() >= deadline:
            present = seen | {m.rank for m in (registered_members(kv, prefix, registered)
                                               if registered else members)}
            if registered is not None:
                # Withdraw, so that a rank joining this incarnation later waits for a live
                # member instead of counting this failed one.
                kv.delete_prefix(_member_key(prefix, registered, me))
            raise CollectiveTimeoutError(group_name, me.rank, "init_collective_group", -1,
                                         [r for r in range(world_size)
                                          if r not in present and r != me.rank], timeout)
        time.sleep(max(0.0, min(next(pauses), deadline - time.monotonic())))


def _register(kv: KeyValue, prefix: str, token: str, group_name: str, world_size: int,
              me: Member, on_token: Callable[[str], None]) -> Optional[str]:
    """Register ``me`` under ``token``; None if that incarnation turned out to be dead.

    Raises:
        ValueError: a live member of a live incarnation holds ``me``'s rank.
    """
    # Look before registering: ``on_token`` takes over the rank's socket path, which a live
    # holder of the rank is using.
    holders = [m for m in registered_members(kv, prefix, token, me.rank) if m != me]
    if holders and _incarnation_is_dead(kv, prefix, token,
                                        registered_members(kv, prefix, token), me, world_size):
        mark_broken(kv, prefix, token)
        return None
    if not holders:
        on_token(token)
        if not kv.put(_member_key(prefix, token, me), "", overwrite=False):
            return token
    raise ValueError(f"group '{group_name}': rank {me.rank} has already joined from another "
                     f"process (pid {holders[0].pid if holders else os.getpid()}), which is "
                     f"alive in the group's current incarnation; every member needs its own "
                     f"rank in [0, {world_size})")


def _incarnation_is_dead(kv: KeyValue, prefix: str, token: str, members: List[Member],
                         me: Member, world_size: int) -> bool:
    """Whether no call of ``token``'s incarnation, whose members are ``members``, can ever
    complete again."""
    if any(m.node == me.node and m != me and not process_alive(m.pid) for m in members):
        return True
    gone = {int(k.rsplit("/", 1)[1]) for k in kv.keys(f"{prefix}{token}/left/")}
    return gone >= set(range(world_size)) - {me.rank}


def mark_broken(kv: KeyValue, prefix: str, token: str, record: Optional[dict] = None) -> None:
    """Record that ``token``'s incarnation can never complete a call again (see the module),
    with the failure that broke it (``errors.error_record``) if there is one; the first
    failure recorded stays."""
    kv.put(f"{prefix}{token}/broken", "" if record is None else json.dumps(record),
           overwrite=False)


def broken_by(kv: KeyValue, prefix: str, token: str) -> Optional[dict]:
    """The failure recorded by :func:`mark_broken` for ``token``'s incarnation; None while it
    is not broken, or broken with no failure recorded.

    Raises:
        ValueError: the recorded failure is not a JSON object.
    """
    value = kv.get(f"{prefix}{token}/broken")
    if not value:
        return None
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError(f"the broken mark of incarnation {token} holds {value[:80]!r}")
    return record


def _pauses(longest: float = 0.05) -> Iterator[float]:
    """The sleeps between two looks at the store while waiting: short at first (the others are
    usually a moment away), growing to at most ``longest`` seconds."""
    pause = 0.002
    while True:
        yield pause
        pause = min(pause * 1.5, longest)


LOOKS_PER_SECOND = 4000
"""How often all the waiting ranks of a group together may look at the store (each look is a
request to Ray's control store, which serves the whole cluster)."""

RECHECK_S = 0.5
"""How often a registered rank looks whether its incarnation was replaced (a new token) or
broken (a member died), besides whether it is complete."""


def _longest_pause(world_size: int) -> float:
    """The longest sleep between two looks of one of ``world_size`` waiting ranks: 50 ms, or
    longer where the group is so large that looks every 50 ms would load the store beyond
    ``LOOKS_PER_SECOND`` (400 ranks: 100 ms)."""
    return max(0.05, world_size / LOOKS_PER_SECOND)


def _member_key(prefix: str, token: str, me: Member) -> str:
    return (f"{prefix}{token}/member/{me.rank}/{me.node}/{me.pid}/{me.cores}/{me.cross_node}/"
            f"{me.engine}/{me.host}")


def registered_members(kv: KeyValue, prefix: str, token: str,
                       claiming: Optional[int] = None) -> List[Member]:
    """The members registered under ``token``'s incarnation, in no particular order.

    Args:
        kv: the store.
        prefix: the group's key prefix (``group_prefix``).
        token: the incarnation.
        claiming: only the members claiming this rank (one short listing instead of the whole
            membership), or None for all.

    Returns:
        One ``Member`` per registration key.
    """
    found = []
    for key in kv.keys(f"{prefix}{token}/member/"
                       + ("" if claiming is None else f"{claiming}/")):
        rank, node, pid, cores, cross_node, engine, host = key.rsplit("/", 7)[1:]
        found.append(Member(int(rank), node, int(pid), int(cores), cross_node, host, engine))
    return found


def publish_stream_endpoint(kv: KeyValue, prefix: str, token: str, rank: int, host: str,
                            port: int) -> None:
    """Record where ``rank`` listens for streams from other nodes."""
    kv.put(f"{prefix}{token}/stream/{rank}/{host}/{port}")


def stream_endpoints(kv: KeyValue, prefix: str, token: str) -> Dict[int, Tuple[str, int]]:
    """``{rank: (host, port)}`` of the members that have published their stream endpoint."""
    found = {}
    for key in kv.keys(f"{prefix}{token}/stream/"):
        rank, host, port = key.rsplit("/", 3)[1:]
        found[int(rank)] = (host, int(port))
    return found


def wait_for_stream_endpoint(kv: KeyValue, prefix: str, token: str, rank: int,
                             timeout: float) -> Dict[int, Tuple[str, int]]:
    """Every published stream endpoint, once ``rank``'s is among them (members publish right
    after the membership completes, so a peer may be a moment late).

    Raises:
        ConnectionError: ``rank`` published none within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    pauses = _pauses()
    while True:
        found = stream_endpoints(kv, prefix, token)
        if rank in found:
            return found
        if time.monotonic() >= deadline:
            raise ConnectionError(f"rank {rank} published no stream endpoint within {timeout} s")
        time.sleep(next(pauses))


def leave(kv: KeyValue, prefix: str, token: str, rank: int, world_size: int,
          dead: Iterable[int] = ()) -> Set[int]:
    """Mark ``rank`` as gone, and the ``dead`` members with it; the last member out deletes
    the incarnation's keys.

    A member that died never leaves by itself: a survivor that saw its process gone leaves on
    its behalf, so that the survivors' destroy still removes every key.

    Returns:
        The ranks that have left so far, this one included.
    """
    # The dead first: the last member out deletes the keys once it sees this rank's own key,
    # so nothing may be written after it.
    for other in dead:
        kv.put(f"{prefix}{token}/left/{other}")
    kv.put(f"{prefix}{token}/left/{rank}")
    gone = {int(k.rsplit("/", 1)[1]) for k in kv.keys(f"{prefix}{token}/left/")}
    if rank not in gone:
        # Our own key, put before the listing, is gone: the last member out closed the
        # incarnation in between, so every rank has left (else this rank's node-mates would
        # each think another is still in, and none would shut the node's post office).
        return set(range(world_size))
    if len(gone) >= world_size:
        close_incarnation(kv, prefix, token)
    return gone


def close_incarnation(kv: KeyValue, prefix: str, token: str) -> None:
    """Delete the incarnation's keys (and the token, unless a newer incarnation replaced it)."""
    kv.delete_prefix(f"{prefix}{token}/")
    if kv.get(prefix + "token") == token:
        kv.delete_prefix(prefix + "token")
