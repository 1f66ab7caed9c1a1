"""A rank's membership of a ``ray`` group: the transport, and what leaving must undo.

Leaving (``close``) removes this rank's socket; the last member on a node removes the node's
directory and post office, the last member of the group its keys. A broken group's survivors
leave for the members that died there (they never will), and a shrink's survivors for the
ranks it counted as gone (``elastic``); a node's directory on this machine goes once all its
ranks are gone, whoever the last one out.
"""

from __future__ import annotations

import os
import shutil
from typing import FrozenSet, Mapping, Optional, Sequence

from ...errors import error_record
from ...engine.native_runner import NativeRunner
from ...transport.link_transport import LinkTransport
from ...transport.processes import process_alive
from ..base import BackendFactory, Reformed
from ...engine.cpu import TransportMembership
from . import elastic, private_dirs, rendezvous
from .machines import oversubscribed
from .post_offices import post_office_owners, shut_post_office
from .rendezvous import Member


class RayMembership(TransportMembership):
    """A rank's membership of a ``ray`` group: the transport plus what leaving must undo.

    Args (besides the transport membership's):
        token, prefix: the incarnation and the group's key prefix.
        directory: the group's directory on this node.
        members: every rank as the rendezvous recorded it.
        post_office: this node's post office, where this rank started it.
        factory: makes the memberships of the group's next incarnations (shrink, grow).
        timeout: the group's default deadline, in seconds (a next incarnation keeps it).

    Attributes:
        departed: set by a shrink, the ranks it found gone: closing leaves the incarnation for
            them besides itself (and looks for no dead node-mate of its own); None before.
        incarnation_closed: the incarnation's keys are gone already (the others went on
            without this rank, or the group was destroyed): closing leaves nothing in the store.
    """

    def __init__(self, group_name: str, transport: LinkTransport, token: str, prefix: str,
                 directory: str, members: Sequence[Member],
                 post_office: Optional[object], forced: Mapping[str, str],
                 native: Optional[NativeRunner] = None,
                 factory: Optional[BackendFactory] = None, timeout: float = 0.0):
        super().__init__(group_name, transport, epoch=int(token[:15], 16),
                         node_of=[m.node for m in members],
                         oversubscribed=oversubscribed(members), forced=forced, native=native)
        self.token = token
        self.prefix = prefix
        self.directory = directory
        self.members = tuple(members)
        # Held: a post office actor lives as long as its creator holds a handle to it; the
        # group's next incarnation opens its post office in it (``elastic``).
        self.post_office = post_office
        self.factory = factory
        self.timeout = timeout
        self.departed: Optional[FrozenSet[int]] = None
        self.incarnation_closed = False

    def shrink(self, failures: Sequence[Optional[BaseException]],
               timeout: float) -> Reformed:
        return elastic.shrink(self, failures, timeout)

    def prepare_grow(self, world_size: int) -> BackendFactory:
        return elastic.prepare_grow(self, world_size)

    def grow(self, world_size: int, timeout: float) -> Reformed:
        return elastic.grow(self, world_size, timeout)

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
        # a /proc read per node-mate, which every rank of a healthy 400-rank group would pay
        # (and every survivor of a shrink, which found them already).
        broken = self.departed is None and transport.state.aborted() is not None
        super().close()
        try:
            os.unlink(os.path.join(self.directory, f"{self.rank}.sock"))
        except FileNotFoundError:
            pass
        dead_here = [m.rank for m in self.members
                     if m.node == node and m.rank != self.rank and not process_alive(m.pid)
                     ] if broken else []
        if self.incarnation_closed:
            gone = set(range(self.world_size))
        else:
            gone = rendezvous.leave(rendezvous.KeyValue(), self.prefix, self.token, self.rank,
                                    self.world_size, sorted(self.departed or dead_here))
        nodes = {m.node for m in self.members}
        # Only a group that spans nodes has post offices; looking one up by name is a request
        # to Ray's control store, which the last of 400 ranks leaving a one-node group made
        # under load.
        if len(nodes) > 1 and {m.rank for m in self.members if m.node == node} <= gone:
            shut_post_office(self.group_name, transport.group_key,
                             post_office_owners(self.members)[node], node)
        root = os.path.dirname(self.directory)
        for other in nodes:
            # This node's directory, and that of a node of this machine whose ranks all died.
            if {m.rank for m in self.members if m.node == other} <= gone:
                shutil.rmtree(private_dirs.node_path(root, other), ignore_errors=True)
        private_dirs.remove_if_no_node(root)
