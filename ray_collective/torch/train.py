"""Ray Train: the backend registered in every Train worker before Train initialises torch.

``TorchTrainer`` calls ``dist.init_process_group(backend=...)`` in its workers before the
training function runs, so ``import ray_collective.torch`` inside that function is too late.
:func:`worker_runtime_env` gives a runtime environment for ``RunConfig(worker_runtime_env=)``
that runs :func:`~ray_collective.torch.register` as each worker process starts. It uses Ray's
worker setup hook, set on the workers alone: ``ray.init(runtime_env={"worker_process_setup_hook":
"ray_collective.torch.register"})`` sets the same hook for every worker of the job, but only in
``ray.init``, and it would load torch into every actor of the job.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..errors import ArgumentValueError

SETUP_HOOK = "ray_collective.torch.register"
"""What each Train worker runs as it starts: the module path of :func:`register`."""


def worker_runtime_env(runtime_env: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A runtime environment for Ray Train's workers in which backend ``"ray_collective"``
    is registered before Train initialises the process group.

    Use it as ``RunConfig(worker_runtime_env=worker_runtime_env())`` with
    ``TorchConfig(backend="ray_collective")``.

    Args:
        runtime_env: a runtime environment of the workers' own to add the hook to (not
            changed).

    Returns:
        A copy of ``runtime_env`` (or a new one) whose ``env_vars`` name the setup hook.

    Raises:
        ArgumentValueError: ``runtime_env`` sets a worker setup hook of its own.
    """
    from ray._private import ray_constants

    variable = ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    merged = dict(runtime_env or {})
    env_vars = dict(merged.get("env_vars") or {})
    if "worker_process_setup_hook" in merged or env_vars.get(variable, SETUP_HOOK) != SETUP_HOOK:
        raise ArgumentValueError(
            "runtime_env already sets a worker setup hook; call ray_collective.torch.register() "
            "from it instead of using worker_runtime_env()")
    env_vars[variable] = SETUP_HOOK
    merged["env_vars"] = env_vars
    return merged
