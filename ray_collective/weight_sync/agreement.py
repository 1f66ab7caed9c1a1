"""What the members agree on before a sync's bytes move, and after.

Before: every member contributes a header (:data:`HEADER_WORDS` int64 words: role, index, its
input's status, its layout's fingerprint, the version, the plan it holds) to one allgather on
the control group. Where every member holds the same plan and every fingerprint matches it,
that is all; otherwise (a first sync, a changed state dict, a new member, bad input somewhere)
a second allgather carries every member's full description (:class:`~.layout.Layout`), and
every member computes the same verdict from the same bytes: a new plan, or one error that
names the member, the tensor and both sides, raised on every member before any byte moved.

After: one allgather of a status byte and a byte per control rank that this member knows
dead, so that
every member ends the sync the same way (delivered, or the same members named) even where only
some of them saw the failure.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .layout import Layout, difference
from .plan import PlanError, SyncPlan, make_plan

PUBLISHER, SUBSCRIBER = 0, 1
ROLE_NAMES = ("publisher", "subscriber")

(H_MAGIC, H_ROLE, H_INDEX, H_STATUS, H_FP0, H_FP1, H_VERSION, H_LAST, H_PLAN, H_DESC_BYTES,
 H_BUCKET, H_PUBLISHERS) = range(12)
HEADER_WORDS = 12
MAGIC = 0x5753_0001
"""The header's first word: "WS" and the protocol's version."""

OK, BAD_INPUT = 0, 1


def member_name(role: int, index: int) -> str:
    """How messages name a member, e.g. ``"subscriber 2"``."""
    return f"{ROLE_NAMES[role]} {index}"


def plan_key(fingerprints: Sequence[Tuple[int, int]], bucket_bytes: int) -> int:
    """The int64 that names a plan: its publishers' fingerprints and bucket size."""
    text = repr((tuple(fingerprints), bucket_bytes)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


@dataclass(frozen=True)
class Roster:
    """The members in control-group rank order: ``(role, index)`` each."""

    members: Tuple[Tuple[int, int], ...]

    @property
    def publishers(self) -> int:
        return sum(1 for role, _ in self.members if role == PUBLISHER)

    def name(self, control_rank: int) -> str:
        return member_name(*self.members[control_rank])

    def control_rank(self, publisher: int, data_rank: int) -> int:
        """The control rank of ``data_rank`` in publisher ``publisher``'s data group (its rank 0
        is the publisher, then the subscribers in control order)."""
        return publisher if data_rank == 0 else self.publishers + data_rank - 1


@dataclass(frozen=True)
class Verdict:
    """What the members agreed before a sync: the roster, the plan, the version, and whether
    every bucket goes (a new plan, or a subscriber that does not hold the last version)."""

    roster: Roster
    plan: SyncPlan
    key: int
    version: int
    full: bool


def header(role: int, index: int, layout: Layout, version: int, last: int, key: int,
           description: bytes, bucket_bytes: int, publishers: int) -> np.ndarray:
    """This member's header (see the module docstring)."""
    words = np.zeros(HEADER_WORDS, np.int64)
    fp = (0, 0) if layout.error else layout.fingerprint()
    words[[H_MAGIC, H_ROLE, H_INDEX, H_STATUS, H_FP0, H_FP1, H_VERSION, H_LAST, H_PLAN,
           H_DESC_BYTES, H_BUCKET, H_PUBLISHERS]] = (
        MAGIC, role, index, BAD_INPUT if layout.error else OK, fp[0], fp[1], version, last,
        key, len(description), bucket_bytes, publishers)
    return words


def allgather_words(words: np.ndarray, group: str, world: int, timeout: Optional[float],
                    memory: Any) -> np.ndarray:
    """Every member's ``words``, one row per control rank, through ``memory`` (host memory,
    or device buffers on the nccl backend: ``transfer.HostBuckets``, ``gpu.GpuBuckets``)."""
    return memory.allgather(words, group, world, timeout)


def agree(headers: np.ndarray, description: bytes, plan: Optional[SyncPlan], key: int,
          group: str, timeout: Optional[float], memory: Any
          ) -> Tuple[Optional[Verdict], Optional[str]]:
    """The verdict of one sync from every member's header, or the error every member raises.

    Args:
        headers: every member's header, by control rank.
        description: this member's layout, encoded (sent only if a description is needed).
        plan, key: the plan this member holds, and its key (0: none).
        group: the control group.
        timeout: the deadline of the second allgather, where one is needed.
        memory: what the allgather goes through (see :func:`allgather_words`).

    Returns:
        ``(verdict, None)``, or ``(None, the error's text)``: the same on every member.
    """
    roster = Roster(tuple((int(r), int(i)) for r, i in headers[:, [H_ROLE, H_INDEX]]))
    bad = [f"control rank {rank} sent no weight-sync header (is it a member of another "
           f"weight sync of this name?)" for rank in np.flatnonzero(headers[:, H_MAGIC] != MAGIC)]
    if bad:
        return None, bad[0]
    publishers = [rank for rank, (role, _) in enumerate(roster.members) if role == PUBLISHER]
    bucket_bytes = int(headers[:, H_BUCKET].max())
    current = plan_key([tuple(headers[r, [H_FP0, H_FP1]]) for r in publishers], bucket_bytes)
    need = (headers[:, H_STATUS] != OK).any() or (headers[:, H_PLAN] != current).any()
    if not need:
        model_fp = plan.model.fingerprint()
        need = any(tuple(headers[r, [H_FP0, H_FP1]]) != model_fp
                   for r, (role, _) in enumerate(roster.members) if role == SUBSCRIBER)
    if need:
        layouts = _descriptions(headers, description, group, timeout, memory)
        errors = [f"{roster.name(r)}: {layout.error}" for r, layout in enumerate(layouts)
                  if layout.error]
        if errors:
            return None, "; ".join(errors)
        try:
            plan = make_plan([layouts[r] for r in publishers], bucket_bytes or None)
        except PlanError as err:
            return None, str(err)
        side = "the publishers" if len(publishers) > 1 else "publisher 0"
        for r, (role, _) in enumerate(roster.members):
            if role == SUBSCRIBER:
                wrong = difference(plan.model, layouts[r], side, roster.name(r))
                if wrong:
                    return None, wrong
        key = current
    versions = {int(headers[r, H_VERSION]) for r in publishers}
    if len(versions) > 1:
        return None, "the publishers publish different versions: " + ", ".join(
            f"{roster.name(r)} version {int(headers[r, H_VERSION])}" for r in publishers)
    version = versions.pop()
    last = int(headers[publishers, H_LAST].max())
    if version <= last:
        return None, (f"version {version} does not go forward: version {last} was published "
                      f"last; publish a larger version")
    full = need or any(int(headers[r, H_VERSION]) != last
                       for r, (role, _) in enumerate(roster.members) if role == SUBSCRIBER)
    return Verdict(roster, plan, key, version, bool(full)), None


def _descriptions(headers: np.ndarray, description: bytes, group: str,
                  timeout: Optional[float], memory: Any) -> List[Layout]:
    width = int(headers[:, H_DESC_BYTES].max())
    mine = np.zeros(width, np.uint8)
    mine[:len(description)] = np.frombuffer(description, np.uint8)
    rows = allgather_words(mine, group, len(headers), timeout, memory)
    return [Layout.decode(row[:int(n)].tobytes())
            for row, n in zip(rows, headers[:, H_DESC_BYTES])]
