"""A recording stand-in for ``cupy.cuda`` and ``cupy.cuda.nccl``, for testing the NCCL backend
without a GPU.

It is not a GPU and claims no GPU coverage: it is the smallest model of CUDA streams, events and
NCCL communicators that lets the backend's own logic run and be checked — which calls it makes,
in which order, on which stream and device, with which NCCL datatype, count, op, root and peer —
and that executes the data movement the calls describe on host memory, so results can be
compared with numpy.

The model, no kinder than NCCL where the backend could tell:

- "Device memory" is host memory (numpy buffers) tagged with a device; every address the
  backend passes is checked to lie inside one allocation.
- A stream is a FIFO of tasks that complete in order: event markers, waits on events, device
  copies, and NCCL work. An event completes when the tasks queued before its record have.
- Work moves only when the host looks: when it queries an event or synchronizes a device. A
  launch or a copy returns before anything is done, so a backend that reads a result without
  waiting for its completion event reads memory not yet written.
- NCCL calls of one communicator match across ranks in issue order (collectives by their
  index, send/recv per peer pair); a call completes once every party has reached it on its
  stream and the parties agree, and only then is its data moved (``nccl_standin_moves``: no
  defensive copy; bfloat16 reduced as bfloat16). Parties that disagree (kind, count, datatype,
  op, root) or a party that never comes leave the others waiting, as NCCL hangs (or corrupts
  memory): only the caller's deadline ends it. Calls issued inside ``groupStart/groupEnd`` on
  one stream form one task, as NCCL launches them together.
- Communicator creation blocks until the whole clique has constructed (outside a group) or
  until ``groupEnd``, like ``ncclCommInitRank``: without end, unless :meth:`StandInGpus.close`
  releases it.
- Failures can be injected: an asynchronous NCCL error, an error returned by a launch, a CUDA
  error on events, launches that block until their communicator is aborted (as a blocking
  communicator does while it connects to an absent peer), caller work that holds a stream until
  released, and launches that complete without moving any data (``inert_launches``), to show
  that a test notices.

Every call is appended to ``StandInGpus.log`` as ``(thread name, call name, details...)``.
"""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ray_collective.backends.nccl import NcclLibrary
from support.contract import TensorKind
from support.nccl_standin_moves import (DATATYPE_DTYPES, NCCL_CONSTANTS, disagreement, move_p2p,
                                        run_collective)

NOT_READY = 600
NCCL_INTERNAL_ERROR = 3
CUDA_ERROR_LAUNCH_TIMEOUT = 702


class StandInNcclError(RuntimeError):
    """Stands for ``cupy.cuda.nccl.NcclError``."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        super().__init__(f"stand-in NCCL error {status}" + (f" ({detail})" if detail else ""))


class StandInCudaError(RuntimeError):
    """Stands for ``cupy.cuda.runtime.CUDARuntimeError``."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"stand-in CUDA error {status}")


class _Marker:
    def __init__(self):
        self.done = False


class _Task:
    """One entry of a stream: ``step()`` returns True once it has completed."""

    def __init__(self, step: Callable[[], bool], what: str):
        self.step = step
        self.what = what


class StandInCupyArray:
    """Stands for a ``cupy.ndarray`` on one device; ``host`` is its memory."""

    def __init__(self, host: np.ndarray, device: int, allocation: "_Allocation"):
        self.host = host
        self.dtype = host.dtype
        self.shape = host.shape
        self.strides = host.strides
        self.size = host.size
        self.flags = types.SimpleNamespace(c_contiguous=host.flags.c_contiguous)
        self.device = types.SimpleNamespace(id=device)
        self.data = allocation


# as_view recognises CuPy arrays by their module.
StandInCupyArray.__module__ = "cupy.standin"


class _Allocation:
    """Stands for ``cupy.cuda.MemoryPointer``: ``ptr`` is the address."""

    def __init__(self, gpus: "StandInGpus", device: int, nbytes: int):
        self.buffer = np.zeros(max(nbytes, 1), np.uint8)
        self.ptr = int(self.buffer.ctypes.data)
        self.nbytes = nbytes
        self.device = device
        gpus.device_memory.register(self)


