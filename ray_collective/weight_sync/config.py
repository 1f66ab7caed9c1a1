"""What a weight sync is made of: its groups' names, a member's configuration and place in
them, and which members an error names dead.

A weight sync named ``N`` with P publishers is one control group of every member (publishers
first, then the subscribers) and, with P > 1, one data group per publisher (that publisher as
rank 0, then every subscriber); with one publisher the control group is the data group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from ..backends.base import BackendFactory
from ..errors import ArgumentValueError, PeerDiedError
from ..types import Backend
from .agreement import PUBLISHER, Roster


def control_group(name: str) -> str:
    """The control group of weight sync ``name``."""
    return f"weight-sync:{name}"


def data_group(name: str, publisher: int, publishers: int) -> str:
    """The data group of ``publisher`` in weight sync ``name``."""
    return control_group(name) if publishers == 1 else f"weight-sync:{name}:from-{publisher}"


@dataclass(frozen=True)
class SyncConfig:
    """What a member was made with.

    Attributes:
        name: the weight sync.
        role: ``PUBLISHER`` or ``SUBSCRIBER``.
        index: the member's index among its role.
        publishers: the number of publishers.
        timeout: the default deadline of a sync's every step, in seconds.
        bucket_bytes: the bucket size (0: chosen by the model's size).
        gpu: whether the sync runs on the ``nccl`` backend (GPU tensors).
    """

    name: str
    role: int
    index: int
    publishers: int
    timeout: float
    bucket_bytes: int = 0
    gpu: bool = False

    @property
    def groups(self) -> List[str]:
        """The groups this member is in: the control group first, then its data groups."""
        control = control_group(self.name)
        if self.publishers == 1:
            return [control]
        mine = [self.index] if self.role == PUBLISHER else range(self.publishers)
        return [control] + [data_group(self.name, p, self.publishers) for p in mine]

    def fresh_ranks(self, subscribers: int) -> Dict[str, Tuple[int, int]]:
        """``{group: (rank, world size)}`` of this member in a newly formed sync of
        ``subscribers`` subscribers (publishers first in the control group; in a data group
        its publisher, then the subscribers)."""
        groups, publishers = self.groups, self.publishers
        if self.role == PUBLISHER:
            place = {groups[0]: (self.index, publishers + subscribers)}
            place.update({g: (0, 1 + subscribers) for g in groups[1:]})
        else:
            place = {groups[0]: (publishers + self.index, publishers + subscribers)}
            place.update({g: (1 + self.index, 1 + subscribers) for g in groups[1:]})
        return place


def runs_on_gpu(backend: Any) -> bool:
    """Whether a sync on ``backend`` (a name, ``Backend`` or factory) runs on the GPU: the
    ``nccl`` backend's."""
    name = getattr(backend, "name", None) if isinstance(backend, BackendFactory) else backend
    if isinstance(name, str):
        try:
            return Backend(name) is Backend.NCCL
        except ValueError:
            return False
    return False


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """``bucket_bytes`` as a config holds it (0: chosen by the model's size).

    Raises:
        ArgumentValueError: not None or an int in [1, 2^40].
    """
    if bucket_bytes is None:
        return 0
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or \
            not 1 <= bucket_bytes <= 1 << 40:
        raise ArgumentValueError(f"bucket_bytes must be an int in [1, 2^40], not "
                                 f"{bucket_bytes!r}")
    return bucket_bytes


def dead_members(config: SyncConfig, error: Optional[BaseException],
                 roster: Optional[Roster]) -> Set[int]:
    """The control ranks ``error`` (or an error it wraps) names dead; ranks of a data group
    only with a roster to map them."""
    found: Set[int] = set()
    seen = set()
    control = control_group(config.name)
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, PeerDiedError):
            if error.group_name == control:
                found |= set(error.dead_ranks)
            elif roster is not None:
                for p in range(config.publishers):
                    if error.group_name == data_group(config.name, p, config.publishers):
                        found |= {roster.control_rank(p, r) for r in error.dead_ranks}
        error = getattr(error, "cause", None) or error.__cause__
    return found
