"""How a member's groups change between syncs, at the driver's request: made whole first
(``settle``: shrunk after a failed sync, a member that died since found by one barrier), then
grown by the subscribers that join or shrunk after those that left. Every member of the sync
does the same step at once; the groups are the elastic groups (``ray_collective.elastic``).
"""

from __future__ import annotations

from typing import Dict

from .. import api
from ..elastic import grow_member, shrink_member
from ..errors import CollectiveError, RankExcludedError, WeightSyncError
from ..group import current_registry
from .config import control_group, dead_members


class MembershipChanges:
    """The steps of a change of members, mixed into ``member.WeightSyncMember`` (whose
    ``config``, ``_error``, ``_broken``, ``_repair`` and ``_key`` they use)."""

    def settle(self, timeout: float) -> Dict[str, int]:
        """Make this member's groups whole before the driver changes the members: shrink them
        if the last sync failed, then find with one barrier a member that died since and
        shrink again without it (every member does the same at once). Call with
        :attr:`lock` held.

        Returns:
            ``{group: world size}`` of this member's groups.

        Raises:
            WeightSyncError: the sync cannot go on, or shrinking failed.
        """
        if self._broken:
            raise self._error(WeightSyncError, self._broken)
        if self.config.gpu:
            raise self._error(WeightSyncError, "subscribers cannot be added or removed: the "
                                               "nccl backend's groups cannot shrink or grow "
                                               "(CuPy exposes neither ncclCommShrink nor grow); "
                                               "destroy the weight sync and declare it again "
                                               "with the subscribers you want")
        if self._repair:
            self._shrink(timeout)
        control = control_group(self.config.name)
        try:
            api.barrier(control, timeout=timeout)
        except CollectiveError as err:
            dead = dead_members(self.config, err, None)
            if not dead:
                raise
            self._shrink(timeout)
            api.barrier(control, timeout=timeout)
        return {g: api.get_collective_group_size(g) for g in self.config.groups}

    def grow(self, added: int, timeout: float) -> None:
        """Grow every group of this member by ``added`` new subscribers (which join as the
        next ranks meanwhile). Call with :attr:`lock` held, after :meth:`settle`."""
        registry = current_registry()
        for group in self.config.groups:
            grow_member(registry, group, api.get_collective_group_size(group) + added, timeout)
        self._key = 0

    def shrink_out(self, timeout: float) -> None:
        """Shrink every group of this member after subscribers left it. Call with
        :attr:`lock` held, after :meth:`settle`."""
        self._shrink(timeout)

    def _shrink(self, deadline: float) -> None:
        """Shrink every group of this member, leaving out the members that failed."""
        registry = current_registry()
        try:
            for group in self.config.groups:
                shrink_member(registry, group, deadline)
        except RankExcludedError as err:
            self._broken = (f"the other members went on without {self.me} ({err}); it is no "
                            f"longer a member: destroy the weight sync here")
            raise self._error(WeightSyncError, self._broken) from err
        except CollectiveError as err:
            raise self._error(WeightSyncError, f"shrinking the groups after a failure failed: "
                                               f"{err}; call again") from err
        self._repair = False
        self._key = 0
