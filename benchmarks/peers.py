"""The libraries the harness compares, each behind one small interface used inside a rank.

A peer lives in one rank's process: ``setup`` joins the group, ``operation`` binds one
collective to buffers made by ``make_buffers``, ``barrier`` aligns the ranks before a timed
call, and ``teardown`` leaves the group. Adding a library means one more subclass and one more
entry in ``PEERS``.

- ``ray``: this library (across nodes, its default transport there). ``ray-object-store``:
  the same with its object-store transport between nodes (``RAY_COLLECTIVE_CROSS_NODE``).
  ``gloo``: ``ray.util.collective`` with Gloo. All three get the same numpy arrays: Ray
  2.60's ``TorchGLOOGroup`` wraps them with ``torch.from_numpy`` (a zero-copy view, about half
  a microsecond per call), so Gloo is timed on the tensors a user would pass.
- ``torch``: ``torch.distributed``'s own Gloo process group in the same rank actors (what Ray
  Train sets up on CPU), on ``torch.from_numpy`` views of the same numpy buffers.
- ``ray-plain``: what a user writes without a collective library (``plain_ray``).
- ``mpi4py``: MPICH through mpi4py's buffer methods. MPI processes cannot live in Ray actors,
  so this peer runs in processes of its own under ``mpiexec`` (``mpi_job``, ``mpi_worker``).

A peer that cannot run a collective lists it in ``unsupported``; the harness gives those rows a
note instead of running them.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import socket
import types
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, FrozenSet, Iterator, List, Mapping, Optional

import numpy as np

from .collectives import message_layout

CROSS_NODE_VARIABLE = "RAY_COLLECTIVE_CROSS_NODE"
"""The environment variable that picks the ``ray`` backend's transport between nodes
(``streams``, the default, or ``object_store``), read in a member when its group is created."""

BROADCAST_ROOT = 0
"""The root rank of broadcast and reduce."""

BY_REFERENCE_BYTES = 100 * 1024
"""The ``ray-plain`` peer moves tensors at least this large as ObjectRefs (one ``ray.put``);
smaller ones travel inside the actor task's arguments and return values, as Ray inlines them."""


@dataclass(frozen=True)
class Buffers:
    """One rank's buffers for a point, reused by every iteration of it.

    Attributes:
        tensor: the single tensor (input and output of allreduce, broadcast, reduce; input of
            allgather; output of reducescatter); None for barrier.
        tensor_list: the list of parts (output of allgather and gather, input of
            reducescatter, scatter and alltoall); empty for the collectives that take no list.
        output_list: alltoall's output list; empty for every other collective.
    """

    tensor: Optional[Any]
    tensor_list: List[Any] = field(default_factory=list)
    output_list: List[Any] = field(default_factory=list)


