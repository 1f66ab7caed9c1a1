"""Where the ``ray`` backend keeps a group's files on a node, and the checks that keep them this
user's alone.

The members of a group on one node meet in one directory: their Unix sockets (``<rank>.sock``),
the node's state page, the abort record. Whoever can replace that directory, or any directory
above it, can put a socket of their own in a member's place and read what is sent to it: the
group's key and the shared memory passed with large messages. So:

- **Where.** ``<parent>/ray_collective-<uid>/<session>/<group>/<node>``. ``parent`` is
  ``RAY_COLLECTIVE_DIR`` when set (it must then be the same for every member on the node: set
  it in the job's ``runtime_env``), else ``/dev/shm``, else ``/tmp``: ``/dev/shm`` is memory
  (tmpfs), where files that ranks map and wait on belong, while ``/tmp`` may be disk.
  ``session`` is a digest of Ray's session directory, so that two Ray clusters on one machine
  (whose job ids repeat) never share, or sweep, each other's groups; ``group`` a digest of the
  job, the group's name and the incarnation's token; ``node`` the start of the Ray node's id
  (several Ray nodes may share a machine). Digests keep every path short, whatever the group's
  name: a socket's path must fit in 108 bytes. Ray's session directory itself is not used:
  Ray makes it writable by every user, without the sticky bit, so anyone could rename a
  directory inside it and put their own in its place.
- **What is checked.** The parent and every directory above it (symbolic links resolved) must
  belong to root or to this user, and one that others may write to must have the sticky bit
  (as ``/tmp`` and ``/dev/shm`` do), so that no other user can rename or replace what this
  user made there. From ``ray_collective-<uid>`` down, each directory is opened relative to
  its checked parent's descriptor, without following a symbolic link, and must belong to this
  process's user and be writable by no one else; the library creates them 0700. A directory
  that fails is refused with ``InsecureDirectoryError``, never repaired, never used. With
  those checks passed, no path the members later use by name (to bind or connect a socket)
  can be redirected by another user.
- **What is trusted**: root, and this user's own processes.
- **A squatted default.** Any local user may make ``/dev/shm/ray_collective-<uid>`` before
  this user does. Where ``RAY_COLLECTIVE_DIR`` is not set and the default base fails its
  checks, the backend goes on in a base of its own: ``ray_collective-<uid>-<random>`` in the
  same parent, made by ``tempfile.mkdtemp`` (0700; a name that exists already is never
  taken, so no other user can have chosen it), and noted, for this user's other processes on
  this machine, in ``~/.ray_collective/base-<host>-<parent digest>`` (a directory 0700 of
  this user's, checked as the rest; the note is read and written under a lock, so the ranks
  of one node always meet in one base). It says so once, with a ``RuntimeWarning`` in the
  process that made it. The squatted directory is never used, nor any the note names that
  fails the checks (a new base replaces it). A base named by ``RAY_COLLECTIVE_DIR`` that
  fails is refused as before: the user chose it.

``node_directory`` gives a rank the group's checked directory on its node (made if missing,
with a note of the job that made it, so that ``remove_finished_groups`` can sweep it once the
job has finished); ``group_root`` and ``session_directory`` find what exists without making
anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import stat
import tempfile
import warnings
from typing import Iterable, Optional, Tuple

from ...errors import ArgumentValueError, InsecureDirectoryError
from ...transport.node_state import write_atomically
from ...types import MAX_WORLD_SIZE

DIRECTORY_VARIABLE = "RAY_COLLECTIVE_DIR"
"""Names the directory in which ``ray_collective-<uid>`` is made, instead of the defaults."""

DEFAULT_PARENTS = ("/dev/shm", "/tmp")
"""Where ``ray_collective-<uid>`` goes when ``RAY_COLLECTIVE_DIR`` is not set: the first that
passes the checks."""

SOCKET_PATH_MAX = 107
"""The longest path a Unix socket may have, in bytes (``sun_path`` holds 108, NUL included)."""

_LONGEST_SOCKET_NAME = f"{MAX_WORLD_SIZE - 1}.sock"
_SESSION_DIGEST_CHARS, _GROUP_DIGEST_CHARS, _NODE_CHARS = 12, 16, 8
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

JOB_FILE = "job"
"""In a group's directory: the id of the job that made it (so that a later job can sweep it)."""


class _Refused(Exception):
    """A directory failed a check: ``(path, what is wrong with it)``."""


