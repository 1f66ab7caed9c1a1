"""A recording stand-in for ``cupy.cuda`` and ``cupy.cuda.nccl``, for testing the NCCL backend
without a GPU.

It is not a GPU and claims no GPU coverage: it is the smallest model of CUDA streams, events and
NCCL communicators that lets the backend's own logic run and be checked — which calls it makes,
in which order, on which stream and device, with which NCCL datatype, count, op, root and peer —
and that executes the data movement the calls describe on host memory, so results can be
compared with numpy.

The model:

- "Device memory" is host memory (numpy buffers) tagged with a device; every address the
  backend passes is checked to lie inside one allocation.
- A stream is a FIFO of tasks that complete in order: event markers, waits on events, device
  copies, and NCCL work. An event completes when the tasks queued before its record have.
- NCCL calls of one communicator match across ranks in issue order (collectives by their
  index, send/recv per peer pair); a call completes once every party has reached it on its
  stream, and only then is its data moved. Calls issued inside ``groupStart/groupEnd`` on one
  stream form one task, as NCCL launches them together.
- Communicator creation blocks until the whole clique has constructed (outside a group) or
  until ``groupEnd``, like ``ncclCommInitRank``.
- Failures can be injected: an asynchronous NCCL error, an error returned by a launch, a CUDA
  error on events, launches that block (as a blocking communicator does while it connects to
  an absent peer), and caller work that holds a stream until released.

Every call is appended to ``StandInGpus.log`` as ``(thread name, call name, details...)``.
"""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ray_collective.backends.nccl import NcclLibrary

NCCL_CONSTANTS = dict(
    NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, NCCL_AVG=4,
    NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4, NCCL_UINT64=5,
    NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_BFLOAT16=9,
)
DATATYPE_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64,
                   5: np.uint64, 6: np.float16, 7: np.float32, 8: np.float64, 9: np.uint16}
NOT_READY = 600
INIT_WAIT_S = 5.0


