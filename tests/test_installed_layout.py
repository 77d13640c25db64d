"""Where the server looks for its model when MODEL_DIR is not set: model/ of the checkout, and for a package installed
without -e (in site-packages, where no model/ ships) the working directory's model/, naming the missing file."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from drafter_lib.common import layout

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkout_serves_its_own_model_dir():
    assert layout.IN_CHECKOUT and layout.MODEL_DIR == ROOT / "model"


def _installed(tmp_path: Path) -> Path:
    """A copy of the package alone, as `pip install .` puts it in site-packages (no pyproject.toml, no model/)."""
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "drafter_lib", site / "drafter_lib", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _run(code: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_an_installed_package_serves_the_working_directorys_model_dir(tmp_path):
    site, work = _installed(tmp_path), tmp_path / "work"
    work.mkdir()
    out = _run("from drafter_lib.common import layout; from drafter_lib.serve.settings import Settings; "
               "print(layout.IN_CHECKOUT, layout.MODEL_DIR, Settings().model_dir)", site, work)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(work / "model"), str(work / "model")]


def test_specdraft_serve_without_a_model_stops_naming_it(tmp_path):
    site, work = _installed(tmp_path), tmp_path / "work"
    work.mkdir()
    out = _run("from drafter_lib.serve.cli import main; main([])", site, work)
    assert out.returncode == 1, out.stderr
    assert "set MODEL_DIR" in out.stderr and str(work / "model" / "config.json") in out.stderr, out.stderr
    assert "site-packages/model" not in out.stderr and "Traceback" not in out.stderr
