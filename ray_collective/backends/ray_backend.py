"""The ``ray`` backend: joins a rank to a group over Ray and runs it on the Ray transport.

Joining (``RayBackendFactory.create``), inside each member process:

1. find the incarnation's token and the group's private directory on this node (made and
   checked by ``backends.private_dirs``: ``/dev/shm/ray_collective-<uid>/...``, mode 0700),
   and listen on ``<rank>.sock`` there;
2. register in Ray's key-value store and wait for every rank (``backends.rendezvous``);
3. if the group spans nodes: with streams (``RAY_COLLECTIVE_CROSS_NODE=streams``, the
   default), listen on the node's address for streams from other nodes and publish where;
   and the lowest rank of each node starts that node's post office
   (``backends.post_office``), the only process the library adds. With streams it carries no
   message, only what must reach a node's state page from another node (an abort, which
   ranks are dead or stalled); with ``object_store`` it carries the messages too.

Leaving (``close``) removes this rank's socket; the last member on a node removes the node's
directory and post office, the last member of the group its keys. A group declared from the
driver is joined by running the same code inside each actor (``ray_collective.declared``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..algorithms.selector import forced_algorithms
from ..errors import ArgumentValueError, BackendNotAvailableError, error_record
from ..transport import tcp, uds
from ..transport.node_state import NodeState
from ..transport.engine import SPIN_S
from ..transport.link_transport import LinkTransport, Peer
from ..transport.post_office_carrier import PostOffices
from ..transport.processes import process_alive
from ..transport.stream_carrier import Streams
from . import private_dirs, rendezvous
from .key_value import NAMESPACE
from .base import BackendFactory, Declaration, Membership
from .post_office import POST_OFFICE_PID_FILE, PostOffice, pack_round
from .transport_membership import TransportMembership

_LOG = logging.getLogger(__name__)

CROSS_NODE_VARIABLE = "RAY_COLLECTIVE_CROSS_NODE"
STREAMS, OBJECT_STORE = "streams", "object_store"
CROSS_NODE_TRANSPORTS = (STREAMS, OBJECT_STORE)


def cross_node_transport(group_name: str, rank: int) -> str:
    """The transport between nodes this rank asks for: ``RAY_COLLECTIVE_CROSS_NODE``
    (``streams`` when unset), or ``object_store`` where Ray runs with TLS.

    The streams do not speak TLS: where Ray encrypts its own traffic (``RAY_USE_TLS``), a
    group's messages between nodes keep to Ray's channels (the object store), with a warning.

    Raises:
        ArgumentValueError: the variable names no transport.
    """
    value = os.environ.get(CROSS_NODE_VARIABLE, "").strip() or STREAMS
    if value not in CROSS_NODE_TRANSPORTS:
        raise ArgumentValueError(
            f"group '{group_name}', rank {rank}: {CROSS_NODE_VARIABLE}={value!r} names no "
            f"transport between nodes; use 'streams' (direct TCP streams, the default) or "
            f"'object_store' (Ray actor tasks and its object store)")
    if value == STREAMS and os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        _LOG.warning("group '%s', rank %d: Ray runs with TLS (RAY_USE_TLS) and the streams "
                     "between nodes do not; this group's messages between nodes go through "
                     "Ray's object store instead", group_name, rank)
        return OBJECT_STORE
    return value


def _ray():
    import ray
    return ray


def _runtime() -> Tuple[str, str, str]:
    """(job id, node id, session directory) of this process."""
    ray = _ray()
    if not ray.is_initialized():
        raise BackendNotAvailableError(
            "the 'ray' backend needs Ray: call ray.init() first (inside actors and tasks Ray "
            "is already initialized)")
    context = ray.get_runtime_context()
    try:
        from ray._private.worker import global_worker
        session = global_worker.node.get_session_dir_path()
    except AttributeError:
        session = tempfile.gettempdir()
    return context.get_job_id(), context.get_node_id(), session


def _finished_jobs() -> set:
    """Ids of the jobs of this Ray cluster that have finished (empty if Ray cannot say)."""
    # Through the process's own connection to Ray's control store: ray._private.state's
    # job_table() opens a second one in a worker (an eventfd, an epoll and a timer
    # descriptor, kept for the life of the process).
    try:
        from ray._private.worker import global_worker
        jobs = global_worker.gcs_client.get_all_job_info()
        return {job_id.hex() for job_id, job in jobs.items() if job.is_dead}
    except Exception:  # noqa: BLE001 - a private API of Ray: without it, nothing is swept
        return set()


def sweep_finished_jobs(session_dir: str) -> None:
    """Remove the keys and this machine's group directories of jobs that have finished.

    Members that die with their job (a driver that exits without destroying its groups) never
    leave; whoever opens the next incarnation of any group cleans up after them.
    """
    finished = _finished_jobs()
    if not finished:
        return
    rendezvous.sweep_finished_jobs(rendezvous.KeyValue(), finished)
    private_dirs.remove_finished_groups(session_dir, finished)


POST_OFFICE_NAME_PREFIX = "post-office-"
"""How the Ray actor names of post offices begin (in the namespace ``key_value.NAMESPACE``)."""


def post_office_name(group_key: bytes, node: str) -> str:
    """The Ray actor name of a group's post office on ``node``."""
    return f"{POST_OFFICE_NAME_PREFIX}{group_key.hex()}-{node[:16]}"


