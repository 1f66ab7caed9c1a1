"""``python -m ray_collective status``: the ``ray`` groups of a running cluster, and what each
rank is doing, read without disturbing any rank.

It reads only what the ranks already publish:

- Ray's key-value store (``backends.ray.rendezvous``), through a plain client of Ray's control
  store (no driver is started, which would take seconds): the groups of the live jobs, each
  incarnation's members (rank, node, pid) and its broken mark;
- Ray's actor table: which actor each member is (matched by node and pid);
- each node's state page of the group (``transport.node_state``): the call each rank started,
  whether it is still in it and since when. A page on this machine is read from its file; a
  page on another machine through that node's post office (a group across nodes has one per
  node) or, for a group on one node, a task placed on that node: both need a Ray driver, so
  they are asked only when a page is not here, and what does not answer within the deadline is
  reported as unreadable.

Groups of the ``nccl`` backend publish nothing of this kind and are not listed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import unquote

from ...transport.node_state import PageSnapshot, RankCall, read_page
from ..key_value import NAMESPACE, KeyValue
from . import private_dirs, rendezvous
from .post_offices import post_office_name, post_office_owners

DEADLINE_S = 1.5
"""What the remote reads may take in all, so that the whole answer comes within 2 s."""


class _ControlStore:
    """Ray's key-value store through a client of Ray's control store (the module interface
    ``KeyValue`` wraps), read-only."""

    def __init__(self, gcs):
        self._gcs = gcs

    def _internal_kv_initialized(self) -> bool:
        return True

    def _internal_kv_get(self, key: bytes, namespace: str) -> Optional[bytes]:
        return self._gcs.internal_kv_get(key, namespace.encode())

    def _internal_kv_list(self, prefix: bytes, namespace: str) -> List[bytes]:
        return self._gcs.internal_kv_keys(prefix, namespace.encode())


CONNECT_S = 2.0
"""How long the command waits for the cluster's control store to accept a connection (Ray's
own client would retry for most of a minute at an address where nothing listens)."""


def _control_store_client(address: Optional[str]):
    """A client of the cluster's control store, found as ``ray status`` finds it: ``address``,
    else ``RAY_ADDRESS``, else the one cluster running on this machine. A cluster with token
    authentication is joined with the token where it was found on this machine (as
    ``ray.init`` does); one named by address only with ``RAY_AUTH_MODE=token`` set.

    Raises:
        ConnectionError: no cluster, several, nothing listening at the address, or a
            cluster that wants a token this process does not send; the message says what
            to do.
    """
    import ray._raylet
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray.exceptions import AuthenticationError, RpcError
    found_here = (address or os.environ.get("RAY_ADDRESS")) in (None, "", "auto")
    try:
        bootstrap = canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as err:
        if "multiple" in str(err).lower():
            raise
        raise ConnectionError(f"{err} (start a cluster with `ray start --head`, or run a "
                              f"script that calls ray.init() and leave it running)") from None
    host, _, port = bootstrap.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except (OSError, ValueError) as err:
        raise ConnectionError(f"no Ray cluster answers at {bootstrap} ({err}); pass "
                              f"--address HOST:PORT of a running cluster (what ray.init() "
                              f"printed, or `ray status` shows)") from None
    try:
        try:
            return _quietly(ray._raylet.GcsClient, bootstrap)
        except AuthenticationError:
            if not found_here or "RAY_AUTH_MODE" in os.environ:
                raise
            from ray._private.authentication.authentication_token_setup import \
                maybe_enable_token_auth_if_token_available
            # Its warning speaks of starting a cluster; this command only reads one.
            logging.getLogger(maybe_enable_token_auth_if_token_available.__module__).setLevel(
                logging.ERROR)
            if not maybe_enable_token_auth_if_token_available(warn_if_disabled=False):
                raise
            return _quietly(ray._raylet.GcsClient, bootstrap)
    except AuthenticationError:
        raise ConnectionError(
            f"the cluster at {bootstrap} uses token authentication: set RAY_AUTH_MODE=token "
            f"and give its token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN "
            f"(`ray get-auth-token` prints it on the head node)") from None
    except RpcError as err:
        raise ConnectionError(f"the cluster at {bootstrap} did not answer: "
                              f"{str(err).splitlines()[0]}") from None


def _quietly(connect, address: str):
    """``connect(address=address)`` with this process's stderr closed meanwhile: Ray's client
    logs each refused attempt there in lines of its own, and the command says in one line
    what went wrong."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        return connect(address=address)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _actors(gcs) -> Dict[Tuple[str, int], Tuple[str, str]]:
    """``{(node id, pid): (class name, actor id)}`` of the live actors (empty if Ray's private
    interface for it is missing)."""
    async def actor_table():
        return await gcs.async_get_all_actor_info(timeout=DEADLINE_S)

    try:
        from ray.core.generated.gcs_pb2 import ActorTableData
        table = asyncio.run(actor_table())
    except Exception:  # noqa: BLE001 - a private interface of Ray's: the column stays empty
        return {}
    found = {}
    for actor_id, info in table.items():
        if info.state == ActorTableData.ALIVE:
            found[(info.address.node_id.hex(), info.pid)] = (info.class_name, actor_id.hex())
    return found


