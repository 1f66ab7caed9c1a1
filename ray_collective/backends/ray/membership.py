"""A rank's membership of a ``ray`` group: the transport, and what leaving must undo.

Leaving (``close``) removes this rank's socket; the last member on a node removes the node's
directory and post office, the last member of the group its keys. A broken group's survivors
leave for the members that died there (they never will).
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping, Optional, Sequence

from ...errors import error_record
from ...native.runner import NativeRunner
from ...transport.link_transport import LinkTransport
from ...transport.processes import process_alive
from ..transport_membership import TransportMembership
from . import private_dirs, rendezvous
from .machines import oversubscribed
from .post_offices import shut_post_office
from .rendezvous import Member


class RayMembership(TransportMembership):
    """A rank's membership of a ``ray`` group: the transport plus what leaving must undo."""

    def __init__(self, group_name: str, transport: LinkTransport, token: str, prefix: str,
                 directory: str, members: Sequence[Member],
                 post_office: Optional[object], forced: Mapping[str, str],
                 native: Optional[NativeRunner] = None):
        super().__init__(group_name, transport, epoch=int(token[:15], 16),
                         node_of=[m.node for m in members],
                         oversubscribed=oversubscribed(members), forced=forced, native=native)
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
            shut_post_office(transport.group_key, node)
            shutil.rmtree(self.directory, ignore_errors=True)
            root = os.path.dirname(self.directory)
            try:
                # Unless another node's directory of the group is still there (same machine).
                if set(os.listdir(root)) <= {private_dirs.JOB_FILE}:
                    shutil.rmtree(root, ignore_errors=True)
            except OSError:
                pass