class _DeviceMemory:
    """Every live allocation of the stand-in GPUs, by address."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._allocations: Dict[int, weakref.ref] = {}

    def register(self, allocation: _Allocation) -> None:
        with self._lock:
            self._allocations[allocation.ptr] = weakref.ref(allocation)

    def at(self, ptr: int, nbytes: int, device: Optional[int] = None) -> np.ndarray:
        """The bytes at ``[ptr, ptr + nbytes)``, which must lie in one live allocation (on
        ``device``, if given)."""
        with self._lock:
            for base, ref in self._allocations.items():
                allocation = ref()
                if allocation is not None and base <= ptr and ptr + nbytes <= base + max(
                        allocation.nbytes, 1):
                    assert device is None or allocation.device == device, (
                        f"address on device {allocation.device} used on device {device}")
                    return allocation.buffer[ptr - base:ptr - base + nbytes]
        raise AssertionError(f"address {ptr:#x} (+{nbytes}) is not in a live allocation")


class _Communicator:
    """Stands for ``cupy.cuda.nccl.NcclCommunicator``."""

    def __init__(self, gpus: "StandInGpus", ndev: int, commId: Union[tuple, bytes], rank: int):
        gpus._record("NcclCommunicator", ndev, rank)
        if gpus.id_as_bytes:
            if not isinstance(commId, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                                f"{type(commId).__name__})")
        elif gpus.char_signed:
            assert all(-128 <= v <= 127 for v in commId), "unique id not in signed char range"
        else:
            assert all(0 <= v <= 255 for v in commId), "unique id not in unsigned char range"
        assert len(commId) == 128
        self._gpus = gpus
        self.uid = tuple(commId) if gpus.id_as_bytes else tuple(v & 0xFF for v in commId)
        self.nranks = ndev
        self.rank = rank
        self.device = gpus._current_device()
        self.aborted = False
        self.destroyed = False
        self.async_error = 0
        self.collectives_issued = 0
        self.sends_issued: Dict[int, int] = {}
        self.recvs_issued: Dict[int, int] = {}
        gpus.cliques.join(self)

    # NCCL calls
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._collective("allReduce", stream, sendbuf=sendbuf, recvbuf=recvbuf, count=count,
                         datatype=datatype, op=op)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._collective("reduce", stream, sendbuf=sendbuf, recvbuf=recvbuf, count=count,
                         datatype=datatype, op=op, root=root)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._collective("broadcast", stream, sendbuf=sendbuff, recvbuf=recvbuff, count=count,
                         datatype=datatype, root=root)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._collective("allGather", stream, sendbuf=sendbuf, recvbuf=recvbuf, count=count,
                         datatype=datatype)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._collective("reduceScatter", stream, sendbuf=sendbuf, recvbuf=recvbuf,
                         count=recvcount, datatype=datatype, op=op)

    def send(self, sendbuf, count, datatype, peer, stream):
        n = self.sends_issued.get(peer, 0)
        self.sends_issued[peer] = n + 1
        self._issue("send", stream, ("p2p", self.rank, peer, n),
                    dict(buf=sendbuf, count=count, datatype=datatype, peer=peer))

    def recv(self, recvbuf, count, datatype, peer, stream):
        n = self.recvs_issued.get(peer, 0)
        self.recvs_issued[peer] = n + 1
        self._issue("recv", stream, ("p2p", peer, self.rank, n),
                    dict(buf=recvbuf, count=count, datatype=datatype, peer=peer))

    def _collective(self, kind, stream, **args):
        n = self.collectives_issued
        self.collectives_issued += 1
        self._issue(kind, stream, ("coll", n), args)

    def _issue(self, kind, stream, key, args):
        self._gpus.cliques.issue(self, kind, stream, key, args)

    # lifetime and errors
    def abort(self):
        self._gpus.cliques.abort(self)

    def destroy(self):
        self._gpus._record("destroy", self.rank)
        assert not self.aborted, "destroy after abort"
        self.destroyed = True

    def check_async_error(self):
        if self.aborted:
            raise StandInNcclError(4)
        if self.async_error:
            raise StandInNcclError(self.async_error)


class _Op:
    def __init__(self, communicator: _Communicator, kind: str, stream: int, key: tuple,
                 args: dict):
        self.communicator = communicator
        self.kind = kind
        self.stream = stream
        self.key = key
        self.args = args
        self.posted = False
        self.done = False


class StandInGpus:
    """A machine of ``device_count`` stand-in GPUs; ``cuda`` and ``nccl`` stand for CuPy's
    modules, ``library()`` builds the backend's adapter over them.

    Args:
        device_count: visible GPUs.
        version: what ``nccl.get_version()`` returns.
        char_signed: whether the platform's C ``char`` is signed (checks the unique id form).
        id_as_bytes: the CuPy 14 form: ``get_unique_id`` returns bytes and ``NcclCommunicator``
            accepts nothing else (before, both used a tuple of C ``char`` values).
        without: NCCL constants this CuPy lacks.

    Attributes (failures to inject; set them at any time):
        block_launches: an NCCL launch blocks until its communicator is aborted, then fails.
        launch_error: an NCCL launch raises this NCCL status (0: none).
        event_error: querying an event returns this CUDA status (0: none).
        inert_launches: NCCL calls complete without moving any data.
    """

    def __init__(self, device_count: int = 4, version: int = 22105, char_signed: bool = True,
                 id_as_bytes: bool = False, without: Sequence[str] = ()):
        self.device_count = device_count
        self.version = version
        self.char_signed = char_signed
        self.id_as_bytes = id_as_bytes
        self.log: List[tuple] = []
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.closed = False
        self._ids = itertools.count(1000)
        self.device_memory = _DeviceMemory(self.lock)
        self._streams: Dict[int, dict] = {}
        self._events: Dict[int, dict] = {}
        self._local = threading.local()
        self.block_launches = False
        self.launch_error = 0
        self.event_error = 0
        self.inert_launches = False
        self.cliques = _Cliques(self)
        self.default_streams = {d: self._new_stream(d, 0) for d in range(device_count)}
        self.cuda = self._cuda_module()
        self.nccl = self.cliques.module(without)

    def library(self) -> NcclLibrary:
        """The backend's adapter over these stand-ins."""
        return NcclLibrary(self.cuda, self.nccl, self.id_as_bytes)

    def close(self) -> None:
        """Release whatever still blocks (a communicator's creation, a blocked launch, a device
        synchronize): each raises. For the end of a test."""
        with self.lock:
            self.closed = True
            self.changed.notify_all()

    # ------------------------------------------------------------ tensors

    def array(self, values, device: int = 0, dtype=None) -> StandInCupyArray:
        """A stand-in cupy array on ``device`` holding ``values``."""
        values = np.asarray(values, dtype=dtype)
        allocation = _Allocation(self, device, values.nbytes)
        host = allocation.buffer[:values.nbytes].view(values.dtype).reshape(values.shape)
        host[...] = values
        return StandInCupyArray(host, device, allocation)

    @staticmethod
    def host(tensor: StandInCupyArray) -> np.ndarray:
        """A copy of ``tensor``'s memory as it is now."""
        return tensor.host.copy()

    def use_stream(self, device: int, stream: int) -> None:
        """Make ``stream`` the calling thread's current stream of ``device``."""
        self._thread_state().streams[device] = stream

    def new_stream(self, device: int) -> int:
        """A stream a caller could create on ``device``."""
        with self.lock:
            return self._new_stream(device, 0)

    def hold(self, stream: int) -> Callable[[], None]:
        """Queue caller work on ``stream`` that runs until the returned function is called."""
        released = threading.Event()
        with self.lock:
            self._live_stream(stream)["tasks"].append(_Task(released.is_set, "held work"))

        def release() -> None:
            released.set()
            with self.lock:
                self.changed.notify_all()
        return release

    def fail_communicators(self, status: int) -> None:
        """Make every communicator report asynchronous NCCL error ``status``."""
        with self.lock:
            for communicator in self.communicators():
                communicator.async_error = status

    def calls(self, name: str) -> List[tuple]:
        """The logged calls named ``name``."""
        return [entry for entry in self.log if entry[1] == name]

    def wait_for_call(self, name: str, timeout: float = 10.0) -> None:
        """Block until another thread has made a call named ``name`` (it may still be in it).

        Raises:
            AssertionError: no such call within ``timeout`` seconds.
        """
        with self.lock:
            assert self.changed.wait_for(lambda: self.calls(name), timeout), (
                f"no {name} call within {timeout} s")

    def live_streams(self) -> List[int]:
        """Streams created and not destroyed (the callers' default streams excluded)."""
        return [s for s, state in self._streams.items()
                if not state["destroyed"] and s not in self.default_streams.values()]

    def live_events(self) -> List[int]:
        """Events created and not destroyed."""
        return [e for e, state in self._events.items() if not state["destroyed"]]

    def communicators(self) -> List[_Communicator]:
        """Every communicator created."""
        return self.cliques.communicators()

    # ------------------------------------------------------------ the modules

    def _cuda_module(self):
        runtime = types.SimpleNamespace(
            CUDARuntimeError=StandInCudaError,
            streamNonBlocking=1, eventDisableTiming=2, memcpyDeviceToDevice=3,
            getDeviceCount=lambda: self.device_count,
            getDevice=self._current_device,
            setDevice=self._set_device,
            deviceSynchronize=self._device_synchronize,
            streamCreateWithFlags=self._stream_create,
            streamDestroy=self._stream_destroy,
            eventCreateWithFlags=self._event_create,
            eventDestroy=self._event_destroy,
            eventRecord=self._event_record,
            eventQuery=self._event_query,
            streamWaitEvent=self._stream_wait_event,
            memcpyAsync=self._memcpy_async,
        )
        return types.SimpleNamespace(
            runtime=runtime,
            alloc=lambda nbytes: _Allocation(self, self._current_device(), nbytes),
            get_current_stream=lambda device_id: types.SimpleNamespace(
                ptr=self._thread_state().streams.get(device_id, self.default_streams[device_id])),
        )

    # ------------------------------------------------------------ thread state

    def _thread_state(self):
        state = self._local
        if not hasattr(state, "device"):
            state.device = 0
            state.streams = {}
            state.group_depth = 0
            state.grouped_ops = []
            state.grouped_inits = []
        return state

    def _record(self, name: str, *details) -> None:
        with self.lock:
            self.log.append((threading.current_thread().name, name) + details)
            self.changed.notify_all()

    def _current_device(self) -> int:
        return self._thread_state().device

    def _set_device(self, device: int) -> None:
        assert 0 <= device < self.device_count, f"no device {device}"
        self._thread_state().device = device

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Block until ``condition()`` (checked under the lock at every change) holds, for ever
        unless :meth:`close` is called.

        Raises:
            StandInNcclError: closed while waiting (``what`` says who waited).
        """
        with self.lock:
            self.changed.wait_for(lambda: self.closed or condition())
            if not condition():
                raise StandInNcclError(NCCL_INTERNAL_ERROR, f"{what}: the stand-in was closed")

    # ------------------------------------------------------------ streams and events

    def _new_stream(self, device: int, flags: int) -> int:
        stream = next(self._ids)
        self._streams[stream] = dict(device=device, flags=flags, tasks=[], destroyed=False)
        return stream

    def _stream_create(self, flags: int) -> int:
        with self.lock:
            stream = self._new_stream(self._current_device(), flags)
        self._record("streamCreateWithFlags", stream, self._current_device(), flags)
        return stream

    def _stream_destroy(self, stream: int) -> None:
        self._record("streamDestroy", stream)
        with self.lock:
            assert not self._streams[stream]["destroyed"], "stream destroyed twice"
            self._streams[stream]["destroyed"] = True

    def stream_device(self, stream: int) -> int:
        """The device ``stream`` was created on."""
        return self._streams[stream]["device"]

    def _event_create(self, flags: int) -> int:
        with self.lock:
            event = next(self._ids)
            self._events[event] = dict(device=self._current_device(), marker=None,
                                       destroyed=False, flags=flags)
        self._record("eventCreateWithFlags", event, self._current_device(), flags)
        return event

    def _event_destroy(self, event: int) -> None:
        self._record("eventDestroy", event)
        with self.lock:
            assert not self._events[event]["destroyed"], "event destroyed twice"
            self._events[event]["destroyed"] = True

    def _live_event(self, event: int) -> dict:
        state = self._events[event]
        assert not state["destroyed"], "use of a destroyed event"
        return state

    def _live_stream(self, stream: int) -> dict:
        state = self._streams[stream]
        assert not state["destroyed"], "use of a destroyed stream"
        return state

    def queue(self, stream: int, step: Callable[[], bool], what: str) -> None:
        """Append a task to ``stream``; it runs when the host next looks (:meth:`_pump`)."""
        with self.lock:
            self._live_stream(stream)["tasks"].append(_Task(step, what))
            self.changed.notify_all()

    def _event_record(self, event: int, stream: int) -> None:
        self._record("eventRecord", event, stream)
        with self.lock:
            state = self._live_event(event)
            assert state["device"] == self._live_stream(stream)["device"], (
                "event and stream on different devices")
            marker = state["marker"] = _Marker()

            def step():
                marker.done = True
                return True
            self.queue(stream, step, "marker")

    def _event_query(self, event: int) -> int:
        with self.lock:
            self._pump()
            if self.event_error:
                return self.event_error
            marker = self._live_event(event)["marker"]
            return 0 if marker is None or marker.done else NOT_READY

    def _stream_wait_event(self, stream: int, event: int, flags: int) -> None:
        self._record("streamWaitEvent", stream, event)
        with self.lock:
            marker = self._live_event(event)["marker"]
            self.queue(stream, lambda: marker is None or marker.done, "wait")

    def _memcpy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._record("memcpyAsync", dst, src, size, stream)
        assert kind == 3, "only device-to-device copies are expected"
        with self.lock:
            device = self._live_stream(stream)["device"]

            def step():
                memory = self.device_memory
                memory.at(dst, size, device)[...] = memory.at(src, size, device)
                return True
            self.queue(stream, step, "copy")

    def _device_synchronize(self) -> None:
        device = self._current_device()
        self._record("deviceSynchronize", device)
        try:
            self.wait_until(lambda: self._pump() or not any(
                state["tasks"] for state in self._streams.values()
                if state["device"] == device), f"deviceSynchronize({device})")
        except StandInNcclError:
            raise StandInCudaError(CUDA_ERROR_LAUNCH_TIMEOUT) from None

    def _pump(self) -> None:
        """Complete every task that can complete, until nothing moves (called with the lock
        held, when the host looks)."""
        moved, progress = False, True
        while progress:
            progress = False
            for state in self._streams.values():
                while state["tasks"] and state["tasks"][0].step():
                    state["tasks"].pop(0)
                    progress = moved = True
        if moved:
            self.changed.notify_all()


class _Cliques:
    """The NCCL side of the stand-in: communicators by clique, groups, launches, and the
    matching of each call's parties across ranks."""

    def __init__(self, gpus: StandInGpus):
        self._gpus = gpus
        self._cliques: Dict[tuple, Dict[int, _Communicator]] = {}
        self._matches: Dict[tuple, Dict[object, _Op]] = {}

    def communicators(self) -> List[_Communicator]:
        return [c for clique in self._cliques.values() for c in clique.values()]

    def module(self, without: Sequence[str]):
        """The stand-in for ``cupy.cuda.nccl``, lacking the constants named in ``without``."""
        gpus = self._gpus
        module = types.SimpleNamespace(
            available=True,
            NcclError=StandInNcclError,
            get_version=lambda: gpus.version,
            get_unique_id=self.unique_id,
            groupStart=self.group_start,
            groupEnd=self.group_end,
            NcclCommunicator=lambda ndev, commId, rank: _Communicator(gpus, ndev, commId, rank),
        )
        for name, value in NCCL_CONSTANTS.items():
            if name not in without:
                setattr(module, name, value)
        return module

    def unique_id(self) -> Union[tuple, bytes]:
        self._gpus._record("get_unique_id")
        raw = np.random.default_rng().integers(0, 256, 128, dtype=np.uint8)
        if self._gpus.id_as_bytes:
            return raw.tobytes()
        return tuple(int(v) for v in (raw.view(np.int8) if self._gpus.char_signed else raw))

    def join(self, communicator: _Communicator) -> None:
        gpus = self._gpus
        with gpus.lock:
            clique = self._cliques.setdefault(communicator.uid, {})
            assert communicator.rank not in clique, "two communicators with one NCCL rank"
            clique[communicator.rank] = communicator
            gpus.changed.notify_all()
        state = gpus._thread_state()
        if state.group_depth:
            state.grouped_inits.append(communicator)
        else:
            self._wait_for_clique(communicator)

    def _wait_for_clique(self, communicator: _Communicator) -> None:
        self._gpus.wait_until(
            lambda: len(self._cliques[communicator.uid]) >= communicator.nranks,
            f"NCCL rank {communicator.rank}'s communicator creation")

    def group_start(self) -> None:
        self._gpus._record("groupStart")
        self._gpus._thread_state().group_depth += 1

    def group_end(self) -> None:
        gpus = self._gpus
        gpus._record("groupEnd")
        state = gpus._thread_state()
        state.group_depth -= 1
        if state.group_depth:
            return
        inits, state.grouped_inits = state.grouped_inits, []
        for communicator in inits:
            self._wait_for_clique(communicator)
        ops, state.grouped_ops = state.grouped_ops, []
        by_stream: Dict[int, List[_Op]] = {}
        for op in ops:
            by_stream.setdefault(op.stream, []).append(op)
        self._block_if_asked([op.communicator for op in ops])
        for stream, batch in by_stream.items():
            self._enqueue(stream, batch)

    def _block_if_asked(self, communicators: Sequence[_Communicator]) -> None:
        if not self._gpus.block_launches or not communicators:
            return
        self._gpus._record("blocked launch")
        self._gpus.wait_until(lambda: any(c.aborted for c in communicators), "a blocked launch")
        raise StandInNcclError(NCCL_INTERNAL_ERROR)

    def issue(self, communicator: _Communicator, kind: str, stream: int, key: tuple,
              args: dict) -> None:
        gpus = self._gpus
        gpus._record(kind, communicator.rank, stream, dict(args))
        if gpus.launch_error:
            raise StandInNcclError(gpus.launch_error)
        assert not communicator.aborted and not communicator.destroyed, "call on a dead comm"
        with gpus.lock:
            assert gpus._live_stream(stream)["device"] == communicator.device, (
                "NCCL call on a stream of another device")
        op = _Op(communicator, kind, stream, (communicator.uid,) + key, args)
        state = gpus._thread_state()
        if state.group_depth:
            state.grouped_ops.append(op)
            return
        self._block_if_asked([communicator])
        self._enqueue(stream, [op])

    def _enqueue(self, stream: int, batch: List[_Op]) -> None:
        def step():
            for op in batch:
                if not op.posted:
                    op.posted = True
                    self._post(op)
            return all(op.done for op in batch)
        self._gpus.queue(stream, step, "nccl")

    def abort(self, communicator: _Communicator) -> None:
        gpus = self._gpus
        gpus._record("abort", communicator.rank)
        with gpus.lock:
            communicator.aborted = True
            # Aborting stops the communicator's kernels: its pending work ends.
            for parties in self._matches.values():
                for op in parties.values():
                    if op.communicator is communicator:
                        op.done = True
            gpus.changed.notify_all()

    def _post(self, op: _Op) -> None:
        """Add ``op`` to its call's parties; run the call once they are all there and agree."""
        p2p = op.kind in ("send", "recv")
        parties = self._matches.setdefault(op.key, {})
        parties[op.kind if p2p else op.communicator.rank] = op
        expected = 2 if p2p else op.communicator.nranks
        if len(parties) < expected:
            return
        ordered = [parties["send"], parties["recv"]] if p2p else [parties[r] for r in
                                                                   range(expected)]
        differs = disagreement(ordered)
        if differs:
            self._gpus._record("mismatch", op.key, differs)  # NCCL would hang: so do its parties
            return
        if not self._gpus.inert_launches:
            if p2p:
                move_p2p(*ordered, self._typed)
            else:
                run_collective(ordered, self._typed)
        for party in ordered:
            party.done = True

    def _typed(self, op: _Op, ptr: int, count: int) -> np.ndarray:
        dtype = np.dtype(DATATYPE_DTYPES[op.args["datatype"]])
        return self._gpus.device_memory.at(ptr, count * dtype.itemsize,
                                           op.communicator.device).view(dtype)


class StandInKind(TensorKind):
    """The contract's tensors on the stand-in GPU of each rank (rank r uses device r)."""

    def __init__(self, gpus: StandInGpus):
        self.gpus = gpus

    def tensor(self, array: np.ndarray, rank: int) -> StandInCupyArray:
        return self.gpus.array(array, device=rank)

    def array(self, tensor: StandInCupyArray) -> np.ndarray:
        return self.gpus.host(tensor)
