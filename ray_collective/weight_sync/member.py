"""One process's membership of a weight sync: its groups, what it last sent or received, and
the steps of one sync.

A weight sync named ``N`` with P publishers is one *control group* of every member (publishers
first, as ranks 0..P-1, then the subscribers) and, with P > 1, one *data group* per publisher
(that publisher as rank 0, then every subscriber in the control group's order); with one
publisher the control group is the data group. All are groups of the collectives, so shrinking
and growing them is the elastic groups' work.

One sync (:meth:`WeightSyncMember.sync`):

1. If the last sync failed, the member first shrinks every group it is in (the others do the
   same: the last step below told them all), which leaves the dead out.
2. Agreement (``agreement.agree``): headers, and descriptions where needed; bad input anywhere
   raises on every member here.
3. Bytes (``transfer``): each publisher sends its buckets down its data group; a subscriber
   receives from every publisher at once, one thread per data group.
4. The close: one more allgather on the control group, so that every member ends the same way;
   a member that died is named to all, and the next sync goes on without it.

On the ``nccl`` backend (``config.gpu``) the same steps run on the GPU (``gpu``), with two
differences the backend's groups impose: NCCL aborts a group's communicators at any failure
and the nccl backend's groups cannot shrink or grow (CuPy exposes neither ncclCommShrink nor
grow), so a failed sync (a timeout, a dead member) leaves the weight sync broken, to be
destroyed and declared again, and NCCL cannot say which member failed, so none is named; and
there is no change digest on the GPU (see ``_read``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Collection, Dict, Optional, Tuple

import numpy as np

from .. import api
from ..errors import (CollectiveError, WeightSyncError, WeightSyncMemberDiedError,
                      WeightSyncMismatchError)
from ..group import current_registry, use_registry
from .agreement import (H_PLAN, PUBLISHER, ROLE_NAMES, SUBSCRIBER, Verdict, agree,
                        allgather_words, header, member_name)
from .config import SyncConfig, control_group, data_group, dead_members
from .gpu import MemberGpus, device_bytes_of
from .layout import Layout, read_state_dict
from .plan import SyncPlan
from .reform import MembershipChanges
from .transfer import HostBuckets, choose_buckets, receive_buckets, send_buckets


@dataclass(frozen=True)
class SyncReport:
    """What this member's last delivered sync moved.

    Attributes:
        version: the version.
        moved_bytes: bytes this member sent (a publisher) or received (a subscriber).
        model_bytes: the model's bytes.
        full: whether every bucket went (a first sync, a new subscriber, a changed model).
    """

    version: int
    moved_bytes: int
    model_bytes: int
    full: bool


NCCL_BROKEN = ("on the 'nccl' backend a failed sync breaks the weight sync: NCCL aborts the "
               "groups' communicators, and the nccl backend's groups cannot shrink or grow "
               "(CuPy exposes neither ncclCommShrink nor grow); destroy the weight sync and "
               "declare it again")
NO_GPU_DIGEST = ("the 'nccl' backend keeps no change digest of GPU buckets; pass digest=False "
                 "(its default on nccl) and name what did not change with unchanged=")


class WeightSyncMember(MembershipChanges):
    """This process's part in one weight sync (see the module docstring).

    Args:
        config: the member's place in the sync.
        cupy: on the nccl backend, the CuPy module (default: imported on first use).
    """

    def __init__(self, config: SyncConfig, cupy: Any = None):
        self.config = config
        self._gpu = MemberGpus(cupy, config.groups) if config.gpu else None
        self.me = member_name(config.role, config.index)
        self._plan: Optional[SyncPlan] = None
        self._key = 0
        self._version = -1
        self._digests: Dict[int, int] = {}
        self._repair = False
        self._broken = ""
        self._lock = threading.Lock()
        self._async: Optional[ThreadPoolExecutor] = None
        self._receivers: Optional[ThreadPoolExecutor] = None
        self._moved = 0
        self.report: Optional[SyncReport] = None

    @property
    def lock(self) -> threading.Lock:
        """Held while a sync or a change of members runs: one at a time."""
        return self._lock

    @property
    def version(self) -> int:
        """The version this member last published or received in full (-1: none yet)."""
        return self._version

    def submit(self, run, *args) -> Any:
        """Run ``run(*args)`` on this member's sync thread; its Future."""
        if self._async is None:
            self._async = ThreadPoolExecutor(1, thread_name_prefix=f"weight-sync[{self.me}]")
        return self._async.submit(run, *args)

    def close(self) -> None:
        """Stop this member's threads (its groups are left by the caller)."""
        for pool in (self._async, self._receivers):
            if pool is not None:
                pool.shutdown(wait=False)
        if self._gpu is not None:
            self._gpu.close()

    def _error(self, cls, detail: str, version: Optional[int] = None, **extra) -> WeightSyncError:
        return cls(self.config.name, self.me, version, detail=detail, **extra)

    # ------------------------------------------------------------------ one sync

    def caller_stream(self, state_dict: Any) -> Optional[int]:
        """On the nccl backend, the stream the calling thread queues its work on for the GPU
        of ``state_dict``'s tensors (a sync starts after that work, and the caller's later
        work waits for the sync); None on the CPU or where there is no GPU tensor."""
        where = self._gpu.where(state_dict) if self._gpu else None
        return None if where is None else self._gpu.caller_stream(where)

    @property
    def control(self) -> str:
        """The control group's name."""
        return control_group(self.config.name)

    def _buckets(self, group: str, where: Optional[Tuple[int, str]]):
        """Where this sync's buckets and control words of ``group`` live."""
        return self._gpu.buckets(group, where) if self._gpu else HostBuckets()

    def sync(self, role: int, state_dict: Any, version: int, unchanged: Optional[Collection[str]],
             use_digest: Optional[bool], timeout: Optional[float],
             caller: Optional[int] = None) -> int:
        """Publish (``role`` PUBLISHER) or receive one version; see ``publish_weights``.

        ``use_digest`` None: the backend's default (on for ``ray``, off for ``nccl``);
        ``caller``: on the nccl backend, the caller's stream taken where the call was made
        (an ``async_op`` call), else the calling thread's.

        Returns:
            The version delivered.

        Raises:
            WeightSyncMismatchError: the members' inputs disagree (on every member).
            WeightSyncMemberDiedError: a member died; the next sync goes on without it.
            WeightSyncError: the sync failed otherwise (a timeout), or cannot go on.
        """
        with self._lock:
            if self._broken:
                raise self._error(WeightSyncError, self._broken)
            deadline = self.config.timeout if timeout is None else timeout
            if self._repair:
                self._shrink(deadline)
            if use_digest is None:
                use_digest = not self.config.gpu
            layout, bytes_of = self._read(role, state_dict, version, unchanged, use_digest)
            where = self._gpu.where(state_dict) if self._gpu else None
            ordered = where is not None and not layout.error
            if ordered:
                bytes_of = device_bytes_of(bytes_of)
                caller = self._gpu.caller_stream(where) if caller is None else caller
                self._gpu.after_caller(where, caller)
            control = self._buckets(self.control, where)
            try:
                verdict = self._agree(layout, version, deadline, control)
                failure = self._move(verdict, bytes_of, unchanged, use_digest, deadline, where)
                self._close(verdict, failure, deadline, control)
            finally:
                if ordered:
                    self._gpu.before_caller(where, caller)
            return verdict.version

    def _read(self, role: int, state_dict: Any, version: int,
              unchanged: Optional[Collection[str]], use_digest: bool):
        call = "publish_weights" if role == PUBLISHER else "receive_weights"
        if role != self.config.role:
            right = "publish_weights" if self.config.role == PUBLISHER else "receive_weights"
            return Layout(error=f"{self.me} called {call}; a {ROLE_NAMES[self.config.role]} "
                                f"calls {right}"), {}
        layout, bytes_of = read_state_dict(state_dict, role == SUBSCRIBER, call,
                                           self.config.gpu)
        if layout.error or role == SUBSCRIBER:
            return layout, bytes_of
        if self.config.gpu and use_digest:
            return Layout(error=f"{call}: digest=True: {NO_GPU_DIGEST}"), {}
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or \
                not 0 <= version < 2 ** 63:
            return Layout(error=f"{call}: version must be an int in [0, 2^63), not "
                                f"{version!r}"), {}
        if unchanged is not None:
            if isinstance(unchanged, str) or not all(isinstance(n, str) for n in unchanged):
                return Layout(error=f"{call}: unchanged must be a collection of tensor "
                                    f"names, not {unchanged!r}"), {}
            unknown = sorted(set(unchanged) - set(bytes_of))
            if unknown:
                return Layout(error=f"{call}: unchanged names {unknown[0]!r}, which is not in "
                                    f"state_dict"), {}
        return layout, bytes_of

    def _agree(self, layout: Layout, version: int, deadline: float, control: Any) -> Verdict:
        config = self.config
        description = layout.encode()
        proposed = int(version) if config.role == PUBLISHER and not layout.error else -1
        words = header(config.role, config.index, layout,
                       proposed if config.role == PUBLISHER else self._version,
                       self._version if config.role == PUBLISHER else -1, self._key,
                       description, config.bucket_bytes, config.publishers)
        try:
            headers = self._allgather(words, deadline, control)
        except CollectiveError as err:
            if config.gpu:
                self._broken = NCCL_BROKEN
                raise self._error(WeightSyncError, f"{err}; {NCCL_BROKEN}") from err
            dead = dead_members(self.config, err, None)
            if not dead:
                self._repair = True
                raise self._error(WeightSyncError, f"{err}; the next sync shrinks the groups "
                                                   f"and goes on") from err
            if any(rank < config.publishers for rank in dead):
                self._broken = (f"publisher {min(dead)} died; a weight sync cannot go on "
                                f"without a publisher: destroy it and declare it again")
                raise self._error(WeightSyncMemberDiedError, self._broken,
                                  dead=[f"publisher {r}" for r in sorted(dead)
                                        if r < config.publishers]) from err
            # A member died after the last sync had ended well for this member but not for
            # all: every survivor finds out here, shrinks, and the sync goes on without it.
            self._shrink(deadline)
            words[H_PLAN] = self._key
            headers = self._allgather(words, deadline, control)
        try:
            verdict, problem = agree(headers, description, self._plan, self._key, self.control,
                                     deadline, control)
        except CollectiveError as err:
            if not config.gpu:
                raise
            self._broken = NCCL_BROKEN
            raise self._error(WeightSyncError, f"{err}; {NCCL_BROKEN}") from err
        if problem:
            raise self._error(WeightSyncMismatchError, problem,
                              proposed if proposed >= 0 else None)
        return verdict

    def _allgather(self, words: np.ndarray, deadline: float, control: Any) -> np.ndarray:
        return allgather_words(words, self.control, api.get_collective_group_size(self.control),
                               deadline, control)

    def _move(self, verdict: Verdict, bytes_of: Dict[str, Any],
              unchanged: Optional[Collection[str]], use_digest: bool,
              deadline: float, where: Optional[Tuple[int, str]]) -> Optional[BaseException]:
        """The sync's bytes; the failure, if any, for the close to tell everyone."""
        config, plan = self.config, verdict.plan
        try:
            if config.role == PUBLISHER:
                mine = plan.buckets_of(config.index)
                known: Dict[int, int] = {}
                if verdict.full:
                    self._digests = {}
                    send = [True] * len(mine)
                else:
                    send = choose_buckets(plan, mine, bytes_of, unchanged, use_digest,
                                          self._digests, known)
                self._moved = sum(b.nbytes for b, goes in zip(mine, send) if goes)
                group = data_group(config.name, config.index, config.publishers)
                send_buckets(plan, mine, send, bytes_of, group, deadline, known,
                             self._buckets(group, where))
                self._digests.update(known)
            else:
                self._moved = self._receive_all(plan, bytes_of, deadline, where)
        except CollectiveError as err:
            return err
        return None

    def _receive_all(self, plan: SyncPlan, bytes_of: Dict[str, Any], deadline: float,
                     where: Optional[Tuple[int, str]]) -> int:
        config = self.config
        groups = [data_group(config.name, p, config.publishers) for p in range(config.publishers)]
        if len(groups) == 1:
            return receive_buckets(plan, plan.buckets_of(0), bytes_of, groups[0], deadline,
                                   self._buckets(groups[0], where))
        if self._receivers is None:
            self._receivers = ThreadPoolExecutor(len(groups),
                                                 thread_name_prefix=f"weight-sync[{self.me}]")
        registry = current_registry()
        futures = [self._receivers.submit(in_registry, registry, receive_buckets, plan,
                                          plan.buckets_of(p), bytes_of, group, deadline,
                                          self._buckets(group, where))
                   for p, group in enumerate(groups)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return sum(f.result() for f in futures)

    def _close(self, verdict: Verdict, failure: Optional[BaseException],
               deadline: float, control: Any) -> None:
        roster = verdict.roster
        if failure is not None and self.config.gpu:
            # NCCL has aborted the group: no close to send, and no member it could name.
            self._broken = NCCL_BROKEN
            if self.config.role == SUBSCRIBER:
                self._version = -1
            raise self._error(WeightSyncError, f"{failure}; {NCCL_BROKEN}",
                              verdict.version) from failure
        world = len(roster.members)
        words = np.zeros(world + 1, np.uint8)
        dead = dead_members(self.config, failure, roster) if failure is not None else set()
        words[0] = failure is not None
        words[[1 + r for r in dead]] = 1
        try:
            rows = allgather_words(words, self.control, world, deadline, control)
        except CollectiveError as err:
            if self.config.gpu:
                self._broken = NCCL_BROKEN
                raise self._error(WeightSyncError, f"{err}; {NCCL_BROKEN}",
                                  verdict.version) from err
            dead |= dead_members(self.config, err, roster)
            failure = failure or err
        else:
            dead |= {r for r in range(world) if rows[:, 1 + r].any()}
            if rows[:, 0].any() and failure is None:
                failed = [roster.name(r) for r in range(world) if rows[r, 0]]
                failure = WeightSyncError(self.config.name, failed[0], verdict.version,
                                          f"{', '.join(failed)} failed")
        if failure is None:
            self._plan, self._key, self._version = verdict.plan, verdict.key, verdict.version
            self.report = SyncReport(verdict.version, self._moved, verdict.plan.nbytes,
                                     verdict.full)
            return
        self._repair = True
        self._plan, self._key = verdict.plan, verdict.key
        self._digests = {}
        if self.config.role == SUBSCRIBER:
            self._version = -1
        names = [roster.name(r) for r in sorted(dead)]
        if any(roster.members[r][0] == PUBLISHER for r in dead):
            self._broken = (f"{', '.join(names)} died during the sync of version "
                            f"{verdict.version}; a weight sync cannot go on without a "
                            f"publisher: destroy it and declare it again")
        if names:
            then = (self._broken or "the next sync goes on without "
                    + ("it" if len(names) == 1 else "them"))
            raise self._error(WeightSyncMemberDiedError, f"{', '.join(names)} died; {then}",
                              verdict.version, dead=names) from failure
        raise self._error(WeightSyncError, f"{failure}; the next sync shrinks the groups and "
                                           f"goes on", verdict.version) from failure



def in_registry(registry, run, *args):
    """``run(*args)`` with ``registry`` as this thread's groups (a worker thread's call)."""
    with use_registry(registry):
        return run(*args)
