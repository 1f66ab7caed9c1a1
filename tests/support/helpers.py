"""What the tests share besides fixtures: reference results computed by numpy alone (with
``support.reference``), small integer inputs, the plain member actors the Ray tests form groups
around (and how to run code inside them), counting the calls that take a backend's full path,
acting while a transport waits, scripts and benchmarks run in a subprocess, and acting as
another user (the security tests)."""

import contextlib
import errno
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np

import ray_collective as col
from support import reference
from support.kinds import refuse_ray_subprocess
from support.paths import REPO_DIR, python_path


def numpy_reduce(arrays, op):
    """What an allreduce of ``arrays`` with ``op`` must give, computed by numpy on the stack."""
    return reference.reduce(arrays, op.name)


def rank_data(rank, shape, dtype, op=col.ReduceOp.SUM, seed=0):
    """Rank ``rank``'s deterministic input: small values, so products and sums stay exact."""
    rng = np.random.default_rng(seed * 1000 + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    low, high = (1, 3) if op is col.ReduceOp.PRODUCT else (-20, 20)
    if dtype.kind == "u":
        low = max(low, 0)
    values = rng.integers(low, high, shape)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(low, high, shape)).astype(dtype)
    return values.astype(dtype)


class Member:
    """A user's actor class with nothing collective about it: groups are formed around it."""

    def pid(self):
        return os.getpid()


def count_full_path(monkeypatch, membership_class):
    """Record the collective of every call that takes the full path (``Group.submit``) on a
    group whose membership is a ``membership_class``, in every rank, as a list the test reads
    afterwards."""
    from ray_collective.group import Group
    taken = []
    original = Group.submit

    def submit(self, known, *args, **kwargs):
        if isinstance(self.membership, membership_class):
            taken.append(known[0].options.collective.value)
        return original(self, known, *args, **kwargs)

    monkeypatch.setattr(Group, "submit", submit)
    return taken


def start_members(ray, count):
    """``count`` fresh member actors that need no CPU (so many fit on two cores)."""
    actor = ray.remote(num_cpus=0)(Member)
    members = [actor.remote() for _ in range(count)]
    ray.get([m.pid.remote() for m in members])
    return members


def run_in(ray, actors, function, *args, timeout=120):
    """Run ``function(rank, *args)`` inside each actor (rank = position); returns the results."""
    refs = [a.__ray_call__.remote(lambda _self, r=rank: function(r, *args))
            for rank, a in enumerate(actors)]
    return ray.get(refs, timeout=timeout)


def join(rank, group, world_size, timeout=60.0):
    """Inside a member: join ``group`` on the ``ray`` backend; returns (rank, world size)."""
    col.init_collective_group(world_size, rank, backend="ray", group_name=group, timeout=timeout)
    return col.get_rank(group), col.get_collective_group_size(group)


def leave(rank, group):
    """Inside a member: destroy its part of ``group``; returns whether it is still a member."""
    col.destroy_collective_group(group)
    return col.is_group_initialized(group)


def group_keys(ray, group):
    """The keys this job's ``group`` holds in Ray's key-value store."""
    from ray.experimental import internal_kv
    job = ray.get_runtime_context().get_job_id()
    return internal_kv._internal_kv_list(f"{job}/{group}/".encode(), namespace="ray_collective")


def process_resources(rank):
    """Inside a member: open descriptors (memfds among them) and resident memory of its
    process."""
    fds = os.listdir("/proc/self/fd")
    memfds = 0
    for fd in fds:
        try:
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(fds), memfds, rss


def act_while_waiting(transport, action):
    """Run ``action()`` in a thread as soon as ``transport`` polls inside a ``wait``, so that
    it happens while the caller waits (what a fixed delay cannot promise on a busy machine).

    Returns:
        The thread (join it once the wait is over).
    """
    waiting = threading.Event()
    progress = transport.progress
    poll = progress.progress

    def polled(*args, **kwargs):
        waiting.set()
        return poll(*args, **kwargs)

    progress.progress = polled
    thread = threading.Thread(target=lambda: waiting.wait(60) and action(), daemon=True)
    thread.start()
    return thread


def run_benchmark(module, *arguments, timeout=300):
    """``python -m module *arguments`` from the repository in a subprocess; returns it once it
    exited with 0 (else fails with the end of its stderr)."""
    refuse_ray_subprocess(f"python -m {module}")
    completed = run_python(["-m", module, *arguments], timeout)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def run_python(arguments, timeout):
    """``python *arguments`` in the repository, in a subprocess that starts a Ray of its own if
    it needs one; returns the finished process (its output as text)."""
    # It must not join a Ray (or a cluster) the suite may point to, nor one another program
    # runs on this machine, which a bare ray.init() would find: "local" starts a new one.
    environment = dict(os.environ, RAY_ADDRESS="local", PYTHONPATH=python_path())
    return subprocess.run([sys.executable, *arguments], cwd=REPO_DIR, env=environment,
                          capture_output=True, text=True, timeout=timeout)


NOBODY = 65534
"""The uid and gid of the unprivileged user the security tests become (``nobody``)."""


def attempts_as(uid, gid, attempts):
    """Run each ``(label, function)`` of ``attempts`` in a child process that has dropped to
    ``uid``/``gid``; returns ``{label: errno name or "allowed"}``."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        # Only system calls from here on: the parent has threads, so this child must not
        # import or take locks they may have held.
        outcome = {}
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            for label, attempt in attempts:
                try:
                    attempt()
                    outcome[label] = "allowed"
                except OSError as err:
                    outcome[label] = errno.errorcode.get(err.errno, str(err.errno))
            os.write(write_end, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        assert ready, "the unprivileged child did not answer"
        answer = os.read(read_end, 1 << 16)
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    return json.loads(answer)


@contextlib.contextmanager
def writable_by_everyone():
    """A fresh directory every user may make entries in, with the sticky bit (as /tmp): where
    another user can plant what the library must refuse. Removed afterwards, whatever is in it."""
    path = tempfile.mkdtemp(prefix="ray-collective-test-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
