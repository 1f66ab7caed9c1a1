"""The package's import structure: no cycle, imports inside functions only for optional
dependencies, and the layers of docs/architecture.md (algorithms know nothing of transports or
Ray; transports know nothing of algorithms or backends; the API layer knows no backend, only the
registry of them); the sizes of docs/architecture.md (no file of the library over 600 lines, no
class over 300, no function over 80, C included, but for the exceptions listed here, which may
only shrink); and one cache of prepared calls per group.

Read from the source with ``ast`` (module-level imports; ``if TYPE_CHECKING:`` blocks are not
imports at run time), so a violation is found without importing anything.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "ray_collective"
OPTIONAL_DEPENDENCIES = ("ray", "torch", "cupy", "spacy", "thinc", "faker", "jax", "ml_dtypes")
"""Imported inside functions, so that ``import ray_collective`` needs none of them (the last
three only by ``ray_collective.integrations``, which nothing below it imports)."""

LAZY_MODULES = {
    "ray_collective.backends.nccl": "the nccl backend, loaded when a group first names it",
    "ray_collective.array_protocols": "arrays taken through DLPack or a buffer, loaded when "
                                      "the first one arrives",
    "ray_collective.batch": "the driver's batch_remote, loaded on first use",
    "ray_collective.refs": "the driver's *_refs collectives, loaded on first use",
    "ray_collective.actor_pool": "ActorPool, loaded on first use (it imports Ray)",
    "ray_collective.sim": "the simulator, for benchmarks and the command line",
    "ray_collective.testing": "in-process groups for tests",
    "ray_collective.weight_sync": "weight sync, loaded when a process first uses it",
    "ray_collective.torch": "the torch.distributed backend, loaded by import ray_collective.torch",
}
"""Our modules that may be imported inside functions (with their subpackages): a rank needs
none of them until it uses it, and each costs every rank process its memory (400 of them on
one machine: docs/running-at-scale.md). A joined one-node rank has none of them loaded
(``test_a_joined_rank_has_not_imported_the_lazy_modules``)."""


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, node: ast.AST) -> list:
    """The modules an import statement of ``module`` names (package modules and others)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = _package_of(module)
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    submodules = [f"{base}.{alias.name}" for alias in node.names
                  if f"{base}.{alias.name}" in MODULES]
    return submodules or [base]


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str):
    """(module-level imported modules, [(line, imported module) inside functions])."""
    tree = ast.parse(MODULES[module].read_text())
    top, inner = [], []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child)
                if in_function:
                    inner.extend((child.lineno, target) for target in targets)
                else:
                    top.extend(targets)
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, inner


IMPORTS = {module: _imports(module) for module in MODULES}


def _internal_graph() -> dict:
    return {module: sorted({t for t in top if t in MODULES and t != module})
            for module, (top, _) in IMPORTS.items()}


def _find_cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in graph:
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def _imports_optional_dependency_at_top(module: str) -> bool:
    return any(t.split(".")[0] in OPTIONAL_DEPENDENCIES for t in IMPORTS[module][0])


def test_the_package_is_read():
    assert len(MODULES) > 40
    assert "ray_collective.algorithms.catalog" in MODULES


