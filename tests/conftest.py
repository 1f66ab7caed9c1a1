"""The session's fixtures (one local Ray instance and a pool of member actors), the kinds of
tests (``support.kinds``: each test gets its kind's marker at collection, and a ``unit`` test
that starts Ray anyway fails) and the test extras a run requires (``support.extras``)."""

import pytest

from support import extras, kinds
from support.helpers import start_members
from support.paths import python_path

POOL_SIZE = 5


def pytest_sessionstart(session):
    """With ``RAY_COLLECTIVE_REQUIRE_EXTRAS=1`` (CI), stop before the first test if a test
    extra is missing, rather than let the tests that need it skip."""
    absent = extras.missing() if extras.required() else []
    if absent:
        raise pytest.UsageError(
            f"{extras.REQUIRE_VARIABLE} is set and these test extras are missing: "
            f"{', '.join(absent)}. Install them ({extras.INSTALL}), or unset the variable to "
            f"skip the tests that need them.")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test with its kinds before ``-m`` selects among them."""
    for item in items:
        try:
            found = kinds.kinds_of(item.fixturenames, [m.name for m in item.iter_markers()])
        except kinds.KindError as err:
            raise pytest.UsageError(f"{item.nodeid}: {err}") from None
        for kind in sorted(found):
            item.add_marker(kind)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request, monkeypatch):
    """Inside a ``unit`` test, starting Ray raises instead: the test is not what it says."""
    if request.node.get_closest_marker("unit") is None:
        return
    monkeypatch.setenv(kinds.UNIT_TEST_VARIABLE, request.node.nodeid)
    try:
        import ray
    except ImportError:
        return  # nothing could start it (``pytest -m unit`` where Ray is not installed)

    def refuse(*args, **kwargs):
        raise kinds.KindError(f"{request.node.nodeid} is a unit test, but it calls ray.init: "
                              f"use the ray_session fixture, or mark it @pytest.mark.ray")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session; workers can import the test modules."""
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": python_path()}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def members(ray_session):
    """A pool of member actors shared by the tests that leave them healthy."""
    pool = start_members(ray_session, POOL_SIZE)
    yield pool
    for actor in pool:
        ray_session.kill(actor)