class Peer(abc.ABC):
    """One collective library as a rank drives it; a fresh instance per rank and group."""

    name: ClassVar[str]
    """The backend name of the CLI's ``--backends``."""

    unsupported: ClassVar[FrozenSet[str]] = frozenset()
    """Collectives this library does not offer; their rows say so instead of running."""

    runs_in_mpiexec: ClassVar[bool] = False
    """True: the peer runs in ``mpiexec``'s processes, not in the rank actors."""

    needs_hub: ClassVar[bool] = False
    """True: the harness starts a central actor (``plain_ray.PlainRayHub``) for the group and
    hands it to ``setup`` as ``shared``."""

    needs_store_address: ClassVar[bool] = False
    """True: the driver picks a free TCP port on its node (``store_address``) for the group's
    rendezvous store and hands the ``tcp://host:port`` address to ``setup`` as ``shared``."""

    @abc.abstractmethod
    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """Join the group; returns once every rank has joined.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: a name no other group of this run uses.
            timeout_s: the longest any call of the group may wait.
            shared: what the driver made for the whole group: the central actor of a peer
                with ``needs_hub``, the store address of one with ``needs_store_address``,
                else None.

        Returns:
            Facts for the report's metadata (library versions), JSON-serializable.

        Raises:
            Exception: whatever the library raises when it cannot form the group.
        """

    @abc.abstractmethod
    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """A call that runs one blocking collective on ``buffers``, bound once per point.

        Binding ahead keeps argument handling of the harness out of the timed region.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments; it raises whatever the library raises.

        Raises:
            KeyError: a collective this peer does not run.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has called it.

        Raises:
            Exception: whatever the library raises.
        """

    @abc.abstractmethod
    def teardown(self) -> None:
        """Leave the group and release what this rank holds for it.

        Raises:
            Exception: whatever the library raises.
        """

    def make_tensor(self, count: int, dtype: np.dtype) -> Any:
        """A tensor of ``count`` elements this library accepts, its pages already touched.

        Args:
            count: number of elements.
            dtype: numpy dtype.

        Returns:
            A zero-filled numpy array; zeros keep sums finite and free of denormals however
            many iterations run.
        """
        tensor = np.empty(count, dtype=dtype)
        tensor.fill(0)
        return tensor

    def make_parts(self, parts: int, count: int, dtype: np.dtype) -> List[Any]:
        """A list of ``parts`` tensors of ``count`` elements (see ``make_tensor``).

        Args:
            parts: length of the list.
            count: elements per tensor.
            dtype: numpy dtype.

        Returns:
            Separate tensors, as the ``ray.util.collective`` API takes them.
        """
        return [self.make_tensor(count, dtype) for _ in range(parts)]


@contextlib.contextmanager
def cross_node_transport(value: Optional[str]) -> Iterator[None]:
    """``RAY_COLLECTIVE_CROSS_NODE`` set to ``value`` (None: unset) in this process for the
    ``with`` block, and as it was again after it.

    Args:
        value: the transport to ask for, or None for the library's default.

    Yields:
        Nothing.
    """
    before = os.environ.get(CROSS_NODE_VARIABLE)
    try:
        if value is None:
            os.environ.pop(CROSS_NODE_VARIABLE, None)
        else:
            os.environ[CROSS_NODE_VARIABLE] = value
        yield
    finally:
        if before is None:
            os.environ.pop(CROSS_NODE_VARIABLE, None)
        else:
            os.environ[CROSS_NODE_VARIABLE] = before


class CollectiveApiPeer(Peer):
    """A library with ``ray.util.collective``'s function names and argument order.

    Subclasses join in ``setup`` and record the group's name in ``_group_name``.
    """

    def __init__(self) -> None:
        self._group_name = ""
        self._rank = 0

    @abc.abstractmethod
    def module(self) -> Any:
        """The module whose free functions run the collectives (imported on first use).

        Returns:
            The module.
        """

    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """The module's free function for ``collective`` with its arguments bound.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments.

        Raises:
            KeyError: a collective this peer does not run.
        """
        if collective in self.unsupported:
            raise KeyError(f"{self.name} does not run {collective}")
        group = self._group_name
        module = self.module()
        if collective == "sendrecv":
            return functools.partial(round_trip, module.send, module.recv, buffers.tensor,
                                     self._rank, group)
        arguments = {
            "allreduce": (buffers.tensor, group),
            "reduce": (buffers.tensor, BROADCAST_ROOT, group),
            "broadcast": (buffers.tensor, BROADCAST_ROOT, group),
            "allgather": (buffers.tensor_list, buffers.tensor, group),
            "reducescatter": (buffers.tensor, buffers.tensor_list, group),
            "gather": (buffers.tensor_list, buffers.tensor, BROADCAST_ROOT, group),
            "scatter": (buffers.tensor, buffers.tensor_list, BROADCAST_ROOT, group),
            "alltoall": (buffers.output_list, buffers.tensor_list, group),
            "barrier": (group,),
        }
        return functools.partial(getattr(module, collective), *arguments[collective])

    def barrier(self) -> None:
        """Block on the library's own barrier.

        Raises:
            Exception: whatever the library raises.
        """
        self.module().barrier(self._group_name)

    def teardown(self) -> None:
        """Destroy this rank's membership of the group.

        Raises:
            Exception: whatever the library raises.
        """
        self.module().destroy_collective_group(self._group_name)


