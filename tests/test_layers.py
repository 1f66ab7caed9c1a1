"""The package's import structure: no cycle, imports inside functions only for optional
dependencies, and the layers of docs/architecture.md (algorithms know nothing of transports or
Ray; transports know nothing of algorithms or backends; the API layer knows no backend, only the
registry of them), and no class in ``transport/`` over 300 lines.

Read from the source with ``ast`` (module-level imports; ``if TYPE_CHECKING:`` blocks are not
imports at run time), so a violation is found without importing anything.
"""

import ast
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "ray_collective"
OPTIONAL_DEPENDENCIES = ("ray", "torch", "cupy")
"""Imported inside functions, so that ``import ray_collective`` needs none of them."""


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


def test_imports_inside_functions_are_only_of_optional_dependencies():
    """An import inside a function hides a dependency (often a cycle); only the optional ones
    may hide there, or a module of ours that imports one of them at its top."""
    hidden = [f"{MODULES[module].relative_to(PACKAGE_DIR.parent)}:{line} imports {target}"
              for module, (_, inner) in IMPORTS.items() for line, target in inner
              if not (target.split(".")[0] in OPTIONAL_DEPENDENCIES
                      or (target in MODULES and _imports_optional_dependency_at_top(target)))]
    assert not hidden, "\n".join(hidden)


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
    ("types", "errors", "tensors", "validation", "recorder", "metrics"),
    ("algorithms", "transport"),
    ("plan", "executor", "sim", "native"),
    ("backends",),
    ("group",),
    ("declared", "elastic"),
    ("api", "refs", "batch", "actor_pool", "interop", "ray_util_group", "testing", "__init__",
     "status", "__main__"),
)
"""README's layers, bottom first: a module imports only from its own layer or those below."""


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for depth, names in enumerate(LAYERS):
        if top in names:
            return depth
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there and in README")


def test_every_module_imports_only_its_layer_and_those_below():
    upward = [f"{module} (layer {_layer_of(module)}) imports {target} "
              f"(layer {_layer_of(target)})"
              for module, (top, inner) in IMPORTS.items()
              for target in top + [t for _, t in inner]
              if target in MODULES and _layer_of(target) > _layer_of(module)]
    assert not upward, "\n".join(upward)


def test_the_api_layer_imports_no_backend_only_the_registry():
    """api.py dispatches through the registry (``backends``) and the backend interface
    (``backends.base``); a backend's own modules would make it the only one."""
    allowed = {"ray_collective.backends", "ray_collective.backends.base"}
    top, inner = IMPORTS["ray_collective.api"]
    wrong = [t for t in top + [t for _, t in inner]
             if t.startswith("ray_collective.backends") and t not in allowed]
    assert not wrong, "api.py imports " + ", ".join(wrong)


MAX_CLASS_LINES = 300


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