def test_no_import_cycle_between_modules():
    cycle = _find_cycle(_internal_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": []}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None


def _is_lazy(module: str) -> bool:
    return any(module == lazy or module.startswith(lazy + ".") for lazy in LAZY_MODULES)


def test_imports_inside_functions_are_only_of_optional_dependencies():
    """An import inside a function hides a dependency (often a cycle); only the optional ones
    may hide there, a module of ours that imports one of them at its top, or one of
    ``LAZY_MODULES``."""
    hidden = [f"{MODULES[module].relative_to(PACKAGE_DIR.parent)}:{line} imports {target}"
              for module, (_, inner) in IMPORTS.items() for line, target in inner
              if not (target.split(".")[0] in OPTIONAL_DEPENDENCIES or _is_lazy(target)
                      or (target in MODULES and _imports_optional_dependency_at_top(target)))]
    assert not hidden, "\n".join(hidden)


def test_every_lazy_module_exists():
    assert [m for m in LAZY_MODULES if m not in MODULES] == []


def test_no_module_imports_a_lazy_one_at_its_top():
    """A lazy module imported at the top of one that every rank loads would be loaded anyway;
    only lazy modules themselves (and their own packages) may."""
    eager = [f"{module} imports {target}" for module, (top, _) in IMPORTS.items()
             if not _is_lazy(module) for target in top if _is_lazy(target)]
    assert not eager, "\n".join(eager)


def _loaded_lazy_modules(rank: int, group: str) -> list:
    """Inside a fresh actor: join ``group`` of 2 on the ``ray`` backend, allreduce once, then
    the lazy modules (and optional dependencies) this process has loaded."""
    import sys

    import numpy as np

    import ray_collective as col
    col.init_collective_group(2, rank, backend="ray", group_name=group, timeout=60.0)
    tensor = np.full(4, rank + 1, np.float32)
    col.allreduce(tensor, group)
    col.destroy_collective_group(group)
    assert tensor.tolist() == [3.0] * 4
    return sorted(m for m in sys.modules
                  if _is_lazy(m) or m.split(".")[0] in ("torch", "cupy", "benchmarks"))


def test_a_joined_rank_has_not_imported_the_lazy_modules(ray_session):
    """Two actors in processes of their own (a runtime environment no other test uses, so
    Ray starts new workers rather than lending ones that ran other tests) join a one-node
    group and allreduce: neither holds a lazy module."""
    import uuid

    from support.helpers import Member, run_in
    fresh = {"env_vars": {"RAY_COLLECTIVE_TEST_FRESH_WORKER": uuid.uuid4().hex}}
    member = ray_session.remote(num_cpus=0)(Member).options(runtime_env=fresh)
    actors = [member.remote() for _ in range(2)]
    try:
        loaded = run_in(ray_session, actors, _loaded_lazy_modules, "lazy-modules")
    finally:
        for actor in actors:
            ray_session.kill(actor)
    assert loaded == [[], []]


@pytest.mark.parametrize("layer, forbidden", [
    ("ray_collective.algorithms", ("ray_collective.transport", "ray_collective.backends",
                                   "ray_collective.group", "ray_collective.api", "ray")),
    ("ray_collective.transport", ("ray_collective.algorithms", "ray_collective.backends",
                                  "ray_collective.group", "ray_collective.api")),
])
def test_layers_import_nothing_above_them(layer, forbidden):
    wrong = [f"{module} imports {target}"
             for module, (top, inner) in IMPORTS.items() if module.startswith(layer)
             for target in top + [t for _, t in inner]
             if any(target == f or target.startswith(f + ".") for f in forbidden)]
    assert not wrong, "\n".join(wrong)


LAYERS = (
    ("types", "errors", "tensors", "array_protocols", "reductions", "validation", "recorder",
     "metrics", "settings"),
    ("algorithms", "transport"),
    ("engine", "sim", "native"),
    ("engine.cpu", "backends"),
    ("group",),
    ("declared", "elastic"),
    ("api", "api_groups", "api_multigpu", "refs", "batch", "actor_pool", "interop",
     "ray_util_group", "testing", "__init__",
     "__main__", "weight_sync", "functional", "torch", "objects"),
    ("integrations",),
)
"""The layers of docs/architecture.md, bottom first: a module imports only from its own layer
or those below. A module's layer is its subpackage's, unless the module is named itself (the
CPU engine, ``engine.cpu``, is a membership: it sits with the backends, above the rest of the
engine)."""


def _layer_of(module: str) -> int:
    parts = module.split(".")[1:] or ["__init__"]
    for name in (".".join(parts[:2]), parts[0]):
        for depth, names in enumerate(LAYERS):
            if name in names:
                return depth
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there and in "
                         f"docs/architecture.md")


