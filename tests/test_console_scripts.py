"""Every console script of the package exits 0 when it succeeds: its function returns nothing (a console script
passes the return value to sys.exit, which prints any object that is not an int or None and exits 1)."""
import ast
import importlib
import inspect
import textwrap
from importlib import metadata


def _returns(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    out = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) and not top:
                continue  # a nested function's returns are its own
            if isinstance(child, ast.Return) and child.value is not None and not (
                    isinstance(child.value, ast.Constant) and child.value.value is None):
                out.append(ast.unparse(child))
            visit(child, False)

    visit(tree.body[0], False)
    return out


def test_console_scripts_return_nothing():
    scripts = [ep for ep in metadata.distribution("specdraft").entry_points if ep.group == "console_scripts"]
    assert len(scripts) >= 10
    bad = {}
    for ep in scripts:
        name, fn = ep.name, getattr(importlib.import_module(ep.module), ep.attr)
        if _returns(fn):
            bad[name] = _returns(fn)
    assert not bad, f"console scripts that would exit 1 on success: {bad}"
