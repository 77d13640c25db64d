"""bench/pass_cost.py's plot of v_k per target: one curve per target beside the k + 1 and v = 1 guides."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pass_cost import KS, plot  # noqa: E402


def test_the_plot_draws_every_target(tmp_path):
    costs = {"a": {"v_at_k": {str(k): 1 + 0.1 * k for k in KS}}, "b": {"v_at_k": {str(k): 0.9 * (k + 1) for k in KS}}}
    out = tmp_path / "p" / "pass_cost.png"
    plot(costs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
