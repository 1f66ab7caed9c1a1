"""The post office: the one helper actor per node of a group that spans nodes.

Over the object store (``RAY_COLLECTIVE_CROSS_NODE=object_store``), ranks on other nodes send
it one actor task per round (``deliver``) holding every message of that round for ranks on its
node: small payloads inline in the task's arguments, large ones as numpy arrays that Ray moves
through the object store (arguments above Ray's inline limit become ObjectRefs, read here
without a copy). The post office sends each message to its local destination exactly as the
sender would on its own node, through the same link and wire protocol code
(``transport.ray_transport.Deliveries``), so a receiving rank treats local and remote peers
alike. Over streams it carries no message (the ranks' own streams do).

Either way it answers for its node: which ranks are dead (process table), which have started a
collective and are not stalled in it (the node's state page), and publishes an abort raised on
another node.

One post office per node per group, created by the node's lowest rank and owned by it; it
handles one task at a time, which keeps each sender's messages in order.
"""

from __future__ import annotations

import os
import select
import shutil
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..transport import uds, wire
from ..transport.node_state import NodeState, write_atomically
from ..transport.ray_transport import Deliveries, RemoteMessage, process_alive
from ..transport.shm import SendArena

POST_OFFICE_PID_FILE = "post-office.pid"
"""In a node's group directory: the process id of the node's post office."""


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
        self.links: Dict[Tuple[int, int], uds.Link] = {}
        self.deliveries = Deliveries(self.arena, self._collect_releases)
        self._buffer = bytearray(uds.RECEIVE_BUFFER_BYTES)
        # Where this node's ranks look to tell the loss of their post office from their peers'.
        write_atomically(os.path.join(directory, POST_OFFICE_PID_FILE), str(os.getpid()))

    def deliver(self, messages: List[RemoteMessage]) -> None:
        """Send each ``(source, destination, tag, step, count, header, payload)`` to its rank."""
        self._collect_releases()
        for source, destination, tag, step, count, header, payload in messages:
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

    def _link(self, source: int, destination: int) -> Optional[uds.Link]:
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
