"""Groups as one process sees them: the registry object, each membership, and async work.

A process (a Ray actor, or a thread of a test) holds its memberships in one
:class:`GroupRegistry`. The process-wide registry is the only module-level state of the library;
a test that runs several ranks in one process gives each rank's thread its own registry with
:func:`use_registry`.

A :class:`Group` numbers its calls, runs them in order (inline when nothing is queued, on one
worker thread for ``async_op=True``), and turns the first failure into a broken state: every
later call fails fast with the same cause, and the other members are told through the backend.
A group keeps one cache of prepared calls (``prepared``): per call shape, what its backend
prepared once (:meth:`Membership.prepare`) and the shape the recorder counts it under. Every
call runs as ``prepared.run(seq, arrays)`` in :meth:`Group.run`: a blocking call of a known
shape straight from the API, the others through :meth:`Group.submit`, inline or queued. Each
group owns its rank's flight recorder (``recorder``), which :meth:`Group.run` feeds, and the
registry owns the process's metrics flush (``metrics``).
A shrink or a grow (``elastic``) moves it to a new membership (:meth:`Group.reincarnate`),
which starts its numbering and state afresh.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .backends.base import BackendFactory, CallViews, Membership, PreparedCall, Reformed
from .errors import (CollectiveMismatchError, GroupAlreadyInitializedError,
                     GroupBrokenError, GroupNotInitializedError, UnsupportedOperationError)
from .metrics import MetricsFlush, exportable
from .recorder import (DEFAULT_TRACE_SIZE, CallShape, FlightRecorder, ObservingOptions, clock,
                       shape_of)
from .types import MAX_TIMEOUT_S, CallOptions, Collective, ReduceOp

_log = logging.getLogger(__name__)

# Distinct call options a group keeps (they differ by collective, op, root, peer, tag and a
# per-call timeout); past this the cache starts over, so odd timeouts cannot grow it forever.
OPTIONS_CACHE_SIZE = 256

PREPARED_CACHE_SIZE = 64
"""Call shapes a group keeps prepared (see :meth:`Group.prepare`); the oldest is dropped
beyond this."""

Known = Tuple[PreparedCall, Optional[CallShape]]
"""A prepared call and the recorder's shape of its calls (None without a recorder)."""


class Work:
    """Handle of a call made with ``async_op=True``."""

    def __init__(self, future: Future, description: str):
        self._future = future
        self._description = description

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the call completes.

        Args:
            timeout: seconds to wait at most (past ``MAX_TIMEOUT_S``, a year, that long);
                None waits until the call itself finishes or hits its own deadline.

        Raises:
            TimeoutError: ``timeout`` passed first; the call goes on running.
            CollectiveError: the call failed (the same error a blocking call would raise).
        """
        try:
            self._future.result(None if timeout is None else min(timeout, MAX_TIMEOUT_S))
        except FutureTimeout:
            if self._future.done():
                raise  # the call itself timed out (CollectiveTimeoutError is a TimeoutError)
            raise TimeoutError(f"{self._description} is still running after {timeout:g}s; it "
                               f"goes on until it completes or reaches its own deadline") from None

    def is_completed(self) -> bool:
        """Whether the call has finished (successfully or not)."""
        return self._future.done()


def _from_my_side(cause: BaseException, rank: int) -> Optional[BaseException]:
    """The peer's mismatch as this rank should see it, when this rank is the other party."""
    if isinstance(cause, CollectiveMismatchError) and rank in cause.ranks and rank != cause.rank:
        flipped = {field: (theirs, mine) for field, (mine, theirs) in cause.differences.items()}
        return CollectiveMismatchError(cause.group_name, rank, cause.rank, cause.collective,
                                       cause.seq, flipped)
    return None


def _record_failure(recorder: Optional[FlightRecorder], shape: Optional[CallShape], seq: int,
                    start: float, error: BaseException) -> None:
    """Record the failed call, and hand the error this rank's recent calls."""
    if recorder is None:
        return
    recorder.failed(shape, seq, start, error)
    try:
        error.trace = recorder.trace()
    except AttributeError:
        pass  # an error type that takes no attributes


