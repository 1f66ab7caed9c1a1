"""The post office: the one helper actor per node of a group that spans nodes.

Ranks on other nodes send it one actor task per round (``deliver``) holding every message of
that round for ranks on its node: small payloads inline in the task's arguments, large ones as
numpy arrays that Ray moves through the object store (arguments above Ray's inline limit become
ObjectRefs, read here without a copy). The post office hands each message to its local
destination exactly as a local sender would (a Unix-socket packet, large payloads through its
shared-memory arena), so a receiving rank treats local and remote peers alike.

It also answers for its node: which ranks are dead (process table), which have started a
collective (the node's state page), and publishes an abort raised on another node.

One post office per node per group, created by the node's lowest rank and owned by it; it
handles one task at a time, which keeps each sender's messages in order.
"""

from __future__ import annotations

import select
import shutil
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..transport import uds
from ..transport.node_state import NodeState
from ..transport.ray_transport import process_alive
from ..transport.shm import SendArena


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

    def deliver(self, messages: List[Tuple[int, int, bytes, Optional[np.ndarray]]]) -> None:
        """Hand each ``(source, destination, packet, large payload or None)`` to its rank."""
        self._collect_releases()
        for source, destination, packet, payload in messages:
            link = self._link(source, destination)
            if link is None:
                continue
            if payload is None:
                link.send(packet)
                continue
            segment, fd, offset = self.arena.place(payload, self._collect_releases)
            fields = list(uds.DATA_FRAME.unpack_from(packet))
            fields[5], fields[6] = segment, offset
            first_use = segment not in link.segments_sent
            link.segments_sent.add(segment)
            link.send(uds.DATA_FRAME.pack(*fields) + packet[uds.DATA_FRAME.size:],
                      fd if first_use else None)
        self._flush(time.monotonic() + self.timeout)

    def dead_ranks(self, ranks: List[int]) -> List[int]:
        """Those of ``ranks`` whose process has exited."""
        return [r for r in ranks if not process_alive(self.local_pids.get(r, -1))]

    def started(self, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` that have started collective ``seq``."""
        return self.state.started(ranks, seq)

    def abort(self, record: dict) -> None:
        """Publish another node's failure to the ranks here."""
        self.state.abort(record)

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
        if link is not None and not link.closed:
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
            for packet, fd in link.receive(uds.RELEASE_FRAME.size):
                if packet[0] == uds.RELEASE:
                    _, segment, offset = uds.RELEASE_FRAME.unpack_from(packet)
                    self.arena.release(segment, offset)

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