POST_OFFICE_LOOKUP_S = 10.0
"""How long a rank looks for another node's post office by name before it counts it as gone."""


class RayPostOffices(PostOffices):
    """Reaches the other nodes of a group through their post office actors, and reads the
    failure published for the whole group with ``read_abort`` (the incarnation's broken mark
    in Ray's key-value store)."""

    def __init__(self, group_key: bytes, node: str, other_nodes: Sequence[str],
                 deadline_s: float, directory: str,
                 read_abort: Callable[[], Optional[dict]]):
        self.group_key = group_key
        self._read_abort = read_abort
        self.node = node
        self.other_nodes = tuple(other_nodes)
        self.deadline_s = deadline_s
        self._pid_file = os.path.join(directory, POST_OFFICE_PID_FILE)
        self._local_pid: Optional[int] = None
        self._local_seen = False
        self._local_lookup_until = time.monotonic() + POST_OFFICE_LOOKUP_S
        self._next_local_lookup = 0.0
        self._handles: Dict[str, object] = {}
        self._gone: set = set()

    def _handle(self, node: str):
        """The post office of ``node``; None once it is known to be gone.

        Its creator starts it right after joining, so its name may be missing for a moment
        after the group forms; a name missing ``POST_OFFICE_LOOKUP_S`` after that is a post
        office that died.
        """
        if node in self._gone:
            return None
        handle = self._handles.get(node)
        if handle is None:
            ray = _ray()
            deadline = min(self._local_lookup_until, time.monotonic() + self.deadline_s)
            while handle is None:
                try:
                    handle = ray.get_actor(post_office_name(self.group_key, node),
                                           namespace=NAMESPACE)
                except ValueError:
                    if time.monotonic() > deadline:
                        self._gone.add(node)
                        return None
                    time.sleep(0.01)
            self._handles[node] = handle
        return handle

    def deliver(self, node, messages) -> None:
        handle = self._handle(node)
        if handle is not None:  # else the receivers' wait finds the post office gone
            messages, parts = pack_round(messages)
            handle.deliver.remote(messages, *parts)

    def _ask(self, node: str, method: str, *args):
        """The post office's answer; None when it is dead, [] when it does not answer soon."""
        ray = _ray()
        handle = self._handle(node)
        if handle is None:
            return None
        try:
            return ray.get(getattr(handle, method).remote(*args), timeout=10)
        except ray.exceptions.RayActorError:
            self._gone.add(node)
            return None
        except ray.exceptions.GetTimeoutError:
            return []

    def dead_ranks(self, node, ranks) -> Optional[List[int]]:
        return self._ask(node, "dead_ranks", ranks)

    def local_post_office_alive(self) -> bool:
        if self._local_pid is None:
            try:
                with open(self._pid_file) as source:
                    self._local_pid = int(source.read())
            except (OSError, ValueError):
                return self._local_name_alive()
        return process_alive(self._local_pid)

    def _local_name_alive(self) -> bool:
        """Before the post office has written its pid (it may have died first): whether its
        name is registered, asked at most once a second. A name once seen and then gone, or
        never seen within ``POST_OFFICE_LOOKUP_S`` of joining, is a dead post office."""
        now = time.monotonic()
        if now < self._next_local_lookup:
            return True
        self._next_local_lookup = now + 1.0
        try:
            _ray().get_actor(post_office_name(self.group_key, self.node), namespace=NAMESPACE)
        except ValueError:
            return not self._local_seen and now < self._local_lookup_until
        self._local_seen = True
        return True

    def responsive(self, node, ranks, seq) -> List[int]:
        return self._ask(node, "responsive", ranks, seq) or []

    def published_abort(self) -> Optional[dict]:
        try:
            return self._read_abort()
        except Exception:  # noqa: BLE001 - a store gone with the job, or a mark not ours
            return None

    def abort(self, record) -> None:
        # Finding the post offices asks Ray's control store, which took up to a second on the
        # loaded test cluster; the rank that aborts raises its error without waiting for that
        # (its streams have carried the abort already). Measured: the survivors of a killed
        # rank raised 1.4-3.6 s after the kill with this done inline.
        threading.Thread(target=self._abort_other_nodes, args=(record,), daemon=True,
                         name="ray_collective-abort").start()

    def _abort_other_nodes(self, record) -> None:
        for node in self.other_nodes:
            try:
                handle = self._handle(node)
                if handle is not None:  # else that node's ranks find their post office gone
                    handle.abort.remote(record)
            except Exception:  # noqa: BLE001 - Ray may be shutting down with the job
                return


