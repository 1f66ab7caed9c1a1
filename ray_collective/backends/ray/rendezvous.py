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
- ``<prefix><token>/size`` holds the incarnation's world size, written by whoever opens it
  (rank 0 of an imperative group, the member whose decision opens a shrunk or grown one:
  ``elastic``) before it publishes the token, or put (if absent) by the first rank to join a
  token it was given (a declared group). A rank that follows ``<prefix>token`` registers only
  under an incarnation whose size is there and is its own, and that is not complete: a new
  rank of a grow that comes before the members opened the grown incarnation waits for it
  rather than counting itself into the current one, and a rank that left an incarnation
  never registers again in it as it closes. A rank joining a given token with another world
  size is refused.
- ``<prefix><token>/complete`` is written by the rank whose registration completed the
  membership (it is the one that finds all ``world_size`` keys when it lists them after its
  own), with its node and every member (``_completion``), so that the others read the
  membership in the one key they poll rather than list 400 keys each. Its node-mates are
  woken at once (``Waiting.completed``); a rank of another node that finds the key by
  looking wakes its own node-mates, so the looks of a rank that waits registered are only a
  fallback, and rarer the larger the group (``registered_pause``).
- ``<prefix><token>/stream/<rank>/<host>/<port>`` is where a member of a group that spans
  nodes listens for streams from other nodes, published right after the membership is
  complete and read by a peer when it first connects.
- ``<prefix><token>/left/<rank>`` marks a member that destroyed its membership; the last one to
  leave deletes the incarnation's keys.
- ``<prefix><token>/broken`` marks an incarnation that can never complete a call again: a
  member raised a collective error in it (the key holds that error's record, which ranks
  waiting on other nodes read: see ``RayPostOffices.published_abort``), or a joining rank
  found it dead. A rank joining a given token (a declared group, a shrink or grow) that finds
  it broken raises at once: nobody will open another incarnation for it.
- ``<prefix><token>/reform/...``: the agreement of a shrink or grow (``elastic``).

A rank that registered under a token that then changes (it joined before rank 0 reopened the
group) registers again under the new one; a registered rank looks for that (and for a broken
mark) every ``recheck_interval`` (``RECHECK_S``, longer in large groups), and otherwise polls
only the ``complete`` key. A rank never
registers under a token it has left (a re-init after a destroy waits for the next
incarnation), and a rank whose join times out withdraws its member key. How often the waiting
ranks look is bounded for the whole group, not per rank: every look is a request to Ray's
control store, which 256 ranks on 2 cores kept busy enough to take 70-100 ms a request.

