"""The backends groups can be created with, by name: the built-in ones and any a program adds.

:data:`BACKENDS` is the one registry of them. ``resolve`` turns what a caller passed as
``backend=`` (a name, a :class:`~ray_collective.types.Backend`, or a
:class:`~ray_collective.backends.base.BackendFactory` such as the in-process one used by tests)
into a factory. A program adds its own backend with ``ray_collective.register_backend(name,
factory)``; the built-in ones are registered the same way below. What a backend can do (GPU
tensors, the multi-GPU calls, which collectives) is declared by its memberships
(:class:`~ray_collective.backends.base.Membership`), not known here.
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple, Union

from ..errors import ArgumentTypeError, ArgumentValueError, BackendNotAvailableError
from ..types import BACKEND_ALIASES, Backend
from .base import BackendFactory
from .nccl import NcclBackendFactory
from .ray_backend import RayBackendFactory


class BackendRegistry:
    """Backend factories by name (case-insensitive)."""

    def __init__(self):
        self._factories: Dict[str, BackendFactory] = {}
        self._lock = threading.Lock()

    def register(self, name: str, factory: BackendFactory) -> None:
        """Make ``factory`` the backend called ``name``.

        Raises:
            ArgumentTypeError: ``name`` is not a string or ``factory`` not a BackendFactory.
            ArgumentValueError: ``name`` is empty, an alias of a built-in backend, or taken.
        """
        if not isinstance(name, str):
            raise ArgumentTypeError(f"a backend name must be a str, not {type(name).__name__}")
        if not isinstance(factory, BackendFactory):
            raise ArgumentTypeError(
                f"backend {name!r}: the factory must be a "
                f"ray_collective.backends.base.BackendFactory, not {type(factory).__name__}")
        key = name.strip().lower()
        if not key or key in BACKEND_ALIASES:
            raise ArgumentValueError(f"{name!r} cannot name a backend"
                                     + (f": it means {BACKEND_ALIASES[key]!r}" if key else ""))
        with self._lock:
            if key in self._factories:
                raise ArgumentValueError(
                    f"a backend called {key!r} is registered already; choose another name")
            self._factories[key] = factory

    def synchronize(self, gpu_id: int) -> None:
        """Wait until the work every GPU backend queued on GPU ``gpu_id`` has finished.

        Raises:
            BackendNotAvailableError: no registered backend can wait for GPUs here.
            ValueError: ``gpu_id`` is not a visible GPU.
        """
        with self._lock:
            factories = list(self._factories.values())
        waited, unavailable = False, None
        for factory in factories:
            try:
                waited = factory.synchronize(gpu_id) or waited
            except BackendNotAvailableError as err:
                unavailable = err
        if not waited:
            raise unavailable or BackendNotAvailableError(
                "synchronize needs a GPU backend (such as 'nccl'), and none of the registered "
                f"backends ({', '.join(self.names())}) runs on GPUs here")

    def names(self) -> Tuple[str, ...]:
        """The registered names, built-in ones first."""
        return tuple(self._factories)

    def resolve(self, backend: Union[str, Backend, BackendFactory]) -> BackendFactory:
        """The factory for ``backend``.

        Args:
            backend: a registered name (case-insensitive; ``"gloo"`` means ``"ray"``), a
                :class:`Backend`, or a factory instance.

        Returns:
            The :class:`BackendFactory`.

        Raises:
            ArgumentValueError: an unknown backend name.
            ArgumentTypeError: neither a name nor a factory.
        """
        if isinstance(backend, BackendFactory):
            return backend
        if not isinstance(backend, str):
            raise ArgumentTypeError(f"backend must be a name such as 'ray' or 'nccl', not "
                            f"{type(backend).__name__}")
        key = backend.value if isinstance(backend, Backend) else backend.strip().lower()
        factory = self._factories.get(BACKEND_ALIASES.get(key, key))
        if factory is None:
            raise ArgumentValueError(f"unknown backend {backend!r}; choose one of "
                             f"{', '.join(self.names())} (or register yours with "
                             f"ray_collective.register_backend)")
        return factory


BACKENDS = BackendRegistry()
BACKENDS.register(Backend.RAY.value, RayBackendFactory())
BACKENDS.register(Backend.NCCL.value, NcclBackendFactory())