class _TooDeep(Exception):
    """``RAY_COLLECTIVE_DIR`` leaves no room for a socket's path."""


def node_directory(session_dir: str, job_id: str, group_name: str, token: str, node: str,
                   rank: int) -> str:
    """The group's private directory on this node, made (0700) where missing, every directory
    on its path checked (see the module).

    Args:
        session_dir: Ray's session directory (its path is digested; nothing is made there).
        job_id: the Ray job.
        group_name: the group (digested; errors).
        token: the group's incarnation.
        node: this Ray node's id.
        rank: the rank asking (errors).

    Returns:
        The directory's path; a socket named for any rank fits in it.

    Raises:
        InsecureDirectoryError: a directory on the path could be taken over by another user.
        ArgumentValueError: ``RAY_COLLECTIVE_DIR`` names a directory too deep for socket paths.
    """
    group = _group_name(job_id, group_name, token)
    try:
        path, fd = _open_base(create=True)
        try:
            for name in (_session_name(session_dir), group, node[:_NODE_CHARS]):
                path = os.path.join(path, name)
                child = _open_private(fd, name, path, create=True)
                os.close(fd)
                fd = child
                if name == group and not _exists(JOB_FILE, fd):
                    write_atomically(os.path.join(path, JOB_FILE), job_id)
        finally:
            os.close(fd)
    except _Refused as refused:
        raise InsecureDirectoryError(group_name, rank, *refused.args) from None
    except _TooDeep as too_deep:
        raise ArgumentValueError(f"group '{group_name}', rank {rank}: {too_deep}") from None
    return path


def node_path(root: str, node: str) -> str:
    """Where ``node``'s directory of a group is (made by :func:`node_directory`), below the
    group's ``root`` (:func:`group_root`)."""
    return os.path.join(root, node[:_NODE_CHARS])


def remove_node_directory(session_dir: str, job_id: str, group_name: str, token: str,
                          node: str) -> None:
    """Remove ``node``'s directory of the incarnation ``token``, and the incarnation's
    directory on this machine once no node's is left in it (what remains is left as it is).

    Args:
        session_dir, job_id, group_name, token, node: as for :func:`node_directory`.
    """
    root = group_root(session_dir, job_id, group_name, token)
    if root is None:
        return
    shutil.rmtree(node_path(root, node), ignore_errors=True)
    remove_if_no_node(root)


def remove_if_no_node(root: str) -> None:
    """Remove an incarnation's directory on this machine (``root``, :func:`group_root`) if no
    node's directory is left in it."""
    try:
        if set(os.listdir(root)) <= {JOB_FILE}:
            shutil.rmtree(root, ignore_errors=True)
    except OSError:
        pass


def group_root(session_dir: str, job_id: str, group_name: str, token: str) -> Optional[str]:
    """The directory holding the group's per-node directories on this machine (nothing is made).

    Args:
        session_dir, job_id, group_name, token: as for :func:`node_directory`.

    Returns:
        Its path (it may not exist), or None when this user's base directory does not exist or
        fails the checks.
    """
    session = session_directory(session_dir)
    return None if session is None else os.path.join(session,
                                                      _group_name(job_id, group_name, token))


def existing_node_directory(session_dir: str, job_id: str, group_name: str, token: str,
                            node: str) -> Optional[str]:
    """The group's directory for ``node`` on this machine, if it is there (nothing is made).

    Args:
        session_dir, job_id, group_name, token: as for :func:`node_directory`.
        node: the Ray node's id.

    Returns:
        Its path, or None when this machine holds no such directory (the node is elsewhere).
    """
    root = group_root(session_dir, job_id, group_name, token)
    if root is None:
        return None
    path = os.path.join(root, node[:_NODE_CHARS])
    return path if os.path.isdir(path) else None


def session_directory(session_dir: str) -> Optional[str]:
    """The directory of this Ray session's groups on this machine (nothing is made).

    Args:
        session_dir: Ray's session directory.

    Returns:
        Its path (it may not exist), or None when this user's base directory does not exist or
        fails the checks.
    """
    try:
        base, fd = _open_base(create=False)
    except (_Refused, _TooDeep, FileNotFoundError):
        return None
    os.close(fd)
    return os.path.join(base, _session_name(session_dir))