Rebuilding after a crash works in any join order. A member that died never leaves, so its key
stays under the old token until rank 0 (or the driver) opens the next incarnation; a rank that
comes first and finds its rank taken does not count the old incarnation as live when it is
marked broken, when a member of it on this node is a dead process, or when every other rank
has left it: it marks it broken and waits for the next. Only a rank taken by a live member of a
live incarnation is refused (``ValueError``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from dataclasses import astuple, dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple
from urllib.parse import quote

from ...errors import (CollectiveError, CollectiveTimeoutError, GroupBrokenError,
                       error_from_record)
from ...transport.processes import process_alive
from ..arrivals import Arrivals
from ..key_value import KeyValue

@dataclass(frozen=True)
class Waiting:
    """How a rank waits while it joins (:func:`join`).

    Attributes:
        nap: sleeps between two looks at the store, ``nap(seconds)``; it may end early (the
            ``ray`` backend's ends when the rank's listening socket is knocked), and returns
            whether it was woken so (a plain sleep returns None: not woken).
        completed: run, with every member, by the rank whose registration completed the
            membership after it told them through the store, and by a rank of another node
            that learned it by looking rather than by being woken (the ``ray`` backend knocks
            the rank's node-mates, so that they look at once rather than at their next look).
        longest_pause: the longest nap; None for one that grows with the world size
            (``_longest_pause`` before registering, ``registered_pause`` after).
    """

    nap: Callable[[float], Optional[bool]] = time.sleep
    completed: Callable[[List["Member"]], None] = lambda members: None
    longest_pause: Optional[float] = None


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


def open_incarnation(kv: KeyValue, prefix: str, world_size: Optional[int] = None) -> str:
    """Start a new incarnation of the group: clear old keys and publish a fresh token (with its
    world size first, when known, so that no rank following the token can see it without)."""
    kv.delete_prefix(prefix)
    token = uuid.uuid4().hex
    if world_size is not None:
        kv.put(f"{prefix}{token}/size", str(world_size))
    kv.put(prefix + "token", token)
    return token


def join(kv: KeyValue, prefix: str, group_name: str, world_size: int, me: Member,
         timeout: float, on_token: Callable[[str], None], token: Optional[str] = None,
         watch: Optional[Callable[[], None]] = None,
         waiting: Waiting = Waiting(),
         arrivals: Optional[Arrivals] = None) -> Tuple[str, List[Member]]:
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
        watch: called every ``RECHECK_S`` while this rank waits registered; what it raises
            ends the join, the rank's key withdrawn first (a shrink's watch raises when a rank
            it waits for is dead).
        waiting: how the rank waits between two looks at the store.
        arrivals: this rank's announced terms (``backends.arrivals``), looked at every
            ``RECHECK_S`` whether it waits registered or not; the ranks it saw arrive are not
            named as missing.

    Returns:
        The token joined and every member, by rank.

    Raises:
        CollectiveTimeoutError: some ranks did not register in time (it names them).
        GroupBrokenError: ``token``'s incarnation was marked broken (its recorded failure is
            the cause).
        JoinMismatchError: a rank that came later brought terms that disagree.
        ValueError: another live process registered as the same rank, or ``token``'s
            incarnation has another world size.
    """
    deadline = time.monotonic() + timeout
    registered = None
    abandoned: Set[str] = set()
    waits = pauses(world_size, waiting.longest_pause)
    recheck_s = recheck_interval(world_size)
    members: List[Member] = []
    # The ranks seen registered in this incarnation while this rank waited: one whose own
    # deadline passed first withdrew its key, but it came, and is not named as missing.
    seen: Set[int] = set()
    next_recheck = 0.0
    next_look = time.monotonic() + recheck_s
    woken = False
    while True:
        if arrivals is not None and time.monotonic() >= next_look:
            next_look = time.monotonic() + recheck_s
            try:
                arrivals.look()
            except BaseException:
                if registered is not None:
                    kv.delete_prefix(_member_key(prefix, registered, me))
                raise
        # A registered rank polls one key; whether its incarnation was replaced or broken
        # is looked at only every recheck_s (each look is a request to Ray's control store,
        # which 400 waiting ranks would otherwise keep busy).
        if registered is None or time.monotonic() >= next_recheck:
            next_recheck = time.monotonic() + recheck_s
            current = token or kv.get(prefix + "token")
            if registered is not None and kv.get(f"{prefix}{registered}/broken") is not None:
                kv.delete_prefix(_member_key(prefix, registered, me))
                if token is not None:
                    raise _broken(kv, prefix, token, group_name, me.rank)
                abandoned.add(registered)
                registered, members, seen = None, [], set()
            if registered is not None and watch is not None:
                try:
                    watch()
                except BaseException:
                    kv.delete_prefix(_member_key(prefix, registered, me))
                    raise
            # Never rejoin an incarnation this rank left: a re-init after a destroy waits for
            # the next one, which rank 0 opens once it has left too.
            if current is not None and current != registered and current not in abandoned \
                    and kv.get(f"{prefix}{current}/left/{me.rank}") is None:
                if kv.get(f"{prefix}{current}/broken") is not None:
                    if token is not None:
                        raise _broken(kv, prefix, token, group_name, me.rank)
                    abandoned.add(current)
                else:
                    registered = _register(kv, prefix, current, group_name, world_size, me,
                                           on_token, following=token is None)
                    if registered is None:
                        abandoned.add(current)
                    else:
                        # The store is linearizable: the rank whose key went in last sees
                        # every key here, and tells the others with one key they can poll.
                        members = registered_members(kv, prefix, registered)
                        seen = {m.rank for m in members}
                        if len(members) >= world_size:
                            kv.put(f"{prefix}{registered}/complete",
                                   _completion(me.node, members))
                            waiting.completed(members)
                            return registered, sorted(members, key=lambda m: m.rank)
                        waits = pauses(world_size, waiting.longest_pause, registered=True)
        if registered is not None:
            completion = kv.get(f"{prefix}{registered}/complete")
            if completion is not None:
                completer_node, members = _completed_members(completion)
                if members is None:
                    # Completed for a rank that died after its key went in (``elastic``).
                    members = registered_members(kv, prefix, registered)
                elif completer_node != me.node and not woken:
                    # The first of this node's ranks to see it: the completer woke only its
                    # own node-mates.
                    waiting.completed(members)
                return registered, sorted(members, key=lambda m: m.rank)
        if time.monotonic() >= deadline:
            present = seen | {m.rank for m in (registered_members(kv, prefix, registered)
                                               if registered else members)}
            if arrivals is not None:
                present |= arrivals.present()
            if registered is not None:
                # Withdraw, so that a rank joining this incarnation later waits for a live
                # member instead of counting this failed one.
                kv.delete_prefix(_member_key(prefix, registered, me))
            raise CollectiveTimeoutError(group_name, me.rank, "init_collective_group", -1,
                                         [r for r in range(world_size)
                                          if r not in present and r != me.rank], timeout)
        woken = bool(waiting.nap(max(0.0, min(next(waits), deadline - time.monotonic()))))


def _register(kv: KeyValue, prefix: str, token: str, group_name: str, world_size: int,
              me: Member, on_token: Callable[[str], None], following: bool) -> Optional[str]:
    """Register ``me`` under ``token``; None if that incarnation turned out to be dead, or, when
    ``following`` the group's current token, not this rank's.

    Raises:
        ValueError: a live member of a live incarnation holds ``me``'s rank, or ``token``
            (given, not followed) is an incarnation of another world size.
    """
    size_key = f"{prefix}{token}/size"
    if following:
        # Only an open incarnation of this rank's world size: one whose keys are gone was
        # closed (its members all left), and a grow's new rank waits for the incarnation of
        # the grown size, which the members open.
        size = kv.get(size_key)
        if size is None or int(size) != world_size:
            return None
    elif kv.put(size_key, str(world_size), overwrite=False):
        size = kv.get(size_key)
        if size is not None and int(size) != world_size:
            raise ValueError(f"group '{group_name}': rank {me.rank} joins with world_size="
                             f"{world_size}, but the incarnation it was given has {size} "
                             f"ranks; every member must pass the same world_size")
    # Look before registering: ``on_token`` takes over the rank's socket path, which a live
    # holder of the rank is using.
    holders = [m for m in registered_members(kv, prefix, token, me.rank) if m != me]
    if holders and _incarnation_is_dead(kv, prefix, token,
                                        registered_members(kv, prefix, token), me, world_size):
        mark_broken(kv, prefix, token)
        return None
    if not holders:
        # Complete without this rank: it left this incarnation, which may close (every member
        # gone) at any moment. One that is not complete cannot close before this rank joins.
        if following and kv.get(f"{prefix}{token}/complete") is not None:
            return None
        on_token(token)
        if not kv.put(_member_key(prefix, token, me), "", overwrite=False):
            return token
    raise ValueError(f"group '{group_name}': rank {me.rank} has already joined from another "
                     f"process (pid {holders[0].pid if holders else os.getpid()}), which is "
                     f"alive in the group's current incarnation; every member needs its own "
                     f"rank in [0, {world_size})")


def _broken(kv: KeyValue, prefix: str, token: str, group_name: str,
            rank: int) -> GroupBrokenError:
    """The error of a rank whose given incarnation was marked broken while it joined."""
    try:
        record = broken_by(kv, prefix, token)
    except ValueError:
        record = None
    try:
        cause = error_from_record(record, rank) if record else None
    except (KeyError, TypeError, ValueError, AttributeError):
        cause = None  # a record that is no error of this library's
    return GroupBrokenError(group_name, rank, cause or CollectiveError(
        f"rank {rank} of group '{group_name}': the incarnation it was joining was marked "
        f"broken"))


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


def pauses(world_size: int, longest: Optional[float] = None,
           registered: bool = False) -> Iterator[float]:
    """The sleeps between two looks at the store of one of ``world_size`` ranks waiting for
    each other. A registered rank (it is woken when the membership completes) sleeps
    ``longest`` each time, or ``registered_pause(world_size)`` when None; one still looking for
    an incarnation to register in (nobody can wake it) sleeps short at first, then at most
    ``longest``, or ``_longest_pause(world_size)`` when None."""
    if registered:
        # Not short at first: those on this node are woken, and a group that spans nodes
        # needs only one look on each node soon (that rank wakes the others).
        return itertools.repeat(registered_pause(world_size) if longest is None else longest)
    return _pauses(_longest_pause(world_size) if longest is None else longest)


LOOKS_PER_SECOND = 4000
"""How often all the ranks of a group that look for an incarnation to register in may look
at the store together (each look is a request to Ray's control store, which serves the whole
cluster); they wait for rank 0 to open it, a moment at most."""

REGISTERED_LOOKS_PER_SECOND = 400
"""How often all the registered ranks of a group may look whether it is complete, together:
they are woken when it is, so their looks are a fallback, and the first look on each node of
a group that spans nodes (see the module)."""

RECHECK_S = 0.5
"""How often a registered rank of a group of up to ``RECHECKS_PER_SECOND / 2`` ranks looks
whether its incarnation was replaced (a new token) or broken (a member died), besides whether
it is complete."""

RECHECKS_PER_SECOND = 200
"""How often all the registered ranks of a group may look whether their incarnation was
replaced or broken, together (400 ranks: each every 2 s)."""


def _longest_pause(world_size: int) -> float:
    """The longest sleep between two looks of one of ``world_size`` ranks looking for an
    incarnation: 50 ms, or longer where the group is so large that looks every 50 ms would
    load the store beyond ``LOOKS_PER_SECOND`` (400 ranks: 100 ms)."""
    return max(0.05, world_size / LOOKS_PER_SECOND)


def registered_pause(world_size: int) -> float:
    """The longest sleep between two looks of one of ``world_size`` registered ranks: 50 ms,
    or longer beyond ``REGISTERED_LOOKS_PER_SECOND`` looks a second (400 ranks: 1 s)."""
    return max(0.05, world_size / REGISTERED_LOOKS_PER_SECOND)


def recheck_interval(world_size: int) -> float:
    """Seconds between two looks of a registered rank at whether its incarnation was replaced
    or broken: ``RECHECK_S``, or longer beyond ``RECHECKS_PER_SECOND`` looks a second."""
    return max(RECHECK_S, world_size / RECHECKS_PER_SECOND)


def _completion(node: str, members: List[Member]) -> str:
    """The value of the ``complete`` key: the completer's node and every member."""
    return json.dumps({"node": node, "members": [astuple(member) for member in members]})


