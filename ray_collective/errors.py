"""The errors of ray_collective.

Every failure of a collective or a group derives from :class:`CollectiveError`, which is itself a
``RuntimeError`` so that code written for ``ray.util.collective`` (which raises ``RuntimeError``)
keeps catching it. Messages say who (group, rank), what (collective, sequence number, shapes) and
what to do. Bad arguments are reported before any communication with an :class:`ArgumentError`:
an :class:`ArgumentValueError` or :class:`ArgumentTypeError`, each both the built-in error Python
code expects (``ValueError``, ``TypeError``) and the ``RuntimeError`` that ``ray.util.collective``
raises for the same input, so code catching either keeps working.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


RANKS_SHOWN = 32
"""A message lists at most this many ranks (the lowest) and says how many there are in all:
a timeout in a group of thousands must not make a message of megabytes."""


def _ranks(ranks: Iterable[int]) -> str:
    listed = sorted(set(ranks))
    shown = ", ".join(str(r) for r in listed[:RANKS_SHOWN])
    more = f", ... ({len(listed)} ranks in all)" if len(listed) > RANKS_SHOWN else ""
    return f"[{shown}{more}]"


class CollectiveError(RuntimeError):
    """Base class of every error raised by a collective operation or group.

    Errors cross process boundaries (an actor's error reaches the driver through Ray). Their
    constructors take structured arguments, so they pickle as their message and attributes
    rather than as constructor calls.

    Attributes:
        trace: the failing rank's last calls on the group (``get_collective_trace``'s list, the
            failed call last), set on every error that broke a group; None otherwise.
    """

    trace = None

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    # A timeout is also an OSError, whose layout only OSError's own constructor may allocate.
    error = (OSError if issubclass(cls, OSError) else Exception).__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ArgumentError(RuntimeError):
    """A call's arguments are wrong; raised before anything is sent, the group stays usable.

    Never raised itself: it is the common base of :class:`ArgumentValueError` and
    :class:`ArgumentTypeError`, so ``except ArgumentError`` catches every bad-argument error.
    """


class ArgumentValueError(ArgumentError, ValueError):
    """An argument has the right type but a wrong value (a rank out of range, a list that is not
    one tensor per rank, shapes that differ, a read-only output in strict mode, ...)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument has the wrong type (not a tensor, an unsupported dtype, a GPU tensor on a CPU
    group, an op that is not a ReduceOp, ...)."""


class ReadOnlyTensorWarning(UserWarning):
    """A collective wrote its result into a read-only numpy array (see ``tensors.as_view``)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete before its deadline.

    Attributes:
        group_name: the group the call was made on.
        rank: the rank that timed out.
        collective: the collective's name (``"allreduce"``, ``"recv"``, ...).
        seq: the call's sequence number within the group (p2p calls count per peer and tag).
        missing_ranks: the peers this rank was still waiting for.
        timeout: the deadline that passed, in seconds.
    """

    def __init__(self, group_name: str, rank: int, collective: str, seq: int,
                 missing_ranks: Sequence[int], timeout: float,
                 reported_by: Optional[int] = None):
        self.group_name = group_name
        self.rank = rank
        self.collective = collective
        self.seq = seq
        self.missing_ranks = tuple(sorted(set(missing_ranks)))
        self.timeout = timeout
        self.reported_by = reported_by
        who = "" if reported_by is None else f" (reported by rank {reported_by}, whose call " \
                                               f"timed out first)"
        if seq < 0:
            # A join has no sequence number; the ranks it names never called.
            super().__init__(
                f"rank {rank} of group '{group_name}': {collective} timed out after "
                f"{timeout:g}s; ranks {_ranks(self.missing_ranks)} never called it. Start "
                f"every rank of the group (each calls init_collective_group with its own "
                f"rank and the same world_size), or pass a longer timeout=.")
            return
        super().__init__(
            f"rank {rank} of group '{group_name}': {collective} #{seq} timed out after "
            f"{timeout:g}s waiting for ranks {_ranks(self.missing_ranks)}{who}. Those ranks "
            f"never started the call or stopped making progress in it (a stopped, hung or very "
            f"busy process). Check that every rank of the group makes the same collective calls "
            f"in the same order, or pass a longer timeout= to the call or to "
            f"init_collective_group.")


class PeerDiedError(CollectiveError):
    """A member of the group died (its process or actor is gone) while this rank needed it."""

    def __init__(self, group_name: str, rank: int, collective: str, seq: int,
                 dead_ranks: Sequence[int], detail: str = ""):
        self.group_name = group_name
        self.rank = rank
        self.collective = collective
        self.seq = seq
        self.dead_ranks = tuple(sorted(set(dead_ranks)))
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"rank {rank} of group '{group_name}': {collective} #{seq} failed because ranks "
            f"{_ranks(self.dead_ranks)} died{extra}. The group is broken: call "
            f"shrink_collective_group in every survivor to go on without them, or destroy it "
            f"and create a new one with the surviving or restarted actors.")


class PostOfficeDiedError(CollectiveError):
    """The post office of a node (the helper actor that carries messages between that node's
    ranks and the other nodes) died; the ranks it served may well be alive.

    Attributes:
        group_name: the group.
        rank: the rank that found out.
        node: the node whose post office died.
        served_ranks: the ranks on that node, cut off from the other nodes.
    """

    def __init__(self, group_name: str, rank: int, collective: str, seq: int, node: str,
                 served_ranks: Sequence[int]):
        self.group_name = group_name
        self.rank = rank
        self.collective = collective
        self.seq = seq
        self.node = node
        self.served_ranks = tuple(sorted(set(served_ranks)))
        super().__init__(
            f"rank {rank} of group '{group_name}': {collective} #{seq} failed because the post "
            f"office of node {node[:8]} died: the helper actor that carries messages between "
            f"ranks {_ranks(self.served_ranks)} on that node and the other nodes (those ranks "
            f"themselves may be alive). The group is broken: call shrink_collective_group in "
            f"every live rank to go on in a new incarnation, or destroy it and create it "
            f"again.")


class CollectiveMismatchError(CollectiveError):
    """Two ranks made incompatible calls (different collective, dtype, count, shape, root, op...).

    Attributes:
        group_name: the group.
        ranks: the two ranks whose calls disagree (this rank first).
        differences: ``{field: (this rank's value, the peer's value)}``.
    """

    def __init__(self, group_name: str, rank: int, peer: int, collective: str, seq: int,
                 differences: dict):
        self.group_name = group_name
        self.rank = rank
        self.ranks = (rank, peer)
        self.collective = collective
        self.seq = seq
        self.differences = dict(differences)
        what = "; ".join(f"{field}: rank {rank} has {mine!r}, rank {peer} has {theirs!r}"
                         for field, (mine, theirs) in self.differences.items())
        super().__init__(
            f"rank {rank} of group '{group_name}': {collective} #{seq} does not match the call "
            f"of rank {peer}: {what}. Every rank must call the same collective with the same "
            f"dtype, element count and root, in the same order.")


class GroupBrokenError(CollectiveError):
    """The group failed earlier; every later call fails fast with the original cause."""

    def __init__(self, group_name: str, rank: int, cause: BaseException):
        self.group_name = group_name
        self.rank = rank
        self.cause = cause
        advice = "Destroy the group and create it again."
        told = str(cause).rstrip()
        super().__init__(
            f"rank {rank} of group '{group_name}' is broken by an earlier failure: {told}"
            + ("" if told.endswith(advice) else f" {advice}"))


class WeightSyncError(CollectiveError):
    """A weight sync (``ray_collective.weight_sync``) failed; the message says which sync,
    which member (publisher or subscriber, and its index), which version and what to do.

    Attributes:
        sync_name: the weight sync.
        member: this member, e.g. ``"subscriber 2"``.
        version: the version the sync was moving, or None before it was known.
    """

    def __init__(self, sync_name: str, member: str, version: Optional[int], detail: str):
        self.sync_name = sync_name
        self.member = member
        self.version = version
        what = f" of version {version}" if version is not None else ""
        super().__init__(f"{member} of weight sync '{sync_name}': the sync{what} failed: "
                         f"{detail}")


class WeightSyncMismatchError(WeightSyncError, ValueError):
    """The members' state dicts, versions or calls do not agree (a tensor's name, shape or
    dtype, a version that does not go forward, a publisher calling ``receive_weights``...):
    refused on every member before any byte moved; the weight sync stays usable."""


class WeightSyncMemberDiedError(WeightSyncError):
    """A member died during the sync. After a subscriber's death, the next sync goes on
    without it (nothing to call); after a publisher's, the sync cannot go on.

    Attributes:
        dead: the dead members, e.g. ``("subscriber 3",)``.
    """

    def __init__(self, sync_name: str, member: str, version: Optional[int],
                 dead: Sequence[str], detail: str):
        self.dead = tuple(dead)
        super().__init__(sync_name, member, version, detail)


class GroupError(CollectiveError):
    """Base class of errors about group membership and lifetime."""


class GroupNotInitializedError(GroupError):
    """The named group does not exist in this process."""

    def __init__(self, group_name: str, declared_here: bool = False):
        self.group_name = group_name
        if declared_here:
            super().__init__(
                f"the collective group '{group_name}' was declared from this process, which is "
                f"not one of its members: call the collective inside the member actors, or "
                f"from here with the driver's calls on object refs (allreduce_refs, "
                f"reduce_refs, broadcast_refs, allgather_refs, reducescatter_refs, send_ref; "
                f"see docs/refs.md).")
            return
        super().__init__(
            f"the collective group '{group_name}' is not initialized in this process. Call "
            f"init_collective_group(world_size, rank, group_name='{group_name}') in every member, "
            f"or declare_collective_group(actors, ...) from the driver, first.")


class WeightSyncNotInitializedError(GroupNotInitializedError):
    """This process is no member of the named weight sync (nor the driver that declared it)."""

    def __init__(self, sync_name: str, detail: str):
        self.group_name = sync_name
        GroupError.__init__(self, detail)


class GroupAlreadyInitializedError(GroupError):
    """A group of that name already exists in this process."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        super().__init__(
            f"the collective group '{group_name}' is already initialized in this process. "
            f"Destroy it first, or use another group_name.")


