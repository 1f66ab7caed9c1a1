"""The post office: the one helper actor per node of a group that spans nodes.

Over the object store (``RAY_COLLECTIVE_CROSS_NODE=object_store``), ranks on other nodes send
it one actor task per round (``deliver``) holding every message of that round for ranks on its
node. Ray carries a task argument up to 100 KiB inside the task's own message and a larger one
through the object store (put by the sender, pulled by this node, read here without a copy),
which costs a few milliseconds more: a round of up to ``INLINE_ROUND_BYTES`` therefore goes
with its payloads cut into arguments of ``INLINE_ARGUMENT_BYTES`` (``pack_round``), a larger
one as whole arrays through the object store. The post office sends each message to its local
destination exactly as the sender would on its own node, through the same link and wire
protocol code (``transport.uds.Deliveries``), so a receiving rank treats local and
remote peers alike. Over streams it carries no message (the ranks' own streams do).

Either way it answers for its node: which ranks are dead (process table), which have started a
collective and are not stalled in it (the node's state page), and publishes an abort raised on
another node.

One post office per node per incarnation of a group, created by the node's lowest rank and
owned by it. They live in one actor process per group and node (:class:`PostOfficeHost`),
which the owner starts for the group's first incarnation and reuses for every later one it is
the node's lowest rank of (a shrink's or a grow's): starting a worker process costs about a
second of CPU, which a re-formation would otherwise pay on every node. The actor handles one
task at a time, which keeps each sender's messages in order; a group's actor carries no other
group's messages, so no group waits behind another's delivery.
"""

from __future__ import annotations

import os
import select
import shutil
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import uds, wire
from .node_state import NodeState, read_page, write_atomically
from .post_office_carrier import RemoteMessage
from .processes import process_alive
from .shm import SendArena

POST_OFFICE_PID_FILE = "post-office.pid"
"""In a node's group directory: the process id of the node's post office."""

INLINE_ARGUMENT_BYTES = 96 << 10
"""The payload bytes of one argument of a ``deliver`` task cut into parts: with its pickling,
under Ray's limit for arguments carried in the task's message (``max_direct_call_object_size``,
100 KiB)."""

INLINE_ROUND_BYTES = 4 << 20
"""The most payload bytes a round sends to one node as parts in the task's message (Ray carries
at most 10 MiB of a task's arguments in its message, ``task_rpc_inlined_bytes_limit``).
Measured on a local cluster of 2 nodes x 2 ranks, the whole collective, p50 of two runs each:
allreduce 256 KiB 5.4-5.5 ms in parts against 18-20 ms through the object store, 1 MiB 8.7-10
against 21-22 ms; a limit of 4 MiB against 1 MiB: allreduce 3 MiB 21-25 against 34-36 ms; of
8 MiB against 4 MiB: broadcast 6 MiB faster (18-19 against 23-25 ms), 10 MiB slower (31-33
against 26-27 ms), allreduce level."""


def pack_round(messages: List[RemoteMessage]) -> Tuple[list, list]:
    """The arguments of the ``deliver`` task that carries ``messages``: the messages, and the
    parts their large payloads are cut into when the round is small enough to travel inside
    the task's message (see ``INLINE_ROUND_BYTES``).

    Args:
        messages: ``(source, destination, tag, step, count, header, payload)`` each; a payload
            is the bytes of a small message or the flat array of a large one.

    Returns:
        ``(messages, parts)``: with parts, a large payload is replaced by the number of parts
        (in order, after those of the messages before it) that hold its bytes.
    """
    large = sum(m[6].nbytes for m in messages if isinstance(m[6], np.ndarray))
    if large == 0 or large > INLINE_ROUND_BYTES:
        return messages, []
    packed, parts = [], []
    for *head, payload in messages:
        if isinstance(payload, np.ndarray):
            raw = payload.view(np.uint8)
            cut = [raw[i:i + INLINE_ARGUMENT_BYTES]
                   for i in range(0, raw.nbytes, INLINE_ARGUMENT_BYTES)]
            parts.extend(cut)
            payload = len(cut)
        packed.append((*head, payload))
    return packed, parts


