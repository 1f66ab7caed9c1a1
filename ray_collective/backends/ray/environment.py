"""What the ``ray`` backend reads from its process: Ray's runtime and the environment variables.

Ray is imported only here and only when a group is made (``import ray_collective`` needs only
numpy). ``RAY_COLLECTIVE_CROSS_NODE`` chooses how a group's messages cross nodes,
``RAY_COLLECTIVE_PURE_PYTHON`` turns the native core off.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from typing import Tuple

from ... import native
from ...errors import ArgumentValueError, BackendNotAvailableError

_LOG = logging.getLogger(__name__)

CROSS_NODE_VARIABLE = "RAY_COLLECTIVE_CROSS_NODE"
STREAMS, OBJECT_STORE = "streams", "object_store"
CROSS_NODE_TRANSPORTS = (STREAMS, OBJECT_STORE)


def cross_node_transport(group_name: str, rank: int) -> str:
    """The transport between nodes this rank asks for: ``RAY_COLLECTIVE_CROSS_NODE``
    (``streams`` when unset), or ``object_store`` where Ray runs with TLS.

    The streams do not speak TLS: where Ray encrypts its own traffic (``RAY_USE_TLS``), a
    group's messages between nodes keep to Ray's channels (the object store), with a warning.

    Raises:
        ArgumentValueError: the variable names no transport.
    """
    value = os.environ.get(CROSS_NODE_VARIABLE, "").strip() or STREAMS
    if value not in CROSS_NODE_TRANSPORTS:
        raise ArgumentValueError(
            f"group '{group_name}', rank {rank}: {CROSS_NODE_VARIABLE}={value!r} names no "
            f"transport between nodes; use 'streams' (direct TCP streams, the default) or "
            f"'object_store' (Ray actor tasks and its object store)")
    if value == STREAMS and os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        _LOG.warning("group '%s', rank %d: Ray runs with TLS (RAY_USE_TLS) and the streams "
                     "between nodes do not; this group's messages between nodes go through "
                     "Ray's object store instead", group_name, rank)
        return OBJECT_STORE
    return value


def ray_module():
    """Ray itself, imported on first use (``import ray_collective`` does not import Ray)."""
    import ray
    return ray


def runtime() -> Tuple[str, str, str]:
    """(job id, node id, session directory) of this process."""
    ray = ray_module()
    if not ray.is_initialized():
        raise BackendNotAvailableError(
            "the 'ray' backend needs Ray: call ray.init() first (inside actors and tasks Ray "
            "is already initialized)")
    context = ray.get_runtime_context()
    try:
        from ray._private.worker import global_worker
        session = global_worker.node.get_session_dir_path()
    except AttributeError:
        session = tempfile.gettempdir()
    return context.get_job_id(), context.get_node_id(), session


def finished_jobs() -> set:
    """Ids of the jobs of this Ray cluster that have finished (empty if Ray cannot say)."""
    # Through the process's own connection to Ray's control store: ray._private.state's
    # job_table() opens a second one in a worker (an eventfd, an epoll and a timer
    # descriptor, kept for the life of the process).
    try:
        from ray._private.worker import global_worker
        jobs = global_worker.gcs_client.get_all_job_info()
        return {job_id.hex() for job_id, job in jobs.items() if job.is_dead}
    except Exception:  # noqa: BLE001 - a private API of Ray: without it, nothing is swept
        return set()


def dead_nodes() -> set:
    """Ids of the nodes Ray's control store counts as dead (empty if Ray cannot say)."""
    # Through the process's own connection to the store, as finished_jobs does.
    try:
        from ray._private.worker import global_worker
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
        nodes = global_worker.gcs_client.get_all_node_info()
        return {node_id.hex() for node_id, node in nodes.items()
                if node.state != GcsNodeInfo.ALIVE}
    except Exception:  # noqa: BLE001 - a private API of Ray: without it, no node is known dead
        return set()


PURE_PYTHON_VARIABLE = "RAY_COLLECTIVE_PURE_PYTHON"
"""Set to 1 (or true) to run every collective on the pure-Python engine, native core or not."""
NATIVE, PYTHON = "native", "python"


def engine_wanted(group_name: str, rank: int) -> str:
    """The engine this rank can run collectives on: ``native`` where the C core imports and
    ``RAY_COLLECTIVE_PURE_PYTHON`` is not set, else ``python`` (with a warning when the core is
    missing: it should have been built by ``pip install``).

    Raises:
        ArgumentValueError: the variable holds neither a true nor a false value.
    """
    value = os.environ.get(PURE_PYTHON_VARIABLE, "").strip().lower()
    if value in ("1", "true", "yes"):
        return PYTHON
    if value not in ("", "0", "false", "no"):
        raise ArgumentValueError(
            f"group '{group_name}', rank {rank}: {PURE_PYTHON_VARIABLE}={value!r}; set it to 1 "
            f"for the pure-Python engine, or 0 (or leave it unset) for the native core")
    if native.available():
        return NATIVE
    warnings.warn(f"ray_collective's native core is not available ({native.import_error()}); "
                  f"collectives run on the pure-Python engine, several times slower for small "
                  f"messages. Reinstall the package with a C compiler present "
                  f"(pip install -e . builds it)", RuntimeWarning, stacklevel=2)
    return PYTHON
