"""The session's fixtures: one local Ray instance and a pool of member actors."""

import pytest

from support.helpers import start_members
from support.paths import python_path

POOL_SIZE = 5


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
