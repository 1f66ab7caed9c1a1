"""What the ``ray`` backend exposes on a node, tried as an attacker would, on real Ray actors:
the group's files and shared memory are out of another user's reach, a directory another user
planted or took over is never used (tests/test_private_dirs.py tries each check alone), no TCP
port is opened on one node, and a crafted frame on a rank's socket is refused or fails the
group with a typed error, never unpickled."""

import array
import contextlib
import os
import pickle
import socket
import stat
import struct
import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.backends.ray.private_dirs import DIRECTORY_VARIABLE
from support.helpers import NOBODY, attempts_as, process_resources, run_in, writable_by_everyone
from ray_collective.transport import wire

LARGE = 1 << 18
"""float32 elements of a message that travels through shared memory (1 MiB)."""
DEADLINE_S = 20.0
"""The deadline of the tests' allreduces: a failure must come well before it (a quarter)."""

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with setuid")


def _group_of(name):
    from ray_collective.group import current_registry
    return current_registry().get(name)


def _layout(rank, group):
    """Inside a member: after a large allreduce (through the native core's rings, or the
    Python engine's shared memory) and a large send that its receiver comes to only after the
    send's grace (so it takes the transport's shared memory on either engine), where its group
    lives on this node."""
    tensor = np.ones(LARGE, np.float32)
    col.allreduce(tensor, group)
    if rank == 0:
        col.send(tensor, 1, group)
    elif rank == 1:
        time.sleep(0.2)
        col.recv(tensor, 0, group)
    return _where(rank, group)


def _where(rank, group):
    """Inside a member: its process, its group's directory and socket, its memfds."""
    backend = _group_of(group).membership
    return {"pid": os.getpid(), "directory": backend.directory,
            "socket": backend.transport.peers[rank].socket_path,
            "memfds": [fd for fd in os.listdir("/proc/self/fd")
                       if _link(f"/proc/self/fd/{fd}").startswith("/memfd:ray_collective")]}


def _link(path):
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.fixture
def pair(ray_session, members):
    """A declared group of two pool members; its name."""
    name = f"security-{time.monotonic_ns()}"
    col.declare_collective_group(members[:2], group_name=name)
    yield name
    col.destroy_collective_group(name)


def _pure_python(rank, on):
    if on:
        os.environ["RAY_COLLECTIVE_PURE_PYTHON"] = "1"
    else:
        os.environ.pop("RAY_COLLECTIVE_PURE_PYTHON", None)


@pytest.fixture
def socket_pair(ray_session, members):
    """A declared group of two pool members whose collectives travel on their Unix sockets
    (the pure-Python engine), for the tests that craft what arrives there; its name. With the
    native core, collectives take the rings in the group's directory, which only this user
    can open (tests/test_native_node.py plays hostile ring files)."""
    run_in(ray_session, members[:2], _pure_python, True)
    try:
        name = f"security-{time.monotonic_ns()}"
        col.declare_collective_group(members[:2], group_name=name)
        yield name
        col.destroy_collective_group(name)
    finally:
        run_in(ray_session, members[:2], _pure_python, False)


# ------------------------------------------------------------------ files and shared memory


def _connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    finally:
        sock.close()


def _open_readable(path):
    os.close(os.open(path, os.O_RDONLY))


@needs_root
def test_another_user_cannot_reach_the_group_directory_sockets_or_shared_memory(
        ray_session, members, pair):
    layouts = run_in(ray_session, members[:2], _layout, pair)
    directory = layouts[0]["directory"]
    assert all(layout["memfds"] for layout in layouts), layouts
    # every directory from the library's base (this user's) down is private to its owner
    group_root = os.path.dirname(directory)
    session = os.path.dirname(group_root)
    base = os.path.dirname(session)
    assert os.path.basename(base) == f"ray_collective-{os.getuid()}", base
    for path in (base, session, group_root, directory):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, path
        assert os.lstat(path).st_uid == os.getuid(), path
    for entry in os.listdir(directory):
        mode = os.stat(os.path.join(directory, entry)).st_mode
        if stat.S_ISSOCK(mode):
            assert stat.S_IMODE(mode) == 0o600, (entry, oct(mode))
        else:
            assert not mode & (stat.S_IRWXO | stat.S_IRWXG), (entry, oct(mode))

    attempts = [("list directory", lambda: os.listdir(directory)),
                ("open state file", lambda: _open_readable(os.path.join(directory, "state")))]
    rings = [entry for entry in os.listdir(directory) if entry.startswith("ring-")]
    if _engine(members[0], pair, ray_session) == "native":
        assert sorted(rings) == ["ring-0-1", "ring-1-0"], rings
    attempts += [(f"open {ring}", lambda p=os.path.join(directory, ring): _open_readable(p))
                 for ring in rings]
    for rank, layout in enumerate(layouts):
        memfd = f"/proc/{layout['pid']}/fd/{layout['memfds'][0]}"
        attempts += [(f"connect to rank {rank}", lambda p=layout["socket"]: _connect(p)),
                     (f"open rank {rank}'s memfd", lambda p=memfd: _open_readable(p))]
    # the same attempts as the owner succeed: the paths are right, only the user differs
    assert set(attempts_as(os.getuid(), os.getgid(), attempts).values()) == {"allowed"}
    refused = attempts_as(NOBODY, NOBODY, attempts)
    assert refused == {label: "EACCES" for label, _ in attempts}, refused
    # the owner's connections above said no HELLO: the ranks closed them and work on
    assert run_in(ray_session, members[:2], _allreduce_checked, pair, 3) == [3, 3]


