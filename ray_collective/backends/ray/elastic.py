"""Elastic ``ray`` groups: the survivors of a failure go on without the failed ranks (shrink), or
the members take new ranks in (grow), each time in a fresh incarnation of the group joined
through the ordinary join (``factory``): a new token, so a new epoch in every message header, a
new directory on each node (fresh rings, sockets and state page), new streams and post offices.

The members agree in the current incarnation's key space, in rounds
(``<prefix><token>/reform/<round>/``):

- ``here/<rank>/<named>/<doubtful>``: a member came to the shrink. ``named``: the ranks it
  knows to have failed (those its error names, as dead or as stalled, and those the group's
  recorded failure names); ``doubtful``: ranks cut off with a lost post office, who may be
  alive (comma-separated).
- ``dead/<rank>``: a member found that rank's process gone (every member looks at the
  processes of its own node).
- ``decision``: the round's outcome, put if absent, so that the first decision wins: JSON
  ``{"kind", "ranks", "world_size", "token", "gone"}``: ``ranks`` are the old ranks that go
  on, in their new rank order (dense, in the old order), ``token`` the new incarnation,
  ``gone`` the excluded ranks known to be dead or gone (the others leave the old incarnation
  for them). A shrink decides once every old rank is accounted for: here, gone (left, its
  process found gone, its node dead to Ray), named as failed by a rank that is here, or, after
  ``SUSPECT_GRACE_S``, a rank of another node whose node lost a rank or its post office and
  where no rank came (a node that went away, before Ray counts it dead). At its deadline it
  decides with the ranks that came. A grow decides at once: the first member to ask.
- ``failed``: the round's new incarnation could not form (a rank it waited for died, the
  deadline passed, members asked for different things); JSON ``{"ranks", "kind", "message"}``.
  The next call opens the next round, whose shrink counts those ranks as failed.

The decider records the new incarnation's world size, then makes it the group's current token,
so that the new ranks of a grow, who follow the token, find it (and a newcomer that came early
waits for it: it has another world size than the current incarnation's). Every kept rank then
joins the new incarnation with a watch (``rendezvous.join``) that ends the join when a rank it
waits for is found dead or the deadline passes, marking the round failed and the new
incarnation broken so that the others stop too. Only with the new membership complete does a
rank leave the old one (the group layer closes it), for itself and for the ranks the decision
counts as gone. An excluded rank that may be alive (a stopped one) is not left for: the old
incarnation's keys, and its node's directory, stay until it learns from the decision, at its
next shrink, that it is no longer a member (``RankExcludedError``) and leaves; or until the
group is destroyed from the driver, or the job ends.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import (Callable, FrozenSet, Iterable, List, Optional, Protocol, Sequence, Set,
                    Tuple)

from ...errors import (CollectiveError, CollectiveTimeoutError, GroupBrokenError,
                       PeerDiedError, PostOfficeDiedError, RankExcludedError, error_from_record)
from ...transport.link_transport import LinkTransport
from ...transport.processes import process_alive
from ..base import BackendFactory, Reformed
from . import private_dirs, rendezvous
from .environment import dead_nodes, runtime
from .rendezvous import KeyValue, Member



class Reforming(Protocol):
    """What a shrink or a grow reads and marks of the ``ray`` backend's membership
    (``membership.RayMembership``, which calls this module; this module does not know it)."""

    group_name: str
    rank: int
    transport: LinkTransport
    token: str
    prefix: str
    members: Tuple[Member, ...]
    factory: Optional[BackendFactory]
    post_office: Optional[object]
    timeout: float
    departed: Optional[FrozenSet[int]]
    incarnation_closed: bool

SUSPECT_GRACE_S = 1.0
"""How long a shrink waits for the ranks of another node that lost a rank or its post office,
when none of that node's ranks has come, before it counts them as gone with their node."""

SHRINK, GROW = "shrink", "grow"


