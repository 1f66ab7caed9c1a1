"""A test bed of Ray nodes with networks of their own: one network namespace per node, each
joined by one veth link to a bridge in a namespace of its own, each link rate-limited by ``tc``.

``python -m benchmarks.netbed up --nodes 2 --link 1gbit`` brings one up, ``status`` shows the
beds on this machine, ``down`` removes them; the tests (``tests/test_netbed.py``) and the
benchmarks on the bed (``benchmarks.netbed_bench``) use :class:`Bed` as a context manager.

Layout of bed ``rcnb<id>`` with N nodes:

- namespace ``rcnb<id>-sw`` holds bridge ``br0`` (the switch) and the switch ends ``v0``..;
- namespace ``rcnb<id>-n<k>`` holds node k: ``lo`` (up) and ``eth0`` at ``10.213.0.<k+1>/24``,
  the other end of ``v<k>``; no default route, so nothing leaves the bed;
- the link's rate is a token bucket (``tbf``) on both of its ends' egress (``eth0``: what the
  node sends, ``v<k>``: what it receives), as a full-duplex link; no delay (``netem`` is not in
  every kernel), so the bed models bandwidth, not latency;
- node k runs ``ray start`` inside its namespace, bound to its address (``--node-ip-address``),
  with the custom resource ``node<k>`` (``benchmarks.nodes`` orders nodes by it), pinned to core
  ``k mod cores`` so that each node's ranks see a core of their own where there are enough;
  the driver runs in node 0's namespace (:meth:`Bed.command`).

Nothing is added to the machine's own network stack: every link is created inside the bed's
namespaces. What a bed made is removed by :func:`remove` (its processes, found as those living
in its namespaces, then the namespaces and its directory ``/tmp/rcnb<id>``), which ``down``, a
:class:`Bed` leaving (also on an exception, SIGTERM or interpreter exit) and the next ``up``
after a crash (:func:`remove_stale`: a bed whose owner process is gone) all call.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence

PREFIX = "rcnb"
"""Every namespace and directory a bed makes starts with this."""
SUBNET = "10.213.0"
"""Node k's address is ``SUBNET.(k+1)``; it exists only inside the bed's namespaces."""
HEAD_PORT = 6379
STATE_FILE = "bed.json"
OBJECT_STORE_BYTES = 1 << 30
"""Each node's object store: room for a 256 MiB tensor or two in flight."""
STOP_GRACE_S = 5.0
"""How long the processes in a bed's namespaces get after SIGTERM before SIGKILL."""
NODE_START_TIMEOUT_S = 120.0
STATELESS_GRACE_S = 30.0
"""A bed without its state file is another process's bed being made, until this old."""


class BedError(RuntimeError):
    """The bed could not be brought up, changed or asked about; the message says what failed."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 60.0,
         env: Optional[Dict[str, str]] = None) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode:
        raise BedError(f"{' '.join(argv)} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable() -> Optional[str]:
    """Why a bed cannot be brought up on this machine, or None if it can.

    Returns:
        The reason (not root, ``ip`` or ``tc`` missing, namespaces refused), or None.
    """
    if os.geteuid() != 0:
        return "the network bed needs root (network namespaces, veth links, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network bed needs {tool!r} (iproute2) on PATH"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"network namespaces are refused here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def address(node: int) -> str:
    """Node ``node``'s address inside the bed."""
    return f"{SUBNET}.{node + 1}"


def parse_rate(text: Optional[str]) -> Optional[float]:
    """A link rate in bits per second from ``tc``'s notation (``1gbit``, ``500mbit``), or None
    for ``unlimited`` / None.

    Raises:
        ValueError: not a rate.
    """
    if text is None or text.lower() in ("unlimited", "none", ""):
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    lowered = text.lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            try:
                return float(lowered[:-len(unit)]) * factor
            except ValueError:
                break
    raise ValueError(f"not a link rate: {text!r} (e.g. 1gbit, 10gbit, 500mbit, unlimited)")


def _burst_bytes(rate_bps: float) -> int:
    """The token bucket's depth: 1 ms at the rate, at least 256 KiB (a GSO packet is up to
    64 KiB, and a shallow bucket at 10 Gbit/s throttles below its rate)."""
    return max(256 << 10, int(rate_bps / 8 / 1000))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a bed is made of.

    Attributes:
        name: the bed's name (``rcnb<id>``), its namespaces' prefix.
        nodes: Ray nodes, each in a namespace of its own.
        rates: each node's link rate (``tc`` notation) or None for unlimited.
        pin_cores: pin node k's processes to core ``k mod cores``.
    """

    name: str
    nodes: int
    rates: tuple
    pin_cores: bool = True

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def namespace(self, node: int) -> str:
        """Node ``node``'s namespace."""
        return f"{self.name}-n{node}"

    @property
    def directory(self) -> str:
        return f"/tmp/{self.name}"

    @property
    def head_address(self) -> str:
        return f"{address(0)}:{HEAD_PORT}"


