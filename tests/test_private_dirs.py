"""Where the ``ray`` backend keeps a group's sockets on a node (``backends.ray.private_dirs``), and
how it refuses a directory another local user could take over: each attack is played as uid
65534 in a directory where that user may write, as ``/tmp`` and ``/dev/shm`` are (no Ray)."""

import os
import shutil
import socket
import stat
import tempfile

import pytest

import ray_collective as col
from support.helpers import NOBODY, attempts_as, writable_by_everyone
from ray_collective.backends.ray import private_dirs
from ray_collective.types import MAX_WORLD_SIZE

SESSION = "/tmp/ray/session_2026-11-26_00-00-00_000000_1"
JOB, TOKEN, NODE = "01000000", "0f" * 16, "a1b2c3d4" * 7
BASE = f"ray_collective-{os.getuid()}"

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with setuid")


@pytest.fixture
def parent(monkeypatch):
    """A directory every user may write to, with the sticky bit (as /tmp), named by
    RAY_COLLECTIVE_DIR."""
    with writable_by_everyone() as path:
        monkeypatch.setenv(private_dirs.DIRECTORY_VARIABLE, path)
        yield path


def _node_directory(group_name="g", job=JOB, token=TOKEN):
    return private_dirs.node_directory(SESSION, job, group_name, token, NODE, 0)


def test_the_directory_is_this_users_at_every_level_and_holds_any_ranks_socket(parent):
    old_umask = os.umask(0o277)  # would make the directories 0500 without the fchmod
    try:
        directory = _node_directory()
    finally:
        os.umask(old_umask)
    base = os.path.join(parent, BASE)
    levels = [base]
    while levels[-1] != directory:
        below = os.path.relpath(directory, levels[-1]).split(os.sep)[0]
        levels.append(os.path.join(levels[-1], below))
    assert len(levels) == 4  # base, session, group, node
    for path in levels:
        info = os.lstat(path)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid(), path
        assert stat.S_IMODE(info.st_mode) == 0o700, (path, oct(info.st_mode))
    with open(os.path.join(levels[2], private_dirs.JOB_FILE)) as job:
        assert job.read() == JOB
    # the longest socket name fits (bind refuses a path past sun_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.bind(os.path.join(directory, f"{MAX_WORLD_SIZE - 1}.sock"))
    finally:
        server.close()
    # made once, found again, and found without making anything
    assert _node_directory() == directory
    assert private_dirs.group_root(SESSION, JOB, "g", TOKEN) == levels[2]
    assert private_dirs.session_directory(SESSION) == levels[1]


def test_without_the_variable_the_directory_is_in_dev_shm(monkeypatch):
    monkeypatch.delenv(private_dirs.DIRECTORY_VARIABLE, raising=False)
    if not os.path.isdir("/dev/shm") or not os.stat("/dev/shm").st_mode & stat.S_ISVTX:
        pytest.skip("this machine has no /dev/shm like /tmp")
    token = os.urandom(16).hex()  # a group of its own beside whatever else runs here
    directory = _node_directory(token=token)
    try:
        assert directory.startswith(f"/dev/shm/{BASE}/"), directory
    finally:
        shutil.rmtree(os.path.dirname(directory))


ODD_NAMES = ["../../etc", "a/b", "x" * 10_000, "\0", "名前 with spaces", "%2F", "\ud800"]


def test_any_group_name_gives_a_directory_of_the_same_length_inside_the_base(parent):
    directories = [_node_directory(name) for name in ODD_NAMES]
    assert len(set(directories)) == len(ODD_NAMES)
    assert len({len(d) for d in directories}) == 1
    for directory in directories:
        assert os.path.realpath(directory).startswith(os.path.join(parent, BASE) + os.sep)


# Each attack: what is done (as whom) and what the refusal says.
ATTACKS = {
    "another user's base directory": ("nobody", lambda parent, base: os.mkdir(base, 0o777),
                                      f"belongs to uid {NOBODY}"),
    "another user's symbolic link as base": (
        "nobody", lambda parent, base: os.symlink(tempfile.gettempdir(), base),
        "symbolic link"),
    "the base made writable by others": (
        "owner", lambda parent, base: (_node_directory(), os.chmod(base, 0o777)),
        "written by its group or others"),
    "a symbolic link below the base": (
        "owner", lambda parent, base: _replace_by_link(
            os.path.dirname(os.path.dirname(_node_directory()))), "symbolic link"),
    "a parent others may write to without the sticky bit": (
        "owner", lambda parent, base: os.chmod(parent, 0o777), "has no sticky bit"),
    "a parent that belongs to another user": (
        "owner", lambda parent, base: os.chown(parent, NOBODY, NOBODY),
        "neither root nor this user"),
}


def _replace_by_link(path):
    """Move the directory ``path`` aside and put a symbolic link to it in its place."""
    os.rename(path, path + "-moved")
    os.symlink(path + "-moved", path)


@needs_root
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_directory_another_user_could_take_over_is_refused(parent, attack):
    who, act, problem = ATTACKS[attack]
    base = os.path.join(parent, BASE)
    if who == "nobody":
        assert attempts_as(NOBODY, NOBODY, [(attack, lambda: act(parent, base))]) == {
            attack: "allowed"}
    else:
        act(parent, base)
    planted = sorted(os.listdir(parent)) if os.access(parent, os.R_OK) else None
    with pytest.raises(col.InsecureDirectoryError, match=problem) as refused:
        _node_directory()
    assert isinstance(refused.value, col.BackendNotAvailableError)
    assert "rank 0 of group 'g'" in str(refused.value)
    assert "RAY_COLLECTIVE_DIR" in str(refused.value)
    # nothing was made, and nothing is found there either
    assert sorted(os.listdir(parent)) == planted
    if who == "nobody" and os.path.isdir(base) and not os.path.islink(base):
        assert os.listdir(base) == []
    assert private_dirs.session_directory(SESSION) is None or attack == (
        "a symbolic link below the base")


def test_a_directory_too_deep_for_socket_paths_is_an_argument_error(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv(private_dirs.DIRECTORY_VARIABLE, str(deep))
    with pytest.raises(col.ArgumentValueError, match="RAY_COLLECTIVE_DIR=.* is too deep"):
        _node_directory()
    assert not os.listdir(deep)


def test_finished_jobs_lose_their_group_directories_and_no_other(parent):
    finished = _node_directory(job="02000000", token="1" * 32)
    running = _node_directory(job="03000000", token="2" * 32)
    private_dirs.remove_finished_groups(SESSION, {"02000000", "09000000"})
    assert not os.path.exists(os.path.dirname(finished))
    assert os.path.isdir(running)
    # another Ray session's groups are another directory, never swept from this one
    other = private_dirs.node_directory(SESSION + "-other", "02000000", "g", "3" * 32, NODE, 0)
    private_dirs.remove_finished_groups(SESSION, {"02000000"})
    assert os.path.isdir(other)
