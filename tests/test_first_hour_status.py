"""``python -m ray_collective`` as a user runs it from a second shell: a clean environment
(no ``RAY_ADDRESS``, no ``RAY_AUTH_MODE``, nothing a process that called ``ray.init()`` would
pass on). ``--help`` exits 0 and lists every option; every failure is one line that says what
to do: no cluster at the address, a cluster with token authentication (Ray's default for a
local cluster) read without ``RAY_AUTH_MODE=token``; with it, the group is listed."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from support.paths import SUPPORT_DIR

COMMAND_S = 60


def _clean_environment(**extra):
    """What a new shell of this user has: HOME and PATH, nothing of Ray's."""
    return dict({"HOME": os.environ.get("HOME", "/root"),
                 "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"},
                **extra)


def _run(*arguments, **extra):
    return subprocess.run([sys.executable, "-m", "ray_collective", *arguments],
                          capture_output=True, text=True, timeout=COMMAND_S, check=False,
                          env=_clean_environment(**extra), cwd="/")


def _one_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("arguments", [("--help",), ("status", "--help")])
def test_help_exits_0_and_lists_every_option(arguments):
    finished = _run(*arguments)
    assert finished.returncode == 0, finished.stderr
    for option in ("status", "--address", "--json", "--local-only", "group"):
        assert option in finished.stdout


def test_no_command_and_an_unknown_option_exit_2_with_the_usage():
    assert _run().returncode == 2
    finished = _run("status", "--adress", "x")
    assert finished.returncode == 2 and "usage:" in finished.stderr


def test_status_at_an_address_where_no_cluster_listens_says_so_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]     # bound, never listening
        finished = _run("status", "--address", f"127.0.0.1:{port}")
    assert finished.returncode == 1
    line = _one_line(finished.stderr)
    # Ray spells a loopback address as this node's own
    assert "no Ray cluster answers at " in line and f":{port} " in line
    assert "--address" in line


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a process namespace of its own")
def test_status_on_a_machine_with_no_cluster_says_how_to_start_one_in_one_line():
    """Run where no Ray process can be seen (a PID namespace of its own: the clusters of
    other tests on this machine are not there) nor the note of the last cluster `ray start`
    made (an empty /tmp/ray in a mount namespace of its own), as on a machine where none
    runs."""
    hide = "mount -t tmpfs tmpfs /tmp/ray && " if os.path.isdir("/tmp/ray") else ""
    finished = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
         f'{hide}exec "{sys.executable}" -m ray_collective status'], capture_output=True,
        text=True, timeout=COMMAND_S, check=False, env=_clean_environment(), cwd="/")
    assert finished.returncode == 1
    line = _one_line(finished.stderr)
    assert "Could not find any running Ray instance" in line and "ray start --head" in line


@pytest.mark.ray
def test_status_from_a_second_shell_on_a_default_local_cluster():
    job = subprocess.Popen([sys.executable, os.path.join(SUPPORT_DIR, "first_hour_job.py")],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, env=_clean_environment(),
                           cwd="/")
    try:
        address = job.stdout.readline().strip()
        assert address, "the job did not start its cluster"
        refused = _run("status", "--address", address)
        assert refused.returncode == 1
        line = _one_line(refused.stderr)
        assert "token authentication" in line and "RAY_AUTH_MODE=token" in line
        answered = _run("status", "--address", address, RAY_AUTH_MODE="token")
        assert answered.returncode == 0, answered.stderr
        assert "group 'first-hour-status'" in answered.stdout
        assert "2 ranks" in answered.stdout
    finally:
        job.stdin.close()
        try:
            job.wait(COMMAND_S)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
