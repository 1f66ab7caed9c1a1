"""A member's buckets in GPU memory: the weight sync's path on the ``nccl`` backend.

The same steps as on the CPU (``transfer``), with every byte kept on the member's GPU:

- **The caller's tensors** (CuPy arrays, torch CUDA tensors) are read as device addresses; a
  bucket that is one piece of one tensor is broadcast from and into that memory, through a
  CuPy array over it (no copy).
- **Fused buckets** are packed and unpacked by device-to-device copies (``cudaMemcpyAsync``) on
  two streams of this library's own, one per staging buffer: packing bucket k+1 on one stream
  overlaps the broadcast of bucket k, and a staging buffer is reused only once its last
  broadcast is done (its stream waits for it). Nothing passes through host memory.
- **Order.** The nccl backend starts a collective after the work queued on the caller's current
  stream; each broadcast is submitted with its staging buffer's stream current, so it starts
  after its packing. At the start of a sync both streams wait for the caller's stream (the
  training step that wrote the weights); at the end the caller's stream waits for both (the
  inference that reads them), and the host waits until everything is done, so that a blocking
  call returns with the bytes in place, as the backend's blocking collectives do.
- **Control words** (the agreement's headers and descriptions, the bucket flags: bytes to a few
  KiB) travel as small device buffers through the same nccl groups' collectives, copied from
  and to host memory on the first stream: one mechanism, one deadline and one failure
  behaviour for every byte of a sync, and no second backend beside nccl.

The GPU is reached through CuPy only (the nccl backend needs it anyway), given as the module:
CuPy itself by default, the NCCL stand-in's model of it in the tests.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import api
from ..errors import BackendNotAvailableError, CollectiveError
from ..tensors import as_view

STAGING_SLOTS = 2
"""Staging buffers (and streams) per data group: a bucket packed while the last is in flight."""
_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2          # cudaMemcpyKind
_EVENT_NOT_READY = 600                           # cudaErrorNotReady
_POLL_S = 50e-6


@dataclass(frozen=True)
class DeviceBytes:
    """``nbytes`` bytes of GPU memory at ``address``; ``owner`` keeps that memory alive."""

    address: int
    nbytes: int
    owner: Any

    def part(self, offset: int, nbytes: int) -> "DeviceBytes":
        """Bytes ``[offset, offset + nbytes)`` of these."""
        return DeviceBytes(self.address + offset, nbytes, self.owner)


def load_cupy() -> Any:
    """The CuPy module.

    Raises:
        BackendNotAvailableError: CuPy is not installed.
    """
    try:
        import cupy
    except ImportError as err:
        raise BackendNotAvailableError(
            f"a weight sync on the 'nccl' backend moves GPU memory through CuPy, and importing "
            f"it failed ({err}); install CuPy built for your CUDA version") from err
    return cupy


class GpuMemory:
    """One member's GPU as weight sync uses it: streams, events, copies, arrays over memory.

    Args:
        cupy: the CuPy module (or the stand-in's model of it).
        device: the GPU the member's tensors live on.
        kind: ``"cupy"`` or ``"torch"``: whose current stream the caller's work is on.
    """

    def __init__(self, cupy: Any, device: int, kind: str):
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self.device = device
        self.kind = kind
        self._events: List[int] = []
        self._streams: List[int] = []
        with self.on_device():
            self.streams = tuple(self._new_stream() for _ in range(STAGING_SLOTS))
            self._marks = tuple(self._new_event() for _ in range(STAGING_SLOTS + 1))

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """This GPU as the calling thread's current device inside the block."""
        previous = self._runtime.getDevice()
        if previous != self.device:
            self._runtime.setDevice(self.device)
        try:
            yield
        finally:
            if previous != self.device:
                self._runtime.setDevice(previous)

    def _new_stream(self) -> int:
        stream = int(self._runtime.streamCreateWithFlags(self._runtime.streamNonBlocking))
        self._streams.append(stream)
        return stream

    def _new_event(self) -> int:
        event = int(self._runtime.eventCreateWithFlags(self._runtime.eventDisableTiming))
        self._events.append(event)
        return event

    def close(self) -> None:
        """Release the streams and events (after :meth:`wait_all`)."""
        for event in self._events:
            self._runtime.eventDestroy(event)
        for stream in self._streams:
            self._runtime.streamDestroy(stream)
        self._events, self._streams = [], []

    # ------------------------------------------------------------ order with the caller

    def caller_stream(self) -> int:
        """The stream the calling thread queues its work on for this GPU."""
        if self.kind == "torch":
            return int(sys.modules["torch"].cuda.current_stream(self.device).cuda_stream)
        return int(self._cupy.cuda.get_current_stream(self.device).ptr)

    def after_caller(self, caller: int) -> None:
        """Make both streams wait for the work queued on ``caller`` so far."""
        mark = self._marks[STAGING_SLOTS]
        self._runtime.eventRecord(mark, caller)
        for stream in self.streams:
            self._runtime.streamWaitEvent(stream, mark, 0)

    def before_caller(self, caller: int) -> None:
        """Make ``caller`` wait for everything queued on both streams so far."""
        for stream, mark in zip(self.streams, self._marks):
            self._runtime.eventRecord(mark, stream)
            self._runtime.streamWaitEvent(caller, mark, 0)

    def wait_all(self, deadline: float, what: str) -> None:
        """Block until everything queued on both streams is done.

        Raises:
            CollectiveError: not done by ``deadline`` (``time.monotonic()``), or the GPU failed.
        """
        for stream, mark in zip(self.streams, self._marks):
            self._runtime.eventRecord(mark, stream)
        for mark in self._marks[:STAGING_SLOTS]:
            while True:
                status = self._runtime.eventQuery(mark)
                if status == 0:
                    break
                if status != _EVENT_NOT_READY:
                    raise CollectiveError(f"{what}: the GPU cuda:{self.device} reported CUDA "
                                          f"error {status}")
                if time.monotonic() > deadline:
                    raise CollectiveError(f"{what}: the copies on cuda:{self.device} did not "
                                          f"finish before the deadline")
                time.sleep(_POLL_S)

    @contextmanager
    def current(self, slot: int) -> Iterator[None]:
        """Stream ``slot`` as CuPy's current stream inside the block: a collective submitted
        there starts after the work queued on it."""
        with self.on_device(), self._cupy.cuda.ExternalStream(self.streams[slot], self.device):
            yield

    # ------------------------------------------------------------ memory

    def array(self, memory: DeviceBytes) -> Any:
        """A CuPy uint8 array over ``memory`` (no copy)."""
        cuda = self._cupy.cuda
        unowned = cuda.UnownedMemory(memory.address, memory.nbytes, memory.owner, self.device)
        return self._cupy.ndarray((memory.nbytes,), self._cupy.uint8,
                                  cuda.MemoryPointer(unowned, 0))

    def allocate(self, nbytes: int) -> DeviceBytes:
        """``nbytes`` of device memory from CuPy's pool."""
        with self.on_device():
            pointer = self._cupy.cuda.alloc(nbytes)
        return DeviceBytes(int(pointer.ptr), nbytes, pointer)

    def copy(self, destination: DeviceBytes, source: DeviceBytes, slot: int) -> None:
        """Queue a device-to-device copy of ``source`` into ``destination`` on stream
        ``slot``."""
        if source.nbytes:
            self._runtime.memcpyAsync(destination.address, source.address, source.nbytes,
                                      self._runtime.memcpyDeviceToDevice, self.streams[slot])

    def upload(self, host: np.ndarray, deadline: float) -> DeviceBytes:
        """A device copy of the small host array ``host``, done when this returns."""
        memory = self.allocate(max(host.nbytes, 1))
        if host.nbytes:
            self._runtime.memcpyAsync(memory.address, host.ctypes.data, host.nbytes,
                                      _HOST_TO_DEVICE, self.streams[0])
        self.wait_all(deadline, "copying control words to the GPU")
        return memory.part(0, host.nbytes)

    def download(self, memory: DeviceBytes, out: np.ndarray, deadline: float) -> np.ndarray:
        """``memory`` read into the host array ``out`` (of its size), once done."""
        if memory.nbytes:
            self._runtime.memcpyAsync(out.ctypes.data, memory.address, memory.nbytes,
                                      _DEVICE_TO_HOST, self.streams[0])
        self.wait_all(deadline, "copying control words from the GPU")
        return out


class GpuStaging:
    """The staging buffers of one data group on the GPU: made on first use at the largest
    fused bucket's size, buffer ``slot`` packed and unpacked on stream ``slot``."""

    def __init__(self, memory: GpuMemory, nbytes: int):
        self._memory = memory
        self._nbytes = nbytes
        self._buffers: List[Optional[DeviceBytes]] = [None] * STAGING_SLOTS

    def buffer(self, slot: int, nbytes: int) -> DeviceBytes:
        """Staging buffer ``slot``, its first ``nbytes``."""
        if self._buffers[slot] is None:
            self._buffers[slot] = self._memory.allocate(self._nbytes)
        return self._buffers[slot].part(0, nbytes)

    def pack(self, slot: int, views: Sequence[DeviceBytes], payload: DeviceBytes) -> None:
        """Queue the copies of ``views`` into ``payload``, in order, on stream ``slot``."""
        offset = 0
        for view in views:
            self._memory.copy(payload.part(offset, view.nbytes), view, slot)
            offset += view.nbytes

    def unpack(self, slot: int, views: Sequence[DeviceBytes], payload: DeviceBytes) -> None:
        """Queue the copies of ``payload`` back into ``views`` on stream ``slot``."""
        offset = 0
        for view in views:
            self._memory.copy(view, payload.part(offset, view.nbytes), slot)
            offset += view.nbytes


class GpuBuckets:
    """Where a member's buckets live on the ``nccl`` backend, for one group: the same
    interface as ``transfer.HostBuckets``, on :class:`GpuMemory`."""

    def __init__(self, memory: GpuMemory):
        self._memory = memory

    @staticmethod
    def views(plan, bucket, bytes_of: Dict[str, DeviceBytes]) -> List[DeviceBytes]:
        """The caller's memory of each segment of ``bucket``."""
        return [bytes_of[plan.tensors[s.tensor].name].part(s.offset, s.nbytes)
                for s in bucket.segments]

    def tensor(self, memory: DeviceBytes) -> Any:
        """What a collective takes for ``memory``: a CuPy array over it."""
        return self._memory.array(memory)

    def staging(self, nbytes: int) -> GpuStaging:
        """A data group's two staging buffers of ``nbytes`` each, on the GPU."""
        return GpuStaging(self._memory, nbytes)

    def issuing(self, slot: int):
        """Stream ``slot`` current: the broadcast starts after that buffer's copies."""
        return self._memory.current(slot)

    def finish(self, timeout: Optional[float]) -> None:
        """Wait until the copies queued by this sync are done."""
        self._memory.wait_all(_deadline(timeout), "unpacking the buckets")

    def allgather(self, words: np.ndarray, group: str, world: int, timeout: Optional[float]
                  ) -> np.ndarray:
        """Every member's ``words`` (one row per rank of ``group``), through device buffers."""
        deadline = _deadline(timeout)
        mine = self.tensor(self._memory.upload(words, deadline))
        rows = [self.tensor(self._memory.allocate(words.nbytes)) for _ in range(world)]
        with self.issuing(0):
            api.allgather(rows, mine, group, timeout=timeout)
        out = np.empty((world,) + words.shape, words.dtype)
        for row, target in zip(rows, out):
            self._memory.download(DeviceBytes(int(row.data.ptr), words.nbytes, row), target,
                                  deadline)
        return out

    def broadcast_words(self, words: np.ndarray, group: str, timeout: Optional[float]
                        ) -> np.ndarray:
        """Rank 0's ``words`` of ``group`` in every rank's ``words``, through a device
        buffer."""
        deadline = _deadline(timeout)
        memory = self._memory.upload(words, deadline)
        with self.issuing(0):
            api.broadcast(self.tensor(memory), 0, group, timeout=timeout)
        return self._memory.download(memory, words, deadline)


class MemberGpus:
    """A member's GPU side on the nccl backend: a :class:`GpuMemory` (streams of its own) per
    group it is in, on the GPU its tensors are on.

    Args:
        cupy: the CuPy module, or None to import it on first use.
        groups: the member's groups.
    """

    def __init__(self, cupy: Any, groups: Sequence[str]):
        self._cupy = cupy
        self._groups = tuple(groups)
        self._memories: Dict[Tuple[str, int, str], GpuMemory] = {}
        self._last_device: Optional[int] = None

    def where(self, state_dict: Any) -> Optional[Tuple[int, str]]:
        """``(device, kind)`` of the first GPU tensor of ``state_dict``, or None."""
        if not hasattr(state_dict, "values"):
            return None
        for tensor in state_dict.values():
            try:
                view = as_view(tensor, writable=False)
            except Exception:  # bad input: refused in the agreement, on every member
                continue
            if view.device.startswith("cuda:"):
                self._last_device = int(view.device.split(":", 1)[1])
                return self._last_device, view.kind
        return None

    def _memory(self, group: str, device: int, kind: str) -> GpuMemory:
        key = (group, device, kind)
        if key not in self._memories:
            if self._cupy is None:
                self._cupy = load_cupy()
            self._memories[key] = GpuMemory(self._cupy, device, kind)
        return self._memories[key]

    def buckets(self, group: str, where: Optional[Tuple[int, str]]) -> GpuBuckets:
        """Where the buckets and control words of ``group`` live this sync. With no GPU
        tensor (bad input, refused after the agreement), the GPU of this member's last sync,
        or the current CUDA device."""
        if where is None:
            device = self._last_device
            if device is None:
                device = int((self._cupy or load_cupy()).cuda.runtime.getDevice())
            where = (device, "cupy")
        return GpuBuckets(self._memory(group, *where))

    def caller_stream(self, where: Tuple[int, str]) -> int:
        """The calling thread's current stream on that GPU, of that tensor kind."""
        return self._memory(self._groups[0], *where).caller_stream()

    def after_caller(self, where: Tuple[int, str], caller: int) -> None:
        """Every group's streams wait for the work queued on ``caller`` so far."""
        for group in self._groups:
            self._memory(group, *where).after_caller(caller)

    def before_caller(self, where: Tuple[int, str], caller: int) -> None:
        """``caller`` waits for everything queued on every group's streams so far."""
        for group in self._groups:
            self._memory(group, *where).before_caller(caller)

    def close(self) -> None:
        """Release every stream and event."""
        for memory in self._memories.values():
            memory.close()
        self._memories = {}


def _deadline(timeout: Optional[float]) -> float:
    return time.monotonic() + (timeout if timeout is not None else 1800.0)


def device_bytes_of(views: Dict[str, Any]) -> Dict[str, DeviceBytes]:
    """Each GPU tensor view's memory, by name (``views``: name to ``TensorView``)."""
    from ..backends.nccl import NcclLibrary
    return {name: DeviceBytes(NcclLibrary.pointer(view), view.count * view.wire_dtype.itemsize,
                              view.tensor)
            for name, view in views.items()}