def remove_finished_groups(session_dir: str, finished_jobs: Iterable[str]) -> None:
    """Remove this machine's directories of this session's groups made by finished jobs
    (members that died with their job never removed them).

    Args:
        session_dir: Ray's session directory.
        finished_jobs: ids of the jobs that have finished.

    Returns:
        None; what cannot be read or removed is left.
    """
    finished = set(finished_jobs)
    session = session_directory(session_dir)
    if session is None or not finished:
        return
    try:
        roots = os.listdir(session)
    except OSError:
        return
    for name in roots:
        root = os.path.join(session, name)
        try:
            with open(os.path.join(root, JOB_FILE)) as source:
                job_id = source.read().strip()
        except OSError:
            continue
        if job_id in finished:
            shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------ the checks


def _session_name(session_dir: str) -> str:
    return hashlib.sha256(os.fsencode(session_dir)).hexdigest()[:_SESSION_DIGEST_CHARS]


def _group_name(job_id: str, group_name: str, token: str) -> str:
    # surrogatepass: a digest for any str (the API refuses lone surrogates; this never fails).
    text = f"{job_id}/{group_name}/{token}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()[:_GROUP_DIGEST_CHARS]


def _base_name() -> str:
    return f"ray_collective-{os.getuid()}"


def _deepest_socket(parent: str) -> int:
    """Bytes of the longest socket path under ``parent``."""
    return len(os.fsencode(os.path.join(
        parent, _base_name(), "s" * _SESSION_DIGEST_CHARS, "g" * _GROUP_DIGEST_CHARS,
        "n" * _NODE_CHARS, _LONGEST_SOCKET_NAME)))


def _open_base(create: bool) -> Tuple[str, int]:
    """``ray_collective-<uid>`` in the chosen parent, checked: its path and an open descriptor.

    Raises:
        _Refused: the parent or the base directory fails a check.
        _TooDeep: ``RAY_COLLECTIVE_DIR`` leaves no room for socket paths.
        FileNotFoundError: the base directory does not exist and ``create`` is false.
    """
    parent = _parent()
    path = os.path.join(parent, _base_name())
    parent_fd = os.open(parent, _OPEN_DIRECTORY)
    try:
        try:
            return path, _open_private(parent_fd, _base_name(), path, create)
        except _Refused as refused:
            if os.environ.get(DIRECTORY_VARIABLE, "").strip():
                raise
            return _open_own_base(parent, parent_fd, create, refused)
    finally:
        os.close(parent_fd)


NOTES_DIRECTORY = ".ray_collective"
"""In this user's home: the notes of the bases made where the default one was squatted."""