def test_every_module_imports_only_its_layer_and_those_below():
    upward = [f"{module} (layer {_layer_of(module)}) imports {target} "
              f"(layer {_layer_of(target)})"
              for module, (top, inner) in IMPORTS.items()
              for target in top + [t for _, t in inner]
              if target in MODULES and _layer_of(target) > _layer_of(module)]
    assert not upward, "\n".join(upward)


def test_the_api_layer_imports_no_backend_only_the_registry():
    """The public functions (``api.py``, ``api_groups.py``, ``api_multigpu.py``) dispatch
    through the registry (``backends``) and the backend interface (``backends.base``); a
    backend's own modules would make it the only one."""
    allowed = {"ray_collective.backends", "ray_collective.backends.base"}
    wrong = [f"{module} imports {t}"
             for module in ("ray_collective.api", "ray_collective.api_groups",
                            "ray_collective.api_multigpu")
             for t in IMPORTS[module][0] + [t for _, t in IMPORTS[module][1]]
             if t.startswith("ray_collective.backends") and t not in allowed]
    assert not wrong, "\n".join(wrong)


MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80

LONG_TODAY = {
    "ray_collective.backends.ray.rendezvous.join":
        "the rendezvous's join: its steps are to be split where the rendezvous is reworked",
}
"""The functions and classes over the limits today, each named with why it is left: the list
may only shrink (an entry that is no longer too long fails the test, so that it is taken out)."""


def _python_sizes(modules: dict) -> list:
    """``(name, kind, lines)`` of every module, class and function of ``modules``."""
    found = []
    for module, path in modules.items():
        text = path.read_text()
        found.append((module, "file", len(text.splitlines())))
        tree = ast.parse(text)

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}.{child.name}"
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    found.append((name, kind, child.end_lineno - child.lineno + 1))
                    visit(child, name)

        visit(tree, module)
    return found


def _c_sizes(paths, root: pathlib.Path = PACKAGE_DIR.parent) -> list:
    """``(path:function, kind, lines)`` of every C source and header file and of every function
    in it: from the line that names the function to its closing brace in the first column."""
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        name = f"{path.relative_to(root)}"
        found.append((name, "file", len(lines)))
        start = None
        for number, line in enumerate(lines):
            if start is None and _opens_function(lines, number):
                start = (number, line.split("(")[0].split()[-1].lstrip("*"))
            elif start is not None and line == "}":
                found.append((f"{name}:{start[1]}", "function", number - start[0] + 1))
                start = None
    return found


def _opens_function(lines: list, number: int) -> bool:
    """Whether line ``number`` names a function whose body follows: a line in the first column
    with a parenthesis, whose signature goes on to a ``{`` before any ``;`` or blank line (not
    a declaration, nor a macro's use)."""
    line = lines[number]
    if not line[:1].isalpha() or "(" not in line or line.startswith(
            ("typedef", "struct", "enum", "union")):
        return False
    for following in lines[number:number + 6]:
        if following.rstrip().endswith("{"):
            return True
        if not following.strip() or following.rstrip().endswith(";"):
            return False
    return False


