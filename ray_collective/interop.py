"""Registers the ``ray`` backend in Ray's own ``ray.util.collective``, without importing it.

After ``import ray_collective``, code written for ``ray.util.collective`` runs on this library
by passing ``backend="ray"``. Importing ``ray.util.collective`` costs seconds (it imports torch
when torch is installed), so this module does not import it: if it is loaded already the
backend is registered at once, otherwise a one-shot import hook registers it right after
``ray.util.collective`` is first imported. The group class itself is in
``ray_collective.ray_util_group``.

``ray.util.collective`` keeps its backends per process, and the actors of code that keeps
``import ray.util.collective as col`` never import this library. One call on the driver covers
them: :func:`ray_util_collective_runtime_env` gives the job a ``worker_process_setup_hook``
(Ray runs it in every worker process of the job before any task) that calls :func:`install`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Mapping, Optional

from .errors import ArgumentValueError

_TARGET = "ray.util.collective"

SETUP_HOOK = "ray_collective.interop.install"
"""The ``worker_process_setup_hook`` that registers the backend in a worker (a module path, as
Ray job submission requires)."""


def _register() -> None:
    from .ray_util_group import register
    register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``ray.util.collective`` to register after it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Make ``backend="ray"`` usable from ``ray.util.collective`` in this process."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def ray_util_collective_runtime_env(runtime_env: Optional[Mapping[str, Any]] = None) -> dict:
    """A job runtime_env that makes ``backend="ray"`` work in ``ray.util.collective`` everywhere.

    Pass the result to ``ray.init(runtime_env=...)`` on the driver: every worker process of the
    job then registers the backend when it starts (through Ray's ``worker_process_setup_hook``),
    so actors and tasks that only ``import ray.util.collective`` can create groups with
    ``backend="ray"``, imperatively or through ``create_collective_group``. The driver process
    is registered by this call.

    Args:
        runtime_env: the job's runtime_env otherwise (a dict or ``ray.runtime_env.RuntimeEnv``);
            it is copied, not modified.

    Returns:
        A copy of ``runtime_env`` with ``worker_process_setup_hook`` set to ``SETUP_HOOK``
        (``"ray_collective.interop.install"``).

    Raises:
        ArgumentValueError: ``runtime_env`` has another ``worker_process_setup_hook`` (Ray runs
            one per job): call ``ray_collective.interop.install()`` from that hook instead.
    """
    install()
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook is not None and hook != SETUP_HOOK:
        raise ArgumentValueError(
            f"runtime_env already has the worker_process_setup_hook {hook!r}, and Ray runs one "
            f"per job: call ray_collective.interop.install() from that hook instead")
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env
