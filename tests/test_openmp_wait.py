"""The OpenMP wait setting: bounded spinning unless the user chose one, set by server.py before torch loads."""
import os
import subprocess
import sys

import pytest
from server_helpers import ROOT

from drafter_lib.common.openmp_wait import BOUNDED_SPINS, bounded_spin, setting


def test_bounded_spin_sets_a_spin_count_only_where_nothing_is_chosen():
    env = {}
    assert bounded_spin(env) == f"GOMP_SPINCOUNT={BOUNDED_SPINS}"
    assert env == {"GOMP_SPINCOUNT": str(BOUNDED_SPINS)}
    for given in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(given)
        bounded_spin(env)
        assert env == given  # the user's choice stands, and nothing overrides it (GOMP_SPINCOUNT would)
    assert setting({}) == "OpenMP default wait"
    assert setting({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "7"}) == "OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=7"


# Records the wait settings at the moment torch is first imported: libgomp reads them when it loads.
SPY = """
import os, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append((os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")))
sys.meta_path.insert(0, Spy())
import server
import drafter_lib.serve.app  # the app's modules, torch among them
import torch
print(seen[0])
"""


@pytest.mark.parametrize("given, expected", [({}, (None, str(BOUNDED_SPINS))),
                                             ({"OMP_WAIT_POLICY": "PASSIVE"}, ("PASSIVE", None))])
def test_server_sets_the_wait_before_torch_loads(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", SPY], cwd=ROOT, env={**env, **given}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == repr(expected)


def test_study_hands_its_notebooks_the_bounded_spin(monkeypatch):
    """The study's notebook kernels inherit the wait setting from the study process's environment."""
    from drafter_lib.study import run as study

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    study.main(["--preset", "smoke", "--check"])
    assert os.environ["GOMP_SPINCOUNT"] == str(BOUNDED_SPINS) and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    study.main(["--preset", "smoke", "--check"])
    assert "GOMP_SPINCOUNT" not in os.environ
