"""The notebooks are their own source: thin (parameters, calls into drafter_lib, tables, plots) and committed
without outputs. Executed by papermill (the smoke run the CLI made, shared with test_study.py), they must read well
in JupyterLab: progress bars as one summary line, tables as DataFrames, no printed line wide enough to wrap."""
import ast
import re

import nbformat
import pytest

from drafter_lib.common.files import read_json
from drafter_lib.common.layout import NOTEBOOKS_DIR, RunLayout
from drafter_lib.evaluation import evaluate as ev
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


# ----------------------------------------------------------------------------------------------------------------------
# Executed notebooks as a reader sees them (JupyterLab shows what papermill saved)

WIDGET = "application/vnd.jupyter.widget-view+json"  # a tqdm widget's saved state: its first frame, "0%"
UNFINISHED_BAR = re.compile(r"\b\d{1,2}%\|")  # a tqdm frame below 100 %
MAX_STDOUT_WIDTH = 150  # wider lines wrap into a block in JupyterLab: tables belong in DataFrames


def _outputs(path):
    nb = nbformat.read(path, as_version=4)
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(output) -> str:
    return output.get("text") or output.get("data", {}).get("text/plain", "")


@pytest.mark.parametrize("stage", STAGES)
def test_executed_notebook_reads_well(smoke_run, stage):
    """The notebook papermill executed for a smoke run: no progress bar saved below 100 % (a bar there is one summary
    line), no printed line wide enough to wrap, no carriage-return frames."""
    path = RunLayout.of(smoke_run["run_dir"]).notebook(stage)
    outputs = _outputs(path)
    assert outputs, path
    for i, out in outputs:
        where = f"{stage} cell {i}"
        assert WIDGET not in out.get("data", {}), f"{where}: a progress widget saved as {_text(out)!r}"
        text = _text(out)
        assert not UNFINISHED_BAR.search(text), f"{where}: a progress bar saved unfinished: {text!r}"
        if out.output_type == "stream":
            assert "\r" not in text, f"{where}: redrawn frames saved: {text[:200]!r}"
            wide = [line for line in text.splitlines() if len(line) > MAX_STDOUT_WIDTH]
            assert not wide, f"{where}: {len(wide)} printed lines wider than {MAX_STDOUT_WIDTH}: {wide[0][:200]!r}"


def test_executed_notebooks_summarize_bars_and_show_tables_as_dataframes(smoke_run):
    run = RunLayout.of(smoke_run["run_dir"])
    # training's bar became its one summary line, with the last loss it showed
    train = [line for _, o in _outputs(run.notebook("03_train_qat")) if o.output_type == "stream"
             for line in o.text.splitlines() if line.startswith("train: ")]
    assert len(train) == 1 and re.fullmatch(r"train: \d+ it in \d+\.\d s \(.*val=\d.*\)", train[0]), train
    # the evaluation's tables, each under its title as the HTML DataFrame the metrics give, none also printed as text
    frames = ev.report_frames(read_json(run.metrics))
    outputs = [o for _, o in _outputs(run.notebook("05_eval"))]
    shown = [(o["data"]["text/markdown"], after.get("data", {}).get("text/html"))
             for o, after in zip(outputs, outputs[1:]) if "text/markdown" in o.get("data", {})]
    assert shown == [(f"**{title}**", frame._repr_html_()) for title, frame in frames.items()]
    printed = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "minus its chain" not in printed and "difference [95 %]" not in printed


def test_summary_bar_prints_one_line_at_its_end(capsys):
    from drafter_lib.common import progress

    assert progress.live_display()  # no kernel here: a terminal's live bar
    bar = progress.SummaryBar(total=5, desc="score", unit="row")
    bar.update(3)
    bar.set_postfix(tok_s="12")
    assert capsys.readouterr().out == ""  # nothing drawn while it runs
    bar.close()
    bar.close()
    assert re.fullmatch(r"score: 3/5 row in \d+\.\d s \(tok_s=12\)\n", capsys.readouterr().out)  # stopped short
    assert list(progress.SummaryBar(range(4), desc="load")) == [0, 1, 2, 3]
    assert re.fullmatch(r"load: 4 it in \d+\.\d s\n", capsys.readouterr().out)
    list(progress.SummaryBar(range(4), desc="inner", leave=False))
    list(progress.SummaryBar(range(4), desc="off", disable=True))
    assert capsys.readouterr().out == ""  # left nothing, as a live bar would


def test_a_kernel_watched_by_a_person_keeps_the_live_bar(monkeypatch):
    """The rule as a kernel sees it: JupyterLab runs a cell with stdin allowed (a person can answer input()), an
    executor (nbclient, under papermill) without; only the first gets tqdm's live widget."""
    from jupyter_client.manager import start_new_kernel

    from drafter_lib.common.layout import REPO_ROOT

    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        seen = {True: [], False: []}
        for allow_stdin, out in seen.items():
            kc.execute_interactive("from tqdm.notebook import tqdm as widget_bar\n"
                                   "from drafter_lib.common import progress\n"
                                   "bar = progress.progress_bar(range(2))\n"
                                   "print(progress.live_display(), isinstance(bar, widget_bar),"
                                   " isinstance(bar, progress.SummaryBar))",
                                   allow_stdin=allow_stdin, timeout=120,
                                   output_hook=lambda m, out=out: out.extend(m["content"].get("text", "").split()))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert seen[True] == ["True", "True", "False"]
    assert seen[False] == ["False", "False", "True"]
