"""The suite's own rules. Kinds (``support.kinds``): which marker each test gets, that
``pytest -m unit`` leaves out every test that needs Ray or a GPU, that a unit test cannot start
Ray, and that a run that selects no test fails. Extras (``support.extras``): a missing test
extra skips a test, or fails it and the run where the extras are required."""

import subprocess
import sys

import pytest

import conftest
from support import extras, kinds
from support.helpers import run_benchmark
from support.paths import REPO_DIR


@pytest.mark.parametrize("fixtures, markers, expected", [
    ((), (), {"unit"}),
    (("tmp_path",), ("parametrize",), {"unit"}),
    (("members", "ray_session"), (), {"ray"}),
    ((), ("ray",), {"ray"}),
    ((), ("multinode", "slow"), {"multinode", "slow"}),
    ((), ("slow",), {"slow"}),
    ((), ("gpu", "skipif"), {"gpu"}),
    (("ray_session",), ("multinode",), {"multinode", "ray"}),
])
def test_a_test_is_unit_only_when_it_is_none_of_the_other_kinds(fixtures, markers, expected):
    assert kinds.kinds_of(fixtures, markers) == expected


def test_unit_is_never_marked_by_hand():
    with pytest.raises(kinds.KindError, match="do not mark a test with it"):
        kinds.kinds_of((), ("unit",))


def test_a_unit_test_that_starts_ray_fails_saying_how_to_mark_it():
    pytest.importorskip("ray", reason="it calls ray.init to see it refused")
    import ray
    with pytest.raises(kinds.KindError, match="unit test, but it calls ray.init"):
        ray.init(address="local")
    with pytest.raises(kinds.KindError, match="starts Ray: mark it @pytest.mark.ray"):
        run_benchmark("benchmarks", "--help")


def _pytest(*arguments):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *arguments],
                          cwd=REPO_DIR, capture_output=True, text=True, timeout=120)


def test_selecting_unit_leaves_out_ray_slow_and_multinode_tests():
    collected = _pytest("--collect-only", "-q", "-m", "unit", "tests/test_sim.py",
                        "tests/test_ray_backend.py", "tests/test_join_nodes.py")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert any("test_sim.py::test_cli_prints_the_table" in i for i in ids)
    assert any("test_join_nodes.py::test_bad_arguments_are_refused" in i for i in ids)
    assert not [i for i in ids if "test_ray_backend.py" in i or "4096" in i
                or "two_node_run" in i], ids


def test_a_run_that_selects_no_test_fails():
    # pytest's own exit status 5; `make test` and .ci/run pass it on (see CONTRIBUTING.md).
    assert _pytest("-q", "-m", "unit and gpu", "tests/test_suite.py").returncode == 5


def test_a_present_extra_is_imported_whether_required_or_not(monkeypatch):
    monkeypatch.setattr(extras, "MODULES", {"json": "the standard library"})
    assert extras.need("json", "this test").__name__ == "json"
    monkeypatch.setenv(extras.REQUIRE_VARIABLE, "1")
    assert extras.need("json", "this test").__name__ == "json"


@pytest.mark.parametrize("required, outcome", [("", pytest.skip.Exception),
                                               ("0", pytest.skip.Exception),
                                               ("1", pytest.fail.Exception)])
def test_a_missing_extra_skips_unless_required_then_fails(monkeypatch, required, outcome):
    monkeypatch.setitem(extras.MODULES, "no_such_module_here", "no-such-package")
    monkeypatch.setenv(extras.REQUIRE_VARIABLE, required)
    with pytest.raises(outcome, match=r"the oracle: no_such_module_here \(package "
                                      r"no-such-package\) is missing"):
        extras.need("no_such_module_here", "the oracle")


def test_a_missing_mpiexec_is_a_missing_extra(monkeypatch, tmp_path):
    monkeypatch.delenv(extras.REQUIRE_VARIABLE, raising=False)  # make test sets it
    monkeypatch.setattr(extras, "MODULES", {"json": "the standard library"})
    monkeypatch.setattr(extras, "MPIEXEC", str(tmp_path / "mpiexec"))
    with pytest.raises(pytest.skip.Exception, match="MPICH's mpiexec"):
        extras.need_mpiexec("the oracle")
    assert extras.missing() == ["mpich"]


def test_a_required_run_stops_before_the_first_test_when_an_extra_is_missing(monkeypatch):
    monkeypatch.setitem(extras.MODULES, "no_such_module_here", "no-such-package")
    monkeypatch.delenv(extras.REQUIRE_VARIABLE, raising=False)  # make test sets it
    conftest.pytest_sessionstart(None)  # not required: the tests that need it skip
    monkeypatch.setenv(extras.REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.UsageError, match="missing: (.*, )?no-such-package"):
        conftest.pytest_sessionstart(None)
