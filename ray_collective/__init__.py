"""ray_collective: collective communication for Ray actors, a drop-in for ``ray.util.collective``.

``import ray_collective as col`` gives the same functions with the same arguments, plus
``gather``, ``scatter``, ``alltoall``, ``ReduceOp.AVG``, ``async_op=``, ``timeout=`` and ``tag=``,
elastic groups (``shrink_collective_group``, ``grow_collective_group``), the declarative
``*_refs`` collectives, ``batch_remote`` / ``ActorPool`` for calling one
method on many actors at once, and weight sync (``declare_weight_sync``, ``publish_weights``,
``receive_weights``: a model from trainers to inference actors), and ``functional``: the
collectives that return their result as a new array (for JAX's immutable arrays).
Importing it needs only numpy (and Ray for the Ray backend); torch and cupy are optional.

Only the errors, the types and the ``ray.util.collective`` registration are imported with the
package; every other public name is imported on its first use (this module's ``__getattr__``),
since every process pays for every module it holds (docs/running-at-scale.md): a rank that never
calls the driver's ``batch_remote``, ``ActorPool``, ``*_refs`` or weight sync does not hold
them, the ``nccl`` backend is loaded when first asked for (``backends``), and a process that
imports one module of the package (a node's post office, which needs only the transport's
modules) does not import the API, the groups and the backends with it.
"""

import importlib

from .errors import (ArgumentError, ArgumentTypeError, ArgumentValueError,
                     BackendNotAvailableError, CollectiveError, CollectiveMismatchError,
                     CollectiveTimeoutError, GroupAlreadyInitializedError, GroupBrokenError,
                     GroupError, GroupNotInitializedError, InsecureDirectoryError,
                     JoinMismatchError, PeerDiedError, PostOfficeDiedError, RankExcludedError,
                     RankFailedError, ReadOnlyTensorWarning, TensorRefError,
                     UnsupportedOperationError, WeightSyncError, WeightSyncMemberDiedError,
                     WeightSyncMismatchError, WeightSyncNotInitializedError)
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


_API_NAMES = ("allgather", "allgather_multigpu", "allreduce", "allreduce_multigpu", "alltoall",
              "barrier", "broadcast", "broadcast_multigpu", "create_collective_group",
              "declare_collective_group", "destroy_collective_group", "gather",
              "get_collective_group_size", "get_collective_trace", "get_group_handle",
              "get_rank", "gloo_available", "grow_collective_group", "init_collective_group",
              "is_backend_available", "is_group_initialized", "nccl_available", "recv",
              "recv_multigpu", "reduce", "reduce_multigpu", "reducescatter",
              "reducescatter_multigpu", "register_backend", "scatter", "send", "send_multigpu",
              "shrink_collective_group", "synchronize")
_BATCH_NAMES = ("batch_remote", "BatchRemoteHandle", "PerActor")
_WEIGHT_SYNC_NAMES = ("declare_weight_sync", "add_weight_subscribers",
                      "remove_weight_subscribers", "destroy_weight_sync", "init_weight_sync",
                      "publish_weights", "receive_weights", "WeightSyncWork",
                      "weight_sync_report")
_REFS_NAMES = ("allreduce_refs", "reduce_refs", "broadcast_refs", "allgather_refs",
               "reducescatter_refs", "send_ref")
_LAZY_MODULES = {
    **{name: ".api" for name in _API_NAMES},
    **{name: ".group" for name in ("GroupRegistry", "Work", "use_registry")},
    **{name: ".objects" for name in ("all_gather_object", "broadcast_object_list",
                                     "gather_object", "scatter_object_list")},
    **{name: ".batch" for name in _BATCH_NAMES},
    **{name: ".refs" for name in _REFS_NAMES},
    **{name: ".weight_sync" for name in _WEIGHT_SYNC_NAMES},
    "ActorPool": ".actor_pool",
}
"""Where each public name that is imported on first use lives."""


def __getattr__(name: str):
    # ActorPool subclasses ray.util.ActorPool; importing it here would make every
    # ``import ray_collective`` import Ray.
    if name == "functional":  # a submodule: ``from . import`` would ask this function again
        return importlib.import_module(".functional", __name__)
    module = _LAZY_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_collective' has no attribute '{name}'")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