class StandInNcclError(RuntimeError):
    """Stands for ``cupy.cuda.nccl.NcclError``."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"stand-in NCCL error {status}")


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
        gpus._register(self)


class _Communicator:
    """Stands for ``cupy.cuda.nccl.NcclCommunicator``."""

    def __init__(self, gpus: "StandInGpus", ndev: int, commId: tuple, rank: int):
        gpus._record("NcclCommunicator", ndev, rank)
        if gpus.char_signed:
            assert all(-128 <= v <= 127 for v in commId), "unique id not in signed char range"
        else:
            assert all(0 <= v <= 255 for v in commId), "unique id not in unsigned char range"
        assert len(commId) == 128
        self._gpus = gpus
        self.uid = tuple(commId)
        self.nranks = ndev
        self.rank = rank
        self.device = gpus._current_device()
        self.aborted = False
        self.destroyed = False
        self.async_error = 0
        self.collectives_issued = 0
        self.sends_issued: Dict[int, int] = {}
        self.recvs_issued: Dict[int, int] = {}
        gpus._join_clique(self)

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
        self._gpus._issue(self, kind, stream, key, args)

    # lifetime and errors
    def abort(self):
        self._gpus._abort(self)

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
        without: NCCL constants this CuPy lacks.
    """

    def __init__(self, device_count: int = 4, version: int = 22105, char_signed: bool = True,
                 without: Sequence[str] = ()):
        self.device_count = device_count
        self.version = version
        self.char_signed = char_signed
        self.log: List[tuple] = []
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._ids = itertools.count(1000)
        self._allocations: Dict[int, weakref.ref] = {}
        self._streams: Dict[int, dict] = {}
        self._events: Dict[int, dict] = {}
        self._cliques: Dict[tuple, Dict[int, _Communicator]] = {}
        self._matches: Dict[tuple, Dict[str, _Op]] = {}
        self._local = threading.local()
        self.block_launches = False
        self.launch_error = 0
        self.event_error = 0
        self.default_streams = {d: self._new_stream(d, 0) for d in range(device_count)}
        self.cuda = self._cuda_module()
        self.nccl = self._nccl_module(without)

    def library(self) -> NcclLibrary:
        """The backend's adapter over these stand-ins."""
        return NcclLibrary(self.cuda, self.nccl)

    # ------------------------------------------------------------ tensors

    def array(self, values, device: int = 0, dtype=None) -> StandInCupyArray:
        """A stand-in cupy array on ``device`` holding ``values``."""
        values = np.asarray(values, dtype=dtype)
        allocation = _Allocation(self, device, values.nbytes)
        host = allocation.buffer[:values.nbytes].view(values.dtype).reshape(values.shape)
        host[...] = values
        return StandInCupyArray(host, device, allocation)

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
                self._pump()
        return release

    def fail_communicators(self, status: int) -> None:
        """Make every communicator report asynchronous NCCL error ``status``."""
        with self.lock:
            for clique in self._cliques.values():
                for communicator in clique.values():
                    communicator.async_error = status

    def calls(self, name: str) -> List[tuple]:
        """The logged calls named ``name``."""
        return [entry for entry in self.log if entry[1] == name]

    def live_streams(self) -> List[int]:
        """Streams created and not destroyed (the callers' default streams excluded)."""
        return [s for s, state in self._streams.items()
                if not state["destroyed"] and s not in self.default_streams.values()]

    def live_events(self) -> List[int]:
        """Events created and not destroyed."""
        return [e for e, state in self._events.items() if not state["destroyed"]]

    def communicators(self) -> List[_Communicator]:
        """Every communicator created."""
        return [c for clique in self._cliques.values() for c in clique.values()]

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

    def _nccl_module(self, without: Sequence[str]):
        module = types.SimpleNamespace(
            available=True,
            NcclError=StandInNcclError,
            get_version=lambda: self.version,
            get_unique_id=self._unique_id,
            groupStart=self._group_start,
            groupEnd=self._group_end,
            NcclCommunicator=lambda ndev, commId, rank: _Communicator(self, ndev, commId, rank),
        )
        for name, value in NCCL_CONSTANTS.items():
            if name not in without:
                setattr(module, name, value)
        return module

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

    def _current_device(self) -> int:
        return self._thread_state().device

    def _set_device(self, device: int) -> None:
        assert 0 <= device < self.device_count, f"no device {device}"
        self._thread_state().device = device

    # ------------------------------------------------------------ memory

    def _register(self, allocation: _Allocation) -> None:
        with self.lock:
            self._allocations[allocation.ptr] = weakref.ref(allocation)

    def memory(self, ptr: int, nbytes: int, device: Optional[int] = None) -> np.ndarray:
        """The bytes at ``[ptr, ptr + nbytes)``, which must lie in one live allocation."""
        with self.lock:
            for base, ref in self._allocations.items():
                allocation = ref()
                if allocation is not None and base <= ptr and ptr + nbytes <= base + max(
                        allocation.nbytes, 1):
                    assert device is None or allocation.device == device, (
                        f"address on device {allocation.device} used on device {device}")
                    return allocation.buffer[ptr - base:ptr - base + nbytes]
        raise AssertionError(f"address {ptr:#x} (+{nbytes}) is not in a live allocation")

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

    def _event_record(self, event: int, stream: int) -> None:
        self._record("eventRecord", event, stream)
        with self.lock:
            state = self._live_event(event)
            stream_state = self._live_stream(stream)
            assert state["device"] == stream_state["device"], (
                "event and stream on different devices")
            marker = state["marker"] = _Marker()

            def step():
                marker.done = True
                return True
            stream_state["tasks"].append(_Task(step, "marker"))
            self._pump()

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
            self._live_stream(stream)["tasks"].append(
                _Task(lambda: marker is None or marker.done, "wait"))
            self._pump()

    def _memcpy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._record("memcpyAsync", dst, src, size, stream)
        assert kind == 3, "only device-to-device copies are expected"
        with self.lock:
            device = self._live_stream(stream)["device"]

            def step():
                self.memory(dst, size, device)[...] = self.memory(src, size, device)
                return True
            self._streams[stream]["tasks"].append(_Task(step, "copy"))
            self._pump()

    def _device_synchronize(self) -> None:
        self._record("deviceSynchronize", self._current_device())
        with self.lock:
            self._pump()
            busy = [s for s, state in self._streams.items()
                    if state["device"] == self._current_device() and state["tasks"]]
            assert not busy, "deviceSynchronize would hang: streams with pending work"

    def _pump(self) -> None:
        """Complete every task that can complete, until nothing moves."""
        progress = True
        while progress:
            progress = False
            for state in self._streams.values():
                while state["tasks"] and state["tasks"][0].step():
                    state["tasks"].pop(0)
                    progress = True
        self.changed.notify_all()

    # ------------------------------------------------------------ NCCL

    def _unique_id(self) -> tuple:
        self._record("get_unique_id")
        raw = np.random.default_rng().integers(0, 256, 128, dtype=np.uint8)
        return tuple(int(v) for v in (raw.view(np.int8) if self.char_signed else raw))

    def _join_clique(self, communicator: _Communicator) -> None:
        with self.lock:
            clique = self._cliques.setdefault(communicator.uid, {})
            assert communicator.rank not in clique, "two communicators with one NCCL rank"
            clique[communicator.rank] = communicator
            self.changed.notify_all()
        state = self._thread_state()
        if state.group_depth:
            state.grouped_inits.append(communicator)
        else:
            self._wait_for_clique(communicator)

    def _wait_for_clique(self, communicator: _Communicator) -> None:
        with self.lock:
            complete = self.changed.wait_for(
                lambda: len(self._cliques[communicator.uid]) >= communicator.nranks,
                INIT_WAIT_S)
        if not complete:
            raise StandInNcclError(2)

    def _group_start(self) -> None:
        self._record("groupStart")
        self._thread_state().group_depth += 1

    def _group_end(self) -> None:
        self._record("groupEnd")
        state = self._thread_state()
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
        with self.lock:
            for stream, batch in by_stream.items():
                self._enqueue(stream, batch)

    def _block_if_asked(self, communicators: Sequence[_Communicator]) -> None:
        if not self.block_launches or not communicators:
            return
        self._record("blocked launch")
        with self.lock:
            self.changed.wait_for(lambda: any(c.aborted for c in communicators), INIT_WAIT_S)
        raise StandInNcclError(3)

    def _issue(self, communicator: _Communicator, kind: str, stream: int, key: tuple,
               args: dict) -> None:
        self._record(kind, communicator.rank, stream, dict(args))
        if self.launch_error:
            raise StandInNcclError(self.launch_error)
        assert not communicator.aborted and not communicator.destroyed, "call on a dead comm"
        with self.lock:
            assert self._live_stream(stream)["device"] == communicator.device, (
                "NCCL call on a stream of another device")
        op = _Op(communicator, kind, stream, (communicator.uid,) + key, args)
        state = self._thread_state()
        if state.group_depth:
            state.grouped_ops.append(op)
            return
        self._block_if_asked([communicator])
        with self.lock:
            self._enqueue(stream, [op])

    def _enqueue(self, stream: int, batch: List[_Op]) -> None:
        def step():
            for op in batch:
                if not op.posted:
                    op.posted = True
                    self._post(op)
            return all(op.done for op in batch)
        self._live_stream(stream)["tasks"].append(_Task(step, "nccl"))
        self._pump()

    def _abort(self, communicator: _Communicator) -> None:
        self._record("abort", communicator.rank)
        with self.lock:
            communicator.aborted = True
            # Aborting stops the communicator's kernels: its pending work ends.
            for parties in self._matches.values():
                for op in parties.values():
                    if op.communicator is communicator:
                        op.done = True
            self._pump()

    def _post(self, op: _Op) -> None:
        if op.kind in ("send", "recv"):
            parties = self._matches.setdefault(op.key, {})
            parties[op.kind] = op
            if len(parties) == 2:
                self._move_p2p(parties["send"], parties["recv"])
            return
        parties = self._matches.setdefault(op.key, {})
        parties[op.communicator.rank] = op
        if len(parties) == op.communicator.nranks:
            self._run_collective([parties[r] for r in range(op.communicator.nranks)])

    def _typed(self, op: _Op, ptr: int, count: int) -> np.ndarray:
        dtype = np.dtype(DATATYPE_DTYPES[op.args["datatype"]])
        return self.memory(ptr, count * dtype.itemsize, op.communicator.device).view(dtype)

    def _move_p2p(self, send: _Op, recv: _Op) -> None:
        assert (send.args["count"], send.args["datatype"]) == (
            recv.args["count"], recv.args["datatype"]), f"mismatch: {send.args} {recv.args}"
        self._typed(recv, recv.args["buf"], recv.args["count"])[...] = self._typed(
            send, send.args["buf"], send.args["count"])
        send.done = recv.done = True

    def _run_collective(self, ops: List[_Op]) -> None:
        first = ops[0]
        for op in ops:
            for field in ("count", "datatype", "op", "root"):
                assert op.args.get(field) == first.args.get(field), (
                    f"{first.kind} mismatch in {field}: {op.args} vs {first.args}")
            assert op.kind == first.kind, f"{op.kind} matched with {first.kind}"
        n, count, kind = len(ops), first.args["count"], first.kind
        if kind in ("allReduce", "reduce"):
            result = _reduce([self._typed(op, op.args["sendbuf"], count).copy() for op in ops],
                             first.args["op"])
            targets = ops if kind == "allReduce" else [ops[first.args["root"]]]
            for op in targets:
                self._typed(op, op.args["recvbuf"], count)[...] = result
        elif kind == "broadcast":
            data = self._typed(ops[first.args["root"]], ops[first.args["root"]].args["sendbuf"],
                               count).copy()
            for op in ops:
                self._typed(op, op.args["recvbuf"], count)[...] = data
        elif kind == "allGather":
            parts = [self._typed(op, op.args["sendbuf"], count).copy() for op in ops]
            for op in ops:
                self._typed(op, op.args["recvbuf"], count * n)[...] = np.concatenate(parts)
        else:  # reduceScatter
            inputs = [self._typed(op, op.args["sendbuf"], count * n).copy() for op in ops]
            for r, op in enumerate(ops):
                self._typed(op, op.args["recvbuf"], count)[...] = _reduce(
                    [x[r * count:(r + 1) * count] for x in inputs], first.args["op"])
        for op in ops:
            op.done = True


def _reduce(arrays: List[np.ndarray], op: int) -> np.ndarray:
    stacked = np.stack(arrays)
    if op == NCCL_CONSTANTS["NCCL_AVG"]:
        total = np.add.reduce(stacked, axis=0, dtype=stacked.dtype)
        if stacked.dtype.kind in "iu":
            return (np.sign(total) * (np.abs(total.astype(object)) // len(arrays))).astype(
                stacked.dtype)
        return (total / len(arrays)).astype(stacked.dtype)
    ufunc = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}[op]
    return ufunc.reduce(stacked, axis=0, dtype=stacked.dtype)
