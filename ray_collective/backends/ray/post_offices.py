"""The post office actors of a group, as its ranks name, start, reach and stop them.

One post office per node of a group that spans nodes (``post_office.PostOffice``), started by
the node's lowest rank, named after the incarnation's key and the node in the namespace
``key_value.NAMESPACE``. :class:`RayPostOffices` is how a rank reaches the others' (the
transport's ``PostOffices``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from ...transport.post_office_carrier import PostOffices
from ...transport.processes import process_alive
from ..key_value import NAMESPACE
from .environment import ray_module
from .post_office import POST_OFFICE_PID_FILE, PostOffice, pack_round

POST_OFFICE_NAME_PREFIX = "post-office-"
"""How the Ray actor names of post offices begin (in the namespace ``key_value.NAMESPACE``)."""


def post_office_name(group_key: bytes, node: str) -> str:
    """The Ray actor name of a group's post office on ``node``."""
    return f"{POST_OFFICE_NAME_PREFIX}{group_key.hex()}-{node[:16]}"


POST_OFFICE_JOIN_WAIT_S = 5.0
"""The longest a join waits for its node's post office to start (``wait_until_started``): on 2
to 4 nodes of a 2-core machine it runs 1.5-2.5 s after it was started, and the group's first
calls would share the cores with its start; over 8 nodes of 256 ranks it took 13.5 s, which a
join should not add to its own time (the first calls then share the cores instead)."""

POST_OFFICE_LOOKUP_S = 10.0
"""How long a rank looks for another node's post office by name before it counts it as gone."""


class RayPostOffices(PostOffices):
    """Reaches the other nodes of a group through their post office actors, and reads the
    failure published for the whole group with ``read_abort`` (the incarnation's broken mark
    in Ray's key-value store)."""

    def __init__(self, group_key: bytes, node: str, other_nodes: Sequence[str],
                 deadline_s: float, directory: str,
                 read_abort: Callable[[], Optional[dict]]):
        self.group_key = group_key
        self._read_abort = read_abort
        self.node = node
        self.other_nodes = tuple(other_nodes)
        self.deadline_s = deadline_s
        self._pid_file = os.path.join(directory, POST_OFFICE_PID_FILE)
        self._local_pid: Optional[int] = None
        self._local_seen = False
        self._local_lookup_until = time.monotonic() + POST_OFFICE_LOOKUP_S
        self._next_local_lookup = 0.0
        self._handles: Dict[str, object] = {}
        self._gone: set = set()

    def _handle(self, node: str):
        """The post office of ``node``; None once it is known to be gone.

        Its creator starts it right after joining, so its name may be missing for a moment
        after the group forms; a name missing ``POST_OFFICE_LOOKUP_S`` after that is a post
        office that died.
        """
        if node in self._gone:
            return None
        handle = self._handles.get(node)
        if handle is None:
            ray = ray_module()
            deadline = min(self._local_lookup_until, time.monotonic() + self.deadline_s)
            while handle is None:
                try:
                    handle = ray.get_actor(post_office_name(self.group_key, node),
                                           namespace=NAMESPACE)
                except ValueError:
                    if time.monotonic() > deadline:
                        self._gone.add(node)
                        return None
                    time.sleep(0.01)
            self._handles[node] = handle
        return handle

    def deliver(self, node, messages) -> None:
        handle = self._handle(node)
        if handle is not None:  # else the receivers' wait finds the post office gone
            messages, parts = pack_round(messages)
            handle.deliver.remote(messages, *parts)

    def _ask(self, node: str, method: str, *args):
        """The post office's answer; None when it is dead, [] when it does not answer soon."""
        ray = ray_module()
        handle = self._handle(node)
        if handle is None:
            return None
        try:
            return ray.get(getattr(handle, method).remote(*args), timeout=10)
        except ray.exceptions.RayActorError:
            self._gone.add(node)
            return None
        except ray.exceptions.GetTimeoutError:
            return []

    def dead_ranks(self, node, ranks) -> Optional[List[int]]:
        return self._ask(node, "dead_ranks", ranks)

    def local_post_office_alive(self) -> bool:
        if self._local_pid is None:
            try:
                with open(self._pid_file) as source:
                    self._local_pid = int(source.read())
            except (OSError, ValueError):
                return self._local_name_alive()
        return process_alive(self._local_pid)

    def _local_name_alive(self) -> bool:
        """Before the post office has written its pid (it may have died first): whether its
        name is registered, asked at most once a second. A name once seen and then gone, or
        never seen within ``POST_OFFICE_LOOKUP_S`` of joining, is a dead post office."""
        now = time.monotonic()
        if now < self._next_local_lookup:
            return True
        self._next_local_lookup = now + 1.0
        try:
            ray_module().get_actor(post_office_name(self.group_key, self.node), namespace=NAMESPACE)
        except ValueError:
            return not self._local_seen and now < self._local_lookup_until
        self._local_seen = True
        return True

    def responsive(self, node, ranks, seq) -> List[int]:
        return self._ask(node, "responsive", ranks, seq) or []

    def published_abort(self) -> Optional[dict]:
        try:
            return self._read_abort()
        except Exception:  # noqa: BLE001 - a store gone with the job, or a mark not ours
            return None

    def abort(self, record) -> None:
        # Finding the post offices asks Ray's control store, which took up to a second on the
        # loaded test cluster; the rank that aborts raises its error without waiting for that
        # (its streams have carried the abort already). Measured: the survivors of a killed
        # rank raised 1.4-3.6 s after the kill with this done inline.
        threading.Thread(target=self._abort_other_nodes, args=(record,), daemon=True,
                         name="ray_collective-abort").start()

    def _abort_other_nodes(self, record) -> None:
        for node in self.other_nodes:
            try:
                handle = self._handle(node)
                if handle is not None:  # else that node's ranks find their post office gone
                    handle.abort.remote(record)
            except Exception:  # noqa: BLE001 - Ray may be shutting down with the job
                return


def shut_post_office(group_key: bytes, node: str) -> None:
    """Stop the group's post office on ``node``, if it is there."""
    ray = ray_module()
    try:
        handle = ray.get_actor(post_office_name(group_key, node), namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(handle.shutdown.remote(), timeout=10)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass
    ray.kill(handle)


def start_post_office(directory: str, group_name: str, group_key: bytes, world_size: int,
                       node: str, local_pids: Dict[int, int], timeout: float):
    """Start the group's post office on ``node`` (the caller, the node's lowest rank, holds the
    returned handle: the actor lives as long as it does)."""
    ray = ray_module()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(PostOffice).options(
        name=post_office_name(group_key, node), namespace=NAMESPACE, num_cpus=0,
        max_concurrency=1, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    return actor.remote(directory, group_name, group_key, world_size, local_pids, timeout)


def wait_until_started(handle, timeout: float) -> bool:
    """Wait until the post office ``handle`` names runs (its worker process started and its
    constructor ran), at most ``timeout`` seconds: the join pays for its start rather than
    the group's first calls, whose ranks would share the cores with it.

    Args:
        handle: what ``start_post_office`` returned.
        timeout: seconds to wait.

    Returns:
        Whether it runs. One that does not yet is looked for by name later, and counted as
        lost if it never appears (``RayPostOffices``); one that failed to start raises nothing
        here, for the same reason.
    """
    ray = ray_module()
    ready, _ = ray.wait([handle.__ray_ready__.remote()], timeout=timeout)
    if not ready:
        return False
    try:
        ray.get(ready[0])
    except ray.exceptions.RayError:
        return False
    return True