def _groups(kv: KeyValue, live_jobs: set, wanted: Optional[str]) -> List[Dict[str, Any]]:
    """The current incarnation of every group of the live jobs (only ``wanted``, if given)."""
    groups = []
    for key in kv.keys(""):
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != "token" or parts[0] not in live_jobs:
            continue
        job_id, name = parts[0], unquote(parts[1])
        if wanted is not None and name != wanted:
            continue
        prefix = rendezvous.group_prefix(job_id, name)
        token = kv.get(prefix + "token")
        if not token:
            continue
        members = sorted(rendezvous.registered_members(kv, prefix, token), key=lambda m: m.rank)
        try:
            broken = rendezvous.broken_by(kv, prefix, token)
        except ValueError:
            broken = None
        groups.append({"job": job_id, "name": name, "token": token, "members": members,
                       "broken": broken})
    return sorted(groups, key=lambda g: (g["name"], g["job"]))


def _pages(group: Dict[str, Any], sessions: Dict[str, str]
           ) -> Tuple[Dict[str, Any], List[str]]:
    """The state pages of ``group``'s nodes found on this machine, by node, and the nodes
    whose page is elsewhere."""
    world_size = max((m.rank for m in group["members"]), default=-1) + 1
    found, elsewhere = {}, []
    for node in sorted({m.node for m in group["members"]}):
        directory = private_dirs.existing_node_directory(
            sessions.get(node, ""), group["job"], group["name"], group["token"], node)
        if directory is None:
            elsewhere.append(node)
            continue
        try:
            found[node] = read_page(directory, world_size)
        except (OSError, ValueError):
            elsewhere.append(node)
    return found, elsewhere


def _read_page_there(session_dir: str, job_id: str, group_name: str, token: str, node: str,
                     world_size: int):
    """Runs on ``node`` (a task placed there): its page of the group, as the post office gives
    it."""
    directory = private_dirs.existing_node_directory(session_dir, job_id, group_name, token,
                                                     node)
    if directory is None:
        return None
    snapshot = read_page(directory, world_size)
    return [tuple(rank) for rank in snapshot.ranks], snapshot.aborted


def _remote_pages(address: Optional[str], asks: List[Tuple[Dict[str, Any], str]],
                  sessions: Dict[str, str]) -> Dict[Tuple[str, str], Any]:
    """The pages of other machines' nodes, through their post offices or a task placed there;
    ``{(group token, node): snapshot}`` for those that answered within ``DEADLINE_S``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    refs = {}
    reader = ray.remote(num_cpus=0)(_read_page_there)
    for group, node in asks:
        world_size = len(group["members"])
        owners = post_office_owners(group["members"])
        if len(owners) > 1:
            try:
                office = ray.get_actor(post_office_name(group["name"], owners[node], node),
                                       namespace=NAMESPACE)
            except ValueError:
                continue
            refs[(group["token"], node)] = office.page.remote(bytes.fromhex(group["token"]))
        else:
            refs[(group["token"], node)] = reader.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                sessions.get(node, ""), group["job"], group["name"], group["token"], node,
                world_size)
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=DEADLINE_S)
    answered = {}
    for key, ref in refs.items():
        if ref in ready:
            try:
                value = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the reader failed: that node stays unreadable
                continue
            if value is not None:
                ranks, aborted = value
                answered[key] = PageSnapshot([RankCall(*rank) for rank in ranks], aborted)
    return answered


def collect(address: Optional[str] = None, group_name: Optional[str] = None,
            remote: bool = True) -> Dict[str, Any]:
    """What ``status --json`` prints: every ``ray`` group of the cluster's live jobs.

    Args:
        address: the cluster (default: ``RAY_ADDRESS``, else the one started on this machine).
        group_name: only this group.
        remote: read the pages of other machines (through a Ray driver); False reports them
            as unreadable.

    Returns:
        ``{"groups": [...]}``, each group ``{"name", "job", "backend", "world_size",
        "members": [{"rank", "node", "pid", "actor", "call": {"seq", "collective",
        "since_s"} or None}], "waiting_for", "broken", "unreadable_nodes"}``.

    Raises:
        ConnectionError: no cluster at ``address``.
    """
    gcs = _control_store_client(address)
    kv = KeyValue(_ControlStore(gcs))
    live_jobs = {job_id.hex() for job_id, job in gcs.get_all_job_info().items()
                 if not job.is_dead}
    sessions = {node_id.hex(): info.session_dir
                for node_id, info in gcs.get_all_node_info().items()}
    groups = _groups(kv, live_jobs, group_name)
    actors = _actors(gcs) if groups else {}
    pages, asks = {}, []
    for group in groups:
        found, elsewhere = _pages(group, sessions)
        pages.update({(group["token"], node): page for node, page in found.items()})
        asks += [(group, node) for node in elsewhere]
    if asks and remote:
        pages.update(_remote_pages(address, asks, sessions))
    return {"groups": [_describe(group, pages, actors) for group in groups]}


def _describe(group: Dict[str, Any], pages: Dict[Tuple[str, str], Any],
              actors: Dict[Tuple[str, int], Tuple[str, str]]) -> Dict[str, Any]:
    """One group of ``collect``'s answer."""
    members, started, aborted = [], {}, None
    for member in group["members"]:
        page = pages.get((group["token"], member.node))
        call = None
        if page is not None and member.rank < len(page.ranks):
            rank_call = page.ranks[member.rank]
            started[member.rank] = rank_call.started
            aborted = aborted or page.aborted
            if rank_call.in_call:
                call = {"seq": rank_call.started - 1, "collective": rank_call.collective,
                        "since_s": round(rank_call.since_s, 3)}
        actor_class, actor_id = actors.get((member.node, member.pid), ("", ""))
        members.append({"rank": member.rank, "node": member.node, "pid": member.pid,
                        "actor": f"{actor_class} {actor_id}".strip(), "call": call})
    newest = max(started.values(), default=0)
    in_progress = any(m["call"] is not None and m["call"]["seq"] == newest - 1
                      for m in members)
    waiting_for = sorted(r for r, s in started.items() if s < newest) if in_progress else []
    return {"name": group["name"], "job": group["job"], "backend": "ray",
            "world_size": len(group["members"]), "members": members,
            "waiting_for": waiting_for, "broken": group["broken"] or aborted,
            "unreadable_nodes": sorted({m.node for m in group["members"]
                                        if (group["token"], m.node) not in pages})}


