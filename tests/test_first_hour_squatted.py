"""A squatted default directory does not stop the ``ray`` backend: another user's
``ray_collective-<uid>`` in the default parent is never used; this user's groups go on in a
base of their own (``mkdtemp``, 0700), said once, noted in ``~/.ray_collective`` so that every
process of this user on the machine meets in the same one, and replaced when what the note
names fails the checks. Played in a test-private parent standing in for ``/dev/shm`` (the
default parents pointed there) and a test-private home; the real ``/dev/shm`` is not touched."""

import os
import stat
import subprocess
import sys
import warnings

import pytest

from ray_collective.backends.ray import private_dirs
from support.helpers import NOBODY, writable_by_everyone
from support.paths import python_path

SESSION = "/tmp/ray/session_2026-12-02_00-00-00_000000_1"
JOB, TOKEN, NODE = "02000000", "1e" * 16, "b1c2d3e4" * 7
BASE = f"ray_collective-{os.getuid()}"

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user's directory "
                                                         "with chown")


@pytest.fixture
def squatted(monkeypatch, tmp_path):
    """A parent like /dev/shm where uid 65534 made this user's default base first."""
    monkeypatch.delenv(private_dirs.DIRECTORY_VARIABLE, raising=False)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    with writable_by_everyone() as parent:
        monkeypatch.setattr(private_dirs, "DEFAULT_PARENTS", (parent,))
        os.mkdir(os.path.join(parent, BASE), 0o755)
        os.chown(os.path.join(parent, BASE), NOBODY, NOBODY)
        yield parent


def _node_directory(group_name="g"):
    return private_dirs.node_directory(SESSION, JOB, group_name, TOKEN, NODE, 0)


def _own_base(parent, directory):
    """The base ``directory`` lies in, checked to be this user's, 0700, in ``parent``."""
    relative = os.path.relpath(directory, parent).split(os.sep)
    base = os.path.join(parent, relative[0])
    info = os.lstat(base)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) == 0o700
    return base


@needs_root
def test_the_backend_goes_on_in_a_base_of_its_own_said_once_and_found_again(squatted):
    with pytest.warns(RuntimeWarning, match=f"{BASE} belongs to uid {NOBODY}.*go on in") as said:
        first = _node_directory()
    assert len(said) == 1
    base = _own_base(squatted, first)
    assert os.path.basename(base).startswith(BASE + "-") and base != os.path.join(squatted,
                                                                                 BASE)
    assert os.listdir(os.path.join(squatted, BASE)) == []    # the squatted one is never used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _node_directory() == first                     # found again, nothing said
        # what status and the sweeps read: <base>/<session>/<group>/<node>
        assert private_dirs.session_directory(SESSION) == os.path.dirname(os.path.dirname(first))


@needs_root
def test_a_noted_base_that_another_user_took_is_replaced_not_used(squatted):
    with pytest.warns(RuntimeWarning):
        taken = _own_base(squatted, _node_directory())
    os.chown(taken, NOBODY, NOBODY)
    with pytest.warns(RuntimeWarning, match="go on in"):
        again = _own_base(squatted, _node_directory())
    assert again != taken and os.stat(taken).st_uid == NOBODY


@needs_root
def test_a_named_directory_that_is_squatted_is_still_refused(squatted, monkeypatch):
    monkeypatch.setenv(private_dirs.DIRECTORY_VARIABLE, squatted)
    from ray_collective import InsecureDirectoryError
    with pytest.raises(InsecureDirectoryError, match=f"belongs to uid {NOBODY}"):
        _node_directory()


_JOIN_BASE = """
import sys, warnings
from ray_collective.backends.ray import private_dirs
private_dirs.DEFAULT_PARENTS = (sys.argv[1],)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    path = private_dirs.node_directory(*sys.argv[2:7], 0)
print(path, len(said))
"""


@needs_root
def test_processes_that_find_the_squat_at_once_all_meet_in_one_base(squatted):
    environment = dict(os.environ, PYTHONPATH=python_path())
    environment.pop(private_dirs.DIRECTORY_VARIABLE, None)
    started = [subprocess.Popen([sys.executable, "-c", _JOIN_BASE, squatted, SESSION, JOB, "g",
                                 TOKEN, NODE], stdout=subprocess.PIPE, text=True,
                                env=environment) for _ in range(3)]
    answers = [process.communicate(timeout=60)[0].split() for process in started]
    assert all(process.returncode == 0 for process in started)
    assert len({path for path, _ in answers}) == 1
    assert sorted(int(said) for _, said in answers) == [0, 0, 1]