class JoinMismatchError(GroupError, ValueError):
    """The ranks joining a group brought terms that cannot form one group (another world
    size, backend or forced algorithm, or one rank claimed twice); raised on every rank that
    came (``backends.arrivals``)."""


class RankExcludedError(GroupError):
    """This rank is no longer a member: the other members shrank the group without it (it was
    dead to them: stopped, hung, or named as failed, when they agreed on who goes on).

    Attributes:
        group_name: the group.
        rank: this rank's number in the incarnation it was left out of.
        kept: the ranks of that incarnation that went on (empty when unknown).
    """

    def __init__(self, group_name: str, rank: int, kept: Sequence[int] = ()):
        self.group_name = group_name
        self.rank = rank
        self.kept = tuple(kept)
        who = f" (ranks {_ranks(self.kept)} went on)" if self.kept else ""
        super().__init__(
            f"rank {rank} of group '{group_name}' is no longer a member: the other members "
            f"shrank the group without it{who}, having found it stopped, hung or failed. Its "
            f"membership was released here; to take part again, join as a new rank of the "
            f"group while its members call grow_collective_group.")


class BackendNotAvailableError(CollectiveError):
    """The requested backend cannot be used in this process (not installed or not built yet)."""


class InsecureDirectoryError(BackendNotAvailableError):
    """A directory the ``ray`` backend would keep a group's sockets in could be taken over by
    another local user (it belongs to someone else, others may write to it, it is a symbolic
    link); the backend refuses to use it (``backends.ray.private_dirs``).

    Attributes:
        group_name: the group.
        rank: the rank that looked.
        path: the directory.
        problem: what is wrong with it.
    """

    def __init__(self, group_name: str, rank: int, path: str, problem: str):
        self.group_name = group_name
        self.rank = rank
        self.path = path
        self.problem = problem
        super().__init__(
            f"rank {rank} of group '{group_name}': the 'ray' backend will not keep the group's "
            f"sockets in {path}: {problem}. Another local user could place their own socket "
            f"there and read what the group sends. Remove it (and find out who made it), or "
            f"set RAY_COLLECTIVE_DIR, for every member of the node, to a directory of your own "
            f"that only you may write to.")