class RayCollectivePeer(CollectiveApiPeer):
    """This library, ``ray_collective``, with its native ``ray`` backend and its default
    transport between nodes."""

    name = "ray"

    cross_node: ClassVar[Optional[str]] = None
    """``RAY_COLLECTIVE_CROSS_NODE`` while the group is created (the library reads it then,
    once per group); None: the variable unset, so the group takes the library's default."""

    def module(self) -> Any:
        """``ray_collective``.

        Returns:
            The module.
        """
        import ray_collective
        return ray_collective

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """``init_collective_group(..., backend="ray", timeout=timeout_s)``.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: the group's name.
            timeout_s: the group's default deadline per call.
            shared: unused.

        Returns:
            ``{"ray_collective": version, "RAY_COLLECTIVE_CROSS_NODE": the transport asked
            for, or "default"}``.

        Raises:
            ray_collective.BackendNotAvailableError: the backend cannot run here.
            ray_collective.CollectiveError: the group could not be formed in time.
        """
        api = self.module()
        self._group_name, self._rank = group_name, rank
        with cross_node_transport(self.cross_node):
            api.init_collective_group(world_size, rank, backend="ray",
                                      group_name=self._group_name, timeout=timeout_s)
        return {"ray_collective": api.__version__,
                CROSS_NODE_VARIABLE: self.cross_node or "default"}


class RayObjectStorePeer(RayCollectivePeer):
    """This library with its object-store transport between nodes (post-office actors and
    Ray's object store), in the same rank actors as ``ray``: its group is created with
    ``RAY_COLLECTIVE_CROSS_NODE=object_store``. On one node it is ``ray`` under another name."""

    name = "ray-object-store"
    cross_node = "object_store"


class GlooPeer(CollectiveApiPeer):
    """``ray.util.collective`` with ``backend="gloo"`` (torch.distributed's Gloo)."""

    name = "gloo"
    unsupported = frozenset({"gather", "scatter", "alltoall"})

    def module(self) -> Any:
        """``ray.util.collective``; importing it with torch present registers Gloo.

        Returns:
            The module.
        """
        import ray.util.collective
        return ray.util.collective

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """``ray.util.collective.init_collective_group(..., backend="gloo")``.

        torch is imported here or by ``TorchPeer``, in the rank's process, and nowhere else in
        the harness. Ray's group makes torch's default process group when the process has
        none yet (else it uses the existing one), and runs on a subgroup of its own.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: the group's name.
            timeout_s: the rendezvous deadline (Ray's ``gloo_timeout``).
            shared: unused.

        Returns:
            ``{"torch": version}``.

        Raises:
            ImportError: torch is not installed (``pip install '.[bench]'``).
            RuntimeError: Gloo is not available, or the rendezvous failed.
        """
        import torch
        api = self.module()
        self._group_name, self._rank = group_name, rank
        api.init_collective_group(world_size, rank, backend="gloo",
                                  group_name=self._group_name,
                                  gloo_timeout=int(timeout_s * 1000))
        return {"torch": torch.__version__}


