"""Backend names and the factories behind them.

``resolve`` turns what a caller passed as ``backend=`` (a name, a :class:`~ray_collective.types.Backend`,
or a :class:`~ray_collective.backends.base.BackendFactory` such as the in-process one used by
tests) into a factory. A backend this build cannot run raises
:class:`~ray_collective.errors.BackendNotAvailableError` that says why.
"""

from __future__ import annotations

from typing import Union

from ..types import Backend
from .base import BackendFactory
from .nccl import NcclBackendFactory
from .ray_backend import RayBackendFactory


_NAMED = {
    Backend.RAY: RayBackendFactory(),
    Backend.NCCL: NcclBackendFactory(),
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
