"""Structure rules that keep the code base readable: every module is documented in the README's module table, and
no module grows past ~400 lines (a module that does is doing two jobs)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (ROOT / "drafter_lib").glob("*.py") if p.name != "__init__.py")
MAX_LINES = 420


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_is_in_readme_table_and_small(path):
    readme = (ROOT / "README.md").read_text()
    assert f"| `{path.name}`" in readme or f", `{path.name}`" in readme, f"README's module table lacks {path.name}"
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.name} has {n} lines (> {MAX_LINES}): split it by job"