class TorchPeer(Peer):
    """``torch.distributed`` with a Gloo process group of its own, in the rank actors.

    What Ray Train sets up on CPU: ``init_process_group("gloo", init_method="tcp://...")``, rank
    0 serving the rendezvous store on the address the driver picked on its node
    (``store_address``). The buffers are ``torch.from_numpy`` views of the same zero-filled
    numpy arrays the other peers get, so it moves the same bytes. Gloo in torch 2.13 runs every
    collective of the harness natively, ``reduce_scatter`` and ``all_to_all`` included.
    """

    name = "torch"
    needs_store_address = True

    def __init__(self) -> None:
        self._group: Any = None
        self._owns_default_group = False
        self._rank = 0

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """``torch.distributed.init_process_group("gloo", init_method=shared, ...)``.

        If this process already has torch's default group (made by ``ray.util.collective``'s
        Gloo peer when it was set up first), the peer makes a Gloo group of its own with
        ``new_group`` instead, so the two never share one.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: unused (torch names its groups itself).
            timeout_s: the rendezvous deadline and the group's per-call deadline.
            shared: the store's ``tcp://host:port`` address (``store_address``).

        Returns:
            ``{"torch": version}``.

        Raises:
            ValueError: no address was given.
            RuntimeError: rank 0 runs on another node than the store's address, or the
                rendezvous failed.
            ImportError: torch is not installed (``pip install '.[bench]'``).
        """
        import datetime

        import torch
        import torch.distributed as dist
        if not shared:
            raise ValueError("the torch peer needs the store address the harness picks")
        if rank == 0:
            _check_store_host(shared)
        timeout = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=shared, world_size=world_size,
                                    rank=rank, timeout=timeout)
            self._group, self._owns_default_group = dist.group.WORLD, True
        self._rank = rank
        return {"torch": torch.__version__}

    def make_tensor(self, count: int, dtype: np.dtype) -> Any:
        """A zero-copy ``torch.from_numpy`` view of the zero-filled array the others get.

        Args:
            count: number of elements.
            dtype: numpy dtype.

        Returns:
            The tensor.
        """
        import torch
        return torch.from_numpy(super().make_tensor(count, dtype))

    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """The ``torch.distributed`` call for ``collective`` on this peer's group.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments.

        Raises:
            KeyError: an unknown collective.
        """
        import torch.distributed as dist
        group, tensor, parts = self._group, buffers.tensor, buffers.tensor_list
        root_parts = parts if self._rank == BROADCAST_ROOT else None
        if collective == "sendrecv":
            return functools.partial(round_trip, dist.send, dist.recv, tensor, self._rank, group)
        calls = {
            "allreduce": functools.partial(dist.all_reduce, tensor, group=group),
            "reduce": functools.partial(dist.reduce, tensor, BROADCAST_ROOT, group=group),
            "broadcast": functools.partial(dist.broadcast, tensor, BROADCAST_ROOT, group=group),
            "allgather": functools.partial(dist.all_gather, parts, tensor, group=group),
            "reducescatter": functools.partial(dist.reduce_scatter, tensor, parts, group=group),
            "gather": functools.partial(dist.gather, tensor, root_parts, BROADCAST_ROOT,
                                        group=group),
            "scatter": functools.partial(dist.scatter, tensor, root_parts, BROADCAST_ROOT,
                                         group=group),
            "alltoall": functools.partial(dist.all_to_all, buffers.output_list, parts,
                                          group=group),
            "barrier": self.barrier,
        }
        return calls[collective]

    def barrier(self) -> None:
        """``torch.distributed.barrier`` on this peer's group."""
        import torch.distributed as dist
        dist.barrier(group=self._group)

    def teardown(self) -> None:
        """Destroy this peer's group (the default group, and so every group, if it made it).

        The harness leaves groups in the reverse order of joining, so a ``gloo`` subgroup made
        on top of this default group is gone before it.
        """
        import torch.distributed as dist
        if self._owns_default_group:
            dist.destroy_process_group()
        elif self._group is not None:
            dist.destroy_process_group(self._group)
        self._group, self._owns_default_group = None, False


def store_address() -> str:
    """A ``tcp://host:port`` address for a rendezvous store on the driver's node.

    The host is this node's IP as Ray knows it (``ray.util.get_node_ip_address``); the port is
    one the kernel just handed out as free there, released again for the group's rank 0 to
    listen on.

    Returns:
        The address.
    """
    import ray
    host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"