@dataclass(frozen=True)
class Decision:
    """What one round decided (see the module).

    Attributes:
        round: the round.
        kind: ``"shrink"`` or ``"grow"``.
        ranks: the old ranks that go on, in their new rank order.
        world_size: the new incarnation's ranks (a grow's are more than ``ranks``).
        token: the new incarnation.
        gone: the excluded ranks known to be dead or gone.
    """

    round: int
    kind: str
    ranks: Tuple[int, ...]
    world_size: int
    token: str
    gone: Tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "ranks": list(self.ranks),
                           "world_size": self.world_size, "token": self.token,
                           "gone": list(self.gone)})

    @classmethod
    def from_json(cls, round_: int, text: str) -> "Decision":
        value = json.loads(text)
        return cls(round_, value["kind"], tuple(value["ranks"]), value["world_size"],
                   value["token"], tuple(value["gone"]))


def _csv(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def _ranks(text: str) -> Set[int]:
    return {int(r) for r in text.split(",") if r}


def failures_named(errors: Iterable[Optional[BaseException]]) -> Tuple[Set[int], Set[int]]:
    """The ranks some errors name as failed, and those they name as cut off.

    Args:
        errors: errors a rank raised or read (a ``GroupBrokenError`` counts as its cause).

    Returns:
        ``(named, doubtful)``: ranks dead (``PeerDiedError``) or holding a call up
        (``CollectiveTimeoutError``); ranks served by a lost post office
        (``PostOfficeDiedError``), who may be alive.
    """
    named: Set[int] = set()
    doubtful: Set[int] = set()
    for error in errors:
        while isinstance(error, GroupBrokenError):
            error = error.cause
        if isinstance(error, PeerDiedError):
            named.update(error.dead_ranks)
        elif isinstance(error, CollectiveTimeoutError):
            named.update(error.missing_ranks)
        elif isinstance(error, PostOfficeDiedError):
            doubtful.update(error.served_ranks)
    return named, doubtful


class Agreement:
    """One member's part in deciding its group's next incarnation, in the current one's key
    space (see the module).

    Args:
        kv: the store.
        prefix: the group's key prefix.
        token: the current incarnation.
        group_name: the group (errors).
        members: the current incarnation's members, by rank.
        rank: this member.
        alive: whether a process of this node lives (by pid).
        nodes_gone: the ids of the nodes Ray counts as dead.
        nap: sleeps between two looks at the store, ``nap(seconds)``; it may end early, when
            :meth:`decide_shrink`'s decider wakes this member.
        wake: wakes the members of this node in their ``nap`` (the decider calls it).
    """

    def __init__(self, kv: KeyValue, prefix: str, token: str, group_name: str,
                 members: Sequence[Member], rank: int,
                 alive: Callable[[int], bool] = process_alive,
                 nodes_gone: Callable[[], Set[str]] = dead_nodes,
                 nap: Callable[[float], None] = time.sleep,
                 wake: Callable[[], None] = lambda: None):
        self.kv = kv
        self.prefix = prefix
        self.token = token
        self.group_name = group_name
        self.members = tuple(members)
        self.rank = rank
        self.node = self.members[rank].node
        self.alive = alive
        self.nodes_gone = nodes_gone
        self.nap = nap
        self.wake = wake
        # Woken by the decider, a member of a one-node group need not look for the decision
        # between two of its own looks at the whole round.
        one_node = all(member.node == self.node for member in self.members)
        self.longest_pause = rendezvous.RECHECK_S if one_node else None

    def _base(self, round_: int) -> str:
        return f"{self.prefix}{self.token}/reform/{round_}/"

    def closed(self) -> bool:
        """Whether the current incarnation is gone: every member left it (the others went on
        without this one) or the group was destroyed."""
        return self.kv.get(f"{self.prefix}{self.token}/size") is None

    def current_round(self) -> Tuple[int, Optional[Decision], Set[int]]:
        """The first round not marked failed, its decision (None while there is none), and the
        ranks the failed rounds before it blamed."""
        round_, blamed = 0, set()
        while True:
            failed = self.kv.get(self._base(round_) + "failed")
            if failed is None:
                return round_, self.decision(round_), blamed
            blamed.update(json.loads(failed)["ranks"])
            round_ += 1

    def decision(self, round_: int) -> Optional[Decision]:
        """Round ``round_``'s decision, None while there is none."""
        value = self.kv.get(self._base(round_) + "decision")
        return None if value is None else Decision.from_json(round_, value)

    def failure(self, round_: int) -> Optional[dict]:
        """Why round ``round_``'s new incarnation could not form, None if it did not fail."""
        value = self.kv.get(self._base(round_) + "failed")
        return None if value is None else json.loads(value)

    def decide_grow(self, world_size: int) -> Decision:
        """The current round's decision, made now (a grow to ``world_size``) if there is none.

        Args:
            world_size: the group's size once grown.

        Returns:
            The decision (a shrink's, or a grow to another size, when another member asked
            first: the caller compares).
        """
        round_, decision, _ = self.current_round()
        if decision is None:
            decision = self._decide(round_, GROW, range(len(self.members)), world_size, ())
        return decision

    def decide_shrink(self, named: Set[int], doubtful: Set[int], deadline: float,
                      clock: Callable[[], float] = time.monotonic) -> Decision:
        """Come to the current round's shrink and wait for its decision (made here if this
        member accounts for every rank first, or at ``deadline``).

        Args:
            named: ranks this member knows to have failed.
            doubtful: ranks cut off with a lost post office, who may be alive.
            deadline: when to decide with the ranks that came, on ``clock``.
            clock: the time (tests pass their own).

        Returns:
            The round's decision (a grow's, when another member asked for one first: the
            caller compares).
        """
        round_, decision, blamed = self.current_round()
        if decision is not None:
            return decision
        base = self._base(round_)
        self.kv.put(f"{base}here/{self.rank}/{_csv((named | blamed) - {self.rank})}/"
                    f"{_csv(doubtful - {self.rank})}")
        started = clock()
        pauses = rendezvous.pauses(len(self.members), self.longest_pause)
        next_look = started
        while True:
            now = clock()
            if now >= next_look or now >= deadline:
                next_look = now + rendezvous.RECHECK_S
                decision = self._settle(round_, now - started, now >= deadline)
            else:
                decision = self.decision(round_)
            if decision is not None:
                return decision
            self.nap(max(0.0, min(next(pauses), next_look - now, deadline - now)))

    def _settle(self, round_: int, waited: float, final: bool) -> Optional[Decision]:
        """Decide if every rank is accounted for (or ``final``); the decision, or None."""
        base = self._base(round_)
        present, named, doubtful, gone = set(), set(), set(), set()
        for key in self.kv.keys(base):
            fields = key[len(base):].split("/")
            if fields[0] == "here":
                present.add(int(fields[1]))
                named |= _ranks(fields[2])
                doubtful |= _ranks(fields[3])
            elif fields[0] == "dead":
                gone.add(int(fields[1]))
            elif fields[0] == "decision":
                return self.decision(round_)
        gone |= {int(k.rsplit("/", 1)[1])
                 for k in self.kv.keys(f"{self.prefix}{self.token}/left/")}
        absent = set(range(len(self.members))) - present - gone
        for r in sorted(absent):
            # A rank that came and died since is found by the join of the new incarnation.
            if self.members[r].node == self.node and not self.alive(self.members[r].pid):
                gone.add(r)
                self.kv.put(f"{base}dead/{r}")
        absent -= gone
        if any(self.members[r].node != self.node for r in absent):
            lost = self.nodes_gone()
            gone |= {r for r in absent if self.members[r].node in lost}
        waiting = absent - named - gone
        if waiting and waited >= SUSPECT_GRACE_S:
            came = {self.members[r].node for r in present}
            troubled = {self.members[r].node for r in named | doubtful | gone}
            waiting = {r for r in waiting if self.members[r].node in came
                       or self.members[r].node not in troubled}
        if waiting and not final:
            return None
        kept = sorted(present - gone)
        return self._decide(round_, SHRINK, kept, len(kept), sorted(gone - present))

    def _decide(self, round_: int, kind: str, ranks: Iterable[int], world_size: int,
                gone: Iterable[int]) -> Decision:
        """Put ``round_``'s decision unless another member did first; the one that stands.

        The member whose decision stands opens the new incarnation for those who follow the
        group's token, and drops the incarnations of the rounds that failed before."""
        candidate = Decision(round_, kind, tuple(ranks), world_size, uuid.uuid4().hex,
                             tuple(gone))
        if self.kv.put(self._base(round_) + "decision", candidate.to_json(), overwrite=False):
            return self.decision(round_)
        self.kv.put(f"{self.prefix}{candidate.token}/size", str(world_size))
        self.kv.put(self.prefix + "token", candidate.token)
        self.wake()
        for earlier in range(round_):
            failed = self.decision(earlier)
            if failed is not None:
                self.kv.delete_prefix(f"{self.prefix}{failed.token}/")
        return candidate

    def fail(self, decision: Decision, ranks: Iterable[int], kind: str, message: str) -> None:
        """Mark ``decision``'s round failed (blaming ``ranks``; the first mark stays) and its
        new incarnation broken, so that every member waiting to join it stops.

        Args:
            decision: the round's decision.
            ranks: the old ranks to blame (the next shrink counts them as failed).
            kind: ``"died"``, ``"timeout"`` or ``"error"``.
            message: what happened, for the others' errors.
        """
        record = {"ranks": sorted(ranks), "kind": kind, "message": message}
        self.kv.put(self._base(decision.round) + "failed", json.dumps(record), overwrite=False)
        rendezvous.mark_broken(self.kv, self.prefix, decision.token,
                               {"group": self.group_name, "rank": self.rank,
                                "kind": "CollectiveError", "message": message})


# ---------------------------------------------------------------------- in a member


def shrink(membership: Reforming, failures: Sequence[Optional[BaseException]],
           timeout: float) -> Reformed:
    """Agree with the other survivors on who goes on, and join the next incarnation with them.

    Args:
        membership: this rank's membership of the current incarnation.
        failures: what this rank knows of the failure (see ``Membership.shrink``).
        timeout: seconds the shrink may take.

    Returns:
        The new membership.

    Raises:
        RankExcludedError: the others went on without this rank.
        PeerDiedError: a rank the new incarnation waited for died; call again.
        CollectiveTimeoutError: ranks the new incarnation waited for never came in time.
        CollectiveError: the other members asked for a grow meanwhile.
    """
    deadline = time.monotonic() + timeout
    agreement = _agreement(membership)
    if agreement.closed():
        membership.incarnation_closed = True
        raise RankExcludedError(membership.group_name, membership.rank)
    named, doubtful = failures_named([*failures, *_published_failures(membership)])
    named |= set(membership.transport.failures.dead)
    decision = agreement.decide_shrink(named, doubtful, deadline)
    what = "shrink_collective_group"
    if decision.kind != SHRINK:
        _refuse(agreement, decision, membership.rank, what, f"a grow to {decision.world_size} "
                f"ranks")
    if membership.rank not in decision.ranks:
        raise RankExcludedError(membership.group_name, membership.rank, decision.ranks)
    reformed = _join(membership, agreement, decision, deadline, what)
    membership.departed = frozenset(decision.gone)
    return reformed


def prepare_grow(membership: Reforming, world_size: int) -> BackendFactory:
    """Decide (or learn) the grow to ``world_size``; the factory its new ranks join with."""
    return membership.factory.incarnation(_grow_decision(membership, world_size).token)


def grow(membership: Reforming, world_size: int, timeout: float) -> Reformed:
    """Join the group's next incarnation of ``world_size`` ranks with the other members and
    the new ranks.

    Raises:
        PeerDiedError: a member died (shrink the group first).
        CollectiveTimeoutError: ranks (members or new ones) never came in time.
        CollectiveError: the other members asked for a shrink, or another size, first.
    """
    deadline = time.monotonic() + timeout
    decision = _grow_decision(membership, world_size)
    return _join(membership, _agreement(membership), decision, deadline,
                 "grow_collective_group")


def _grow_decision(membership: Reforming, world_size: int) -> Decision:
    agreement = _agreement(membership)
    decision = agreement.decide_grow(world_size)
    if decision.kind != GROW or decision.world_size != world_size:
        asked = (f"a grow to {decision.world_size} ranks" if decision.kind == GROW
                 else "a shrink")
        _refuse(agreement, decision, membership.rank, f"grow_collective_group(world_size="
                f"{world_size})", asked)
    return decision


def _agreement(membership: Reforming) -> Agreement:
    # A member waits for the decision in its old transport's wait (which a knock on its
    # socket ends), and the decider knocks its node-mates'.
    transport = membership.transport
    return Agreement(KeyValue(), membership.prefix, membership.token, membership.group_name,
                     membership.members, membership.rank, nap=transport.progress.progress,
                     wake=transport.failures.wake_local_peers)


def _published_failures(membership: Reforming) -> List[CollectiveError]:
    """The failures published for the group: on this node's state page, and with the
    incarnation's broken mark (what a rank that was in no failed call knows)."""
    records = [membership.transport.state.aborted()]
    try:
        records.append(rendezvous.broken_by(KeyValue(), membership.prefix, membership.token))
    except ValueError:
        pass
    errors = []
    for record in records:
        try:
            if record is not None:
                errors.append(error_from_record(record, membership.rank))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # a record that names nothing
    return errors


def _refuse(agreement: Agreement, decision: Decision, rank: int, what: str,
            asked: str) -> None:
    """Fail the round: this member asked for something else than the decision."""
    message = (f"rank {rank} of group '{agreement.group_name}': {what} meets {asked}, "
               f"decided by another member first; every member must make the same call")
    agreement.fail(decision, (), "error", message)
    raise CollectiveError(message)


class _JoinWatch:
    """Looks, while a rank joins the new incarnation, for a rank it waits for that is dead, and
    at the deadline (see ``rendezvous.join``'s ``watch``).

    Args:
        agreement: the old incarnation's agreement.
        decision: the round's decision.
        deadline: the shrink's or grow's deadline (``time.monotonic``).
        what: the call (errors).
        rank: this rank, as the caller knows it (its old rank).
        timeout: the call's timeout (errors).
    """

    def __init__(self, agreement: Agreement, decision: Decision, deadline: float, what: str,
                 rank: int, timeout: float):
        self.agreement = agreement
        self.decision = decision
        self.deadline = deadline
        self.what = what
        self.rank = rank
        self.timeout = timeout
        self.error: Optional[CollectiveError] = None

    def __call__(self) -> None:
        agreement, decision = self.agreement, self.decision
        joined = {m.rank for m in rendezvous.registered_members(
            agreement.kv, agreement.prefix, decision.token)}
        # A grow keeps every rank's number, a shrink renumbers: name the old ranks.
        expected = [decision.ranks[new] if new < len(decision.ranks) else new
                    for new in range(decision.world_size)]
        waiting = [r for new, r in enumerate(expected) if new not in joined]
        members, lost = agreement.members, None
        dead = []
        # Those that joined too: one that died right after its key went in (the last) would
        # leave the membership complete with nobody to say so.
        for r in expected:
            if r >= len(members):
                continue  # a new rank of a grow: nothing tells whether it lives
            if members[r].node == agreement.node:
                if not agreement.alive(members[r].pid):
                    dead.append(r)
            else:
                lost = agreement.nodes_gone() if lost is None else lost
                if members[r].node in lost:
                    dead.append(r)
        if dead:
            self._fail(dead, "died", PeerDiedError(
                agreement.group_name, self.rank, self.what, -1, dead,
                f"while the group formed its new incarnation; call {self.what} again"))
        if not waiting:
            # Every key is in, but the rank whose key completed it did not say so (it died
            # after its key went in, on another node, not known dead yet): say it for it; the
            # new incarnation's first call finds it dead.
            agreement.kv.put(f"{agreement.prefix}{decision.token}/complete")
        elif time.monotonic() >= self.deadline:
            self._fail([r for r in waiting if r < len(members)], "timeout",
                       CollectiveTimeoutError(agreement.group_name, self.rank, self.what, -1,
                                              waiting, self.timeout))

    def _fail(self, ranks: List[int], kind: str, error: CollectiveError) -> None:
        self.error = error
        self.agreement.fail(self.decision, ranks, kind, str(error))
        raise error


def _join(membership: Reforming, agreement: Agreement, decision: Decision,
          deadline: float, what: str) -> Reformed:
    """Join ``decision``'s new incarnation with this rank's new rank; on failure, fail the
    round and remove what this rank made for the new incarnation here."""
    rank = decision.ranks.index(membership.rank)
    timeout = max(0.0, deadline - time.monotonic())
    watch = _JoinWatch(agreement, decision, deadline, what, membership.rank, timeout)
    nodes = {agreement.members[old].node for old in decision.ranks}
    # Every member of one node is knocked when the membership completes (see ``factory``):
    # none needs to look early, and the watch looks every RECHECK_S anyway.
    longest_pause = rendezvous.RECHECK_S if nodes == {agreement.node} and \
        decision.world_size == len(decision.ranks) else None
    try:
        new = membership.factory.incarnation(
            decision.token, watch, longest_pause, membership.post_office).create(
                membership.group_name, decision.world_size, rank, membership.timeout)
    except BaseException as err:
        error = watch.error or _failure_here(agreement, decision, membership.rank, what,
                                             timeout, err)
        job_id, _, session = runtime()
        private_dirs.remove_node_directory(session, job_id, membership.group_name,
                                           decision.token, membership.transport.node)
        if error is err:
            raise
        raise error from None
    return Reformed(new, rank, decision.world_size, decision.ranks)


def _failure_here(agreement: Agreement, decision: Decision, rank: int, what: str,
                  timeout: float, err: BaseException) -> BaseException:
    """The error of a rank whose join of the new incarnation failed (another member's watch
    broke it, or this rank's join raised): what the round's failure mark says, in this rank's
    own numbering."""
    failure = agreement.failure(decision.round)
    if failure is None and isinstance(err, CollectiveTimeoutError):
        # The join's own deadline (the group's) passed before the call's: name the old ranks.
        missing = [decision.ranks[r] if r < len(decision.ranks) else r
                   for r in err.missing_ranks]
        error = CollectiveTimeoutError(agreement.group_name, rank, what, -1, missing, timeout)
        agreement.fail(decision, [r for r in missing if r < len(agreement.members)], "timeout",
                       str(error))
        return error
    if failure is None:
        agreement.fail(decision, (), "error", f"rank {rank} of group '{agreement.group_name}' "
                       f"could not join the new incarnation: {type(err).__name__}: {err}")
        return err
    if failure["kind"] == "died":
        return PeerDiedError(agreement.group_name, rank, what, -1, failure["ranks"],
                             f"while the group formed its new incarnation; call {what} again")
    if failure["kind"] == "timeout":
        return CollectiveTimeoutError(agreement.group_name, rank, what, -1, failure["ranks"],
                                      timeout)
    return CollectiveError(failure["message"]) if isinstance(err, GroupBrokenError) else err
