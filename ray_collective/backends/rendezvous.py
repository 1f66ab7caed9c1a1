"""How the ranks of a ``ray`` group find each other: Ray's internal key-value store.

Keys live in the namespace ``ray_collective`` under ``<job id>/<group name>/``, so two Ray jobs
may use the same group name. One incarnation of a group is identified by a random token:

- ``<prefix>token`` holds the current token. Whoever opens an incarnation (rank 0 of an
  imperative group, or the driver of a declared one) first clears the prefix, so keys left by a
  crashed earlier incarnation cannot pose as members.
- ``<prefix><token>/member/<rank>/<node id>/<pid>/<cores>`` announces one member (``cores``:
  the CPUs its process may run on). Everything a peer needs
  is in the key itself, so one ``list`` call reads the whole membership.
- ``<prefix><token>/left/<rank>`` marks a member that destroyed its membership; the last one to
  leave deletes the incarnation's keys.

A rank that registered under a token that then changes (it joined before rank 0 reopened the
group) registers again under the new one. A rank never registers under a token it has left (a
re-init after a destroy waits for the next incarnation), and a rank whose join times out
withdraws its member key.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable, List, Optional, Set, Tuple

from ..errors import CollectiveTimeoutError

NAMESPACE = "ray_collective"


class KeyValue:
    """The subset of Ray's internal key-value store the rendezvous uses (strings in and out)."""

    def __init__(self):
        from ray.experimental import internal_kv
        self._kv = internal_kv

    def put(self, key: str, value: str = "", overwrite: bool = True) -> bool:
        """Store ``key``; returns whether it existed already."""
        return bool(self._kv._internal_kv_put(key.encode(), value.encode(), overwrite,
                                              namespace=NAMESPACE))

    def get(self, key: str) -> Optional[str]:
        """The value of ``key``, or None."""
        value = self._kv._internal_kv_get(key.encode(), namespace=NAMESPACE)
        return None if value is None else value.decode()

    def keys(self, prefix: str) -> List[str]:
        """Every key starting with ``prefix``."""
        return [k.decode() for k in self._kv._internal_kv_list(prefix.encode(),
                                                                namespace=NAMESPACE)]

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``."""
        self._kv._internal_kv_del(prefix.encode(), del_by_prefix=True, namespace=NAMESPACE)


@dataclass(frozen=True)
class Member:
    """One rank as the rendezvous records it."""

    rank: int
    node: str
    pid: int
    cores: int = 1


def group_prefix(job_id: str, group_name: str) -> str:
    """The key prefix of ``group_name`` in job ``job_id``."""
    return f"{job_id}/{group_name}/"


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
    pause = 0.002
    members: List[Member] = []
    while True:
        current = token or kv.get(prefix + "token")
        # Never rejoin an incarnation this rank left: a re-init after a destroy waits for the
        # next one, which rank 0 opens once it has left too.
        if current is not None and current != registered \
                and kv.get(f"{prefix}{current}/left/{me.rank}") is None:
            on_token(current)
            existed = kv.put(_member_key(prefix, current, me), "", overwrite=False)
            others = [m for m in _members(kv, prefix, current) if m.rank == me.rank and m != me]
            if existed or others:
                raise ValueError(f"group '{group_name}': rank {me.rank} has already joined from "
                                 f"another process (pid {others[0].pid if others else '?'}); "
                                 f"every member needs its own rank in [0, {world_size})")
            registered = current
        if registered is not None:
            members = _members(kv, prefix, registered)
            if len(members) >= world_size:
                return registered, sorted(members, key=lambda m: m.rank)
        if time.monotonic() >= deadline:
            if registered is not None:
                # Withdraw, so that a rank joining this incarnation later waits for a live
                # member instead of counting this failed one.
                kv.delete_prefix(_member_key(prefix, registered, me))
            present = {m.rank for m in members}
            raise CollectiveTimeoutError(group_name, me.rank, "init_collective_group", -1,
                                         [r for r in range(world_size) if r not in present],
                                         timeout)
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)


def _member_key(prefix: str, token: str, me: Member) -> str:
    return f"{prefix}{token}/member/{me.rank}/{me.node}/{me.pid}/{me.cores}"


def _members(kv: KeyValue, prefix: str, token: str) -> List[Member]:
    found = []
    for key in kv.keys(f"{prefix}{token}/member/"):
        rank, node, pid, cores = key.rsplit("/", 4)[1:]
        found.append(Member(int(rank), node, int(pid), int(cores)))
    return found


def leave(kv: KeyValue, prefix: str, token: str, rank: int, world_size: int) -> Set[int]:
    """Mark ``rank`` as gone; the last member out deletes the incarnation's keys.

    Returns:
        The ranks that have left so far, this one included.
    """
    kv.put(f"{prefix}{token}/left/{rank}")
    gone = {int(k.rsplit("/", 1)[1]) for k in kv.keys(f"{prefix}{token}/left/")}
    if len(gone) >= world_size:
        close_incarnation(kv, prefix, token)
    return gone


def close_incarnation(kv: KeyValue, prefix: str, token: str) -> None:
    """Delete the incarnation's keys (and the token, unless a newer incarnation replaced it)."""
    kv.delete_prefix(f"{prefix}{token}/")
    if kv.get(prefix + "token") == token:
        kv.delete_prefix(prefix + "token")
