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


def test_committed_artifacts_hold_no_machine_paths():
    """Published packs, results and notebooks must not record where a machine kept its files."""
    import re
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "model", "results", "notebooks", "architecture.json"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|Users)/|" + re.escape(str(ROOT)))
    bad = []
    for rel in tracked:
        path = ROOT / rel
        if path.suffix in {".json", ".ipynb", ".jsonl", ".txt", ".md", ".csv"} and path.is_file():
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    bad.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not bad, "machine paths in committed artifacts:\n" + "\n".join(bad[:20])
