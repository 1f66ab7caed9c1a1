"""What the members of a group on one node share through one small memory-mapped file.

The file ``<group dir>/state`` holds, as int64 words: word 0, the abort flag (the aborting rank
plus one); then, per rank of the group, the last collective sequence number it started plus
one; then, per rank, its last sign of life inside a call (``time.monotonic()`` in
milliseconds, the same clock in every process of a node), 0 between calls; then, per rank,
what its last collective was: its start (the same clock) times ``CODE_SPAN`` plus the
collective's code (``COLLECTIVE_CODES``). Reading it costs no system call, so a waiting rank
checks the abort flag at every wake-up, and a timed-out rank names the local ranks that hold
the call up: those that never came to it, and those in a call that have given no sign of life
for ``STALL_S`` (a stopped or hung process; a rank waiting in a call refreshes its sign every
0.1 s). The abort's reason is written to ``<group dir>/abort.json`` before the flag is raised.
24 bytes per rank: 9.6 KB at 400 ranks.

Anyone on the node may read the page without disturbing a rank (``python -m ray_collective
status`` does: :func:`read_page`): what each rank is in, since when, and who has not come.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from typing import List, NamedTuple, Optional, Tuple

from ..types import Collective

_HEAD = 1
_WORDS_PER_RANK = 3

COLLECTIVE_CODES = {collective.value: code for code, collective in enumerate(Collective, 1)}
"""The code of each collective on the page (0: none or unknown)."""
CODE_SPAN = 64
"""A rank's call word is its start in milliseconds times this, plus its collective's code."""
_NAMES = {code: name for name, code in COLLECTIVE_CODES.items()}


def _page_bytes(world_size: int) -> int:
    return 8 * (_HEAD + _WORDS_PER_RANK * world_size)


def _first_words(world_size: int) -> Tuple[int, int, int]:
    """Rank 0's started, beat and call words on a page of ``world_size`` ranks; rank r's lie r
    words further on. The page's one layout: the node state, ``read_page`` and, through
    :meth:`NodeState.words_of`, the native core all find a rank's words from it."""
    return _HEAD, _HEAD + world_size, _HEAD + 2 * world_size


class RankWords(NamedTuple):
    """Where one rank's words lie on the page, for the native core to keep them itself (see
    ``Transport.rank_words``): the page and the indices of its int64 words.

    Attributes:
        page: the mapped page (writable).
        started: the word of the last collective it started plus one.
        beat: the word of its last sign of life in a call.
        call: the word of its last collective's start and code.
        code_span: ``CODE_SPAN``.
    """

    page: mmap.mmap
    started: int
    beat: int
    call: int
    code_span: int


