"""Weight sync: a model's weights from trainers (publishers) to a changing set of inference
actors (subscribers), versioned, bucketed and pipelined over the collectives.

From the driver, around actors whose classes know nothing of it::

    col.declare_weight_sync(trainers, engines, name="weights")
    col.add_weight_subscribers("weights", [new_engine])    # between versions
    col.remove_weight_subscribers("weights", [old_engine])
    col.destroy_weight_sync("weights")

or inside each actor: ``col.init_weight_sync(name, role, index, num_publishers,
num_subscribers)``. Then, in each publisher and each subscriber at the same time::

    col.publish_weights(model.state_dict(), "weights", version=step)     # trainers
    version = col.receive_weights(my_state_dict, "weights")              # engines

How it works (docs/weight-sync.md): ``layout`` reads a state dict, ``agreement`` makes every
member agree on the plan and the version before a byte moves (bad input anywhere is refused
everywhere), ``plan`` cuts the model into buckets and deals them to the publishers, ``transfer``
moves them with the library's ``broadcast`` (pipelined chains across nodes, one copy per
subscriber on a node), ``digest`` lets a publisher skip what did not change, ``config`` names a
sync's groups and a member's place in them, ``member`` holds a process's part and the steps
of one sync, ``reform`` changes a member's groups between syncs, ``driver`` forms and changes
syncs from the driver.
On ``backend="nccl"`` the same calls take CuPy arrays and torch CUDA tensors, and ``gpu``
keeps every bucket in GPU memory (no digest there; subscribers cannot be added or removed).
"""

from __future__ import annotations

from typing import Any, Collection, Optional, Union

from ..backends.base import BackendFactory
from ..errors import ArgumentTypeError, ArgumentValueError, WeightSyncNotInitializedError
from ..group import current_registry
from ..types import Backend
from ..validation import check_call_timeout, check_group_name, group_timeout
from .agreement import PUBLISHER, ROLE_NAMES, SUBSCRIBER
from .driver import (add_weight_subscribers, declare_weight_sync, destroy_declared,
                     join_member, leave_member, remove_weight_subscribers)
from .config import SyncConfig, check_bucket_bytes, runs_on_gpu
from .member import SyncReport, WeightSyncMember, in_registry

__all__ = ["declare_weight_sync", "add_weight_subscribers", "remove_weight_subscribers",
           "destroy_weight_sync", "init_weight_sync", "publish_weights", "receive_weights",
           "WeightSyncWork", "SyncReport", "weight_sync_report"]