def _engine(member, group, ray_session):
    return ray_session.get(member.__ray_call__.remote(
        lambda _s: "native" if _group_of(group).membership.native else "python"))


# ------------------------------------------------------------------ directories


def _session_directory(rank):
    from ray._private.worker import global_worker
    return global_worker.node.get_session_dir_path()


@needs_root
def test_a_takeover_in_rays_session_directory_reaches_nothing_of_the_group(
        ray_session, members):
    """Issue 30's attack: Ray's session directory may be written by every user, and a user
    with no rights on the job puts a directory of their own where the library's used to be
    (``rc``) before a group starts. The group's directory is not there, and works."""
    session = run_in(ray_session, members[:1], _session_directory)[0]
    assert os.stat(session).st_mode & stat.S_IWOTH, "the premise: anyone may write there"
    taken = os.path.join(session, "rc")
    aside = f"{taken}-aside-{time.monotonic_ns()}"
    if os.path.lexists(taken):
        os.rename(taken, aside)
    try:
        assert attempts_as(NOBODY, NOBODY, [("make rc", lambda: os.mkdir(taken, 0o777))]) == {
            "make rc": "allowed"}
        col.declare_collective_group(members[:2], group_name="after-takeover")
        try:
            layouts = run_in(ray_session, members[:2], _layout, "after-takeover")
            assert run_in(ray_session, members[:2], _allreduce_checked, "after-takeover",
                          2) == [2, 2]
            assert os.listdir(taken) == []
            for layout in layouts:
                assert not layout["directory"].startswith(session + os.sep), layout
                assert os.lstat(layout["directory"]).st_uid == os.getuid()
        finally:
            col.destroy_collective_group("after-takeover")
    finally:
        os.rmdir(taken)
        if os.path.lexists(aside):
            os.rename(aside, taken)


def _init_under(rank, parent, group):
    """Inside a member: join ``group`` with ``RAY_COLLECTIVE_DIR=parent``; what came of it."""
    os.environ[DIRECTORY_VARIABLE] = parent
    started = time.monotonic()
    try:
        col.init_collective_group(2, rank, "ray", group, timeout=20)
    except col.InsecureDirectoryError as err:
        return type(err).__name__, str(err), time.monotonic() - started
    finally:
        del os.environ[DIRECTORY_VARIABLE]
    col.destroy_collective_group(group)
    return "joined", "", time.monotonic() - started


@needs_root
def test_a_base_directory_planted_by_another_user_is_refused_on_every_rank(
        ray_session, members):
    """Another user made ``ray_collective-<uid>`` first, open to everyone: every rank refuses
    it at init with ``InsecureDirectoryError`` (naming it and its owner), and nothing of the
    group lands in it."""
    with writable_by_everyone() as parent:
        planted = os.path.join(parent, f"ray_collective-{os.getuid()}")
        assert attempts_as(NOBODY, NOBODY, [("plant", lambda: os.mkdir(planted, 0o777))]) == {
            "plant": "allowed"}
        outcomes = run_in(ray_session, members[:2], _init_under, parent, "planted")
        assert os.listdir(planted) == []
    for kind, message, seconds in outcomes:
        assert kind == "InsecureDirectoryError", (kind, message)
        assert planted in message and f"belongs to uid {NOBODY}" in message, message
        assert seconds < 10, seconds
    assert [message.split(":")[0] for _, message, _ in outcomes] == [
        "rank 0 of group 'planted'", "rank 1 of group 'planted'"]


# ------------------------------------------------------------------ TCP


