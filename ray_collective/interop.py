"""Registers the ``ray`` backend in Ray's own ``ray.util.collective``, without importing it.

After ``import ray_collective``, code written for ``ray.util.collective`` runs on this library
by passing ``backend="ray"``. Importing ``ray.util.collective`` costs seconds (it imports torch
when torch is installed), so this module does not import it: if it is loaded already the
backend is registered at once, otherwise a one-shot import hook registers it right after
``ray.util.collective`` is first imported. The group class itself is in
``ray_collective.ray_util_group``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "ray.util.collective"


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