class WeightSyncWork:
    """Handle of ``publish_weights``/``receive_weights`` with ``async_op=True``."""

    def __init__(self, future):
        self._future = future

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until the sync ends; the version it delivered.

        Args:
            timeout: seconds to wait at most; None until the sync ends or reaches its deadline.

        Returns:
            The version.

        Raises:
            TimeoutError: ``timeout`` passed first; the sync goes on.
            WeightSyncError: the sync failed (what the blocking call would have raised).
        """
        return self._future.result(timeout)

    def is_completed(self) -> bool:
        """Whether the sync has ended (delivered or failed)."""
        return self._future.done()


def _check_index(value: Any, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise ArgumentValueError(f"{what} must be an int in [0, {count}), not {value!r}")
    return value


def init_weight_sync(name: str, role: str, index: int, num_publishers: int,
                     num_subscribers: int, backend: Union[str, Backend, BackendFactory] = "ray",
                     timeout: Optional[float] = None, *,
                     bucket_bytes: Optional[int] = None, cupy: Any = None) -> None:
    """Join this process to a weight sync, inside an actor; returns once every member joined.

    Args:
        name: the weight sync's name, the same in every member.
        role: ``"publisher"`` or ``"subscriber"``.
        index: this member's index among its role: ``[0, num_publishers)`` or
            ``[0, num_subscribers)``.
        num_publishers, num_subscribers: the members of each role (at least one each).
        backend: the collectives' backend: ``"ray"`` (CPU tensors) or ``"nccl"`` (CuPy arrays
            and torch CUDA tensors, buckets in GPU memory), or a backend factory of either, as
            for ``init_collective_group``.
        timeout: the default deadline of every step of a sync, in seconds (default 1800).
        bucket_bytes: the size buckets are cut to (default: chosen by the model's size, 4 to
            32 MiB); the same in every member.
        cupy: on ``nccl``, the CuPy module the GPU copies go through (default: ``import
            cupy``; the tests pass the NCCL stand-in's model of it).

    Returns:
        None.

    Raises:
        ArgumentValueError: a bad name, role, index, count, timeout or bucket size, before
            anything is sent.
        GroupAlreadyInitializedError: this process is in a weight sync of that name already.
        CollectiveTimeoutError: the other members did not join in time.
    """
    check_group_name(name)
    if role not in ROLE_NAMES:
        raise ArgumentValueError(f"role must be 'publisher' or 'subscriber', not {role!r}")
    for count, what in ((num_publishers, "num_publishers"), (num_subscribers, "num_subscribers")):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ArgumentValueError(f"{what} must be a positive int, not {count!r}")
    code = ROLE_NAMES.index(role)
    index = _check_index(index, num_publishers if code == PUBLISHER else num_subscribers,
                         "index")
    config = SyncConfig(name, code, index, num_publishers, group_timeout(timeout, None),
                        check_bucket_bytes(bucket_bytes), runs_on_gpu(backend))
    join_member(config, config.fresh_ranks(num_subscribers), backend, cupy)


def _member(name: str, what: str) -> WeightSyncMember:
    member = current_registry().weight_syncs.get(check_group_name(name))
    if member is None:
        raise WeightSyncNotInitializedError(
            name, f"{what}: this process is not a member of weight sync '{name}'; call "
                  f"init_weight_sync in it, or declare_weight_sync from the driver first")
    return member


def publish_weights(state_dict: Any, name: str = "weights", *, version: int,
                    async_op: bool = False, timeout: Optional[float] = None,
                    unchanged: Optional[Collection[str]] = None,
                    digest: Optional[bool] = None) -> Union[int, WeightSyncWork]:
    """Publish ``state_dict`` as ``version``, in every publisher at once; returns once this
    publisher's bytes are sent and every member has closed the sync.

    Args:
        state_dict: names to C-contiguous tensors: numpy arrays and torch CPU tensors on the
            ``ray`` backend, CuPy arrays and torch CUDA tensors (of one kind, on one GPU) on
            ``nccl``. Every publisher passes the whole model (replicas: each sends a share) or
            its own shard.
        name: the weight sync.
        version: this version's number, larger than the last one published.
        async_op: return a :class:`WeightSyncWork` at once (do not change the tensors until
            its ``wait`` returns).
        timeout: seconds each step may take (default: the sync's).
        unchanged: names of tensors the caller knows did not change since the last version:
            with ``digest`` their buckets are checked and skipped if their digest agrees;
            without, skipped on the caller's word.
        digest: skip buckets whose bytes did not change (a digest per bucket, which reads
            every bucket once per sync). None (the default): on for ``ray``; off for ``nccl``, which keeps no
            digest of GPU buckets and refuses ``True`` (on every member).

    Returns:
        The version, or a :class:`WeightSyncWork` with ``async_op``.

    Raises:
        ArgumentValueError: a bad name or timeout (this member only).
        WeightSyncNotInitializedError: this process is no member of the sync.
        WeightSyncMismatchError: the members' tensors, versions or calls disagree: raised on
            every member before any byte moved.
        WeightSyncMemberDiedError: a member died during the sync (named).
        WeightSyncError: the sync failed otherwise.
    """
    member = _member(name, "publish_weights")
    timeout = check_call_timeout(timeout)
    if digest is not None and not isinstance(digest, bool):
        raise ArgumentTypeError(f"digest must be None, True or False, not {digest!r}")
    return _run(member, async_op, PUBLISHER, state_dict, version, unchanged, digest, timeout)


def receive_weights(state_dict: Any, name: str = "weights", *, async_op: bool = False,
                    timeout: Optional[float] = None) -> Union[int, WeightSyncWork]:
    """Receive the next version into ``state_dict``'s own tensors, in every subscriber while
    the publishers publish it.

    Args:
        state_dict: names to writable tensors (CPU on ``ray``, GPU on ``nccl``, as for
            :func:`publish_weights`): the model's names, shapes and dtypes.
        name: the weight sync.
        async_op: return a :class:`WeightSyncWork` at once (do not read the tensors until its
            ``wait`` returns).
        timeout: seconds each step may take (default: the sync's).

    Returns:
        The version received, or a :class:`WeightSyncWork` with ``async_op``.

    Raises:
        ArgumentValueError, WeightSyncNotInitializedError, WeightSyncMismatchError,
        WeightSyncMemberDiedError, WeightSyncError: as for :func:`publish_weights`; after a
            failure the tensors hold a mix of versions, and the next sync sends them whole.
    """
    member = _member(name, "receive_weights")
    timeout = check_call_timeout(timeout)
    return _run(member, async_op, SUBSCRIBER, state_dict, -1, None, None, timeout)


def _run(member: WeightSyncMember, async_op: bool, role: int, state_dict: Any, *args):
    if not isinstance(async_op, bool):
        raise ArgumentTypeError(f"async_op must be True or False, not {async_op!r}")
    if async_op:
        registry = current_registry()
        caller = member.caller_stream(state_dict)     # on the GPU: the caller's, not the thread's
        return WeightSyncWork(member.submit(in_registry, registry, member.sync, role,
                                            state_dict, *args, caller))
    return member.sync(role, state_dict, *args)



def weight_sync_report(name: str = "weights") -> Optional[SyncReport]:
    """What this member's last delivered sync of ``name`` moved (None before the first).

    Args:
        name: the weight sync.

    Returns:
        The :class:`~ray_collective.weight_sync.SyncReport`: version, bytes moved, the
        model's bytes, whether it was full.

    Raises:
        WeightSyncNotInitializedError: this process is no member of the sync.
    """
    return _member(name, "weight_sync_report").report


def destroy_weight_sync(name: str = "weights") -> None:
    """Leave the weight sync (in a member), or make every member leave (on the driver that
    declared it).

    Args:
        name: the weight sync.

    Returns:
        None.

    Raises:
        ArgumentValueError: a bad name.
        WeightSyncNotInitializedError: this process neither is a member nor declared it.
    """
    registry = current_registry()
    check_group_name(name)
    if name in registry.weight_syncs:
        leave_member(registry, name)
    elif name in registry.declared_weight_syncs:
        destroy_declared(registry, name)
    else:
        raise WeightSyncNotInitializedError(
            name, f"destroy_weight_sync: this process is neither a member of weight sync "
                  f"'{name}' nor the driver that declared it")