def _unsupported(group: "Group", collective: Collective) -> UnsupportedOperationError:
    collectives = group.membership.collectives
    return UnsupportedOperationError(
        f"group '{group.name}' (rank {group.rank}) runs on a backend "
        f"({type(group.membership).__name__}) that has no {collective.value}; it runs "
        f"{', '.join(sorted(c.value for c in collectives))}")


class Group:
    """This process's membership of one group.

    Args:
        name: the group name.
        world_size: ranks in the group.
        rank: this process's rank.
        membership: this rank's membership of the group on its backend, which runs the calls.
        timeout: the default deadline of a call, in seconds.
        backend: the backend's name (the recorder's metrics label).
        trace_size: calls the flight recorder keeps (0: no recorder).
        counting: the recorder counts calls for the metrics.
    """

    def __init__(self, name: str, world_size: int, rank: int, membership: Membership,
                 timeout: float, backend: str = "", trace_size: int = DEFAULT_TRACE_SIZE,
                 counting: bool = False):
        self.name = name
        self.world_size = world_size
        self.rank = rank
        self.membership = membership
        self.timeout = timeout
        # The collectives' numbers: ``next`` is atomic, so :meth:`run` takes one without a lock.
        self._numbers = itertools.count()
        self._p2p_seq: Dict[Tuple[str, int, int], int] = {}
        self._broken: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._worker: Optional[ThreadPoolExecutor] = None
        self._queued = 0
        self._options: Dict[Tuple, CallOptions] = {}
        self.prepared: Dict[Tuple, Known] = {}
        # The prepared calls hold the recorded shapes: dropped when the recorder folds them.
        self.recorder = FlightRecorder(name, rank, backend, trace_size, counting,
                                       self.prepared.clear) if trace_size else None

    @property
    def broken(self) -> Optional[BaseException]:
        """The failure that broke the group, or None."""
        return self._broken

    def options(self, collective: Collective, timeout: Optional[float] = None,
                op: ReduceOp = ReduceOp.SUM, root: int = -1, peer: int = -1,
                tag: int = 0) -> CallOptions:
        """The options of a call, shared by every call of this group that asks the same.

        Args:
            collective: the operation.
            timeout: the call's deadline in seconds (already checked), None for the group's.
            op, root, peer, tag: as in :class:`CallOptions`.

        Returns:
            A frozen :class:`CallOptions`, built once per distinct request.

        Raises:
            UnsupportedOperationError: the group's backend does not run ``collective``.
        """
        key = (collective, timeout, op, root, peer, tag)
        options = self._options.get(key)
        if options is None:
            if collective not in self.membership.collectives:
                raise _unsupported(self, collective)
            if len(self._options) >= OPTIONS_CACHE_SIZE:
                self._options.clear()
                self.prepared.clear()  # their keys hold the identity of the options
            options = CallOptions(collective, self.timeout if timeout is None else timeout,
                                  op, root, peer, tag)
            self._options[key] = options
        return options

    def _next_seq_locked(self, kind: str, peer: int, tag: int) -> int:
        """The next number of a collective, or of a send/recv to a peer and tag (under ``_lock``):
        point-to-point calls count apart, so ranks that exchange messages stay in step with
        ranks that do not."""
        if not kind:
            return next(self._numbers)
        key = (kind, peer, tag)
        seq = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = seq + 1
        return seq

    def prepare(self, key: Optional[Tuple], options: CallOptions, views: CallViews) -> Known:
        """The prepared call of a shape, from the cache or prepared by the membership now.

        Args:
            key: the API's key of the shape, under which a later blocking call finds it; None
                for a call that cannot take that path (asynchronous, its own deadline...):
                then the options and the tensor's layout are its key.
            options: the call's options.
            views: the call's tensors, checked.

        Returns:
            The prepared call and its recorded shape.

        Raises:
            TypeError, ValueError: the backend refuses the call, before anything is sent.
        """
        reference = views.reference()
        if key is None:
            key = (id(options),) if reference is None else (
                id(options), reference.kind, reference.device, reference.dtype_name,
                reference.shape)
        known = self.prepared.get(key)
        if known is None:
            known = self.unshared(self.membership.prepare(options, views), reference)
            if len(self.prepared) >= PREPARED_CACHE_SIZE:
                del self.prepared[next(iter(self.prepared))]
            self.prepared[key] = known
        return known

    def unshared(self, prepared: PreparedCall, view: Optional[Any]) -> Known:
        """A prepared call the cache does not keep (a ``*_multigpu`` call), with its shape."""
        if self.recorder is None:
            return prepared, None
        return prepared, shape_of(self.recorder, prepared.options.collective.value, view,
                                  prepared.describe())

    def submit(self, known: Known, arrays: Any, async_op: bool,
               seq_key: Tuple[str, int, int] = ("", -1, 0)) -> Optional[Work]:
        """Number and run one call; blocking unless ``async_op``.

        A blocking call runs inline, in the caller's thread, when no earlier asynchronous call
        of the group is still queued; otherwise it joins the queue behind them and waits, so
        that calls run in the order of their sequence numbers on every rank.

        Args:
            known: the call's prepared call (:meth:`prepare`).
            arrays: its arrays, as ``PreparedCall.run`` takes them.
            async_op: return a :class:`Work` at once instead of blocking.
            seq_key: ``("", -1, 0)`` for collectives, ``("send"|"recv", peer, tag)`` for p2p.

        Returns:
            None for a blocking call, else the call's :class:`Work`.

        Raises:
            GroupBrokenError: the group failed earlier.
            CollectiveError: the call failed (blocking calls).
        """
        with self._lock:
            if self._broken is not None:
                raise GroupBrokenError(self.name, self.rank, self._broken)
            seq = self._next_seq_locked(*seq_key)
            # In the caller's thread, before the call may be queued (see on_submit).
            known[0].on_submit(seq, arrays)
            inline = not (async_op or self._queued)
            if not inline:
                self._queued += 1
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(
                        1, thread_name_prefix=f"ray_collective[{self.name}]")
                future = self._worker.submit(self._run_queued, known, arrays, seq)
        if inline:
            self.run(known, arrays, seq=seq)
            return None
        if async_op:
            return Work(future, f"{known[0].options.collective.value} #{seq} of group "
                                f"'{self.name}'")
        future.result()
        return None

    def _run_queued(self, known: Known, arrays: Any, seq: int) -> None:
        try:
            # Queued calls run one at a time on this thread, and no other call runs meanwhile
            # (a blocking one queues behind them): what broke the group broke it before this.
            if self._broken is not None:
                raise GroupBrokenError(self.name, self.rank, self._broken)
            self.run(known, arrays, seq=seq)
        finally:
            with self._lock:
                self._queued -= 1

    def run(self, known: Known, arrays: Any, channel: Optional[Tuple[str, int, int]] = None,
            seq: int = -1) -> bool:
        """Run one call to completion in this thread, recorded, turning its failure into the
        group's broken state (see :meth:`_failed`).

        Args:
            known: the call's prepared call and shape (:attr:`prepared`).
            arrays: its arrays, as ``PreparedCall.run`` takes them.
            channel: ``("send"|"recv", peer, tag)`` for a point-to-point call, else None.
            seq: its number from :meth:`submit`; -1 (a call of a known shape, straight from
                the API) numbers it here, unless asynchronous calls are still queued.

        Returns:
            True once the call ran; False when it must go through :meth:`submit` (calls are
            queued ahead of it): nothing was done then.

        Raises:
            GroupBrokenError: the group failed earlier.
            CollectiveError: the call failed (the group is then broken).
        """
        if seq < 0:
            # No lock: a call another thread queues meanwhile races this one, as under a lock.
            if self._broken is not None:
                raise GroupBrokenError(self.name, self.rank, self._broken)
            if self._queued:
                return False
            if channel is None:
                seq = next(self._numbers)
            else:
                with self._lock:
                    seq = self._next_seq_locked(*channel)
        prepared, shape = known
        recorder, running = self.recorder, self._running
        running.acquire()  # not ``with``, which costs twice as much, on every call
        try:
            start = clock() if recorder is not None else 0.0
            try:
                prepared.run(seq, arrays)
            except BaseException as err:
                self._failed(err, shape, seq, start)
            if recorder is not None:
                recorder.finished(shape, seq, start)
        finally:
            running.release()
        return True

    def _failed(self, err: BaseException, shape: Optional[CallShape], seq: int,
                start: float) -> None:
        """Raise the failure ``err`` of call ``seq`` (started at ``start``), recorded, with the
        group broken by it; argument errors found by the backend before anything was sent
        leave the group usable, unrecorded."""
        if isinstance(err, GroupBrokenError):
            self._broken = err.cause
            raised = _from_my_side(err.cause, self.rank) or err
            _record_failure(self.recorder, shape, seq, start, raised)
            raise raised from None
        if isinstance(err, (TypeError, ValueError)):
            raise err
        self._broken = err
        _log.debug("group %r rank %d: call #%d broke the group: %s: %s", self.name, self.rank,
                   seq, type(err).__name__, err)
        _record_failure(self.recorder, shape, seq, start, err)
        self.membership.abort(err)
        raise err

    # ------------------------------------------------------------------ the flight recorder

    def trace(self) -> List[Dict[str, Any]]:
        """This rank's last calls on the group, oldest first (empty with no recorder); see
        ``FlightRecorder.trace``."""
        return [] if self.recorder is None else self.recorder.trace()

    def fail(self, error: BaseException) -> None:
        """Break the group with ``error`` raised outside a call, and tell the other members.

        For a failure that keeps this rank from entering a call the others are waiting in
        (a declarative call whose input could not be resolved): they fail fast with it instead
        of waiting for their deadline.
        """
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
        self.membership.abort(error)

    def reincarnate(self, reform: Callable[[Membership, Optional[BaseException]], Reformed]
                    ) -> Reformed:
        """Move the group to its next membership (a shrink or a grow), with no call running.

        Queued asynchronous calls finish first (in a broken group they fail at once); a call
        submitted meanwhile waits, and is numbered in the new membership. What the old one
        taught the group goes with it: sequence numbers, the broken state, the prepared
        calls. The old membership is closed once the new one is in place.

        Args:
            reform: makes the new membership from the old one and the failure that broke the
                group (None if it is not broken); what it raises leaves the group as it was.

        Returns:
            What ``reform`` returned.
        """
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        with self._running, self._lock:
            reformed = reform(self.membership, self._broken)
            old, self.membership = self.membership, reformed.membership
            self.rank, self.world_size = reformed.rank, reformed.world_size
            self._numbers, self._broken = itertools.count(), None
            self._p2p_seq.clear()
            self.prepared.clear()  # their algorithms and peers were the old membership's
            if self.recorder is not None:
                self.recorder.rank = reformed.rank  # its trace goes on across the change
        try:
            old.close()
        except Exception as err:  # noqa: BLE001 - the group lives on in its new membership
            _log.warning("group '%s': releasing its previous membership failed: %r",
                         self.name, err)
        return reformed

    def destroy(self) -> None:
        """Finish queued calls, then release the backend membership."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        self.membership.close()


class DeclaredGroup(ABC):
    """A group declared from this driver: what the driver needs to destroy it."""

    name: str
    actors: Tuple
    members: Tuple
    """The member actors in rank order: ``members[r]`` is rank r."""

    @abstractmethod
    def destroy(self, timeout: float) -> None:
        """Make every member leave and remove what the group left behind."""


class GroupRegistry:
    """The groups one process (or one simulated rank) belongs to, by name."""

    def __init__(self):
        self._groups: Dict[str, Group] = {}
        self._declared: Dict[str, DeclaredGroup] = {}
        self._lock = threading.Lock()
        self._metrics: Optional[MetricsFlush] = None
        # Weight syncs (``ray_collective.weight_sync``) this process is a member of, and those
        # it declared from the driver, by name; that package keeps them and their lock here.
        self.weight_syncs: Dict[str, Any] = {}
        self.declared_weight_syncs: Dict[str, Any] = {}

    def create(self, name: str, world_size: int, rank: int, factory: BackendFactory,
               timeout: float) -> Group:
        """Join a group through ``factory`` and register it.

        Raises:
            GroupAlreadyInitializedError: ``name`` is taken in this registry.
            ArgumentValueError: ``RAY_COLLECTIVE_TRACE_SIZE`` or ``RAY_COLLECTIVE_METRICS``
                holds a value they do not take.
            BackendNotAvailableError, CollectiveTimeoutError: from the backend's rendezvous.
        """
        observing = ObservingOptions.from_environment()
        with self._lock:
            if name in self._groups:
                raise GroupAlreadyInitializedError(name)
            self._groups[name] = None
        try:
            membership = factory.create(name, world_size, rank, timeout)
        except BaseException:
            with self._lock:
                del self._groups[name]
            raise
        counting = observing.metrics and observing.trace_size > 0 and exportable()
        group = Group(name, world_size, rank, membership, timeout, factory.name,
                      observing.trace_size, counting)
        with self._lock:
            self._groups[name] = group
            if counting:
                if self._metrics is None:
                    self._metrics = MetricsFlush(observing.flush_interval_s)
                self._metrics.add(group.recorder)
        return group

    @property
    def metrics(self) -> Optional[MetricsFlush]:
        """The flush that hands this registry's metrics to Ray (None before the first group
        that exports them)."""
        return self._metrics

    def get(self, name: str) -> Group:
        """The group ``name``.

        Raises:
            GroupNotInitializedError: this process is not a member of ``name``.
        """
        group = self._groups.get(name)
        if group is None:
            raise GroupNotInitializedError(name, declared_here=self._declared.get(name)
                                           is not None)
        return group

    def find(self, name: str) -> Optional[Group]:
        """The group ``name``, or None (not a member, or still joining)."""
        return self._groups.get(name)

    def is_initialized(self, name: str) -> bool:
        """Whether ``name`` is a usable group here."""
        return self._groups.get(name) is not None

    def destroy(self, name: str) -> None:
        """Leave ``name`` and release its resources.

        Raises:
            GroupNotInitializedError: this process is not a member of ``name``.
        """
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                raise GroupNotInitializedError(name)
            del self._groups[name]
            metrics = self._metrics if group.recorder is not None and group.recorder.counting \
                else None
        group.destroy()
        if metrics is not None:
            metrics.remove(group.recorder)

    def declare(self, name: str, declare: Callable[[], DeclaredGroup]) -> DeclaredGroup:
        """Record a group this driver declares; ``declare`` makes the members join.

        Raises:
            GroupAlreadyInitializedError: this driver already declared ``name``.
        """
        with self._lock:
            if name in self._declared:
                raise GroupAlreadyInitializedError(name)
            self._declared[name] = None
        try:
            declared = declare()
        except BaseException:
            with self._lock:
                del self._declared[name]
            raise
        with self._lock:
            self._declared[name] = declared
        return declared

    def declared(self, name: str) -> Optional[DeclaredGroup]:
        """The group ``name`` if this driver declared it, else None."""
        return self._declared.get(name)

    def undeclare(self, name: str, timeout: float) -> None:
        """Destroy a group this driver declared: every member leaves.

        Raises:
            GroupNotInitializedError: this driver did not declare ``name``.
        """
        with self._lock:
            declared = self._declared.pop(name, None)
        if declared is None:
            raise GroupNotInitializedError(name)
        declared.destroy(timeout)


_PROCESS_REGISTRY = GroupRegistry()
_active_registry: contextvars.ContextVar = contextvars.ContextVar("ray_collective_registry")


def current_registry() -> GroupRegistry:
    """The registry the calling thread uses: its own if set with :func:`use_registry`, else the
    process's."""
    return _active_registry.get(_PROCESS_REGISTRY)


def find_group(name: str) -> Optional[Group]:
    """``current_registry().find(name)`` in one step: every call of a known shape does it."""
    return _active_registry.get(_PROCESS_REGISTRY)._groups.get(name)


@contextlib.contextmanager
def use_registry(registry: GroupRegistry) -> Iterator[GroupRegistry]:
    """Make ``registry`` the calling thread's registry inside the ``with`` block."""
    token = _active_registry.set(registry)
    try:
        yield registry
    finally:
        _active_registry.reset(token)
