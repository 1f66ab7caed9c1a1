"""The NCCL backend: GPU collectives through ``cupy.cuda.nccl``, one dedicated stream per GPU.

How one call runs:

1. **After the caller's work.** When the call is submitted, in the caller's own thread, an event
   is recorded on the caller's current stream of each GPU the call uses (CuPy's or torch's,
   following the tensor's kind). The GPU's dedicated stream waits for that event, so the
   collective sees everything the caller queued before it, without blocking the host.
2. **Launch.** The NCCL calls go on the dedicated streams, inside one NCCL group when there are
   several: the ``*_multigpu`` variants (one communicator per GPU) and gather, scatter and
   alltoall, which are built from send/recv. allgather and reducescatter take lists of separate
   tensors while NCCL wants one buffer, so they go through scratch memory with device copies on
   the same stream.
3. **Before the caller's later work.** An event recorded after the launch is waited for by the
   caller's stream, so work queued after the call sees its result.
4. **Completion.** The host polls that event until the work has finished, so a blocking call
   returns with the result in place and an ``async_op=True`` work handle completes when the GPU
   has; polling (never a blocking synchronize) keeps the deadline.
5. **Failures.** A launch or a wait that passes the deadline, or an error NCCL reports, aborts
   every communicator of the group (``ncclCommAbort``; never a blocking destroy after an error)
   and raises :class:`~ray_collective.errors.CollectiveTimeoutError` or
   :class:`~ray_collective.errors.PeerDiedError`. ``close`` destroys the communicators of a
   healthy group, and releases every stream and event.

A process may own several GPUs (the group's ``devices``): the group's main NCCL clique then has
one communicator per GPU and serves the ``*_multigpu`` variants; a plain collective on GPU ``i``
uses a clique of GPU ``i`` of every process, created on first use.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...errors import (BackendNotAvailableError, CollectiveError, CollectiveTimeoutError,
                       PeerDiedError)
from ...tensors import TensorView
from ...types import CallOptions, Collective
from ..base import BackendFactory, CallViews, Membership, PreparedCall
from ..arrivals import Terms
from .arguments import GpuArguments, GroupCall, device_of
from .bootstrap import CliqueJoin
from .completion import LaunchWatchdog, NcclOptions, wait_for_events
from .library import ADDRESS_OF, NcclLibrary, load_library
from .rendezvous import InProcessRendezvous, RayRendezvous, Rendezvous
from .steps import CallSteps, Lane, StepBuilding, call_name, views_of

# NCCL result codes that mean the call itself was wrong, not that a peer or the network failed.
_NCCL_INVALID_ARGUMENT = 4
_NCCL_INVALID_USAGE = 5

# ``device -> (caller's stream, event recorded on it)``: where a call must start on each GPU.
CallerOrder = Dict[int, Tuple[int, int]]


class NcclMembership(StepBuilding, Membership):
    """One process's membership of an NCCL group.

    Args:
        group_name: the group.
        world_size: processes in the group.
        rank: this process's rank.
        devices: the GPUs this process uses, in order.
        library: the NCCL library.
        rendezvous: where ranks meet to create further cliques.
        options: the waiting policy.
        communicators: the main clique's communicators, one per device.
    """

    accepts_gpu_tensors = True

    def __init__(self, group_name: str, world_size: int, rank: int, devices: Sequence[int],
                 library: NcclLibrary, rendezvous: Rendezvous, options: NcclOptions,
                 communicators: Sequence[Any]):
        self.group_name = group_name
        self.world_size = world_size
        self.rank = rank
        self.devices = tuple(devices)
        self._library = library
        self._rendezvous = rendezvous
        self._options = options
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self._communicators = list(communicators)
        self._streams: Dict[int, int] = {}
        self._done_events: Dict[int, int] = {}
        self._spare_events: Dict[int, List[int]] = {device: [] for device in self.devices}
        self._orders: Dict[int, CallerOrder] = {}
        self._barrier_scratch: Dict[int, Any] = {}
        self._watchdog = LaunchWatchdog(self._abort_communicators,
                                        options.watchdog_period_seconds,
                                        f"ray_collective[{group_name}] nccl watchdog")
        try:
            for device in self.devices:
                self._streams[device] = library.create_stream(device)
                self._done_events[device] = library.create_event(device)
        except BaseException:
            self.abort(None)
            self.close()
            raise
        self._main = tuple(self._lane(device, communicator)
                           for device, communicator in zip(self.devices, communicators,
                                                           strict=True))
        # With one GPU per process the main clique is also the single-GPU clique.
        self._single: Dict[int, Lane] = (
            {self.devices[0]: self._main[0]} if len(self.devices) == 1 else {})

    def multi_gpu_arguments(self) -> GpuArguments:
        """Checks of the ``*_multigpu`` calls' arguments against this process's GPUs."""
        return GpuArguments(self.devices, self.group_name, self.world_size,
                            lambda options, make_call: NcclCall(self, options, make_call))

    def _lane(self, device: int, communicator: Any) -> Lane:
        return Lane(device, communicator, self._streams[device], self._done_events[device])

    # ------------------------------------------------------------ caller order

    def submitted(self, key: Tuple[int, int], call: GroupCall) -> None:
        """Record where ``call`` must start on each GPU: the caller's streams, now (kept
        under ``key`` until it runs)."""
        order = self._record_caller_order(call)
        with self._lock:
            self._orders[key] = order

    def _submitted_order(self, key: Tuple[int, int]) -> Optional[CallerOrder]:
        if not self._orders:
            return None
        with self._lock:
            return self._orders.pop(key, None)

    def _record_caller_order(self, call: GroupCall) -> CallerOrder:
        order: CallerOrder = {}
        for view in views_of(call):
            if not view.device.startswith("cuda:"):
                continue  # run() refuses it with a message
            device = int(view.device.split(":", 1)[1])
            if device in order or device not in self._spare_events:
                continue
            stream = self._library.caller_stream(view.kind, device)
            event = self._take_event(device)
            self._library.record(event, stream)
            order[device] = (stream, event)
        return order

    def _take_event(self, device: int) -> int:
        with self._lock:
            spare = self._spare_events[device]
            if spare:
                return spare.pop()
        return self._library.create_event(device)

    def _release(self, order: CallerOrder) -> None:
        with self._lock:
            for device, (_, event) in order.items():
                self._spare_events[device].append(event)

    # ------------------------------------------------------------ prepared calls

    def prepare(self, options: CallOptions, views: CallViews) -> "NcclCall":
        """The calls of one shape: their steps built per call from each call's tensors; an
        allreduce, reduce or broadcast, once its first call ran, as its one NCCL operation on
        the tensor's address (:meth:`one_operation`).

        Raises:
            ArgumentTypeError: a CPU tensor; ArgumentValueError: a GPU this process does not
                use in the group (before anything is launched).
        """
        like = CallViews(_like(views.tensor), tuple(_like(v) for v in views.inputs),
                         tuple(_like(v) for v in views.outputs))
        self._device_of_call(GroupCall(options, 0, like.tensor, like.inputs, like.outputs))
        return NcclCall(self, options, functools.partial(_call_of, options, like),
                        like.tensor if options.collective in _KNOWN_SHAPE_OPERATIONS else None)

    def one_operation(self, prepared: "NcclCall", like: TensorView
                      ) -> Optional[Callable[[int, Any], None]]:
        """The ``run`` of later allreduce, reduce and broadcast calls on GPU tensors like
        ``like``: the call's one NCCL operation on the tensor's address, without building its
        steps again; None where the call is not one (an empty tensor, no clique yet)."""
        options, collective = prepared.options, prepared.options.collective
        if like.kind not in ADDRESS_OF or not like.count:
            return None
        lane = self._single.get(device_of(like, self.devices, self.group_name, "tensor"))
        if lane is None:
            return None
        if collective is Collective.BROADCAST:
            fmt, trailing = self._movement(like), (options.root, lane.stream)
        else:
            fmt = self._reduction(like, options.op)
            trailing = (fmt.op, options.root, lane.stream) if collective is Collective.REDUCE \
                else (fmt.op, lane.stream)
        operation = getattr(lane.communicator, _KNOWN_SHAPE_OPERATIONS[collective])
        address_of = ADDRESS_OF[like.kind]
        count, datatype = like.count * fmt.per_element, fmt.datatype
        peers = tuple(r for r in range(self.world_size) if r != self.rank)
        ident = id(prepared)

        def run(seq: int, array: Any) -> None:
            address = address_of(array)
            steps = CallSteps((lane,), peers, launches=[functools.partial(
                operation, address, address, count, datatype, *trailing)])
            # The like view stands for the call's array in the caller order and in messages.
            call = GroupCall(options, seq, tensor=like)
            order = self._submitted_order((ident, seq)) or self._record_caller_order(call)
            try:
                self._execute(call, steps, order)
            finally:
                if order:
                    self._release(order)

        return run

    # ------------------------------------------------------------ running a call

    def run_call(self, key: Tuple[int, int], call: GroupCall) -> None:
        """Build ``call``'s steps and run them, after the work its caller queued (recorded
        when it was submitted under ``key``, else now)."""
        order = self._submitted_order(key)
        try:
            steps = self._steps(call)
            if order is None:
                order = self._record_caller_order(call)
            self._execute(call, steps, order)
        finally:
            if order:
                self._release(order)

    def _execute(self, call: GroupCall, steps: CallSteps, order: CallerOrder) -> None:
        library = self._library
        for lane in steps.lanes:
            if lane.device in order:
                library.wait(lane.stream, order[lane.device][1])
        deadline = time.monotonic() + call.options.timeout
        self._watchdog.arm(deadline)
        try:
            for step in steps.before:
                step()
            self._launch(steps.launches)
            for step in steps.after:
                step()
            for lane in steps.lanes:
                library.record(lane.done, lane.stream)
        except (library.nccl_error, library.cuda_error) as err:
            self._watchdog.disarm()
            raise self._failure(call, steps, err) from err
        if self._watchdog.disarm():
            raise self._failure(call, steps, None)
        for lane in steps.lanes:
            if lane.device in order:
                library.wait(order[lane.device][0], lane.done)
        try:
            completed = wait_for_events(library, [lane.done for lane in steps.lanes],
                                        [lane.communicator for lane in steps.lanes], deadline,
                                        self._options)
        except (library.nccl_error, library.cuda_error) as err:
            raise self._failure(call, steps, err) from err
        if not completed:
            raise self._failure(call, steps, None)

    def _launch(self, launches: Sequence[Callable[[], None]]) -> None:
        if len(launches) <= 1:
            for launch in launches:
                launch()
            return
        self._library.group_start()
        try:
            for launch in launches:
                launch()
        finally:
            self._library.group_end()

    def _failure(self, call: GroupCall, steps: CallSteps,
                 error: Optional[BaseException]) -> Exception:
        """Abort the communicators and return the error the call raises."""
        timed_out = error is None or self._watchdog.expired
        self._abort_communicators()
        name, seq, rank = call_name(call), call.seq, self.rank
        if timed_out:
            return CollectiveTimeoutError(self.group_name, rank, name, seq, steps.peers,
                                          call.options.timeout)
        status = getattr(error, "status", None)
        if isinstance(error, self._library.nccl_error) and status not in (
                _NCCL_INVALID_ARGUMENT, _NCCL_INVALID_USAGE):
            return PeerDiedError(
                self.group_name, rank, name, seq, steps.peers,
                f"NCCL reported '{error}'; NCCL does not say which peer failed, so every rank "
                f"this call needed is listed")
        return CollectiveError(
            f"rank {rank} of group '{self.group_name}': {name} #{seq} failed on the GPU "
            f"({type(error).__name__}: {error}). The communicators are aborted and the group "
            f"is broken: destroy it and create it again.")

    # ------------------------------------------------------------ failure and release

    def elastic_refusal(self, what: str) -> str:
        return (f"group '{self.group_name}' (rank {self.rank}): the 'nccl' backend cannot "
                f"{what} a group. NCCL can (ncclCommShrink since 2.27, grow since 2.30), but "
                f"CuPy, through which this backend reaches NCCL, exposes neither: destroy the "
                f"group and create it again with the ranks you want (a 'ray' group of the same "
                f"actors can {what} on CPU)")

    def _abort_communicators(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            communicators = list(self._communicators)
        for communicator in communicators:
            self._library.abort(communicator)

    def abort(self, error: Optional[BaseException]) -> None:
        """Abort every communicator: the peers' pending NCCL calls fail instead of hanging."""
        self._abort_communicators()

    def close(self) -> None:
        """Destroy the communicators (unless aborted) and release every stream and event."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            aborted = self._aborted
            communicators, self._communicators = self._communicators, []
            events = list(self._done_events.values())
            events += [event for spare in self._spare_events.values() for event in spare]
            events += [event for order in self._orders.values() for _, event in order.values()]
            streams = list(self._streams.values())
            self._done_events, self._streams, self._orders = {}, {}, {}
            self._spare_events = {device: [] for device in self.devices}
            self._barrier_scratch = {}
        self._watchdog.close()
        if not aborted:
            for communicator in communicators:
                self._library.destroy(communicator)
        for event in events:
            self._library.destroy_event(event)
        for stream in streams:
            self._library.destroy_stream(stream)


class NcclCall(PreparedCall):
    """A call shape prepared on an NCCL membership (see :meth:`NcclMembership.prepare`).

    Args:
        membership: the membership.
        options: the calls' options.
        make_call: builds a call's record from its sequence number and arrays.
        like: for an allreduce, reduce or broadcast, the tensor's view without its array:
            after the first call, ``run`` becomes the one NCCL operation; else None.
    """

    __slots__ = ("_membership", "_make_call", "_like")

    def __init__(self, membership: NcclMembership, options: CallOptions,
                 make_call: Callable[[int, Any], GroupCall], like: Optional[TensorView] = None):
        super().__init__(options, self._run_steps)
        self._membership = membership
        self._make_call = make_call
        self._like = like

    def on_submit(self, seq: int, arrays: Any) -> None:
        self._membership.submitted((id(self), seq), self._make_call(seq, arrays))

    def _run_steps(self, seq: int, arrays: Any) -> None:
        self._membership.run_call((id(self), seq), self._make_call(seq, arrays))
        if self._like is not None:
            # Its GPU's clique exists now: that call ran.
            self.run = self._membership.one_operation(self, self._like) or self._run_steps
            self._like = None


def _like(view: Optional[TensorView]) -> Optional[TensorView]:
    """``view`` without its tensor, standing for every call's tensor of the shape (a prepared
    call must not keep the first call's tensor alive)."""
    if view is None:
        return None
    return TensorView(None, None, view.dtype_name, view.wire_dtype, view.shape, view.device,
                      view.kind)