def unpack_round(messages: list, parts: Sequence[np.ndarray]) -> List[RemoteMessage]:
    """The messages of a ``deliver`` task, each payload whole again (``pack_round``'s inverse).

    Args:
        messages: as ``pack_round`` returned them (after Ray carried them).
        parts: the parts that followed them, in order.

    Returns:
        The messages; a payload of one part is that part, of several a new array joining them.
    """
    unpacked, next_part = [], 0
    for *head, payload in messages:
        if isinstance(payload, int):
            pieces = parts[next_part:next_part + payload]
            next_part += payload
            payload = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        unpacked.append((*head, payload))
    return unpacked


class PostOffice:
    """Delivers messages from other nodes to the group's ranks on this node.

    Args:
        directory: the group's private directory on this node.
        group_name: the group's name.
        group_key: the incarnation's 16-byte key (links present it).
        world_size: ranks in the group.
        local_pids: process id of each rank on this node.
        timeout: seconds a delivery may wait for a receiver's socket.
    """

    def __init__(self, directory: str, group_name: str, group_key: bytes, world_size: int,
                 local_pids: Dict[int, int], timeout: float):
        self.directory = directory
        self.group_key = group_key
        self.local_pids = dict(local_pids)
        self.timeout = timeout
        self.state = NodeState(directory, group_name, world_size)
        self.arena = SendArena(f"ray_collective-{group_name}-post-office")
        self.links: Dict[Tuple[int, int], uds.Connection] = {}
        self.deliveries = uds.Deliveries(self.arena, self._collect_releases)
        self._buffer = bytearray(uds.RECEIVE_BUFFER_BYTES)
        # Where this node's ranks look to tell the loss of their post office from their peers'.
        write_atomically(os.path.join(directory, POST_OFFICE_PID_FILE), str(os.getpid()))

    def deliver(self, messages: List[RemoteMessage], *parts: np.ndarray) -> None:
        """Send each ``(source, destination, tag, step, count, header, payload)`` to its rank
        (a payload given as a number of ``parts``: see ``pack_round``)."""
        self._collect_releases()
        for message in unpack_round(messages, parts):
            source, destination, tag, step, count, header, payload = message
            link = self._link(source, destination)
            if link is None:
                continue
            if isinstance(payload, bytes):
                payload = np.frombuffer(payload, np.uint8)
            self.deliveries.send(link, step, tag, count, header, payload, None)
        deadline = time.monotonic() + self.timeout
        while self.deliveries.pending and time.monotonic() < deadline:
            self.deliveries.advance()
        self._flush(deadline)

    def dead_ranks(self, ranks: List[int]) -> List[int]:
        """Those of ``ranks`` whose process has exited."""
        return [r for r in ranks if not process_alive(self.local_pids.get(r, -1))]

    def responsive(self, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` that have started collective ``seq`` and are not stalled in it."""
        return self.state.responsive(ranks, seq)

    def page(self) -> Tuple[List[tuple], Optional[dict]]:
        """The node's state page as read now (``node_state.read_page``), for the ``status``
        command on another machine: ``(one RankCall tuple per rank, the abort or None)``."""
        snapshot = read_page(self.directory, self.state.world_size)
        return [tuple(rank) for rank in snapshot.ranks], snapshot.aborted

    def abort(self, record: dict) -> None:
        """Publish another node's failure to the ranks here, and wake them to read it."""
        if self.state.abort(record):
            for rank in self.local_pids:
                uds.knock(f"{self.directory}/{rank}.sock")

    def shutdown(self) -> None:
        """Close every link and release the arena and the node's group directory."""
        for link in self.links.values():
            link.close()
        self.links.clear()
        self.arena.close()
        self.state.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _link(self, source: int, destination: int) -> Optional[uds.Connection]:
        link = self.links.get((source, destination))
        if link is not None and not (link.closed or link.unwritable):
            return link
        try:
            link = uds.connect(f"{self.directory}/{destination}.sock", source, self.group_key,
                               self.timeout)
        except OSError:
            return None  # the receiver is gone; its peers learn so from its liveness
        self.links[(source, destination)] = link
        return link

    def _collect_releases(self) -> None:
        for link in self.links.values():
            while not link.closed:
                got = link.receive_into(self._buffer)
                if got is None:
                    break
                nbytes, fd = got
                if fd is not None:
                    uds.close_quietly(fd)
                if self._buffer[0] == wire.RELEASE and nbytes == wire.RELEASE_FRAME.size:
                    self.arena.release(*wire.parse_release(memoryview(self._buffer)[:nbytes]))

    def _flush(self, deadline: float) -> None:
        backlogged = [link for link in self.links.values() if link.backlogged and not link.closed]
        while backlogged and time.monotonic() < deadline:
            poller = select.poll()
            for link in backlogged:
                poller.register(link.fd, select.POLLOUT | select.POLLIN)
            poller.poll(100)
            self._collect_releases()
            for link in backlogged:
                link.flush()
            backlogged = [link for link in backlogged if link.backlogged and not link.closed]


class PostOfficeHost:
    """The post offices of one group on one node, one per incarnation (by its key): the actor
    the node's lowest rank starts, and reuses for the group's next incarnations.

    An incarnation's ranks may reach it before its owner has opened it here (the owner opens
    it after the rendezvous, as the others do their first round): its deliveries wait here
    until it opens, and its questions are answered as by a post office still starting.

    Args:
        directory, group_name, group_key, world_size, local_pids, timeout: the first
            incarnation's post office (see :class:`PostOffice`).
    """

    def __init__(self, directory: str, group_name: str, group_key: bytes, world_size: int,
                 local_pids: Dict[int, int], timeout: float):
        self.offices: Dict[bytes, PostOffice] = {}
        self.closed: set = set()
        self.early: Dict[bytes, List[tuple]] = {}
        self.stopping = False
        self.open(directory, group_name, group_key, world_size, local_pids, timeout)

    def open(self, directory: str, group_name: str, group_key: bytes, world_size: int,
             local_pids: Dict[int, int], timeout: float) -> None:
        """Start the post office of another incarnation here (arguments as the class's), and
        deliver what reached it before.

        Raises:
            RuntimeError: its last post office closed, and it is being stopped (the caller
                starts another actor once this one's name is free).
        """
        if self.stopping:
            raise RuntimeError("this post office actor holds no post office and is stopping")
        if group_key in self.offices or group_key in self.closed:
            return
        office = self.offices[group_key] = PostOffice(directory, group_name, group_key,
                                                      world_size, local_pids, timeout)
        for messages, parts in self.early.pop(group_key, ()):
            office.deliver(messages, *parts)

    def close(self, group_key: bytes) -> int:
        """Shut the incarnation's post office (``PostOffice.shutdown``), if it is here.

        Returns:
            How many incarnations' post offices are left: with none, the caller stops the
            actor.
        """
        self.closed.add(group_key)
        self.early.pop(group_key, None)
        office = self.offices.pop(group_key, None)
        if office is not None:
            office.shutdown()
        # The caller stops an empty actor: an incarnation opened in it meanwhile would die
        # with it, so none may open from now on.
        self.stopping = not self.offices
        return len(self.offices)

    def deliver(self, group_key: bytes, messages: List[RemoteMessage], *parts: np.ndarray):
        """``PostOffice.deliver`` for the incarnation; kept until it opens, dropped once it
        is closed (its ranks have left)."""
        office = self.offices.get(group_key)
        if office is not None:
            office.deliver(messages, *parts)
        elif group_key not in self.closed:
            self.early.setdefault(group_key, []).append((messages, parts))

    def dead_ranks(self, group_key: bytes, ranks: List[int]) -> Optional[List[int]]:
        """``PostOffice.dead_ranks``: none before the incarnation opens, None once it is
        closed here (nothing known)."""
        office = self.offices.get(group_key)
        if office is None:
            return None if group_key in self.closed else []
        return office.dead_ranks(ranks)

    def responsive(self, group_key: bytes, ranks: List[int], seq: int) -> List[int]:
        """``PostOffice.responsive``; none for an incarnation not open here."""
        office = self.offices.get(group_key)
        return [] if office is None else office.responsive(ranks, seq)

    def page(self, group_key: bytes) -> Optional[Tuple[List[tuple], Optional[dict]]]:
        """``PostOffice.page``; None for an incarnation not open here."""
        office = self.offices.get(group_key)
        return None if office is None else office.page()

    def abort(self, group_key: bytes, record: dict) -> None:
        """``PostOffice.abort`` for the incarnation, if it is open here."""
        office = self.offices.get(group_key)
        if office is not None:
            office.abort(record)