class UnsupportedOperationError(CollectiveError, NotImplementedError):
    """The group's backend does not implement this operation or tensor kind."""


class SimulationDeadlockError(CollectiveError):
    """In the simulator or the cooperative driver, no rank can make progress."""

    def __init__(self, waiting: dict, detail: Optional[str] = None):
        self.waiting = dict(waiting)
        shown = ", ".join(f"rank {r} waits for {_ranks(peers)}"
                          for r, peers in sorted(self.waiting.items())[:16])
        more = "" if len(self.waiting) <= 16 else f" (and {len(self.waiting) - 16} more)"
        super().__init__(f"deadlock: no rank can progress: {shown}{more}"
                         + (f"; {detail}" if detail else ""))


class RankFailedError(CollectiveError):
    """Another rank of the group failed; this is its error as this rank learned of it.

    Attributes:
        group_name: the group.
        failed_rank: the rank whose call failed.
        kind: the class name of its error.
    """

    def __init__(self, group_name: str, failed_rank: int, kind: str, message: str):
        self.group_name = group_name
        self.failed_rank = failed_rank
        self.kind = kind
        super().__init__(f"rank {failed_rank} of group '{group_name}' failed with {kind}: "
                         f"{message}")


class TensorRefError(CollectiveError):
    """A member could not resolve the ObjectRef of its tensor in a declarative ``*_refs`` call.

    Attributes:
        group_name: the group.
        rank: the member whose ref failed.
        collective: the declarative call (``"allreduce_refs"``, ...).
        detail: why (the producer's error, a timeout, a value that is not a tensor).
    """

    def __init__(self, group_name: str, rank: int, collective: str, detail: str):
        self.group_name = group_name
        self.rank = rank
        self.collective = collective
        self.detail = detail
        super().__init__(
            f"rank {rank} of group '{group_name}': {collective} could not get its tensor: "
            f"{detail}. The group is broken (the other members fail fast with this error): "
            f"destroy it and declare it again.")