def _too_long(sizes: list) -> dict:
    limits = {"file": MAX_FILE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    return {name: f"{kind} of {lines} lines" for name, kind, lines in sizes
            if lines > limits[kind]}


def _library_sizes() -> list:
    c_files = sorted(PACKAGE_DIR.rglob("*.c")) + sorted(PACKAGE_DIR.rglob("*.h"))
    return _python_sizes(MODULES) + _c_sizes(c_files)


def test_no_file_class_or_function_of_the_library_is_over_its_limit():
    long = _too_long(_library_sizes())
    new = [f"{name}: {what}" for name, what in long.items() if name not in LONG_TODAY]
    assert not new, ("over the limits (600 lines a file, 300 a class, 80 a function): "
                     + "; ".join(new))
    fixed = sorted(set(LONG_TODAY) - set(long))
    assert not fixed, f"no longer too long, take them out of LONG_TODAY: {fixed}"


def test_the_size_check_reads_c_functions():
    sizes = _c_sizes(sorted(PACKAGE_DIR.rglob("*.c")))
    assert len([s for s in sizes if s[1] == "function"]) > 50
    assert all(lines > 1 for _, kind, lines in sizes if kind == "function")


def test_the_size_check_finds_a_long_class_function_and_c_function(tmp_path):
    module = tmp_path / "long.py"
    module.write_text("class Long:\n    def f(self):\n" + "        x = 1\n" * MAX_CLASS_LINES)
    assert _too_long(_python_sizes({"long": module})) == {
        "long.Long": f"class of {MAX_CLASS_LINES + 2} lines",
        "long.Long.f": f"function of {MAX_CLASS_LINES + 1} lines"}
    source = tmp_path / "long.c"
    source.write_text("int declared(int x,\n             int y);\n\nstatic int\n"
                      "long_one(int x)\n{\n" + "    x += 1;\n" * MAX_FUNCTION_LINES
                      + "    return x;\n}\n")
    assert _too_long(_c_sizes([source], tmp_path)) == {
        "long.c:long_one": f"function of {MAX_FUNCTION_LINES + 4} lines"}


def _long_classes(package: str) -> list:
    found = []
    for module, path in MODULES.items():
        if not module.startswith(package):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    found.append(f"{module}.{node.name}: {lines} lines")
    return found


def test_no_class_in_the_transport_layer_is_over_300_lines():
    long = _long_classes("ray_collective.transport")
    assert not long, "\n".join(long)


def test_the_class_length_check_finds_a_long_class(tmp_path, monkeypatch):
    module = tmp_path / "long.py"
    module.write_text("class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    monkeypatch.setitem(MODULES, "ray_collective.transport.long_for_test", module)
    assert _long_classes("ray_collective.transport.long_for_test") == [
        f"ray_collective.transport.long_for_test.Long: {MAX_CLASS_LINES + 1} lines"]


def test_importing_the_package_imports_no_integration_framework():
    """``import ray_collective`` needs numpy and Ray only: the integrations' frameworks load
    with the integration (``ray_collective.integrations``, the top layer), never before."""
    frameworks = ("spacy", "thinc", "faker", "typer")
    code = (f"import sys, ray_collective; "
            f"print([m for m in {frameworks!r} if m in sys.modules])")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert found == "[]", f"import ray_collective imported {found}"


def _caches_of_prepared_calls(group) -> list:
    """Where the group, its membership and what the membership holds keep prepared calls: the
    ``Class.attribute`` of every dict among their attributes with one as a value."""
    from ray_collective.backends.base import PreparedCall

    def attributes(holder):
        if hasattr(holder, "__dict__"):
            return vars(holder).items()
        return [(slot, getattr(holder, slot, None)) for cls in type(holder).__mro__
                for slot in getattr(cls, "__slots__", ())]

    def prepared(value):
        return isinstance(value, PreparedCall) or (
            isinstance(value, tuple) and value and isinstance(value[0], PreparedCall))

    holders = [group, group.membership] + [value for _, value in
                                           attributes(group.membership)]
    return sorted({f"{type(holder).__name__}.{name}" for holder in holders
                   for name, value in attributes(holder)
                   if isinstance(value, dict) and any(prepared(v) for v in value.values())})


def test_a_group_keeps_one_cache_of_prepared_calls():
    import numpy as np

    import ray_collective as col
    from ray_collective.group import current_registry
    from ray_collective.testing import run_ranks

    def body(rank):
        x = np.ones(3)
        for _ in range(2):
            col.allreduce(x)
            col.broadcast(x, src_rank=0)
            col.allgather([np.zeros(3), np.zeros(3)], x)
        col.allreduce(x, async_op=True).wait()
        group = current_registry().get("default")
        return _caches_of_prepared_calls(group), len(group.prepared)

    assert run_ranks(2, body) == [(["Group.prepared"], 4)] * 2
