"""The adapter between the NCCL backend and CuPy: communicators, streams, events, device memory.

Everything the backend asks of the GPU goes through one :class:`NcclLibrary`, built from the
``cupy.cuda`` module and its ``nccl`` module. Nothing else in the backend touches CuPy, and
CuPy is imported only by :func:`load_library`, so ``import ray_collective`` works without it
and the tests can build the library from stand-ins that record every call.

Streams and events are raw CUDA handles from ``cupy.cuda.runtime`` rather than CuPy's
``Stream`` and ``Event`` objects: the backend owns their lifetime explicitly (``close`` destroys
them), and a launch costs a few Cython calls instead of Python object churn. A torch CUDA tensor
needs nothing of torch beyond its ``data_ptr()`` and torch's current stream handle; torch is
never imported here (a torch tensor implies torch is already loaded).
"""

from __future__ import annotations

import contextlib
import platform
import sys
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from ...errors import BackendNotAvailableError
from ...tensors import TensorView

INSTALL_HINT = ("install CuPy built for your CUDA version together with NCCL, for example "
                "`pip install cupy-cuda12x nvidia-nccl-cu12`")

_EVENT_NOT_READY = 600  # cudaErrorNotReady: cudaEventQuery on an event whose work still runs
_UNIQUE_ID_BYTES = 128

# A GPU tensor's device address, by its TensorView.kind.
ADDRESS_OF = {"cupy": lambda array: array.data.ptr, "torch": lambda tensor: tensor.data_ptr()}

# Before CuPy 14, Cython converted the unique id through C ``char``, whose signedness is the
# platform's: signed on x86, unsigned on ARM and POWER. Rank 0 and the other ranks may sit on
# different machines (and CuPy versions), so the id travels as plain bytes and each rank converts
# it to what its own CuPy takes.
_SIGNED_CHAR_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def _char_is_signed() -> bool:
    return platform.machine().lower() in _SIGNED_CHAR_MACHINES


def takes_id_as_bytes(cupy_version: str) -> bool:
    """Whether this CuPy's ``NcclCommunicator`` takes the unique id as bytes.

    CuPy 14 changed ``nccl.get_unique_id`` to return bytes and ``NcclCommunicator`` to accept
    only bytes; before, both used a tuple of 128 C ``char`` values.

    Args:
        cupy_version: ``cupy.__version__``.

    Returns:
        True from CuPy 14 on.
    """
    major = cupy_version.split(".", 1)[0]
    return major.isdigit() and int(major) >= 14


