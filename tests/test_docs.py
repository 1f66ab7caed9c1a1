"""The documentation site builds strictly, and its API reference has every public name.

``docs/`` is built as ``make docs`` builds it (Sphinx, ``-W --keep-going``: every warning an
error), so a broken cross-reference, a docstring Sphinx cannot read or a page missing from the
table of contents fails the suite. The reference is then read back from the built inventory
(``objects.inv``): every name of ``ray_collective.__all__`` and every exception class of
``ray_collective.errors`` that the package exports must have an entry. A third build, of a page
with a reference to a function that does not exist, shows that the strict build does fail.
Sphinx and MyST are test extras (``support.extras``): without them these tests skip, saying
what to install, or fail where ``RAY_COLLECTIVE_REQUIRE_EXTRAS=1`` (``make test``, CI).
"""

import inspect
import pathlib
import shutil
import subprocess
import sys

import pytest

from support import extras
from support.paths import REPO_DIR

DOCS = pathlib.Path(REPO_DIR) / "docs"
BUILD_TIMEOUT_S = 300


def _build(source: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    extras.need("sphinx", "the documentation build")
    extras.need("myst_parser", "the documentation's Markdown pages")
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                           "html", str(source), str(out)], cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site, built once for this module's tests; its output directory."""
    out = tmp_path_factory.mktemp("docs-html")
    finished = _build(DOCS, out)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-6000:]
    return out


def _documented_names(site: pathlib.Path):
    from sphinx.util.inventory import InventoryFile
    with open(site / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    return {name for entries in inventory.values() for name in entries}


def test_the_site_builds_with_warnings_as_errors(built_site):
    for page in ("index", "api", "semantics", "compatibility", "ray-backend", "failures",
                 "security", "algorithms", "architecture", "elastic", "spacy", "benchmarking"):
        assert (built_site / f"{page}.html").is_file(), page


def test_every_public_name_has_a_reference_entry(built_site):
    import ray_collective
    from ray_collective import errors
    documented = _documented_names(built_site)
    exported_errors = [name for name, value in vars(errors).items()
                       if inspect.isclass(value) and issubclass(value, Exception)
                       and hasattr(ray_collective, name)]
    public = sorted(set(ray_collective.__all__) | set(exported_errors))
    missing = [name for name in public if f"ray_collective.{name}" not in documented]
    assert not missing, f"no entry in docs/api.md for: {missing}"
    # The options a call or a group carries are part of what a reader of the API meets.
    assert {"ray_collective.types.CallOptions",
            "ray_collective.recorder.ObservingOptions"} <= documented


def test_a_broken_reference_fails_the_build(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    (source / "index.md").write_text("# Broken\n\nSee {py:func}`ray_collective.no_such_function`.\n")
    finished = _build(source, tmp_path / "out")
    assert finished.returncode != 0
    assert "ray_collective.no_such_function" in finished.stderr