def _ranks_over_cores(members: Sequence[rendezvous.Member]) -> Dict[str, bool]:
    """For every node, whether its machine runs more ranks of the group than it has cores (the
    same answer on every rank, since it comes from the shared membership).

    A machine is the Ray nodes at one address: the nodes of a ``ray.cluster_utils.Cluster``
    share the cores of the host they all run on, and counting each node's ranks alone would
    let ranks spin on cores their peers on the other nodes need (4 nodes x 2 ranks on 2
    cores: allreduce 8 B 1.5 ms counted by address, 1.9-2.0 ms by node).
    """
    machine_of = {member.node: member.host or member.node for member in members}
    ranks: Dict[str, int] = {}
    cores: Dict[str, int] = {}
    for member in members:
        machine = machine_of[member.node]
        ranks[machine] = ranks.get(machine, 0) + 1
        cores[machine] = max(cores.get(machine, 0), member.cores)
    return {node: ranks[machine] > cores[machine] for node, machine in machine_of.items()}


def _oversubscribed(members: Sequence[rendezvous.Member]) -> bool:
    """Whether some machine runs more ranks of the group than it has cores."""
    return any(_ranks_over_cores(members).values())


class RayMembership(TransportMembership):
    """A rank's membership of a ``ray`` group: the transport plus what leaving must undo."""

    def __init__(self, group_name: str, transport: LinkTransport, token: str, prefix: str,
                 directory: str, members: Sequence[rendezvous.Member],
                 post_office: Optional[object], forced: Mapping[str, str]):
        super().__init__(group_name, transport, epoch=int(token[:15], 16),
                         node_of=[m.node for m in members],
                         oversubscribed=_oversubscribed(members), forced=forced)
        self.token = token
        self.prefix = prefix
        self.directory = directory
        self.members = tuple(members)
        # Held, never called: a post office lives as long as its creator holds a handle to it.
        self.post_office = post_office

    def abort(self, error: BaseException) -> None:
        super().abort(error)
        # A rank that comes to rebuild the group must not mistake this incarnation for a live
        # one: a member that died here never leaves it.
        try:
            rendezvous.mark_broken(rendezvous.KeyValue(), self.prefix, self.token,
                                   error_record(self.group_name, self.rank, error))
        except Exception:  # noqa: BLE001 - the store may be gone with the job; the abort stands
            pass

    def close(self) -> None:
        transport = self.transport
        node = transport.node
        # Only a broken group can hold members that will never leave; looking for them costs
        # a /proc read per node-mate, which every rank of a healthy 400-rank group would pay.
        broken = transport.state.aborted() is not None
        super().close()
        try:
            os.unlink(os.path.join(self.directory, f"{self.rank}.sock"))
        except FileNotFoundError:
            pass
        dead_here = [m.rank for m in self.members
                     if m.node == node and m.rank != self.rank and not process_alive(m.pid)
                     ] if broken else []
        gone = rendezvous.leave(rendezvous.KeyValue(), self.prefix, self.token, self.rank,
                                self.world_size, dead_here)
        if {m.rank for m in self.members if m.node == node} <= gone:
            _shut_post_office(transport.group_key, node)
            shutil.rmtree(self.directory, ignore_errors=True)
            root = os.path.dirname(self.directory)
            try:
                # Unless another node's directory of the group is still there (same machine).
                if set(os.listdir(root)) <= {private_dirs.JOB_FILE}:
                    shutil.rmtree(root, ignore_errors=True)
            except OSError:
                pass


