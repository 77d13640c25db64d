"""The command-line entry points in pyproject.toml resolve to the package's functions, and each answers --help;
`python -m drafter_lib.study` and `python -m drafter_lib.train` keep working."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_resolves_to_a_function(name):
    module, _, func = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), func)), SCRIPTS[name]


@pytest.mark.parametrize("name", sorted(n for n in SCRIPTS if n != "specdraft-serve"))  # serve takes no options
def test_entry_point_answers_help(name):
    module, _, func = SCRIPTS[name].partition(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {func}; {func}()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("package", ["drafter_lib.study", "drafter_lib.train"])
def test_python_dash_m_runs_the_command(package):
    out = subprocess.run([sys.executable, "-m", package, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
