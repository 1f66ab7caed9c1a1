"""The backends groups can be created with, by name: the built-in ones and any a program adds.

:data:`BACKENDS` is the one registry of them. ``resolve`` turns what a caller passed as
``backend=`` (a name, a :class:`~ray_collective.types.Backend`, or a
:class:`~ray_collective.backends.base.BackendFactory` such as the in-process one used by tests)
into a factory. A program adds its own backend with ``ray_collective.register_backend(name,
factory)``; the built-in ones are registered the same way below. What a backend can do (GPU
tensors, the multi-GPU calls, which collectives) is declared by its memberships
(:class:`~ray_collective.backends.base.Membership`), not known here.

A backend's modules may be imported when it is first asked for rather than with the package
(:meth:`BackendRegistry.register_loader`): the ``nccl`` backend's eight modules cost every
process that imports ``ray_collective`` about 0.3 MB of heap, which a CPU rank never uses and
which 400 ranks on one machine pay 400 times (docs/running-at-scale.md).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Tuple, Union

from ..errors import ArgumentTypeError, ArgumentValueError, BackendNotAvailableError
from ..types import BACKEND_ALIASES, Backend
from .base import BackendFactory
from .ray import RayBackendFactory

FactoryLoader = Callable[[], BackendFactory]
"""Builds a backend's factory, importing its modules, the first time the backend is used."""


class BackendRegistry:
    """Backend factories by name (case-insensitive)."""

    def __init__(self):
        self._factories: Dict[str, Union[BackendFactory, FactoryLoader]] = {}
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
        self._add(name, factory)

    def register_loader(self, name: str, loader: FactoryLoader) -> None:
        """Make the factory that ``loader()`` returns the backend called ``name``; ``loader``
        runs, once, when the backend is first resolved or synchronized.

        Raises:
            ArgumentValueError: ``name`` is empty, an alias of a built-in backend, or taken.
        """
        self._add(name, loader)

    def _add(self, name: str, entry: Union[BackendFactory, FactoryLoader]) -> None:
        key = name.strip().lower()
        if not key or key in BACKEND_ALIASES:
            raise ArgumentValueError(f"{name!r} cannot name a backend"
                                     + (f": it means {BACKEND_ALIASES[key]!r}" if key else ""))
        with self._lock:
            if key in self._factories:
                raise ArgumentValueError(
                    f"a backend called {key!r} is registered already; choose another name")
            self._factories[key] = entry

    def _load(self, key: str) -> BackendFactory:
        """The factory registered as ``key`` (a known name), its loader run if it has not."""
        with self._lock:
            entry = self._factories[key]
            if not isinstance(entry, BackendFactory):
                entry = self._factories[key] = entry()
            return entry

    def synchronize(self, gpu_id: int) -> None:
        """Wait until the work every GPU backend queued on GPU ``gpu_id`` has finished.

        Raises:
            BackendNotAvailableError: no registered backend can wait for GPUs here.
            ValueError: ``gpu_id`` is not a visible GPU.
        """
        factories = [self._load(key) for key in self.names()]
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
        key = BACKEND_ALIASES.get(key, key)
        if key not in self._factories:
            raise ArgumentValueError(f"unknown backend {backend!r}; choose one of "
                             f"{', '.join(self.names())} (or register yours with "
                             f"ray_collective.register_backend)")
        return self._load(key)


BACKENDS = BackendRegistry()
BACKENDS.register(Backend.RAY.value, RayBackendFactory())


def _nccl_factory() -> BackendFactory:
    from .nccl import NcclBackendFactory
    return NcclBackendFactory()


BACKENDS.register_loader(Backend.NCCL.value, _nccl_factory)