STALL_S = 1.0
"""A rank in a call that has given no sign of life for this long is reported as stalled."""


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader in another process sees all of it or none."""
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as out:
        out.write(text)
    os.replace(partial, path)


def _now_ms() -> int:
    return int(time.monotonic() * 1000.0) or 1  # 0 means "not in a call"


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
        size = _page_bytes(world_size)
        fd = os.open(os.path.join(directory, "state"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                     0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # A memoryview, not a numpy array: its items are Python ints, read and written
        # several times per call at a fraction of a numpy scalar's cost.
        self._words = memoryview(self._map).cast("q")
        self._started, self._beats, self._calls = _first_words(world_size)

    def arrive(self, rank: int, seq: int, collective: str = "") -> None:
        """Record that ``rank`` started collective ``seq`` (and is alive in it).

        Args:
            rank: the rank.
            seq: the collective's sequence number.
            collective: its name (a key of ``COLLECTIVE_CODES``; another is shown as unknown).
        """
        words, started = self._words, self._started + rank
        if words[started] < seq + 1:
            words[started] = seq + 1
        now = _now_ms()
        words[self._beats + rank] = now
        words[self._calls + rank] = now * CODE_SPAN + COLLECTIVE_CODES.get(collective, 0)

    def words_of(self, rank: int) -> RankWords:
        """Where ``rank``'s words lie on the page (what :meth:`arrive` and :meth:`complete`
        write)."""
        return RankWords(self._map, self._started + rank, self._beats + rank,
                         self._calls + rank, CODE_SPAN)

    def beat(self, rank: int) -> None:
        """Record that ``rank``, waiting in a call, is alive."""
        self._words[self._beats + rank] = _now_ms()

    def complete(self, rank: int) -> None:
        """Record that ``rank`` has left its call (it owes no sign of life until the next)."""
        self._words[self._beats + rank] = 0

    def responsive(self, ranks: List[int], seq: int) -> List[int]:
        """Those of ``ranks`` that do not hold up collective ``seq``.

        A rank holds it up when it is in a call (any call: it may still be in an earlier one)
        and has given no sign of life for ``STALL_S`` (stopped or hung), or when it is in no
        call and has not started ``seq`` (it never came). A rank alive in an earlier call is
        waiting for someone else, and is not blamed.
        """
        words, first, beats = self._words, self._started, self._beats
        stale = _now_ms() - int(STALL_S * 1000.0)
        responsive = []
        for r in ranks:
            started, beat = words[first + r], words[beats + r]
            if started > seq + 1 or (beat > stale if beat else started == seq + 1):
                responsive.append(r)
        return responsive

    def abort(self, record: dict) -> bool:
        """Publish a failure to every member on this node (the first abort wins; nothing once
        the page is closed: an abort from another node can reach a post office after its
        group left this node).

        Returns:
            Whether this call published it (False: the page holds an abort already, or is
            closed); only the publisher needs to wake the others.
        """
        if self._words is None or self._words[0]:
            return False
        write_atomically(os.path.join(self.directory, "abort.json"), json.dumps(record))
        self._words[0] = int(record["rank"]) + 1
        return True

    def aborted(self) -> Optional[dict]:
        """The failure published by :meth:`abort`, or None."""
        flag = self._words[0]
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
        words, self._words = self._words, None
        if words is not None:
            words.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it


class RankCall(NamedTuple):
    """What the state page says of one rank.

    Attributes:
        started: the last collective sequence number it started plus one (0: none yet).
        in_call: whether it is inside that call now.
        collective: that call's collective ("" when unknown).
        since_s: seconds since it started that call (0 when it started none).
    """

    started: int
    in_call: bool
    collective: str
    since_s: float


class PageSnapshot(NamedTuple):
    """A state page as read at one moment.

    Attributes:
        ranks: per rank of the group, its :class:`RankCall`.
        aborted: the failure published on the page, or None.
    """

    ranks: List[RankCall]
    aborted: Optional[dict]


def read_page(directory: str, world_size: int) -> PageSnapshot:
    """Read a group's state page on this node, changing nothing (the file is opened read-only,
    never made or resized).

    Args:
        directory: the group's directory on this node.
        world_size: ranks in the group.

    Returns:
        The snapshot.

    Raises:
        OSError: the page cannot be read (no such group here, or not this user's).
        ValueError: the page is shorter than a group of ``world_size`` ranks needs.
    """
    fd = os.open(os.path.join(directory, "state"), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        raw = os.pread(fd, _page_bytes(world_size), 0)
    finally:
        os.close(fd)
    if len(raw) < _page_bytes(world_size):
        raise ValueError(f"the state page in {directory} holds {len(raw)} bytes, fewer than a "
                         f"group of {world_size} ranks needs")
    words = memoryview(raw).cast("q")
    now, (first, beats, calls) = _now_ms(), _first_words(world_size)
    ranks = []
    for rank in range(world_size):
        started, beat = words[first + rank], words[beats + rank]
        start_ms, code = divmod(words[calls + rank], CODE_SPAN)
        ranks.append(RankCall(started, beat != 0, _NAMES.get(code, ""),
                              max(0.0, (now - start_ms) / 1000.0) if start_ms else 0.0))
    aborted = None
    if words[0]:
        try:
            with open(os.path.join(directory, "abort.json")) as source:
                aborted = json.load(source)
        except (OSError, ValueError):
            aborted = {"rank": words[0] - 1, "kind": "unknown error"}
    return PageSnapshot(ranks, aborted)
