"""Sphinx configuration of the documentation site: `make docs` builds it into docs/_build/html.

Strict by design: `make docs` and tests/test_docs.py build with ``-W --keep-going`` (every
warning an error, all of them reported), and ``nitpicky`` makes every cross-reference that
resolves to nothing a warning, so a renamed function or a broken link fails the suite. Pages
are Markdown (MyST); the API reference (api.md) is autodoc over the package's docstrings,
read in Google style (Args/Returns/Raises) by napoleon.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "ray_collective"
author = "the ray_collective authors"
copyright = "2026, the ray_collective authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

myst_heading_anchors = 3
"""Headings down to ### get anchors, so that pages link to sections as ``page.md#section``."""

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
# Names the docstrings mention that no page of this site documents: the types of other
# projects (this build reaches no other site) and internal classes a signature shows.
nitpick_ignore_regex = [
    ("py:.*", r"(ray|numpy|np|torch|cupy)(\..*)?"),
    ("py:.*", r"ray_collective\.(backends|transport|group|batch|types|declared|refs|api|tensors|metrics)\..*"),
    ("py:class", r"(concurrent\.futures\.)?Future|abc\.ABC|enum\.Enum"),
    ("py:class", r"(typing\.)?(Any|Optional|Sequence|List|Dict|Tuple|Callable|Iterable|Mapping|Union|TypeVar)(\[.*\])?"),
    ("py:class", r"(collections\.abc\.)?(Sequence|Iterable|Mapping|Callable)"),
    ("py:.*", r"(Tensor|ObjectRef|ActorHandle|Membership|BackendFactory|_.*)"),
]

html_theme = "alabaster"
html_title = "ray_collective"
html_static_path = []