def _as(like: TensorView, tensor: Any) -> TensorView:
    return TensorView(tensor, None, like.dtype_name, like.wire_dtype, like.shape, like.device,
                      like.kind)


def _call_of(options: CallOptions, like: CallViews, seq: int, arrays: Any) -> GroupCall:
    """The record of call ``seq`` of a shape whose tensors are like ``like``, on ``arrays``
    (in the form ``PreparedCall.run`` takes them)."""
    collective = options.collective
    if arrays is None:
        return GroupCall(options, seq)
    if collective is Collective.ALLTOALL:
        inputs, outputs = arrays
        return GroupCall(options, seq, None, tuple(map(_as, like.inputs, inputs)),
                         tuple(map(_as, like.outputs, outputs)))
    if like.outputs or like.inputs or collective in _LISTED:
        tensor, entries = arrays
        entries = tuple(map(_as, like.outputs or like.inputs, entries or ()))
        return GroupCall(options, seq, _as(like.tensor, tensor),
                         () if like.outputs else entries, entries if like.outputs else ())
    return GroupCall(options, seq, _as(like.tensor, arrays))


_LISTED = (Collective.ALLGATHER, Collective.GATHER, Collective.REDUCESCATTER,
           Collective.SCATTER)


# The collectives a known-shape runner serves, and the communicator's method of each.
_KNOWN_SHAPE_OPERATIONS = {Collective.ALLREDUCE: "allReduce", Collective.REDUCE: "reduce",
                           Collective.BROADCAST: "broadcast"}


