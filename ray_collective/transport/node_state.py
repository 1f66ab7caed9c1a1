"""What the members of a group on one node share through one small memory-mapped file.

The file ``<group dir>/state`` holds, as int64 words: word 0, the abort flag (the aborting rank
plus one); then, per rank of the group, the last collective sequence number it started plus
one. Reading it costs no system call, so a waiting rank checks the abort flag at every wake-up
and a timed-out rank names the local ranks that never started the call. The abort's reason is
written to ``<group dir>/abort.json`` before the flag is raised. 8 bytes per rank: 3.2 KB at
400 ranks.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import List, Optional

import numpy as np

_HEAD = 1


class NodeState:
    """The shared state page of one group on one node.

    Args:
        directory: the group's private directory on this node.
        group_name: the group's name (errors).
        world_size: ranks in the group.
    """

    def __init__(self, directory: str, group_name: str, world_size: int):
        self.directory = directory
        self.group_name = group_name
        self.world_size = world_size
        size = 8 * (_HEAD + world_size)
        fd = os.open(os.path.join(directory, "state"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._map, np.int64)

    def arrive(self, rank: int, seq: int) -> None:
        """Record that ``rank`` started collective ``seq``."""
        words = self._words
        if words[_HEAD + rank] < seq + 1:
            words[_HEAD + rank] = seq + 1

    def started(self, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` that have started collective ``seq``."""
        words = self._words
        return [r for r in ranks if words[_HEAD + r] >= seq + 1]

    def abort(self, record: dict) -> None:
        """Publish a failure to every member on this node (the first abort wins)."""
        if self._words[0]:
            return
        path = os.path.join(self.directory, "abort.json")
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w") as out:
            json.dump(record, out)
        os.replace(partial, path)
        self._words[0] = int(record["rank"]) + 1

    def aborted(self) -> Optional[dict]:
        """The failure published by :meth:`abort`, or None."""
        flag = int(self._words[0])
        if not flag:
            return None
        try:
            with open(os.path.join(self.directory, "abort.json")) as source:
                return json.load(source)
        except (OSError, ValueError):
            return {"group": self.group_name, "rank": flag - 1,
                    "kind": "unknown error", "message": "its description could not be read"}

    def close(self) -> None:
        """Unmap the page."""
        self._words = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