def error_record(group_name: str, rank: int, error: BaseException) -> dict:
    """A JSON-safe description of ``error`` raised on ``rank``, for telling the other ranks.

    Errors that other ranks can meaningfully re-raise (timeouts, dead peers, mismatches) keep
    their fields; any other error keeps its class name and message.
    """
    record = {"group": group_name, "rank": rank, "kind": type(error).__name__,
              "message": str(error)}
    if isinstance(error, CollectiveMismatchError):
        record.update(peer=error.ranks[1], collective=error.collective, seq=error.seq,
                      differences={k: list(v) for k, v in error.differences.items()})
    elif isinstance(error, PeerDiedError):
        record.update(collective=error.collective, seq=error.seq, dead=list(error.dead_ranks))
    elif isinstance(error, PostOfficeDiedError):
        record.update(collective=error.collective, seq=error.seq, node=error.node,
                      served=list(error.served_ranks))
    elif isinstance(error, CollectiveTimeoutError):
        record.update(collective=error.collective, seq=error.seq,
                      missing=list(error.missing_ranks), timeout=error.timeout)
    return record


def error_from_record(record: dict, rank: int) -> CollectiveError:
    """The error ``rank`` raises for a failure another rank described with :func:`error_record`.

    A peer-died report becomes this rank's own :class:`PeerDiedError` (naming the dead ranks),
    a lost post office its own :class:`PostOfficeDiedError`,
    a timeout its own :class:`CollectiveTimeoutError` (naming the ranks that held the call up,
    so that every rank blames them, not the rank that timed out first); a mismatch is rebuilt
    as the reporting rank saw it; anything else is a :class:`RankFailedError`.
    """
    group, reporter, kind = record["group"], record["rank"], record["kind"]
    if kind == "CollectiveMismatchError":
        differences = {k: tuple(v) for k, v in record["differences"].items()}
        return CollectiveMismatchError(group, reporter, record["peer"], record["collective"],
                                       record["seq"], differences)
    if kind == "PeerDiedError":
        return PeerDiedError(group, rank, record["collective"], record["seq"], record["dead"],
                             f"reported by rank {reporter}")
    if kind == "PostOfficeDiedError":
        return PostOfficeDiedError(group, rank, record["collective"], record["seq"],
                                   record["node"], record["served"])
    if kind == "CollectiveTimeoutError" and "missing" in record:
        return CollectiveTimeoutError(group, rank, record["collective"], record["seq"],
                                      record["missing"], record["timeout"],
                                      reported_by=reporter)
    return RankFailedError(group, reporter, kind, record["message"])