def _completed_members(value: str) -> Tuple[Optional[str], Optional[List[Member]]]:
    """The completer's node and the members recorded in the ``complete`` key's ``value``;
    (None, None) for a key put without them."""
    if not value:
        return None, None
    record = json.loads(value)
    return record["node"], [Member(*fields) for fields in record["members"]]


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
    waits = _pauses()
    while True:
        found = stream_endpoints(kv, prefix, token)
        if rank in found:
            return found
        if time.monotonic() >= deadline:
            raise ConnectionError(f"rank {rank} published no stream endpoint within {timeout} s")
        time.sleep(next(waits))


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


def incarnations(kv: KeyValue, prefix: str) -> Set[str]:
    """The tokens of the group's incarnations that hold keys (and the current token's)."""
    found = {key[len(prefix):].split("/", 1)[0] for key in kv.keys(prefix)} - {"token"}
    current = kv.get(prefix + "token")
    return {token for token in found | {current} if token and _is_token(token)}


def _is_token(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) == 16
    except ValueError:
        return False


def close_incarnation(kv: KeyValue, prefix: str, token: str) -> None:
    """Delete the incarnation's keys (and the token, unless a newer incarnation replaced it)."""
    kv.delete_prefix(f"{prefix}{token}/")
    if kv.get(prefix + "token") == token:
        kv.delete_prefix(prefix + "token")