def _check_store_host(address: str) -> None:
    """Raise unless this process runs on the node of ``address``, where rank 0 must listen."""
    import ray
    host, here = urllib.parse.urlsplit(address).hostname, ray.util.get_node_ip_address()
    if host != here:
        raise RuntimeError(f"the torch peer's rank 0 runs on node {here}, but its store "
                           f"address {address} is on the driver's node {host}: run the "
                           f"benchmark's driver on the node that hosts rank 0")


class Mpi4pyPeer(Peer):
    """MPICH through mpi4py's buffer methods (``Allreduce``, ``Bcast``, ...) on numpy arrays.

    Runs in the processes of an ``mpiexec`` job (``mpi_worker``), never in a Ray actor. Lists
    of parts are rows of one contiguous array, the layout an MPI user passes.
    """

    name = "mpi4py"
    runs_in_mpiexec = True

    def __init__(self) -> None:
        self._communicator: Any = None
        self._rank = 0

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """Use ``MPI.COMM_WORLD`` of the job, which ``mpiexec`` formed already.

        Args:
            world_size: number of ranks; must be the job's size.
            rank: this rank; must be the process's MPI rank.
            group_name: unused (the job is the group).
            timeout_s: unused: MPI has no per-call deadline; the driver kills the job instead.
            shared: unused.

        Returns:
            ``{"mpi4py": version, "mpi": the MPI library's version line}``.

        Raises:
            RuntimeError: the job's size or rank differ from the ones asked for.
        """
        import mpi4py
        from mpi4py import MPI
        communicator = MPI.COMM_WORLD
        if (communicator.Get_size(), communicator.Get_rank()) != (world_size, rank):
            raise RuntimeError(f"mpiexec made rank {communicator.Get_rank()} of "
                               f"{communicator.Get_size()}, not {rank} of {world_size}")
        self._communicator, self._rank = communicator, rank
        return {"mpi4py": mpi4py.__version__,
                "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split())}

    def make_parts(self, parts: int, count: int, dtype: np.dtype) -> List[Any]:
        """The rows of one zero-filled ``parts`` x ``count`` array (MPI takes one buffer).

        Args:
            parts: length of the list.
            count: elements per part.
            dtype: numpy dtype.

        Returns:
            The rows; ``_block`` gets the array back from them.
        """
        block = np.empty((parts, count), dtype=dtype)
        block.fill(0)
        return list(block)

    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """The mpi4py buffer call for ``collective``, in place where MPI allows.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments.

        Raises:
            KeyError: an unknown collective.
        """
        from mpi4py import MPI
        comm, tensor, is_root = self._communicator, buffers.tensor, self._rank == BROADCAST_ROOT
        parts = _block(buffers.tensor_list)
        if collective == "sendrecv":
            return functools.partial(round_trip, comm.Send, comm.Recv, tensor, self._rank)
        calls = {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, tensor),
            "reduce": (lambda: comm.Reduce(MPI.IN_PLACE, tensor, root=BROADCAST_ROOT))
            if is_root else (lambda: comm.Reduce(tensor, None, root=BROADCAST_ROOT)),
            "broadcast": lambda: comm.Bcast(tensor, root=BROADCAST_ROOT),
            "allgather": lambda: comm.Allgather(tensor, parts),
            "reducescatter": lambda: comm.Reduce_scatter_block(parts, tensor),
            "gather": lambda: comm.Gather(tensor, parts if is_root else None,
                                          root=BROADCAST_ROOT),
            "scatter": lambda: comm.Scatter(parts if is_root else None, tensor,
                                            root=BROADCAST_ROOT),
            "alltoall": lambda: comm.Alltoall(parts, _block(buffers.output_list)),
            "barrier": comm.Barrier,
        }
        return calls[collective]

    def barrier(self) -> None:
        """``MPI.COMM_WORLD.Barrier()``."""
        self._communicator.Barrier()

    def teardown(self) -> None:
        """Nothing to leave: the job ends when the driver stops it."""
        self._communicator = None