def _shut_post_office(group_key: bytes, node: str) -> None:
    ray = _ray()
    try:
        handle = ray.get_actor(post_office_name(group_key, node), namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(handle.shutdown.remote(), timeout=10)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass
    ray.kill(handle)


class RayBackendFactory(BackendFactory):
    """Joins ranks to ``ray`` groups.

    Args:
        token: the incarnation to join (set by the driver for declared groups); None lets rank
            0 open a new incarnation and the others follow it.
    """

    name = "ray"

    def __init__(self, token: Optional[str] = None):
        self.token = token

    def available(self) -> bool:
        return hasattr(os, "memfd_create")

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> Membership:
        if not self.available():
            raise BackendNotAvailableError(
                f"group '{group_name}', rank {rank}: the 'ray' backend needs Linux (memfd and "
                f"Unix sockets with descriptor passing)")
        forced = forced_algorithms()
        cross_node = cross_node_transport(group_name, rank)
        job_id, node, session = _runtime()
        kv = rendezvous.KeyValue()
        prefix = rendezvous.group_prefix(job_id, group_name)
        token = self.token
        if token is None and rank == 0:
            sweep_finished_jobs(session)
            token = rendezvous.open_incarnation(kv, prefix)
        endpoint: Dict[str, object] = {}

        def listen_under(current: str) -> None:
            if "listener" in endpoint:
                endpoint["listener"].close()
            directory = private_dirs.node_directory(session, job_id, group_name, current, node,
                                                    rank)
            path = os.path.join(directory, f"{rank}.sock")
            if os.path.exists(path):
                os.unlink(path)
            endpoint.update(directory=directory, listener=uds.listen(path, world_size + 16))

        me = rendezvous.Member(rank, node, os.getpid(), len(os.sched_getaffinity(0)),
                               cross_node, _ray().util.get_node_ip_address())
        try:
            token, members = rendezvous.join(kv, prefix, group_name, world_size, me, timeout,
                                             listen_under, token)
        except BaseException:
            if "listener" in endpoint:
                endpoint["listener"].close()
            raise
        directory = endpoint["directory"]
        group_key = bytes.fromhex(token)
        peers = [Peer(m.node, m.pid, os.path.join(directory, f"{m.rank}.sock"))
                 for m in members]
        state = NodeState(directory, group_name, world_size)
        nodes = {m.node for m in members}
        post_offices, post_office, streams = None, None, None
        if len(nodes) > 1:
            # Every member must agree, and each asked for what it can do: one asking for the
            # object store (by choice, or for TLS) takes the whole group there.
            if all(m.cross_node == STREAMS for m in members):
                streams = _listen_for_streams(kv, prefix, token, rank, me.host, world_size,
                                              timeout)
            post_offices = RayPostOffices(
                group_key, node, sorted(nodes - {node}), timeout, directory,
                functools.partial(rendezvous.broken_by, kv, prefix, token))
            local = {m.rank: m.pid for m in members if m.node == node}
            if rank == min(local):
                post_office = _start_post_office(directory, group_name, group_key, world_size,
                                                 node, local, timeout)
        # Polling without sleep answers small messages fastest, but only a rank with a core of
        # its own may do it: on a crowded machine it would take the core a peer needs.
        spin_s = 0.0 if _ranks_over_cores(members)[node] else SPIN_S
        transport = LinkTransport(rank, group_name, group_key, peers, endpoint["listener"],
                                  state, post_offices, connect_timeout=timeout, spin_s=spin_s,
                                  streams=streams)
        return RayMembership(group_name, transport, token, prefix, directory, members,
                             post_office, forced)

    def prepare_declaration(self, group_name: str) -> Declaration:
        # The driver opens the incarnation, so that the members join the same one whatever
        # their order, and removes it after them whatever they did.
        job_id, _, session = _runtime()
        sweep_finished_jobs(session)
        token = rendezvous.open_incarnation(rendezvous.KeyValue(),
                                            rendezvous.group_prefix(job_id, group_name))
        return Declaration(RayBackendFactory(token),
                           functools.partial(_remove_incarnation, group_name, token))


def _listen_for_streams(kv: rendezvous.KeyValue, prefix: str, token: str, rank: int,
                        host: str, world_size: int, timeout: float) -> Streams:
    """Listen on ``host`` (this node's address as Ray knows it), publish where, and return the
    way to the other members' listeners (read from the store on a rank's first connection to
    them)."""
    listener = tcp.listen(host, world_size + 16)
    try:
        rendezvous.publish_stream_endpoint(kv, prefix, token, rank, host,
                                           listener.getsockname()[1])
    except BaseException:
        listener.close()
        raise
    known: Dict[int, Tuple[str, int]] = {}

    def address(peer: int) -> Tuple[str, int]:
        if peer not in known:
            known.update(rendezvous.wait_for_stream_endpoint(kv, prefix, token, peer, timeout))
        return known[peer]

    return Streams(listener, address)


def _start_post_office(directory: str, group_name: str, group_key: bytes, world_size: int,
                       node: str, local_pids: Dict[int, int], timeout: float):
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(PostOffice).options(
        name=post_office_name(group_key, node), namespace=NAMESPACE, num_cpus=0,
        max_concurrency=1, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    return actor.remote(directory, group_name, group_key, world_size, local_pids, timeout)


# ------------------------------------------------------------- declared from the driver

def _remove_incarnation(group_name: str, token: str) -> None:
    """Remove what a group leaves outside its members: keys, post offices, this node's files."""
    job_id, _, session = _runtime()
    kv = rendezvous.KeyValue()
    prefix = rendezvous.group_prefix(job_id, group_name)
    nodes = {member.node for member in rendezvous.registered_members(kv, prefix, token)}
    for node in nodes:
        _shut_post_office(bytes.fromhex(token), node)
    rendezvous.close_incarnation(kv, prefix, token)
    root = private_dirs.group_root(session, job_id, group_name, token)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
