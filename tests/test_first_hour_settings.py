"""One place for every setting: each ``RAY_COLLECTIVE_*`` variable the source reads is in
``settings.VARIABLES`` and on ``docs/settings.md`` with its default, the page is linked from
the README and the docs' index; ``RAY_COLLECTIVE_LOG=debug`` logs each group's join, plan
choice and failure on the logger ``ray_collective``, and unset configures nothing."""

import logging
import os
import re
import subprocess
import sys

import ray_collective as col
from ray_collective import settings
from support.helpers import run_in
from support.paths import REPO_DIR, python_path

PAGE = os.path.join(REPO_DIR, "docs", "settings.md")


def _source_variables():
    found = set()
    for top, _, files in os.walk(os.path.join(REPO_DIR, "ray_collective")):
        for name in files:
            if name.endswith((".py", ".c", ".h")):
                with open(os.path.join(top, name), encoding="utf-8") as source:
                    found |= set(re.findall(r"RAY_COLLECTIVE_[A-Z_]+[A-Z]", source.read()))
    return found


def test_every_variable_the_source_reads_is_listed_and_on_the_page_with_its_default():
    listed = {v.name for v in settings.VARIABLES}
    assert _source_variables() <= listed, _source_variables() - listed
    with open(PAGE, encoding="utf-8") as page:
        rows = [line for line in page if line.startswith("| `RAY_COLLECTIVE_")]
    assert len(rows) == len(settings.VARIABLES)
    for variable, row in zip(settings.VARIABLES, rows):
        assert row.startswith(f"| `{variable.name}` | {variable.default} | {variable.effect}")


def test_the_page_is_linked_from_the_readme_and_the_index():
    with open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8") as readme:
        assert "(docs/settings.md)" in readme.read()
    with open(os.path.join(REPO_DIR, "docs", "index.md"), encoding="utf-8") as index:
        assert re.search(r"^settings$", index.read(), re.M)


_IN_PROCESS = """
import numpy as np, ray_collective as col
from ray_collective.testing import run_ranks
def body(rank):
    x = np.ones(8, np.float32)
    col.allreduce(x)
    col.allreduce(x)
    return x
run_ranks(2, body)
def failing(rank):
    if rank == 0:
        col.allreduce(np.ones(4), timeout=0.2)
run_ranks(2, failing, return_exceptions=True)
"""


def _python(code, **variables):
    environment = {k: v for k, v in os.environ.items() if k != settings.LOG_VARIABLE}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True,
                          env=dict(environment, PYTHONPATH=python_path(), **variables))


def test_debug_logging_shows_plan_choices_and_failures_once_each_and_nothing_when_unset():
    logged = _python(_IN_PROCESS, RAY_COLLECTIVE_LOG="debug").stderr
    lines = [line for line in logged.splitlines() if " ray_collective" in line]
    chosen = [line for line in lines if "allreduce of 8 float32 on 2 ranks" in line]
    assert len(chosen) == 2, logged   # one per rank: the second call replays the plan
    assert all("DEBUG" in line and "pid=" in line for line in chosen)
    assert any("broke the group: CollectiveTimeoutError" in line for line in lines), logged
    assert _python(_IN_PROCESS).stderr.count(" ray_collective") == 0


def test_an_unknown_log_level_warns_and_logs_nothing():
    code = "import logging, ray_collective; print(logging.getLogger('ray_collective').handlers)"
    finished = _python(code, RAY_COLLECTIVE_LOG="loud")
    assert "RAY_COLLECTIVE_LOG='loud' is not one of" in finished.stderr
    assert finished.stdout.strip() == "[]"


def _join_logged(rank, group):
    """Inside a member: join and leave with the library's logger caught; its messages."""
    messages = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(settings.LOGGER_NAME)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        col.init_collective_group(2, rank, backend="ray", group_name=group, timeout=60)
        col.destroy_collective_group(group)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return messages


def test_a_ray_group_logs_its_join_on_the_documented_logger(ray_session, members):
    for rank, messages in enumerate(run_in(ray_session, members[:2], _join_logged, "logged")):
        assert any(f"group 'logged' rank {rank} of 2: joining" in m for m in messages)
        assert any(f"group 'logged' rank {rank} of 2: joined incarnation" in m
                   and "engine" in m for m in messages), messages


def _library_handlers():
    import ray_collective  # noqa: F401 - imported in the actor, where the variable is read
    return [handler.get_name() for handler in logging.getLogger(settings.LOGGER_NAME).handlers]


def test_an_actor_given_the_variable_in_its_runtime_env_logs(ray_session):
    actor = ray_session.remote(num_cpus=0)(Logged).options(runtime_env={"env_vars": {
        settings.LOG_VARIABLE: "debug", "PYTHONPATH": python_path()}}).remote()
    try:
        assert ray_session.get(actor.handlers.remote(), timeout=120) == [settings.LOG_VARIABLE]
    finally:
        ray_session.kill(actor)


class Logged:
    def handlers(self):
        return _library_handlers()