def _block(parts: List[Any]) -> Optional[np.ndarray]:
    """The contiguous array whose rows ``Mpi4pyPeer.make_parts`` returned (None for no list)."""
    if not parts:
        return None
    block = parts[0].base
    if block is None or block.shape[0] != len(parts):
        raise ValueError("MPI parts must be rows of one array (Mpi4pyPeer.make_parts)")
    return block


def round_trip(send: Callable, recv: Callable, tensor: Any, rank: int, *group: Any) -> None:
    """One send/recv round trip: rank 0 sends to rank 1, which sends it back; others idle.

    Args:
        send: ``send(tensor, peer, *group)``.
        recv: ``recv(tensor, peer, *group)``.
        tensor: sent and received in place.
        rank: this rank.
        *group: trailing arguments of the library's calls (its group name), if any.
    """
    if rank == 0:
        send(tensor, 1, *group)
        recv(tensor, 1, *group)
    elif rank == 1:
        recv(tensor, 0, *group)
        send(tensor, 0, *group)


class PlainRayPeer(Peer):
    """What a user writes without a collective library: one central actor does the work.

    Each call is one actor task to the group's hub (``plain_ray.PlainRayHub``, started by the
    harness) and a ``ray.get`` of its answer, copied into this rank's buffers so the call is in
    place like the libraries'. The hub answers once every rank has called.

    - Reductions (allreduce, reduce, reducescatter): the tensor is the task's argument (Ray
      puts one over 100 KiB into the object store itself); the hub sums with numpy — the way
      Ray's compiled-graph CPU communicator works — and puts a large result into the store
      once for every rank to read.
    - Data movement (broadcast, allgather, gather, scatter, alltoall, send/recv): a rank
      ``ray.put``s each large tensor itself and the hub only routes the ObjectRefs, so the
      payload is written into the store once and read by its receivers without a copy.
    """

    name = "ray-plain"
    needs_hub = True

    def __init__(self) -> None:
        self._hub: Any = None
        self._rank = 0
        self._sequence = 0
        self._timeout_s = 0.0

    def setup(self, world_size: int, rank: int, group_name: str, timeout_s: float,
              shared: Any = None) -> dict:
        """Keep the hub's handle; one barrier through it so every rank has arrived.

        Args:
            world_size: number of ranks.
            rank: this rank.
            group_name: unused (the hub is the group).
            timeout_s: deadline of every ``ray.get`` on the hub.
            shared: the group's ``PlainRayHub`` actor.

        Returns:
            ``{"ray": version}``.

        Raises:
            ValueError: no hub was given.
            ray.exceptions.GetTimeoutError: the other ranks did not arrive in time.
        """
        import ray
        if shared is None:
            raise ValueError("the ray-plain peer needs the hub actor the harness starts")
        self._hub, self._rank, self._timeout_s = shared, rank, timeout_s
        self.barrier()
        return {"ray": ray.__version__}

    def _exchange(self, collective: str, contribution: Any) -> Any:
        """Hand ``contribution`` to the hub and return this rank's answer, references read."""
        import ray
        self._sequence += 1
        return self._resolve(ray.get(self._hub.exchange.remote(
            collective, self._sequence, self._rank, contribution), timeout=self._timeout_s))

    def _resolve(self, answer: Any) -> Any:
        """``answer`` with its ObjectRefs (itself, or items of a list) replaced by their values."""
        import ray
        if isinstance(answer, ray.ObjectRef):
            answer = ray.get(answer, timeout=self._timeout_s)
        if isinstance(answer, list):
            positions = [index for index, item in enumerate(answer)
                         if isinstance(item, ray.ObjectRef)]
            if positions:
                values = ray.get([answer[index] for index in positions], timeout=self._timeout_s)
                answer = list(answer)
                for index, value in zip(positions, values):
                    answer[index] = value
        return answer

    def _items(self, tensors: List[Any]) -> List[Any]:
        """``tensors`` as the hub routes them: large ones ``ray.put`` once, by this rank."""
        import ray
        return [ray.put(tensor) if tensor.nbytes >= BY_REFERENCE_BYTES else tensor
                for tensor in tensors]

    def operation(self, collective: str, buffers: Buffers) -> Callable[[], Any]:
        """The hub exchange for ``collective``, copying the answer into ``buffers``.

        Args:
            collective: a name of ``collectives.COLLECTIVES``.
            buffers: from ``make_buffers``.

        Returns:
            A callable taking no arguments.

        Raises:
            KeyError: an unknown collective.
        """
        tensor, parts, is_root = buffers.tensor, buffers.tensor_list, self._rank == BROADCAST_ROOT

        def into_tensor(contribution: Any) -> None:
            answer = self._exchange(collective, contribution)
            if answer is not None:
                np.copyto(tensor, answer)

        def into_list(target: List[Any], contribution: Any) -> None:
            answer = self._exchange(collective, contribution)
            if answer is not None:
                for part, value in zip(target, answer):
                    np.copyto(part, value)

        calls = {
            "allreduce": lambda: into_tensor(tensor),
            "reduce": lambda: into_tensor(tensor),
            "reducescatter": lambda: into_tensor(parts),
            "broadcast": lambda: into_list([tensor], self._items([tensor]) if is_root else None),
            "allgather": lambda: into_list(parts, self._items([tensor])),
            "gather": lambda: into_list(parts, self._items([tensor])),
            "scatter": lambda: into_list([tensor], self._items(parts) if is_root else None),
            "alltoall": lambda: into_list(buffers.output_list, self._items(parts)),
            "barrier": self.barrier,
            "sendrecv": lambda: round_trip(self._post, self._take, tensor, self._rank),
        }
        return calls[collective]

    def _post(self, tensor: Any, destination: int) -> None:
        """Leave ``tensor`` in the hub's mailbox from this rank to ``destination``."""
        import ray
        ray.get(self._hub.post.remote(self._rank, destination, self._items([tensor])),
                timeout=self._timeout_s)

    def _take(self, tensor: Any, source: int) -> None:
        """Wait for the next message from ``source`` in the hub's mailbox; copy it in."""
        import ray
        answer = ray.get(self._hub.take.remote(source, self._rank), timeout=self._timeout_s)
        np.copyto(tensor, self._resolve(answer)[0])

    def barrier(self) -> None:
        """An exchange of nothing through the hub.

        Raises:
            ray.exceptions.GetTimeoutError: the other ranks did not arrive in time.
        """
        self._exchange("barrier", None)

    def teardown(self) -> None:
        """Drop the hub's handle (the harness kills the hub)."""
        self._hub = None