class NcclBackendFactory(BackendFactory):
    """Joins processes to NCCL groups; ``backend="nccl"`` uses one with Ray's rendezvous.

    Args:
        rendezvous: where ranks exchange the NCCL unique id. Default: Ray's key-value store
            (:class:`RayRendezvous`) for groups of several processes; an
            :class:`InProcessRendezvous` shared by every rank when the ranks are threads of one
            process (tests, scripts without Ray).
        devices: the GPUs this process uses (indices of the visible devices). Default: every
            visible GPU, which inside a Ray actor are the ones Ray assigned to it.
        library: the NCCL library; default: CuPy's, loaded on first use.
        options: how the backend waits for completion; default :class:`NcclOptions()`.
    """

    name = "nccl"

    def __init__(self, rendezvous: Optional[Rendezvous] = None,
                 devices: Optional[Sequence[int]] = None,
                 library: Optional[NcclLibrary] = None,
                 options: Optional[NcclOptions] = None):
        self._rendezvous = rendezvous
        self._devices = None if devices is None else tuple(devices)
        self._library = library
        self._options = options if options is not None else NcclOptions()

    def available(self) -> bool:
        """Whether CuPy and the NCCL library load in this process.

        Returns:
            True if they do.
        """
        if self._library is not None:
            return True
        try:
            load_library()
        except BackendNotAvailableError:
            return False
        return True

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> Membership:
        """Join the group: check GPU counts, exchange the unique id, create the communicators.

        Args:
            group_name: the group.
            world_size: processes in the group.
            rank: this process's rank.
            timeout: seconds the other ranks have to join.

        Returns:
            The membership.

        Raises:
            BackendNotAvailableError: no CuPy/NCCL, no visible GPU, or no Ray to meet through.
            ValueError: bad ``devices``, or processes that own different numbers of GPUs.
            CollectiveTimeoutError: a rank did not join within ``timeout``.
            CollectiveError: NCCL could not create the communicators.
        """
        library = self._library if self._library is not None else load_library()
        devices = self._resolve_devices(library, group_name, rank)
        rendezvous = self._rendezvous
        if rendezvous is None:
            rendezvous = RayRendezvous() if world_size > 1 else InProcessRendezvous()
        # Through Ray, ranks announce their terms as the ray backend's do, so that a rank that
        # names another backend (or world size, or this rank) is refused at once on both sides.
        arrivals = (rendezvous.announce(group_name, rank, Terms(world_size, self.name), timeout)
                    if isinstance(rendezvous, RayRendezvous) else None)
        try:
            communicators = CliqueJoin(rendezvous, library, group_name, "world", world_size,
                                       rank, devices, "init", 0, timeout,
                                       None if arrivals is None else arrivals.look).run()
        finally:
            if arrivals is not None:
                arrivals.withdraw()
        return NcclMembership(group_name, world_size, rank, devices, library, rendezvous,
                           self._options, communicators)

    def synchronize(self, gpu_id: int) -> bool:
        """Wait for GPU ``gpu_id`` (see :func:`synchronize_device`); True once it has."""
        synchronize_device(gpu_id, self._library)
        return True

    def _resolve_devices(self, library: NcclLibrary, group_name: str,
                         rank: int) -> Tuple[int, ...]:
        count = library.device_count()
        if self._devices is None:
            if count == 0:
                raise BackendNotAvailableError(
                    f"group '{group_name}', rank {rank}: the 'nccl' backend needs a GPU, and "
                    f"this process sees none. Inside Ray, create the actor with num_gpus=1 (or "
                    f"more); otherwise check CUDA_VISIBLE_DEVICES.")
            return tuple(range(count))
        if not self._devices or len(set(self._devices)) != len(self._devices) or any(
                isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < count
                for d in self._devices):
            raise ValueError(
                f"group '{group_name}', rank {rank}: devices={list(self._devices)} must be "
                f"distinct GPU indices among the {count} GPUs this process sees "
                f"(0..{count - 1}).")
        return self._devices


def synchronize_device(gpu_id: int, library: Optional[NcclLibrary] = None) -> None:
    """Block until all work queued on GPU ``gpu_id`` (collectives included) has finished.

    Args:
        gpu_id: the GPU index among the visible devices.
        library: the NCCL library; default: CuPy's.

    Raises:
        BackendNotAvailableError: CuPy or NCCL is not available.
        ValueError: ``gpu_id`` is not a visible GPU.
    """
    library = library if library is not None else load_library()
    count = library.device_count()
    if isinstance(gpu_id, bool) or not isinstance(gpu_id, int) or not 0 <= gpu_id < count:
        raise ValueError(f"gpu_id must be the index of a visible GPU (0..{count - 1}), not "
                         f"{gpu_id!r}")
    library.synchronize(gpu_id)
