"""ray_collective: collective communication for Ray actors, a drop-in for ``ray.util.collective``.

``import ray_collective as col`` gives the same functions with the same arguments, plus
``gather``, ``scatter``, ``alltoall``, ``ReduceOp.AVG``, ``async_op=``, ``timeout=`` and ``tag=``,
elastic groups (``shrink_collective_group``, ``grow_collective_group``), the declarative
``*_refs`` collectives, ``batch_remote`` / ``ActorPool`` for calling one
method on many actors at once, and weight sync (``declare_weight_sync``, ``publish_weights``,
``receive_weights``: a model from trainers to inference actors), and ``functional``: the
collectives that return their result as a new array (for JAX's immutable arrays).
Importing it needs only numpy (and Ray for the Ray backend); torch and cupy are optional.

What a rank does not need until it uses it is imported on first use, since every rank process
pays for every module it holds (docs/running-at-scale.md): the driver's ``batch_remote``,
``ActorPool`` and ``*_refs``, weight sync (through this module's ``__getattr__``), and the ``nccl``
backend (``backends``).
"""

import importlib

from .api import (allgather, allgather_multigpu, allreduce, allreduce_multigpu, alltoall, barrier,
                  broadcast, broadcast_multigpu, create_collective_group,
                  declare_collective_group, destroy_collective_group, gather,
                  get_collective_group_size, get_collective_trace, get_group_handle, get_rank,
                  gloo_available, grow_collective_group, init_collective_group,
                  is_backend_available, is_group_initialized, nccl_available, recv,
                  recv_multigpu, reduce, reduce_multigpu, reducescatter,
                  reducescatter_multigpu, register_backend, scatter, send, send_multigpu,
                  shrink_collective_group, synchronize)
from .errors import (ArgumentError, ArgumentTypeError, ArgumentValueError,
                     BackendNotAvailableError, CollectiveError, CollectiveMismatchError,
                     CollectiveTimeoutError, GroupAlreadyInitializedError, GroupBrokenError,
                     GroupError, GroupNotInitializedError, InsecureDirectoryError,
                     JoinMismatchError, PeerDiedError, PostOfficeDiedError, RankExcludedError,
                     RankFailedError, ReadOnlyTensorWarning, TensorRefError,
                     UnsupportedOperationError, WeightSyncError, WeightSyncMemberDiedError,
                     WeightSyncMismatchError, WeightSyncNotInitializedError)
from .group import GroupRegistry, Work, use_registry
from .objects import (all_gather_object, broadcast_object_list, gather_object,
                      scatter_object_list)
from .interop import install as _install_ray_util_collective_backend
from .interop import ray_util_collective_runtime_env
from .settings import configure_logging as _configure_logging
from .types import Backend, ReduceOp

__version__ = "0.1.0"

_install_ray_util_collective_backend()
_configure_logging()

__all__ = [
    "init_collective_group", "declare_collective_group", "create_collective_group",
    "destroy_collective_group", "shrink_collective_group", "grow_collective_group",
    "is_group_initialized", "get_group_handle", "get_rank", "get_collective_group_size",
    "get_collective_trace",
    "allreduce", "barrier", "reduce", "broadcast", "allgather", "reducescatter", "send", "recv",
    "gather", "scatter", "alltoall",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "allreduce_multigpu", "reduce_multigpu", "broadcast_multigpu", "allgather_multigpu",
    "reducescatter_multigpu", "send_multigpu", "recv_multigpu", "synchronize",
    "nccl_available", "gloo_available", "is_backend_available", "register_backend",
    "ReduceOp", "Backend", "Work", "GroupRegistry", "use_registry",
    "CollectiveError", "CollectiveTimeoutError", "PeerDiedError", "PostOfficeDiedError",
    "CollectiveMismatchError",
    "GroupBrokenError", "GroupError", "GroupNotInitializedError", "GroupAlreadyInitializedError",
    "BackendNotAvailableError", "InsecureDirectoryError", "UnsupportedOperationError",
    "RankFailedError", "RankExcludedError", "JoinMismatchError",
    "TensorRefError", "ArgumentError", "ArgumentValueError", "ArgumentTypeError",
    "ReadOnlyTensorWarning", "ray_util_collective_runtime_env",
    "allreduce_refs", "reduce_refs", "broadcast_refs", "allgather_refs", "reducescatter_refs",
    "send_ref",
    "batch_remote", "BatchRemoteHandle", "PerActor", "ActorPool",
    "declare_weight_sync", "add_weight_subscribers", "remove_weight_subscribers",
    "destroy_weight_sync", "init_weight_sync", "publish_weights", "receive_weights",
    "WeightSyncWork", "weight_sync_report", "WeightSyncError", "WeightSyncMismatchError", "WeightSyncMemberDiedError",
    "WeightSyncNotInitializedError",
]


_BATCH_NAMES = ("batch_remote", "BatchRemoteHandle", "PerActor")
_WEIGHT_SYNC_NAMES = ("declare_weight_sync", "add_weight_subscribers",
                      "remove_weight_subscribers", "destroy_weight_sync", "init_weight_sync",
                      "publish_weights", "receive_weights", "WeightSyncWork",
                      "weight_sync_report")
_REFS_NAMES = ("allreduce_refs", "reduce_refs", "broadcast_refs", "allgather_refs",
               "reducescatter_refs", "send_ref")


def __getattr__(name: str):
    # ActorPool subclasses ray.util.ActorPool; importing it here would make every
    # ``import ray_collective`` import Ray. The driver's batch calls and ``*_refs`` are
    # imported on first use, so that a rank that never calls them does not hold them.
    if name == "ActorPool":
        from .actor_pool import ActorPool
        return ActorPool
    if name in _BATCH_NAMES:
        from . import batch
        return getattr(batch, name)
    if name in _REFS_NAMES:
        from . import refs
        return getattr(refs, name)
    if name == "functional":  # a submodule: ``from . import`` would ask this function again
        return importlib.import_module(".functional", __name__)
    if name in _WEIGHT_SYNC_NAMES:
        from . import weight_sync
        return getattr(weight_sync, name)
    raise AttributeError(f"module 'ray_collective' has no attribute '{name}'")