class NcclLibrary:
    """CuPy's CUDA runtime and NCCL, as the backend uses them.

    Args:
        cuda: the ``cupy.cuda`` module (or a stand-in with ``runtime``, ``alloc`` and
            ``get_current_stream``).
        nccl: the ``cupy.cuda.nccl`` module (or a stand-in).
        id_as_bytes: whether ``nccl.NcclCommunicator`` takes the unique id as bytes (CuPy 14
            and later) rather than as a tuple of C ``char`` values.

    Raises:
        Exception: whatever ``nccl.get_version()`` raises when the NCCL library cannot load.
    """

    def __init__(self, cuda: Any, nccl: Any, id_as_bytes: bool):
        self._cuda = cuda
        self._id_as_bytes = id_as_bytes
        self._runtime = cuda.runtime
        self._nccl = nccl
        self.version = int(nccl.get_version())
        self.nccl_error = nccl.NcclError
        self.cuda_error = cuda.runtime.CUDARuntimeError

    # ------------------------------------------------------------ devices

    def device_count(self) -> int:
        """Number of GPUs visible to this process.

        Returns:
            The count (``CUDA_VISIBLE_DEVICES`` applies; Ray sets it per actor).
        """
        return int(self._runtime.getDeviceCount())

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """Make ``device`` the calling thread's current GPU inside the ``with`` block.

        Args:
            device: the GPU index.

        Returns:
            A context manager that restores the previous device on exit.
        """
        previous = self._runtime.getDevice()
        if previous != device:
            self._runtime.setDevice(device)
        try:
            yield
        finally:
            if previous != device:
                self._runtime.setDevice(previous)

    def synchronize(self, device: int) -> None:
        """Block until all work queued on ``device`` has finished.

        Args:
            device: the GPU index.
        """
        with self.on_device(device):
            self._runtime.deviceSynchronize()

    # ------------------------------------------------------------ NCCL

    def constant(self, name: str) -> Optional[int]:
        """An NCCL enum value by its CuPy name (``"NCCL_FLOAT32"``), or None if CuPy lacks it.

        Args:
            name: the constant's name in ``cupy.cuda.nccl``.

        Returns:
            Its value, or None.
        """
        value = getattr(self._nccl, name, None)
        return None if value is None else int(value)

    def unique_id(self) -> bytes:
        """A fresh NCCL unique id, as 128 plain bytes (the form it travels in).

        Returns:
            The id.
        """
        return bytes(value & 0xFF for value in self._nccl.get_unique_id())

    def open_communicators(self, unique_id: bytes, nranks: int,
                           members: Sequence[Tuple[int, int]]) -> List[Any]:
        """Create this process's communicators of one NCCL clique; blocks until all have joined.

        Args:
            unique_id: the clique's id, from :meth:`unique_id` on its rank 0.
            nranks: the number of communicators in the clique, over every process.
            members: ``(device, nccl_rank)`` of each communicator this process owns.

        Returns:
            The communicators, in the order of ``members``.

        Raises:
            NcclError: NCCL could not create them.
            ValueError: ``unique_id`` does not have 128 bytes.
        """
        if len(unique_id) != _UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {_UNIQUE_ID_BYTES} bytes, not "
                             f"{len(unique_id)}")
        if self._id_as_bytes:
            comm_id: Any = bytes(unique_id)
        else:
            signed = _char_is_signed()
            comm_id = tuple(b - 256 if signed and b > 127 else b for b in unique_id)
        communicators = []
        # Several communicators created by one thread must be created inside one NCCL group:
        # each ncclCommInitRank would otherwise wait for the others, which are not started yet.
        grouped = len(members) > 1
        if grouped:
            self._nccl.groupStart()
        try:
            for device, nccl_rank in members:
                with self.on_device(device):
                    communicators.append(self._nccl.NcclCommunicator(nranks, comm_id,
                                                                     nccl_rank))
        finally:
            if grouped:
                self._nccl.groupEnd()
        return communicators

    def group_start(self) -> None:
        """Open an NCCL group: the calls until :meth:`group_end` are launched together."""
        self._nccl.groupStart()

    def group_end(self) -> None:
        """Close the NCCL group and launch its calls."""
        self._nccl.groupEnd()

    @staticmethod
    def check_async_error(communicator: Any) -> None:
        """Raise the asynchronous error NCCL recorded on ``communicator``, if any.

        Args:
            communicator: an NCCL communicator.

        Raises:
            NcclError: NCCL reported an error (a peer or the network failed).
        """
        communicator.check_async_error()

    @staticmethod
    def abort(communicator: Any) -> None:
        """Abort ``communicator``: stops its kernels without waiting for peers (never blocks
        on a dead peer, unlike destroy).

        Args:
            communicator: an NCCL communicator.
        """
        communicator.abort()

    @staticmethod
    def destroy(communicator: Any) -> None:
        """Destroy ``communicator`` after its work has completed (the orderly release).

        Args:
            communicator: an NCCL communicator.
        """
        communicator.destroy()

    # ------------------------------------------------------------ streams, events, memory

    def create_stream(self, device: int) -> int:
        """A new non-blocking CUDA stream on ``device``.

        Non-blocking: the legacy default stream does not serialize with it, so the only order
        between it and the caller's work is the one the backend sets with events.

        Args:
            device: the GPU index.

        Returns:
            The stream handle.
        """
        with self.on_device(device):
            return int(self._runtime.streamCreateWithFlags(self._runtime.streamNonBlocking))

    def destroy_stream(self, stream: int) -> None:
        """Release a stream made by :meth:`create_stream`.

        Args:
            stream: the stream handle.
        """
        self._runtime.streamDestroy(stream)

    def create_event(self, device: int) -> int:
        """A new CUDA event on ``device``, without timing (cheaper to record and query).

        Args:
            device: the GPU index.

        Returns:
            The event handle.
        """
        with self.on_device(device):
            return int(self._runtime.eventCreateWithFlags(self._runtime.eventDisableTiming))

    def destroy_event(self, event: int) -> None:
        """Release an event made by :meth:`create_event`.

        Args:
            event: the event handle.
        """
        self._runtime.eventDestroy(event)

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``: it completes when the work queued so far does.

        Args:
            event: the event handle.
            stream: the stream handle.
        """
        self._runtime.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for ``event`` (without blocking the host).

        Args:
            stream: the stream handle.
            event: the event handle.
        """
        self._runtime.streamWaitEvent(stream, event, 0)

    def done(self, event: int) -> bool:
        """Whether ``event`` has completed.

        Args:
            event: the event handle.

        Returns:
            True once the work it was recorded after has finished.

        Raises:
            CUDARuntimeError: the device reported an error (for example a failed kernel).
        """
        status = self._runtime.eventQuery(event)
        if status == 0:
            return True
        if status == _EVENT_NOT_READY:
            return False
        raise self.cuda_error(status)

    def allocate(self, device: int, nbytes: int) -> Any:
        """Scratch device memory from CuPy's memory pool.

        Args:
            device: the GPU index.
            nbytes: the size in bytes.

        Returns:
            The allocation (its address is ``.ptr``); the memory returns to the pool when the
            object is dropped.
        """
        with self.on_device(device):
            return self._cuda.alloc(nbytes)

    def copy(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """Queue a device-to-device copy on ``stream``.

        Args:
            destination: the destination address.
            source: the source address.
            nbytes: bytes to copy.
            stream: the stream handle.
        """
        self._runtime.memcpyAsync(destination, source, nbytes,
                                  self._runtime.memcpyDeviceToDevice, stream)

    # ------------------------------------------------------------ caller's tensors

    @staticmethod
    def pointer(view: TensorView) -> int:
        """The device address of a GPU tensor's first element.

        Args:
            view: a cupy or torch CUDA tensor's view.

        Returns:
            The address.
        """
        return int(ADDRESS_OF[view.kind](view.tensor))

    def caller_stream(self, kind: str, device: int) -> int:
        """The stream the calling thread queues its work on for ``device``.

        Args:
            kind: ``"cupy"`` or ``"torch"``: whose notion of the current stream applies.
            device: the GPU index.

        Returns:
            The stream handle (0 is the legacy default stream).
        """
        if kind == "torch":
            return int(sys.modules["torch"].cuda.current_stream(device).cuda_stream)
        return int(self._cuda.get_current_stream(device).ptr)


def load_library() -> NcclLibrary:
    """Import CuPy and its NCCL module and check that the NCCL library loads.

    Returns:
        The library.

    Raises:
        BackendNotAvailableError: CuPy or NCCL is missing or cannot load; the message says
            what to install.
    """
    try:
        import cupy
        from cupy import cuda
        from cupy.cuda import nccl
    except ImportError as err:
        raise BackendNotAvailableError(
            f"the 'nccl' backend is not available: it needs CuPy with NCCL, and importing it "
            f"failed ({err}); {INSTALL_HINT}") from err
    if not getattr(nccl, "available", False):
        raise BackendNotAvailableError(
            f"the 'nccl' backend is not available: this CuPy was built or installed without "
            f"NCCL; {INSTALL_HINT}")
    try:
        return NcclLibrary(cuda, nccl, takes_id_as_bytes(cupy.__version__))
    except Exception as err:  # CuPy raises several types when libnccl or the driver is absent
        raise BackendNotAvailableError(
            f"the 'nccl' backend is not available: the NCCL library did not load "
            f"({type(err).__name__}: {err}); {INSTALL_HINT}") from err