PEERS: Mapping[str, type] = types.MappingProxyType(
    {peer.name: peer
     for peer in (RayCollectivePeer, RayObjectStorePeer, TorchPeer, GlooPeer, PlainRayPeer,
                  Mpi4pyPeer)})
"""Every backend the CLI can measure, by name (read-only), in the default table order."""


def make_buffers(peer: Peer, collective: str, requested_bytes: int, world_size: int,
                 dtype: np.dtype) -> Buffers:
    """The buffers one rank of ``peer`` needs for a point, laid out by ``message_layout``.

    Args:
        peer: the library whose tensors to make.
        collective: a name of ``collectives.COLLECTIVES``.
        requested_bytes: the size asked for.
        world_size: number of ranks.
        dtype: numpy dtype.

    Returns:
        The buffers.

    Raises:
        KeyError: an unknown collective.
    """
    layout = message_layout(collective, requested_bytes, world_size, dtype.itemsize)
    if layout.nbytes == 0:
        return Buffers(tensor=None)
    tensor = peer.make_tensor(layout.elements_per_tensor, dtype)
    lists = [peer.make_parts(layout.list_length, layout.elements_per_tensor, dtype)
             for _ in range(layout.list_count)]
    return Buffers(tensor=tensor, tensor_list=lists[0] if lists else [],
                   output_list=lists[1] if len(lists) > 1 else [])
