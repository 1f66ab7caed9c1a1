"""``ray_collective/native/_core.pyi`` names what the extension has, no more and no less, so
that a type checker sees the core as it is (the package ships ``py.typed``)."""

import ast
import inspect
import pathlib

import pytest

from ray_collective import native

STUB = pathlib.Path(native.__file__).with_name("_core.pyi")


def _stub_names():
    tree = ast.parse(STUB.read_text())
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            members[node.name] = {n.name if isinstance(n, ast.FunctionDef) else n.target.id
                                  for n in node.body
                                  if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return names, members


def test_the_stub_names_every_function_constant_and_member_of_the_core():
    if not native.available():
        pytest.skip("the native core is not built here (it is in CI: make test requires it)")
    from ray_collective.native import _core
    names, members = _stub_names()
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert names == public
    node = {n for n in dir(_core.Node) if not n.startswith("_")} | {"__init__", "__enter__",
                                                                    "__exit__"}
    assert members["Node"] == node
    program = {n for n in dir(_core.Program) if not n.startswith("_")} | {"__init__"}
    assert members["Program"] == program


def test_the_stubs_arguments_are_those_the_docstrings_give():
    if not native.available():
        pytest.skip("the native core is not built here (it is in CI: make test requires it)")
    from ray_collective.native import _core
    tree = ast.parse(STUB.read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    node_methods = {n.name: n for c in tree.body if isinstance(c, ast.ClassDef)
                    for n in c.body if isinstance(n, ast.FunctionDef)}
    for name, obj in [(n, getattr(_core, n)) for n in functions] + \
            [(n, getattr(_core.Node, n)) for n in node_methods if not n.startswith("__")]:
        stub = functions.get(name) or node_methods[name]
        arguments = [a.arg for a in stub.args.args if a.arg != "self"]
        doc = inspect.getdoc(obj)
        # "name(a, b=1) -> ..." where a call takes arguments; no signature where it takes none.
        signature = doc[len(name) + 1:].split(")", 1)[0] if doc.startswith(name + "(") else ""
        documented = [a.split("=")[0].strip() for a in signature.split(",") if a.strip()]
        assert arguments == documented, name
