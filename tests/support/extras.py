"""The test extras (``pip install -e '.[test]'``) a test needs, and what a missing one does.

A developer without one of them (say MPICH) can still run the rest: a test that needs it skips,
saying what to install. CI must not pass that way, since the MPI oracle is the suite's one
independent reference and torch carries the Gloo comparison: ``make test`` and ``.ci/run`` set
``RAY_COLLECTIVE_REQUIRE_EXTRAS=1``, and then ``tests/conftest.py`` stops the run before the
first test if any extra is missing (:func:`missing`), and :func:`need` fails instead of skipping.

Tests bound to an environment rather than to an extra (a GPU, root) skip with the reason
wherever that environment is absent, required or not.
"""

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import List

import pytest

REQUIRE_VARIABLE = "RAY_COLLECTIVE_REQUIRE_EXTRAS"
INSTALL = "pip install -e '.[test]'"
MODULES = {"torch": "torch", "mpi4py": "mpi4py", "matplotlib": "matplotlib", "thinc": "thinc",
           "sklearn": "scikit-learn", "prometheus_client": "ray[default]", "spacy": "spacy",
           "faker": "faker", "sphinx": "sphinx", "myst_parser": "myst-parser",
           "ray.train": "ray[train]", "jax": "jax[cpu]"}
"""Each module of the test extras, and the package that brings it."""
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
"""MPICH's launcher, installed next to the interpreter by the ``mpich`` package."""


def required() -> bool:
    """Whether a missing extra fails the run (``RAY_COLLECTIVE_REQUIRE_EXTRAS=1``) rather than
    skipping the tests that need it.

    Returns:
        True when required.
    """
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def _unavailable(what: str, reason: str) -> None:
    message = f"{reason}: {what} is missing ({INSTALL})"
    if required():
        pytest.fail(f"{message}, and {REQUIRE_VARIABLE} is set", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need(module: str, reason: str) -> ModuleType:
    """The test extra ``module``, imported; skips or fails the calling test without it.

    Args:
        module: a key of :data:`MODULES`.
        reason: what needs it, for the message.

    Returns:
        The module.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        _unavailable(f"{module} (package {MODULES.get(module, module)})", reason)


def need_mpiexec(reason: str) -> str:
    """MPICH's ``mpiexec``; skips or fails the calling test without it.

    Args:
        reason: what needs it, for the message.

    Returns:
        Its path.
    """
    need("mpi4py", reason)
    if not os.access(MPIEXEC, os.X_OK):
        _unavailable(f"MPICH's mpiexec at {MPIEXEC} (package mpich)", reason)
    return MPIEXEC


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a submodule (ray.train) of a package that cannot be imported
        return False


def missing() -> List[str]:
    """The test extras this environment lacks.

    Returns:
        Their package names, empty when every one is installed.
    """
    # Found, not imported: importing torch, thinc and matplotlib would cost the run seconds.
    absent = [package for module, package in MODULES.items() if not _found(module)]
    if not os.access(MPIEXEC, os.X_OK):
        absent.append("mpich")
    return absent
