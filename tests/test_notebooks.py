"""The notebooks are their own source: thin (parameters, calls into drafter_lib, tables, plots) and committed
without outputs. Executing one is tested in test_study.py, against a run the CLI made."""
import ast

import nbformat
import pytest

from drafter_lib.common.layout import NOTEBOOKS_DIR
from drafter_lib.study.run import STAGES

MAX_CELL_LINES = 15
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def test_every_stage_has_a_notebook_and_no_generator_is_left():
    assert [p.stem for p in NOTEBOOKS] == list(STAGES)
    assert not list(NOTEBOOKS_DIR.glob("*.py"))  # the .ipynb files are the source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_thin_and_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged `parameters` (papermill injects after it)"
    assigned = {t.id for node in ast.parse(params[0].source).body for t in node.targets}
    assert assigned == {"run_dir", "preset", "overrides"}
    assert code.index(params[0]) == 0
    assert "stages.open_run(run_dir, preset, overrides)" in code[1].source  # the config and paths of the run
    for i, cell in enumerate(code):
        where = f"{path.name} code cell {i}"
        assert not cell.get("outputs") and cell.get("execution_count") is None, f"{where}: outputs committed"
        assert len(cell.source.splitlines()) <= MAX_CELL_LINES, f"{where}: longer than {MAX_CELL_LINES} lines"
        tree = ast.parse(cell.source)
        defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                            ast.Lambda))]
        assert not defs, f"{where}: defines {type(defs[0]).__name__}; move the logic into drafter_lib"
        # paths come from the run layout, never from string literals
        literals = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [s for s in literals if s.endswith((".jsonl", ".json", "/"))] or cell is params[0], where
