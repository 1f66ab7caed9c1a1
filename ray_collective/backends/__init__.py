"""Backend names and the factories behind them.

``resolve`` turns what a caller passed as ``backend=`` (a name, a :class:`~ray_collective.types.Backend`,
or a :class:`~ray_collective.backends.base.BackendFactory` such as the in-process one used by
tests) into a factory. A backend this build cannot run raises
:class:`~ray_collective.errors.BackendNotAvailableError` that says why.
"""

from __future__ import annotations

from typing import Union

from ..errors import BackendNotAvailableError
from ..types import Backend
from .base import BackendFactory, CollectiveBackend
from .ray_backend import RayBackendFactory


class UnavailableBackend(BackendFactory):
    """A backend name this build knows but cannot run; ``create`` explains why."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def available(self) -> bool:
        return False

    def create(self, group_name: str, world_size: int, rank: int,
               timeout: float) -> CollectiveBackend:
        raise BackendNotAvailableError(
            f"group '{group_name}', rank {rank}: backend '{self.name}' is not available: "
            f"{self.reason}")


_NAMED = {
    Backend.RAY: RayBackendFactory(),
    Backend.NCCL: UnavailableBackend(
        "nccl", "the NCCL (GPU) backend is not part of this version of ray_collective yet."),
}


def resolve(backend: Union[str, Backend, BackendFactory]) -> BackendFactory:
    """The factory for ``backend``.

    Args:
        backend: a backend name (case-insensitive; ``"gloo"`` means ``"ray"``), a
            :class:`Backend`, or a factory instance.

    Returns:
        The :class:`BackendFactory`.

    Raises:
        ValueError: an unknown backend name.
        TypeError: neither a name nor a factory.
    """
    if isinstance(backend, BackendFactory):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name such as 'ray' or 'nccl', not "
                        f"{type(backend).__name__}")
    try:
        return _NAMED[Backend(backend)]
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of "
                         f"{', '.join(b.value for b in Backend)}") from None
