"""The post office actors of a group, as its ranks name, start, reach and stop them.

One post office per node and incarnation of a group that spans nodes
(``post_office.PostOffice``), in one actor per group and node (``post_office.PostOfficeHost``)
started by the node's lowest rank and reused by it for the group's next incarnations, named
after the group, that rank's process and the node in the namespace ``key_value.NAMESPACE``.
:class:`RayPostOffices` is how a rank reaches the others' (the transport's ``PostOffices``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...errors import GroupError
from ...transport.post_office_carrier import PostOffices
from ...transport.processes import process_alive
from ..key_value import NAMESPACE
from .environment import ray_module
from ...transport.post_office import POST_OFFICE_PID_FILE, PostOfficeHost, pack_round
from .rendezvous import Member

POST_OFFICE_NAME_PREFIX = "post-office-"
"""How the Ray actor names of post offices begin (in the namespace ``key_value.NAMESPACE``)."""


def post_office_name(group_name: str, owner_pid: int, node: str) -> str:
    """The Ray actor name of a group's post offices on ``node``, started by the process
    ``owner_pid`` (the node's lowest rank): unique while that process lives, and the same for
    every incarnation it starts them for."""
    group = hashlib.sha256(group_name.encode()).hexdigest()[:16]
    return f"{POST_OFFICE_NAME_PREFIX}{group}-{owner_pid}-{node[:16]}"


def post_office_owners(members: Sequence[Member]) -> Dict[str, int]:
    """The process id of each node's lowest rank (which starts the node's post office)."""
    owners: Dict[str, Tuple[int, int]] = {}
    for member in members:
        if member.node not in owners or member.rank < owners[member.node][0]:
            owners[member.node] = (member.rank, member.pid)
    return {node: pid for node, (_, pid) in owners.items()}


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

    def __init__(self, group_name: str, group_key: bytes, node: str, owners: Dict[str, int],
                 deadline_s: float, directory: str,
                 read_abort: Callable[[], Optional[dict]]):
        self.group_key = group_key
        self._read_abort = read_abort
        self.node = node
        self._names = {n: post_office_name(group_name, pid, n) for n, pid in owners.items()}
        self.other_nodes = tuple(sorted(n for n in owners if n != node))
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
                    handle = ray.get_actor(self._names[node], namespace=NAMESPACE)
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
            handle.deliver.remote(self.group_key, messages, *parts)

    def _ask(self, node: str, method: str, *args):
        """The post office's answer; None when it is dead, [] when it does not answer soon."""
        ray = ray_module()
        handle = self._handle(node)
        if handle is None:
            return None
        try:
            return ray.get(getattr(handle, method).remote(self.group_key, *args), timeout=10)
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
                # In binary: the text layer's decoder costs a first call as much as the read.
                with open(self._pid_file, "rb") as source:
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
            ray_module().get_actor(self._names[self.node], namespace=NAMESPACE)
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
                    handle.abort.remote(self.group_key, record)
            except Exception:  # noqa: BLE001 - Ray may be shutting down with the job
                return


def shut_post_office(group_name: str, group_key: bytes, owner_pid: int, node: str) -> None:
    """Shut the incarnation's post office on ``node``, and stop the actor that held it if it
    holds no other incarnation's.

    Args:
        group_name: the group.
        group_key: the incarnation's key.
        owner_pid: the process that started the node's post office (``post_office_owners``).
        node: the node.
    """
    ray = ray_module()
    try:
        handle = ray.get_actor(post_office_name(group_name, owner_pid, node), namespace=NAMESPACE)
    except ValueError:
        return
    try:
        left = ray.get(handle.close.remote(group_key), timeout=10)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        left = 0
    if left == 0:
        ray.kill(handle)


def open_post_office(directory: str, group_name: str, group_key: bytes, world_size: int,
                     node: str, local_pids: Dict[int, int], timeout: float,
                     reuse: Optional[object] = None) -> Tuple[object, bool]:
    """Open the incarnation's post office on ``node`` in the actor ``reuse`` (the previous
    incarnation's, which this process started), or in a new one where there is none or it
    is gone. The caller, the node's lowest rank, holds the returned handle: the actor lives
    as long as it does.

    Args:
        directory, group_name, group_key, world_size, local_pids, timeout: the post office's
            (see ``post_office.PostOffice``).
        node: this node.
        reuse: the actor of the group's previous incarnation on this node, or None.

    Returns:
        ``(the actor's handle, whether it was started now)``: a new one's worker process is
        still starting (see ``wait_until_started``).

    Raises:
        GroupError: the actor's name stayed taken by one that was stopping for ``timeout``
            seconds.
    """
    ray = ray_module()
    arguments = (directory, group_name, group_key, world_size, local_pids, timeout)
    name = post_office_name(group_name, os.getpid(), node)
    deadline = time.monotonic() + timeout
    while True:
        if reuse is not None and _opened_in(reuse, arguments, timeout):
            return reuse, False
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        try:
            return ray.remote(PostOfficeHost).options(
                name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=1, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                    *arguments), True
        except ValueError:
            pass  # the name is this process's actor of an earlier group of this name
        try:
            reuse = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            reuse = None
        if time.monotonic() > deadline:
            raise GroupError(
                f"group '{group_name}': this node's post office actor {name} could not be "
                f"started in {timeout:g} s: the name stayed taken by one that was stopping; "
                f"join again")
        time.sleep(0.01)


def _opened_in(actor, arguments: tuple, timeout: float) -> bool:
    """Whether the incarnation's post office opened in ``actor`` (False where it is gone or
    stopping)."""
    ray = ray_module()
    try:
        ray.get(actor.open.remote(*arguments), timeout=timeout)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        return False
    return True


def wait_until_started(handle, timeout: float) -> bool:
    """Wait until the post office ``handle`` names runs (its worker process started and its
    constructor ran), at most ``timeout`` seconds: the join pays for its start rather than
    the group's first calls, whose ranks would share the cores with it.

    Args:
        handle: what ``open_post_office`` returned.
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
