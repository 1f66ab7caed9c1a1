"""The part of CuPy's own API that weight sync's GPU path uses (``ray_collective.weight_sync.gpu``),
modelled over the NCCL stand-in's GPUs (``support.nccl_standin``), as ``StandInGpus.cuda`` models
what the nccl backend uses of ``cupy.cuda``.

What it adds to that model, no kinder than CuPy where weight sync could tell:

- ``ndarray(shape, dtype, memptr)``: a stand-in cupy array over existing device memory, which
  must lie inside one live allocation (``cuda.UnownedMemory`` and ``cuda.MemoryPointer`` carry the
  address as CuPy's do);
- ``cuda.ExternalStream(ptr, device_id)``: a stream made current for the calling thread inside a
  ``with`` block, as the nccl backend then reads it (``cuda.get_current_stream``);
- ``cuda.runtime.memcpyAsync`` with the host-to-device and device-to-host kinds besides the
  device-to-device one: the copy is a task of its stream, done only when the host looks (an
  event query), so a result read before waiting for it is not there yet;
- slow copies: a copy completes only at the host's second look after it reached the head of
  its stream, so that work on another stream that does not wait for it (an NCCL broadcast of
  a staging buffer not yet packed) runs first and reads what is not there yet;
- :func:`races`: the log read as a GPU would order it (each stream in order, a wait on an event
  ordering after what its record followed), naming every pair of accesses to the same device
  memory, one of them a write, that nothing orders. Every allocation is kept while the
  stand-in lives, so that an address names one allocation in the log.
"""

from __future__ import annotations

import ctypes
import types
from typing import Dict, List

import numpy as np

from support.nccl_standin import StandInCupyArray, StandInGpus
from support.nccl_standin_moves import DATATYPE_DTYPES

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2


class _UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int):
        self.ptr, self.size, self.owner, self.device = int(ptr), int(size), owner, device_id


class _MemoryPointer:
    def __init__(self, memory, offset: int):
        self.mem = memory
        self.ptr = memory.ptr + offset
        self.device = memory.device


def _host_bytes(address: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), np.uint8)


def standin_cupy(gpus: StandInGpus):
    """The CuPy module weight sync's GPU path sees, over ``gpus``."""
    base = gpus.cuda.runtime

    def memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        assert kind in (HOST_TO_DEVICE, DEVICE_TO_HOST, base.memcpyDeviceToDevice), kind
        gpus._record("memcpyAsync", dst, src, size, stream, kind)
        device = gpus.stream_device(stream)
        looks = [0]

        def step():
            looks[0] += 1
            if looks[0] < 2:
                return False
            if kind == HOST_TO_DEVICE:
                gpus.device_memory.at(dst, size, device)[...] = _host_bytes(src, size)
            elif kind == DEVICE_TO_HOST:
                _host_bytes(dst, size)[...] = gpus.device_memory.at(src, size, device)
            else:
                memory = gpus.device_memory
                memory.at(dst, size, device)[...] = memory.at(src, size, device)
            return True
        gpus.queue(stream, step, "copy")

    kept = []
    allocate = gpus.cuda.alloc

    def alloc(nbytes: int):
        allocation = allocate(nbytes)
        kept.append(allocation)
        return allocation
    gpus.cuda.alloc = alloc       # the nccl backend's scratch too

    runtime = types.SimpleNamespace(**vars(base))
    runtime.memcpyAsync = memcpy_async

    class ExternalStream:
        def __init__(self, ptr: int, device_id: int):
            self.ptr, self.device_id = int(ptr), device_id
            assert gpus.stream_device(self.ptr) == device_id, "stream of another device"

        def __enter__(self):
            self._previous = gpus.cuda.get_current_stream(self.device_id).ptr
            gpus.use_stream(self.device_id, self.ptr)
            return self

        def __exit__(self, *exc):
            gpus.use_stream(self.device_id, self._previous)
            return False

    def ndarray(shape, dtype, memptr):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        host = gpus.device_memory.at(memptr.ptr, nbytes, memptr.device)
        return StandInCupyArray(host.view(dtype).reshape(shape), memptr.device, memptr)

    cuda = types.SimpleNamespace(runtime=runtime, alloc=alloc,
                                 get_current_stream=gpus.cuda.get_current_stream,
                                 ExternalStream=ExternalStream, UnownedMemory=_UnownedMemory,
                                 MemoryPointer=_MemoryPointer)
    return types.SimpleNamespace(cuda=cuda, ndarray=ndarray, uint8=np.uint8)


def races(gpus: StandInGpus) -> List[str]:
    """Accesses to the same device memory, one a write, that no stream order or event wait
    orders, in the order of ``gpus.log`` (device copies, NCCL broadcasts and allgathers).

    Returns:
        One line per race (empty when every conflicting pair is ordered).
    """
    clocks: Dict[int, Dict[int, int]] = {}
    events: Dict[int, Dict[int, int]] = {}
    accesses: List[tuple] = []
    found: List[str] = []

    def access(address: int, nbytes: int, write: bool, stream: int, what: str) -> None:
        if nbytes <= 0:
            return
        clock = clocks.setdefault(stream, {})
        clock[stream] = index = clock.get(stream, -1) + 1
        for low, high, wrote, other, at, did in accesses:
            if low < address + nbytes and address < high and (wrote or write) and \
                    clock.get(other, -1) < at:
                found.append(f"{what} on stream {stream} is not ordered after {did} on "
                             f"stream {other}")
        accesses.append((address, address + nbytes, write, stream, index, what))

    for entry in gpus.log:
        name = entry[1]
        if name == "eventRecord":
            event, stream = entry[2], entry[3]
            events[event] = dict(clocks.get(stream, {}))
        elif name == "streamWaitEvent":
            clock = clocks.setdefault(entry[2], {})
            for stream, index in events.get(entry[3], {}).items():
                clock[stream] = max(clock.get(stream, -1), index)
        elif name == "memcpyAsync":
            dst, src, size, stream = entry[2:6]
            kind = entry[6] if len(entry) > 6 else 3
            if kind != HOST_TO_DEVICE:
                access(src, size, False, stream, f"a copy from {src:#x}")
            if kind != DEVICE_TO_HOST:
                access(dst, size, True, stream, f"a copy into {dst:#x}")
        elif name in ("broadcast", "allGather"):
            rank, stream, args = entry[2], entry[3], entry[4]
            nbytes = args["count"] * np.dtype(DATATYPE_DTYPES[args["datatype"]]).itemsize
            access(args["sendbuf"], nbytes, False, stream, f"rank {rank}'s {name}")
            if name == "allGather" or args.get("root") != rank:
                access(args["recvbuf"], nbytes, True, stream, f"rank {rank}'s {name}")
    return found
