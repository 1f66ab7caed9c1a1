"""The options of one distributed spaCy training run, as the driver hands them to each worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

STRATEGIES = ("allreduce", "reducescatter", "parameter-server")
"""How gradients meet (``exchanges.py``): one allreduce per step; reduce-scatter, shard update
and all-gather; spacy-ray's sharded parameter server."""

LIBRARIES = ("ray_collective", "ray.util.collective-gloo")
"""Who moves a collective strategy's bytes: this library, or Ray's own with Gloo (to compare)."""


@dataclass(frozen=True)
class RunSettings:
    """One run's options, the same on every worker.

    Attributes:
        strategy: a name of ``STRATEGIES``.
        workers: the number of worker actors (the world size).
        library: a name of ``LIBRARIES`` (collective strategies only).
        backend: this library's backend: ``ray`` on CPUs, ``nccl`` with ``gpu_id >= 0``.
        gpu_id: -1 for CPUs; otherwise every worker takes one GPU (thinc on CuPy).
        output_path: where rank 0 saves ``model-last`` and ``model-best``; None saves nothing.
        code_path: a Python file of registered functions every worker imports first.
        grads_per_update: the parameter server: gradients an owner waits for (spacy-ray's 2).
        record_digests: every worker hashes its weights after every step (tests).
        timeout_s: the longest any collective, or the server's final drain, may wait.
    """

    strategy: str
    workers: int
    library: str = "ray_collective"
    backend: str = "ray"
    gpu_id: int = -1
    output_path: Optional[str] = None
    code_path: Optional[str] = None
    grads_per_update: int = 2
    record_digests: bool = False
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}: choose one of "
                             f"{', '.join(STRATEGIES)}")
        if self.library not in LIBRARIES:
            raise ValueError(f"unknown library {self.library!r}: choose one of "
                             f"{', '.join(LIBRARIES)}")
        if self.workers < 1:
            raise ValueError(f"--n-workers must be at least 1, not {self.workers}")
        if self.gpu_id >= 0 and self.library != "ray_collective":
            raise ValueError("GPUs train through this library's nccl backend only")
