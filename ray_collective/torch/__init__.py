"""``torch.distributed`` over this library: ``import ray_collective.torch``, then
``dist.init_process_group(backend="ray_collective", ...)`` in Ray actors or tasks.

Importing this package imports torch and registers the backend (``rendezvous.register``);
``import ray_collective`` alone imports neither. The process group (``process_group``) maps
torch's collectives onto the library's, runs small calls inline and large ones on a worker
thread (``work``), and carries sends and receives on groups of two per direction (``p2p``).
``train`` registers the backend in Ray Train's workers (``worker_runtime_env``). Guide:
docs/torch-backend.md.
"""

from .process_group import BACKEND_NAME, ProcessGroupRayCollective
from .rendezvous import create_process_group, register
from .train import worker_runtime_env
from .work import CollectiveWork

register()

__all__ = ["BACKEND_NAME", "ProcessGroupRayCollective", "CollectiveWork",
           "create_process_group", "register", "worker_runtime_env"]
