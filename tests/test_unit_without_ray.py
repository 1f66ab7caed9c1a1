"""``pytest -m unit`` needs no Ray: its tests collect (and so can run) where Ray cannot be
imported, as on a machine that has only the library's own dependencies. A test module that needs
Ray imports it inside its tests, or skips saying so (``pytest.importorskip``)."""

import os
import subprocess
import sys

from support import extras
from support.paths import REPO_DIR

# Ray made unimportable (None in sys.modules makes every ``import ray`` raise ImportError), then
# the unit tests collected: the run fails on a module that errors at collection.
COLLECT_WITHOUT_RAY = (
    "import sys\n"
    "sys.modules['ray'] = None\n"
    "sys.path.insert(0, '.')\n"
    "import pytest\n"
    "sys.exit(pytest.main(['-q', '-m', 'unit', '--co', '-p', 'no:cacheprovider', 'tests']))\n")


def test_the_unit_tests_collect_with_ray_unimportable():
    # Without Ray, Ray's extras are missing by design: the required-extras check is not this
    # run's to make.
    environment = {k: v for k, v in os.environ.items() if k != extras.REQUIRE_VARIABLE}
    finished = subprocess.run([sys.executable, "-c", COLLECT_WITHOUT_RAY], cwd=REPO_DIR,
                              env=environment, capture_output=True, text=True, timeout=300)
    tail = finished.stdout[-3000:] + finished.stderr[-2000:]
    assert finished.returncode == 0, tail
    assert " error" not in finished.stdout.splitlines()[-1], tail
    collected = int(finished.stdout.splitlines()[-1].split("/")[0])
    assert collected > 1000, tail