def _open_own_base(parent: str, parent_fd: int, create: bool,
                   squatted: _Refused) -> Tuple[str, int]:
    """The base of this user's own in ``parent`` (open in ``parent_fd``), where the default
    one was refused (``squatted``): the one the note names, else (``create``) a new one.

    Raises:
        _Refused: no home directory to keep the note in (the default's refusal, with a hint).
        FileNotFoundError: none is noted and ``create`` is false.
    """
    note = _note_path(parent, squatted)
    lock = os.open(note + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        name = _noted(note)
        if name is not None:
            try:
                return os.path.join(parent, name), _open_private(
                    parent_fd, name, os.path.join(parent, name), create=False)
            except (FileNotFoundError, _Refused):
                pass  # gone with a restart, or taken meanwhile: never used, replaced
        if not create:
            raise FileNotFoundError(note)
        path = tempfile.mkdtemp(prefix=_base_name() + "-", dir=parent)
        fd = _open_private(parent_fd, os.path.basename(path), path, create=False)
        write_atomically(note, os.path.basename(path))
    finally:
        os.close(lock)
    warnings.warn(f"ray_collective: {squatted.args[0]} {squatted.args[1]}, so another user may "
                  f"have made it to stop this user's 'ray' groups; it is not used. This user's "
                  f"groups on this machine go on in {path} (0700, made for them), noted in "
                  f"{note}. Set {DIRECTORY_VARIABLE} to choose the directory yourself.",
                  RuntimeWarning, stacklevel=2)
    return path, fd


def _note_path(parent: str, squatted: _Refused) -> str:
    """The note of this machine's own base in ``parent``, in ``~/.ray_collective`` (made 0700,
    checked as a base is).

    Raises:
        _Refused: the home directory cannot hold it (``squatted``'s refusal, with a hint).
    """
    home = os.path.realpath(os.path.expanduser("~"))
    problem = _problem_above(home) if os.path.isabs(home) else (home, "is not a path")
    if problem is not None:
        raise _Refused(squatted.args[0], f"{squatted.args[1]}, and no private directory can be "
                                          f"noted in {problem[0]}, which {problem[1]}")
    home_fd = os.open(home, _OPEN_DIRECTORY)
    try:
        os.close(_open_private(home_fd, NOTES_DIRECTORY,
                               os.path.join(home, NOTES_DIRECTORY), create=True))
    finally:
        os.close(home_fd)
    digest = hashlib.sha256(os.fsencode(parent)).hexdigest()[:_SESSION_DIGEST_CHARS]
    return os.path.join(home, NOTES_DIRECTORY, f"base-{socket.gethostname()}-{digest}")


def _noted(note: str) -> Optional[str]:
    """The base's name in ``note``; None when there is none, or it is no name of ours."""
    try:
        with open(note, encoding="utf-8") as source:
            name = source.read().strip()
    except FileNotFoundError:
        return None
    prefix = _base_name() + "-"
    return name if name.startswith(prefix) and os.sep not in name and len(name) < 80 \
        else None


def _parent() -> str:
    """The directory to make ``ray_collective-<uid>`` in: ``RAY_COLLECTIVE_DIR``, or the first
    of ``DEFAULT_PARENTS`` that passes the checks (symbolic links resolved).

    Raises:
        _Refused: the one named (or, unset, every default) fails.
        _TooDeep: the one named is too deep for socket paths.
    """
    named = os.environ.get(DIRECTORY_VARIABLE, "").strip()
    if named:
        parent = os.path.realpath(named)
        problem = _problem_above(parent)
        if problem is not None:
            raise _Refused(problem[0], f"{problem[1]} (named by {DIRECTORY_VARIABLE})")
        if _deepest_socket(parent) > SOCKET_PATH_MAX:
            raise _TooDeep(
                f"{DIRECTORY_VARIABLE}={named!r} is too deep: a socket under it would need "
                f"{_deepest_socket(parent)} bytes, and Unix sockets take {SOCKET_PATH_MAX}; "
                f"name a directory at most {SOCKET_PATH_MAX - _deepest_socket('')} bytes long")
        return parent
    problems = []
    for candidate in DEFAULT_PARENTS:
        parent = os.path.realpath(candidate)
        problem = _problem_above(parent)
        if problem is None and _deepest_socket(parent) <= SOCKET_PATH_MAX:
            return parent
        problems.append(f"{problem[0]} {problem[1]}" if problem else f"{parent} is too deep")
    raise _Refused(" and ".join(DEFAULT_PARENTS), "none can be used (" + "; ".join(problems)
                   + f"); set {DIRECTORY_VARIABLE}")


def _problem_above(parent: str) -> Optional[Tuple[str, str]]:
    """``(directory, what is wrong)`` for the first directory from ``/`` down to ``parent`` (a
    resolved path) that another user could change entries of, or that this user cannot make
    directories in; None when there is none."""
    uid = os.getuid()
    path = os.sep
    for part in [""] + [p for p in parent.split(os.sep) if p]:
        path = os.path.join(path, part)
        try:
            info = os.lstat(path)
        except OSError as err:
            return path, f"cannot be examined ({err.strerror})"
        if not stat.S_ISDIR(info.st_mode):
            return path, "is not a directory"
        if info.st_uid not in (0, uid):
            return path, f"belongs to uid {info.st_uid}, neither root nor this user ({uid})"
        if info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX:
            return path, (f"may be written by other users and has no sticky bit (mode "
                          f"{stat.S_IMODE(info.st_mode):o})")
    if not os.access(parent, os.W_OK | os.X_OK):
        return parent, "is not writable by this user"
    return None


def _open_private(parent_fd: int, name: str, path: str, create: bool) -> int:
    """Open directory ``name`` in ``parent_fd`` (``path`` for messages), made 0700 first if
    ``create`` and missing, without following a symbolic link; refused unless it belongs to
    this user and no one else may write to it.

    Raises:
        _Refused: it fails a check.
        FileNotFoundError: it is missing and ``create`` is false.
    """
    made = False
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _OPEN_DIRECTORY, dir_fd=parent_fd)
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP: a symbolic link; ENOTDIR: a file
        raise _Refused(path, f"is a symbolic link or not a directory ({err.strerror})") from None
    info = os.fstat(fd)
    problem = None
    if info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this process's uid {os.getuid()}"
    elif info.st_mode & _OTHERS_WRITE:
        problem = f"may be written by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        os.close(fd)
        raise _Refused(path, problem)
    if made:
        os.fchmod(fd, 0o700)  # whatever the umask
    return fd


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
