"""Joining a ``ray`` group: :class:`RayBackendFactory`.

Inside each member process (a group declared from the driver runs the same code in each actor,
``ray_collective.declared``):

1. find the incarnation's token and the group's private directory on this node (made and
   checked by ``private_dirs``: ``/dev/shm/ray_collective-<uid>/...``, mode 0700), and listen
   on ``<rank>.sock`` there;
2. register in Ray's key-value store and wait for every rank (``rendezvous``);
3. if the group spans nodes: with streams (``RAY_COLLECTIVE_CROSS_NODE=streams``, the
   default), listen on the node's address for streams from other nodes and publish where;
   and the lowest rank of each node starts that node's post office (``post_offices``), the
   only process the library adds. With streams it carries no message, only what must reach a
   node's state page from another node (an abort, which ranks are dead or stalled); with
   ``object_store`` it carries the messages too;
4. build the rank's transport (``transport.link_transport``) and membership (``membership``).

A shrink or a grow (``elastic``) joins the group's next incarnation through the same code, with
the token its members agreed on.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ...algorithms.selector import forced_algorithms
from ...errors import BackendNotAvailableError
from ...transport import tcp, uds
from ...transport.progress import PROGRESS_SPIN_S
from ...transport.link_transport import LinkTransport, Peer
from ...transport.node_state import NodeState
from ...transport.stream_carrier import Streams
from ..arrivals import Arrivals, Terms
from ..base import BackendFactory, Declaration, Membership
from . import private_dirs, rendezvous
from ... import native
from ...engine.native_runner import CORE_SPIN_S, NativeRunner, native_node, slice_s_for
from ...engine.stream_rounds import StreamRounds
from .environment import (NATIVE, STREAMS, cross_node_transport, engine_wanted, finished_jobs,
                          ray_module, runtime)
from .machines import ranks_over_cores, ranks_per_core
from .membership import RayMembership
from .post_offices import (POST_OFFICE_JOIN_WAIT_S, RayPostOffices, open_post_office,
                           post_office_owners, shut_post_office, wait_until_started)


_log = logging.getLogger(__name__)


def sweep_finished_jobs(session_dir: str) -> None:
    """Remove the keys and this machine's group directories of jobs that have finished.

    Members that die with their job (a driver that exits without destroying its groups) never
    leave; whoever opens the next incarnation of any group cleans up after them.
    """
    finished = finished_jobs()
    if not finished:
        return
    rendezvous.sweep_finished_jobs(rendezvous.KeyValue(), finished)
    private_dirs.remove_finished_groups(session_dir, finished)


@dataclass(frozen=True)
class _Joining:
    """What every step of one rank's join reads: the call's arguments and where it runs."""

    group_name: str
    world_size: int
    rank: int
    timeout: float
    job_id: str
    node: str
    session: str
    kv: rendezvous.KeyValue
    prefix: str
    forced: Mapping[str, str]
    started: float


class RayBackendFactory(BackendFactory):
    """Joins ranks to ``ray`` groups.

    Args:
        token: the incarnation to join (set by the driver for declared groups, and by a shrink
            or a grow); None lets rank 0 open a new incarnation and the others follow it.
        watch: called while the join waits (``rendezvous.join``): a shrink's or a grow's,
            in the process that runs it.
        longest_pause: the longest wait between two looks at the store while joining; None
            for the rendezvous's own, which grows with the world size. Every rank waits on its
            listening socket, and the rank that completes the membership knocks on its
            node-mates': a shrink or grow of ranks that all share a node needs no early look.
        post_office: the post office actor this process started for the group's previous
            incarnation (a shrink's or a grow's members pass theirs): where this rank is its
            node's lowest again, the new incarnation's post office opens in it rather than in
            a new worker process.
    """

    name = "ray"

    def __init__(self, token: Optional[str] = None,
                 watch: Optional[Callable[[], None]] = None,
                 longest_pause: Optional[float] = None, post_office: Optional[Any] = None):
        self.token = token
        self.watch = watch
        self.longest_pause = longest_pause
        self.post_office = post_office

    def incarnation(self, token: str, watch: Optional[Callable[[], None]] = None,
                    longest_pause: Optional[float] = None,
                    post_office: Optional[Any] = None) -> "RayBackendFactory":
        """The factory that joins the incarnation ``token`` (a shrink's or a grow's).

        Args:
            token: the incarnation.
            watch: called while the join waits (see ``rendezvous.join``).
            longest_pause: the longest wait between two looks at the store (see the class).
            post_office: the caller's post office actor of the previous incarnation, to reuse
                (see the class); never one of another process (a grow's new ranks get None).

        Returns:
            A factory for that incarnation alone.
        """
        return RayBackendFactory(token, watch, longest_pause, post_office)

    def available(self) -> bool:
        return hasattr(os, "memfd_create")

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> Membership:
        if not self.available():
            raise BackendNotAvailableError(
                f"group '{group_name}', rank {rank}: the 'ray' backend needs Linux (memfd and "
                f"Unix sockets with descriptor passing)")
        job_id, node, session = runtime()
        joining = _Joining(group_name, world_size, rank, timeout, job_id, node, session,
                           rendezvous.KeyValue(), rendezvous.group_prefix(job_id, group_name),
                           forced_algorithms(), time.monotonic())
        token, members, endpoint, me = self._rendezvous(joining)
        return self._connect(joining, token, members, endpoint, me)

    def _rendezvous(self, joining: "_Joining") -> tuple:
        """Steps 1 and 2 of the module's: ``(token, members, endpoint, this member)``, the
        endpoint's ``directory`` and ``listener`` this rank's on this node."""
        group_name, world_size, rank, node = (joining.group_name, joining.world_size,
                                              joining.rank, joining.node)
        endpoint: Dict[str, object] = {}

        def listen_under(current: str) -> None:
            if "listener" in endpoint:
                endpoint["listener"].close()
            directory = private_dirs.node_directory(joining.session, joining.job_id,
                                                    group_name, current, node, rank)
            path = os.path.join(directory, f"{rank}.sock")
            if os.path.exists(path):
                os.unlink(path)
            endpoint.update(directory=directory, listener=uds.listen(path, world_size + 16))

        def nap(seconds: float) -> bool:
            if "listener" in endpoint:
                return uds.wait_for_knock(endpoint["listener"], seconds)
            time.sleep(seconds)
            return False

        def completed(members) -> None:
            for member in members:
                if member.node == node and member.rank != rank:
                    uds.knock(os.path.join(endpoint["directory"], f"{member.rank}.sock"))

        _log.debug("group %r rank %d of %d: joining (job %s, node %s, pid %d, %s, timeout "
                   "%g s)", group_name, rank, world_size, joining.job_id, node[:12],
                   os.getpid(), f"incarnation {self.token[:12]}" if self.token else
                   "following the group", joining.timeout)
        me = rendezvous.Member(rank, node, os.getpid(), len(os.sched_getaffinity(0)),
                               cross_node_transport(group_name, rank),
                               ray_module().util.get_node_ip_address(),
                               engine_wanted(group_name, rank))
        kv, prefix = joining.kv, joining.prefix
        arrivals = Arrivals(kv, joining.job_id, group_name, rank,
                            Terms(world_size, self.name, ",".join(
                                f"{name}={algorithm}" for name, algorithm in sorted(
                                    joining.forced.items()))), node, os.getpid(),
                            joining.timeout, self.token or "open")
        token = self.token
        try:
            # Before rank 0 opens an incarnation: a second process claiming rank 0 must be
            # refused, not replace the first one's token.
            arrivals.announce()
            if token is None and rank == 0:
                token = rendezvous.open_incarnation(kv, prefix, world_size)
                # After the token is out: every other rank is waiting for it, and the sweep
                # touches no key of a live job (0.18 s of rank 0's time at 400 ranks).
                sweep_finished_jobs(joining.session)
            token, members = rendezvous.join(
                kv, prefix, group_name, world_size, me, joining.timeout, listen_under, token,
                self.watch, rendezvous.Waiting(nap, completed, self.longest_pause), arrivals)
        except BaseException as err:
            _log.debug("group %r rank %d of %d: the join failed after %.3f s: %s: %s",
                       group_name, rank, world_size, time.monotonic() - joining.started,
                       type(err).__name__, err)
            if "listener" in endpoint:
                endpoint["listener"].close()
            raise
        finally:
            arrivals.withdraw()
        return token, members, endpoint, me

    def _connect(self, joining: "_Joining", token: str, members, endpoint: dict,
                 me: rendezvous.Member) -> Membership:
        """Steps 3 and 4 of the module's: the streams and post offices between nodes, the
        rank's transport, native runner and membership."""
        group_name, world_size, rank, node = (joining.group_name, joining.world_size,
                                              joining.rank, joining.node)
        timeout, directory, group_key = joining.timeout, endpoint["directory"], bytes.fromhex(token)
        peers = [Peer(m.node, m.pid, os.path.join(directory, f"{m.rank}.sock"))
                 for m in members]
        state = NodeState(directory, group_name, world_size)
        nodes = {m.node for m in members}
        post_offices, post_office, started, streams = None, None, False, None
        if len(nodes) > 1:
            # Every member must agree, and each asked for what it can do: one asking for the
            # object store (by choice, or for TLS) takes the whole group there.
            if all(m.cross_node == STREAMS for m in members):
                streams = _listen_for_streams(joining.kv, joining.prefix, token, rank, me.host,
                                              world_size, timeout)
            post_offices = RayPostOffices(
                group_name, group_key, node, post_office_owners(members), timeout, directory,
                functools.partial(rendezvous.broken_by, joining.kv, joining.prefix, token))
            local = {m.rank: m.pid for m in members if m.node == node}
            if rank == min(local):
                post_office, started = open_post_office(directory, group_name, group_key,
                                                        world_size, node, local, timeout,
                                                        self.post_office)
        # Polling without sleep answers small messages fastest, but only a rank with a core of
        # its own may do it: on a crowded machine it would take the core a peer needs.
        spin_s = 0.0 if ranks_over_cores(members)[node] else PROGRESS_SPIN_S
        transport = LinkTransport(rank, group_name, group_key, peers, endpoint["listener"],
                                  state, post_offices, connect_timeout=timeout, spin_s=spin_s,
                                  streams=streams)
        try:
            # Made now, not by the first calls: a connection and its handshake per peer, and
            # a new post office's worker process starting (a second of CPU on a loaded
            # machine), cost the calls that met them tens of milliseconds each.
            transport.open_streams(timeout)
            if started:
                wait_until_started(post_office, min(timeout, POST_OFFICE_JOIN_WAIT_S))
        except BaseException:
            transport.close()
            raise
        runner = _native_runner(members, node, directory, rank, world_size, transport)
        _log.debug("group %r rank %d of %d: joined incarnation %s in %.3f s: %d node(s), "
                   "engine %s, between nodes %s, post office %s, directory %s", group_name,
                   rank, world_size, token[:12], time.monotonic() - joining.started,
                   len(nodes), "native" if runner is not None else "python",
                   "-" if len(nodes) == 1 else "streams" if streams else "object_store",
                   "-" if post_office is None else "started" if started else "reused",
                   directory)
        return RayMembership(group_name, transport, token, joining.prefix, directory, members,
                             post_office, joining.forced, runner, self, timeout)

    def prepare_declaration(self, group_name: str) -> Declaration:
        # The driver opens the incarnation, so that the members join the same one whatever
        # their order, and removes it after them whatever they did (and those a shrink or a
        # grow opened after it).
        job_id, _, session = runtime()
        sweep_finished_jobs(session)
        token = rendezvous.open_incarnation(rendezvous.KeyValue(),
                                            rendezvous.group_prefix(job_id, group_name))
        return Declaration(RayBackendFactory(token),
                           functools.partial(_remove_incarnations, group_name))


def _native_runner(members, node: str, directory: str, rank: int, world_size: int,
                   transport: LinkTransport) -> Optional[NativeRunner]:
    """The native engine's runner of the rank, where every member asked for it; else None."""
    if not all(m.engine == NATIVE for m in members):
        return None
    slice_s = slice_s_for(ranks_per_core(members)[node])
    on_streams = None
    if transport.stream_carrier is not None:
        on_streams = StreamRounds(native.core(), transport.stream_carrier, transport, slice_s,
                                  CORE_SPIN_S)
    return NativeRunner(native_node(directory, rank, world_size), transport, slice_s,
                        spans_nodes=len({m.node for m in members}) > 1, streams=on_streams)


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


def _remove_incarnations(group_name: str) -> None:
    """Remove what every incarnation of a group of this job leaves outside its members: keys,
    post offices, this machine's files."""
    job_id, _, session = runtime()
    kv = rendezvous.KeyValue()
    prefix = rendezvous.group_prefix(job_id, group_name)
    for token in rendezvous.incarnations(kv, prefix):
        owners = post_office_owners(rendezvous.registered_members(kv, prefix, token))
        if len(owners) > 1:
            for node, owner in owners.items():
                shut_post_office(group_name, bytes.fromhex(token), owner, node)
        rendezvous.close_incarnation(kv, prefix, token)
        root = private_dirs.group_root(session, job_id, group_name, token)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