def _namespaces() -> List[str]:
    listed = _run(["ip", "-j", "netns", "list"], check=False).strip()
    return [entry["name"] for entry in json.loads(listed or "[]")
            if entry["name"].startswith(PREFIX)]


def beds() -> Dict[str, dict]:
    """The beds on this machine: their namespaces and, where it survives, their state file.

    Returns:
        By bed name: ``{"namespaces": [...], "state": {...} or None}``.
    """
    found: Dict[str, dict] = {}
    for namespace in _namespaces():
        found.setdefault(namespace.rsplit("-", 1)[0], {"namespaces": []})["namespaces"].append(
            namespace)
    for entry in os.listdir("/tmp"):
        if entry.startswith(PREFIX) and os.path.isdir(f"/tmp/{entry}"):
            found.setdefault(entry, {"namespaces": []})
    for name, bed in found.items():
        try:
            with open(f"/tmp/{name}/{STATE_FILE}") as state:
                bed["state"] = json.load(state)
        except (OSError, ValueError):
            bed["state"] = None
    return found


def _pids_in(namespace: str) -> List[int]:
    return [int(pid) for pid in _run(["ip", "netns", "pids", namespace], check=False).split()]


def remove(name: str) -> None:
    """Remove bed ``name``: stop every process in its namespaces (SIGTERM, then SIGKILL after
    :data:`STOP_GRACE_S`), delete the namespaces (their links and bridge go with them) and its
    directory. Safe on a half-made or already removed bed."""
    namespaces = [ns for ns in _namespaces() if ns.rsplit("-", 1)[0] == name]
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 2.0)):
        pids = [pid for ns in namespaces for pid in _pids_in(ns) if pid != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [pid for ns in namespaces for pid in _pids_in(ns) if pid != os.getpid()]
            time.sleep(0.1)
    for namespace in namespaces:
        _run(["ip", "netns", "del", namespace], check=False)
    shutil.rmtree(f"/tmp/{name}", ignore_errors=True)


def _owner_alive(state: Optional[dict]) -> bool:
    if state is None:
        return False
    if state.get("owner") is None:
        return True
    try:
        os.kill(state["owner"], 0)
    except ProcessLookupError:
        return False
    return True


def _age_s(name: str, namespaces: Sequence[str]) -> float:
    """Seconds since the newest of bed ``name``'s directory and namespaces was made."""
    paths = [f"/tmp/{name}"] + [f"/run/netns/{namespace}" for namespace in namespaces]
    made = [os.stat(path).st_mtime for path in paths if os.path.exists(path)]
    return time.time() - max(made) if made else float("inf")


def remove_stale() -> List[str]:
    """Remove every bed whose owner process is gone (a crashed run), or that has no state
    :data:`STATELESS_GRACE_S` after it was made (one being made now has none for a moment);
    a bed brought up by ``up`` (detached) stays until ``down``.

    Returns:
        The names of the beds removed.
    """
    stale = [name for name, bed in beds().items()
             if (bed["state"] is not None and not _owner_alive(bed["state"]))
             or (bed["state"] is None and _age_s(name, bed["namespaces"]) > STATELESS_GRACE_S)]
    for name in stale:
        remove(name)
    return stale


def leftovers(name: str) -> List[str]:
    """What is left of bed ``name`` on this machine: namespaces, its directory, and processes
    whose command line names its directory (empty once it is removed)."""
    left = [ns for ns in _namespaces() if ns.rsplit("-", 1)[0] == name]
    if os.path.exists(f"/tmp/{name}"):
        left.append(f"/tmp/{name}")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if f"/tmp/{name}".encode() in cmdline.read():
                    left.append(f"process {pid}")
        except OSError:
            pass
    return left


def _ip(namespace: str, *args: str) -> str:
    return _run(["ip", "-n", namespace, *args])


def set_rate(layout: Layout, node: int, rate: Optional[str]) -> None:
    """Give node ``node``'s link ``rate`` (``tc`` notation) in both directions, or take the
    limit off (None)."""
    bits = parse_rate(rate)
    for namespace, device in ((layout.namespace(node), "eth0"), (layout.switch, f"v{node}")):
        _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
        if bits is not None:
            _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                  "rate", str(int(bits)), "burst", str(_burst_bytes(bits)), "latency", "100ms"])


def set_link(layout: Layout, node: int, up: bool) -> None:
    """Cut node ``node``'s cable (its ``eth0`` down, inside its namespace) or plug it back."""
    _ip(layout.namespace(node), "link", "set", "eth0", "up" if up else "down")


