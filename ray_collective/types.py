"""Names and per-call options shared by every layer: reduce ops, backends, collectives.

Options are frozen dataclasses: a group builds one per distinct request and hands the same
object to every call that asks the same (``Group.options``), so nothing a call decides can leak
into the next one, and a backend may key its per-shape caches on the object's identity.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType


class ReduceOp(enum.Enum):
    """Reduction applied elementwise across ranks.

    SUM, PRODUCT, MIN and MAX follow numpy's ufuncs ``add``, ``multiply``, ``minimum`` and
    ``maximum`` in the tensor's own dtype (integers wrap on overflow, bool SUM is logical or,
    NaN propagates through MIN/MAX). AVG is SUM divided by the world size; on integer dtypes
    the division truncates toward zero (as C and NCCL do), and it is refused on bool.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4


BACKEND_ALIASES = MappingProxyType({"gloo": "ray", "torch_gloo": "ray"})
"""``ray.util.collective``'s CPU backend names, run by this library's native ``ray`` backend."""


class Backend(str, enum.Enum):
    """Backend names accepted by ``init_collective_group`` (case-insensitive).

    ``"gloo"`` and ``"torch_gloo"`` are accepted as aliases of ``"ray"`` so that code written for
    ``ray.util.collective``'s CPU backend runs unchanged on the native backend.
    """

    RAY = "ray"
    NCCL = "nccl"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            name = value.lower()
            name = BACKEND_ALIASES.get(name, name)
            for member in cls:
                if member.value == name:
                    return member
        return None


class Collective(str, enum.Enum):
    """Every operation a group can run; the value is what errors and headers show."""

    ALLREDUCE = "allreduce"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"
    GATHER = "gather"
    SCATTER = "scatter"
    ALLTOALL = "alltoall"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"


DEFAULT_TIMEOUT_S = 1800.0
"""Default deadline of a blocking call, in seconds (the same default as torch.distributed).

A dead peer is reported through its own error long before this; the deadline only bounds a
rank that is alive but never makes the call.
"""

MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""The longest deadline a call keeps, in seconds (one year): a longer one, however large, is
taken as this. It means "no practical limit", and stays within what the system calls that
wait can express (a socket timeout or a lock wait past about 9.2e9 s overflows, a ``poll``
past 24.8 days)."""

MAX_WORLD_SIZE = 65536
"""The most ranks a group may have. A joining rank keeps nothing per rank until its peers have
arrived; once they have, every rank keeps an entry per peer and its node a 16-byte word pair
per rank (1 MiB at this size), and the rendezvous lists one key per rank. The largest groups
run here had 400 ranks on one machine and 256 on 8 nodes."""

MAX_GROUP_NAME_BYTES = 256
"""The longest group name, in bytes of UTF-8. The name travels in every message's header and
in the keys of Ray's key-value store; it is never part of a file name (those are digests)."""


@dataclass(frozen=True)
class CallOptions:
    """What one call asked for, validated by the API layer and handed to the backend.

    Attributes:
        collective: the operation.
        op: the reduce op (reducing collectives only).
        root: the root rank (reduce, broadcast, gather, scatter), else -1.
        peer: the other rank (send, recv), else -1.
        tag: the p2p tag (send, recv).
        timeout: seconds before the call raises ``CollectiveTimeoutError``.
    """

    collective: Collective
    timeout: float
    op: ReduceOp = ReduceOp.SUM
    root: int = -1
    peer: int = -1
    tag: int = 0
