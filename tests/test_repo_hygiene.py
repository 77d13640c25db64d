"""Rules that keep the repository readable for its users: no tracked file tells who measured what in which working
session or under which issue number (that history lives in git and in the issue tracker), and committed artifacts
record no machine paths. The package's layering and the absence of import cycles are checked by import-linter
(`lint-imports`, contracts in pyproject.toml), which CI runs."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".json", ".jsonl", ".toml", ".sh", ".ipynb", ".txt", ".csv", ".cfg", ".yaml", ".yml", ""}
# Third-party prompt text is data, not our writing: a held-out prompt may well mention "issue 3".
DATA_DIRS = ("data/heldout/",)
HISTORY = re.compile(r"\b(session|sessions)\s+\d+|\bissue\s+#?\d+|\bissues\s+\d+(\s*(,|and)\s*\d+)*", re.IGNORECASE)


def tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip("not a git checkout")
    return out.stdout.split()


def test_no_session_or_issue_numbers_in_tracked_files():
    bad = []
    for rel in tracked():
        path = ROOT / rel
        if rel.startswith(DATA_DIRS) or rel == "tests/test_repo_hygiene.py":
            continue
        if path.suffix not in TEXT or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if len(line) < 5000 and HISTORY.search(line):  # long lines: embedded images in notebooks
                bad.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not bad, "history in tracked files (say what is, not when it was measured):\n" + "\n".join(bad[:30])


def test_the_rule_catches_what_it_is_for():
    for text in ("measured in session 22", "(Session 14)", "see issue #38", "issue 9 was not touched",
                 "sessions 24 and 25"):
        assert HISTORY.search(text), text
    for text in ("a session's time", "the issue of memory", "SESSION_KEY = 1"):
        assert not HISTORY.search(text), text


def test_committed_artifacts_hold_no_machine_paths():
    """Published packs, results and notebooks must not record where a machine kept its files."""
    pattern = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|Users)/|" + re.escape(str(ROOT)))
    bad = []
    for rel in tracked("model", "results", "notebooks", "architecture.json"):
        path = ROOT / rel
        if path.suffix in {".json", ".ipynb", ".jsonl", ".txt", ".md", ".csv"} and path.is_file():
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    bad.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not bad, "machine paths in committed artifacts:\n" + "\n".join(bad[:20])