def _listening_tcp_inodes():
    """Socket inodes of every TCP socket on this machine in state LISTEN (0A)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A":
                        inodes.add(fields[9])
        except FileNotFoundError:
            pass
    return inodes


def _listening_sockets_of(pids):
    """``{pid: sorted socket inodes}`` of the listening TCP sockets each process holds."""
    listening = _listening_tcp_inodes()
    held = {}
    for pid in pids:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = _link(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
        held[pid] = sorted(inodes & listening)
    return held


def test_a_one_node_group_opens_no_tcp_listener(ray_session, members):
    actors = members[:3]
    pids = ray_session.get([a.pid.remote() for a in actors])
    before = _listening_sockets_of(pids)
    # Ray's own workers listen (gRPC): the mapping from descriptors to /proc/net finds them
    assert all(before.values()), before
    col.declare_collective_group(actors, group_name="no-tcp")
    try:
        run_in(ray_session, actors, _layout, "no-tcp")
        during = _listening_sockets_of(pids)
    finally:
        col.destroy_collective_group("no-tcp")
    assert during == before


# ------------------------------------------------------------------ crafted frames


def _allreduce_checked(rank, group, calls):
    """``calls`` allreduces of 8 B and 1 MiB, each compared with what numpy gives."""
    world = col.get_collective_group_size(group)
    for call in range(calls):
        length = 2 if call % 2 == 0 else LARGE
        tensor = np.full(length, rank + call, np.float32)
        col.allreduce(tensor, group, timeout=DEADLINE_S)
        expected = sum(r + call for r in range(world))
        np.testing.assert_array_equal(tensor, np.full(length, expected, np.float32))
    return calls


def _refused(rank, group):
    return _group_of(group).membership.transport.refused_connections


def _group_key(rank, group):
    return _group_of(group).membership.transport.group_key


class _Marker:
    """Unpickling this creates the file at ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _malicious_pickle(marker):
    return pickle.dumps(_Marker(marker))