def link_bytes(layout: Layout, node: int) -> Dict[str, int]:
    """Bytes node ``node``'s ``eth0`` has sent and received, and those its token buckets passed.

    Returns:
        ``{"tx": ..., "rx": ..., "tbf_sent": ..., "rate_bps": ...}`` (``tbf_sent`` 0 and
        ``rate_bps`` None on an unlimited link).
    """
    links = json.loads(_ip(layout.namespace(node), "-j", "-s", "link", "show", "dev", "eth0"))
    stats = links[0]["stats64"]
    qdiscs = json.loads(_run(["tc", "-n", layout.namespace(node), "-j", "-s", "qdisc", "show",
                              "dev", "eth0"]) or "[]")
    buckets = [q for q in qdiscs if q.get("kind") == "tbf"]
    return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"],
            "tbf_sent": sum(q.get("bytes", 0) for q in buckets),
            "rate_bps": buckets[0]["options"]["rate"] * 8 if buckets else None}


def _make_network(layout: Layout) -> None:
    _run(["ip", "netns", "add", layout.switch])
    _ip(layout.switch, "link", "set", "lo", "up")
    _ip(layout.switch, "link", "add", "br0", "type", "bridge")
    _ip(layout.switch, "link", "set", "br0", "up")
    for node in range(layout.nodes):
        namespace = layout.namespace(node)
        _run(["ip", "netns", "add", namespace])
        _ip(namespace, "link", "set", "lo", "up")
        # Both ends are made inside the bed: the node's end in its namespace, the switch's end
        # moved straight into the switch's namespace.
        _ip(namespace, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{node}",
            "netns", layout.switch)
        _ip(namespace, "addr", "add", f"{address(node)}/24", "dev", "eth0")
        _ip(namespace, "link", "set", "eth0", "up")
        _ip(layout.switch, "link", "set", f"v{node}", "master", "br0")
        _ip(layout.switch, "link", "set", f"v{node}", "up")
        set_rate(layout, node, layout.rates[node])


