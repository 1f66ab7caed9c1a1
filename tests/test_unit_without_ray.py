"""``pytest -m unit`` needs no Ray: its tests collect (and so can run) where Ray cannot be
imported, as on a machine that has only the library's own dependencies. A test module that needs
Ray imports it inside its tests, or skips saying so (``pytest.importorskip``)."""

import os
import subprocess
import sys

from support.paths import REPO_DIR, SUPPORT_DIR


def test_the_unit_tests_collect_with_ray_unimportable():
    """Collected only, to stay quick: ``make test-without-ray`` runs them so
    (``support/without_ray.py``)."""
    finished = subprocess.run(
        [sys.executable, os.path.join(SUPPORT_DIR, "without_ray.py"), "-q", "-m", "unit",
         "--co"], cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    tail = finished.stdout[-3000:] + finished.stderr[-2000:]
    assert finished.returncode == 0, tail
    assert " error" not in finished.stdout.splitlines()[-1], tail
    collected = int(finished.stdout.splitlines()[-1].split("/")[0])
    assert collected > 1000, tail
    # Ray was unimportable indeed: the module that compares with ray.util.collective skipped.
    assert "SKIPPED [1] tests/test_compat.py" in finished.stdout, tail