@contextlib.contextmanager
def _crafted_connection(ray, members, group, packets_of):
    """A connection to rank 0's socket over which ``packets_of(group key)`` were sent."""
    socket_path = run_in(ray, members[:1], _where, group)[0]["socket"]
    key = run_in(ray, members[:1], _group_key, group)[0]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(socket_path)
        for packet in packets_of(key):
            if isinstance(packet, tuple):  # (bytes, a descriptor passed with them)
                sock.sendmsg([packet[0]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", [packet[1]]))])
            else:
                sock.send(packet)
        yield sock
    finally:
        sock.close()


def _inline_data(header, payload, **fields):
    frame = dict(step=0, tag=wire.COLLECTIVE_TAG, count=len(payload) // 4, nbytes=len(payload),
                 part_offset=0, part_bytes=len(payload), segment=wire.INLINE, segment_offset=0,
                 header_len=len(header))
    frame.update(fields)
    return wire.data_frame(**frame) + header + payload


def _refused_packets(marker, key, descriptor=-1):
    """Packets of a connection that does not prove the group's key (or names no rank);
    ``descriptor`` is one to pass along."""
    eight_bytes = np.ones(2, np.float32).tobytes()
    return {
        "hello with a wrong key": [wire.hello(1, os.urandom(16)), _inline_data(b"", eight_bytes)],
        "hello with a wrong key and a descriptor": [(wire.hello(1, os.urandom(16)), descriptor)],
        "hello from a rank out of range": [wire.hello(7, key), _inline_data(b"", eight_bytes)],
        "garbage bytes": [os.urandom(200)],
        "data frame without hello": [_inline_data(b"x" * 30, eight_bytes, nbytes=1 << 62,
                                                  part_offset=-8, segment=123456)],
        "pickle instead of hello": [_malicious_pickle(marker)],
        "an oversized packet": [os.urandom(100_000)],
    }


@pytest.fixture
def pipe():
    """A pipe's (read end, write end): descriptors that are not shared memory."""
    ends = os.pipe()
    yield ends
    for end in ends:
        os.close(end)


@pytest.mark.parametrize("case", list(_refused_packets("", b"")))
def test_a_connection_without_the_group_key_is_refused_and_the_rank_works_on(
        ray_session, members, socket_pair, pipe, tmp_path, case):
    """Nothing a connection sends is read until its HELLO proves the key; the rank closes it
    (and any descriptor it passed) and goes on with correct results."""
    marker = tmp_path / "unpickled"
    run_in(ray_session, members[:2], _allreduce_checked, socket_pair, 2)  # shared memory set up
    descriptors = run_in(ray_session, members[:1], process_resources)[0][:2]
    with _crafted_connection(ray_session, members, socket_pair,
                             lambda key: _refused_packets(str(marker), key, pipe[0])[case]) \
            as sock:
        # the rank reads the connection while it waits in its next calls
        deadline = time.monotonic() + 30
        while run_in(ray_session, members[:1], _refused, socket_pair)[0] == 0:
            assert time.monotonic() < deadline, "the connection was never refused"
            assert run_in(ray_session, members[:2], _allreduce_checked, socket_pair, 2) == [2, 2]
        sock.settimeout(10)
        try:
            assert sock.recv(100) == b""  # closed by the rank
        except ConnectionResetError:
            pass  # closed by the rank with packets of this connection unread
    assert run_in(ray_session, members[:2], _allreduce_checked, socket_pair, 4) == [4, 4]
    assert run_in(ray_session, members[:1], process_resources)[0][:2] == descriptors
    assert not marker.exists()


def _with_key(marker, key, not_shared_memory=-1):
    """Frames sent as rank 1 by a process that knows the key (a member gone wrong): each is
    malformed or belongs to no call; ``not_shared_memory`` is a descriptor of something else."""
    hello = wire.hello(1, key)
    pickled = _malicious_pickle(marker)
    return {
        "inline part longer than its frame says": [hello, _inline_data(b"h" * 40, b"\0" * 64,
                                                                       part_bytes=1 << 40)],
        "part in a segment never sent": [hello, _inline_data(b"h" * 40, b"", segment=123456,
                                                             segment_offset=1 << 50,
                                                             part_bytes=1 << 20)],
        "header longer than the packet": [hello, _inline_data(b"h" * 10, b"", header_len=65535,
                                                              part_bytes=0)],
        "absurd sizes and offsets": [hello, _inline_data(b"h" * 40, b"\0" * 64, count=-5,
                                                         nbytes=1 << 62, part_offset=-64)],
        "pickle as header and payload": [hello, _inline_data(pickled, pickled)],
        "unknown frame kind": [hello, struct.pack("<B", 99) + pickled],
        "a pipe passed as shared memory": [hello, (_inline_data(b"h" * 40, b"", segment=0,
                                                                part_bytes=64),
                                                   not_shared_memory)],
    }


UNPARSABLE_HEADERS = {"absurd sizes and offsets", "pickle as header and payload"}
"""Cases whose frame is well formed, so its call header is what fails to make sense."""


def _allreduce_until_error(rank, group, calls):
    """Checked allreduces until one fails: (calls that passed, error kind, message, seconds the
    failing call took, kind of the error of one more call and its seconds)."""
    for call in range(calls):
        started = time.monotonic()
        try:
            _allreduce_checked(rank, group, 1)
        except col.CollectiveError as err:
            elapsed = time.monotonic() - started
            started = time.monotonic()
            try:
                _allreduce_checked(rank, group, 1)
                again = "ok"
            except col.CollectiveError as second:
                again = type(second).__name__
            return (call, type(err).__name__, str(err), elapsed, again,
                    time.monotonic() - started)
    return calls, "ok", "", 0.0, "ok", 0.0


@pytest.mark.parametrize("case", list(_with_key("", b"")))
def test_a_malformed_frame_with_the_key_fails_the_group_with_a_typed_error(
        ray_session, members, socket_pair, pipe, tmp_path, case):
    """A connection that proves the key is a member: what it sends is parsed as fixed binary
    frames, and one that makes no sense breaks the group at once, on every rank, with an error
    saying so; nothing is unpickled, nothing hangs."""
    marker = tmp_path / "unpickled"
    with _crafted_connection(ray_session, members, socket_pair,
                             lambda key: _with_key(str(marker), key, pipe[0])[case]):
        outcomes = run_in(ray_session, members[:2], _allreduce_until_error, socket_pair, 20)
    target, other = outcomes
    if case in UNPARSABLE_HEADERS:
        # rank 0 reports the header it could not read; rank 1 the same mismatch from its side
        assert target[1] == other[1] == "CollectiveMismatchError", outcomes
        assert "rank 1 has 'malformed collective message header" in target[2], target
    else:
        assert target[1] == "CollectiveError", target
        assert "rank 1 sent a malformed frame" in target[2], target
        assert other[1] == "GroupBrokenError" and "malformed frame" in other[2], other
    assert target[0] < 3, target  # within the first calls after the frame was sent
    for passed, kind, message, elapsed, again, again_elapsed in outcomes:
        assert elapsed < DEADLINE_S / 4 and again == "GroupBrokenError", message
        assert again_elapsed < DEADLINE_S / 4, message
    assert not marker.exists()