def node_environment(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of the bed's Ray nodes and driver: Gloo bound to the node's link (it
    falls back to loopback, unreachable from other nodes, when the host name does not resolve
    inside the namespace), no usage reports, and Ray's token authentication off: whether it is
    on otherwise depends on a token file in the user's home that any local ``ray.init`` may
    write, between the head's start and a worker's."""
    env = dict(os.environ if base is None else base)
    env.update(GLOO_SOCKET_IFNAME="eth0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    return env


def checkout_environment() -> Dict[str, str]:
    """This process's environment with this checkout's root first on ``PYTHONPATH``: a bed's
    nodes and a driver run inside it import ``benchmarks`` and ``ray_collective`` from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def _start_ray(layout: Layout, env: Dict[str, str]) -> None:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cores = sorted(os.sched_getaffinity(0))
    for node in range(layout.nodes):
        argv = [ray, "start", "--node-ip-address", address(node), "--num-cpus",
                "1" if node == 0 else "0", "--resources", json.dumps({f"node{node}": 100}),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
        if node == 0:
            argv += ["--head", "--port", str(HEAD_PORT), "--include-dashboard=false",
                     "--temp-dir", f"{layout.directory}/ray"]
        else:
            argv += ["--address", layout.head_address]
        if layout.pin_cores:
            argv = ["taskset", "-c", str(cores[node % len(cores)])] + argv
        _run(["ip", "netns", "exec", layout.namespace(node)] + argv, timeout=NODE_START_TIMEOUT_S,
             env=env)


def _write_state(layout: Layout, owner: Optional[int]) -> None:
    state = {"layout": dataclasses.asdict(layout), "owner": owner, "detached": owner is None,
             "head": layout.head_address}
    with open(f"{layout.directory}/{STATE_FILE}", "w") as out:
        json.dump(state, out)


def bring_up(nodes: int, rates: Sequence[Optional[str]], owner: Optional[int],
             pin_cores: bool = True, env: Optional[Dict[str, str]] = None,
             start_ray: bool = True) -> Layout:
    """Make a bed of ``nodes`` nodes and start Ray on them; on any failure, remove what was made.

    Args:
        nodes: Ray nodes (>= 1).
        rates: each node's link rate (``tc`` notation) or None for unlimited.
        owner: the process whose exit makes the bed stale (None: it stays until ``down``).
        pin_cores: pin node k to core ``k mod cores``.
        env: the nodes' environment (default: this process's, see :func:`node_environment`).
        start_ray: start the Ray nodes (False: the network alone).

    Returns:
        The bed's layout.

    Raises:
        BedError: something could not be made (nothing of the bed is left).
        ValueError: a bad node count or rate.
    """
    if nodes < 1 or len(rates) != nodes:
        raise ValueError(f"give one rate per node: {nodes} nodes, {len(rates)} rates")
    for rate in rates:
        parse_rate(rate)
    reason = unavailable()
    if reason:
        raise BedError(reason)
    remove_stale()
    layout = Layout(f"{PREFIX}{uuid.uuid4().hex[:6]}", nodes, tuple(rates), pin_cores)
    try:
        os.makedirs(layout.directory)
        _write_state(layout, owner if owner is not None else os.getpid())
        _make_network(layout)
        if start_ray:
            _start_ray(layout, node_environment(env))
        _write_state(layout, owner)
    except BaseException:
        remove(layout.name)
        raise
    return layout


class Bed:
    """A bed for the life of a ``with`` block (or until :meth:`close`), removed on leaving it,
    on SIGTERM and at interpreter exit.

    Args:
        nodes: Ray nodes.
        rate: every link's rate (``tc`` notation), or None for unlimited.
        pin_cores: pin node k to core ``k mod cores``.
        env: the nodes' environment (see :func:`node_environment`).
    """

    def __init__(self, nodes: int, rate: Optional[str] = None, pin_cores: bool = True,
                 env: Optional[Dict[str, str]] = None):
        self.layout = bring_up(nodes, [rate] * nodes, os.getpid(), pin_cores, env)
        self.env = node_environment(env)
        atexit.register(self.close)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def __enter__(self) -> "Bed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything the bed made (idempotent)."""
        remove(self.layout.name)
        atexit.unregister(self.close)

    def command(self, argv: Sequence[str], node: int = 0) -> List[str]:
        """``argv`` run inside node ``node``'s namespace (the driver's: node 0)."""
        return ["ip", "netns", "exec", self.layout.namespace(node), *argv]

    def run(self, argv: Sequence[str], timeout: float,
            node: int = 0) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``node``'s namespace with the bed's environment (``RAY_ADDRESS``
        the head); its output captured."""
        env = dict(self.env, RAY_ADDRESS=self.layout.head_address)
        return subprocess.run(self.command(argv, node), capture_output=True, text=True,
                              timeout=timeout, env=env)


def _status() -> int:
    found = beds()
    if not found:
        print("no network bed on this machine")
    for name, bed in sorted(found.items()):
        state = bed["state"] or {}
        layout = state.get("layout", {})
        owner = "until down" if state.get("detached") else f"owner pid {state.get('owner')}"
        stale = "" if _owner_alive(bed["state"]) else " (stale: removed by the next up)"
        print(f"{name}: {layout.get('nodes', '?')} nodes, links at start "
              f"{layout.get('rates', '?')}, "
              f"head {state.get('head', '?')}, {owner}{stale}; namespaces "
              f"{', '.join(sorted(bed['namespaces'])) or 'none'}")
        if bed["namespaces"] and layout:
            lay = Layout(name, layout["nodes"], tuple(layout["rates"]))
            for node in range(lay.nodes):
                try:
                    count = link_bytes(lay, node)
                    rate = count["rate_bps"]
                    print(f"  node {node} {address(node)}: link "
                          f"{'unlimited' if rate is None else f'{rate / 1e9:g} Gbit/s'}, "
                          f"tx {count['tx']} B, rx {count['rx']} B")
                except (BedError, ValueError, KeyError, IndexError):
                    print(f"  node {node}: no link")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.netbed up|down|status``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netbed",
                                     description="Ray nodes in network namespaces of their own, "
                                                 "joined by rate-limited veth links.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="bring a bed up (it stays until down)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--link", default="unlimited",
                    help="every link's rate: 1gbit, 10gbit, ... or unlimited (default)")
    up.add_argument("--no-pin", action="store_true", help="do not pin node k to core k")
    down = commands.add_parser("down", help="remove beds (default: every bed)")
    down.add_argument("name", nargs="?", default=None)
    commands.add_parser("status", help="the beds on this machine and their links' counters")
    arguments = parser.parse_args(argv)
    if arguments.command == "status":
        return _status()
    if arguments.command == "down":
        names = [arguments.name] if arguments.name else sorted(beds())
        for name in names:
            remove(name)
            print(f"removed {name}")
        return 0
    try:
        rate = None if parse_rate(arguments.link) is None else arguments.link
        layout = bring_up(arguments.nodes, [rate] * arguments.nodes, None,
                          not arguments.no_pin)
    except (BedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{layout.name} up: head {layout.head_address}; run the driver with\n"
          f"  RAY_ADDRESS={layout.head_address} GLOO_SOCKET_IFNAME=eth0 "
          f"ip netns exec {layout.namespace(0)} python ...\n"
          f"remove it with: python -m benchmarks.netbed down {layout.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
