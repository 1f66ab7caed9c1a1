"""The ``nccl`` backend: GPU collectives through ``cupy.cuda.nccl``, with the multi-GPU variants.

``init_collective_group(..., backend="nccl")`` uses :class:`NcclBackendFactory` with its
defaults: every GPU the process sees, and the NCCL unique id handed over through Ray. Pass a
factory of your own to choose the GPUs or to run the ranks as threads of one process without
Ray::

    rendezvous = InProcessRendezvous()
    factory = NcclBackendFactory(rendezvous=rendezvous, devices=[rank])
    col.init_collective_group(world_size, rank, backend=factory, group_name="g")

Nothing here imports CuPy, torch or Ray until a group is created or availability is asked.
"""

from .arguments import MultiGpuCall
from .backend import NcclBackendFactory, NcclMembership, synchronize_device
from .completion import NcclOptions
from .library import NcclLibrary, load_library
from .rendezvous import InProcessRendezvous, RayRendezvous, Rendezvous

__all__ = [
    "InProcessRendezvous", "MultiGpuCall", "NcclMembership", "NcclBackendFactory", "NcclLibrary",
    "NcclOptions", "RayRendezvous", "Rendezvous", "load_library", "synchronize_device",
]