def format_table(answer: Dict[str, Any]) -> str:
    """``collect``'s answer as text: one block per group, one line per rank."""
    if not answer["groups"]:
        return "no ray_collective group in this cluster's live jobs"
    blocks = []
    for group in answer["groups"]:
        lines = [f"group '{group['name']}' (job {group['job']}): backend {group['backend']}, "
                 f"{group['world_size']} ranks"]
        if group["broken"]:
            broken = group["broken"]
            lines.append(f"  BROKEN by rank {broken.get('rank', '?')}: "
                         f"{broken.get('kind', 'an error')}: "
                         f"{str(broken.get('message', ''))[:160]}")
        lines.append(f"  {'rank':>4}  {'node':<10} {'pid':>7}  {'actor':<32} call")
        for member in group["members"]:
            call = member["call"]
            doing = "idle" if call is None else \
                f"{call['collective'] or '?'} #{call['seq']} for {call['since_s']:.1f} s"
            if group["unreadable_nodes"] and member["node"] in group["unreadable_nodes"]:
                doing = "? (its node's page could not be read)"
            lines.append(f"  {member['rank']:>4}  {member['node'][:8]:<10} {member['pid']:>7}  "
                         f"{member['actor'][:32]:<32} {doing}")
        if group["waiting_for"]:
            lines.append(f"  waiting for ranks {group['waiting_for']} to enter the newest "
                         f"call")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``status`` to ``parser``; returns it."""
    parser.add_argument("group", nargs="?", help="only this group")
    parser.add_argument("--address", help="the cluster's address, HOST:PORT (default: "
                                           "RAY_ADDRESS, else the one cluster running on this "
                                           "machine, as `ray status` finds it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--local-only", action="store_true",
                        help="read only the state pages on this machine (no Ray driver)")
    return parser


DESCRIPTION = ("Show the ray_collective groups of a running Ray cluster: their members, the "
               "call each rank is in, and the ranks a call waits for.")


def run(args: argparse.Namespace) -> int:
    """Run ``status`` with the options ``add_arguments`` parsed.

    Returns:
        0 once printed; 1 when no cluster could be read (one line on stderr says why and
        what to do).
    """
    started = time.monotonic()
    try:
        answer = collect(args.address, args.group, remote=not args.local_only)
    except ConnectionError as err:
        print(f"ray_collective status: {err}", file=sys.stderr)
        return 1
    answer["took_s"] = round(time.monotonic() - started, 3)
    print(json.dumps(answer) if args.json else format_table(answer))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ray_collective status [GROUP] [--address ADDRESS] [--json] [--local-only]``.

    Returns:
        0 once printed (or on ``--help``); 1 when no cluster could be read; 2 for options
        it does not take.
    """
    parser = add_arguments(argparse.ArgumentParser(prog="python -m ray_collective status",
                                                   description=DESCRIPTION))
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return run(args)
