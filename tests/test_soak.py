"""bench/soak.py's short version (the CI soak): a few clients for 15 s against a tiny packed model through ./serve.sh,
with malformed and abandoned requests mixed in; the report must show no unexpected error, every re-checked draft
equal to the same request sent alone, and RSS within the stated bound."""

from __future__ import annotations

import importlib.util
import json
import sys

from server_helpers import ROOT, tiny_hf_model, write_tiny_model_dir


def load_soak():
    # by path: bench/ is not a package on every sys.path the tests run with
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_short_soak_serves_cleanly_and_drafts_equal_requests_sent_alone(tmp_path, capsys):
    model_dir = write_tiny_model_dir(tmp_path / "tiny", tiny_hf_model(seed=0))
    out = tmp_path / "soak.json"
    # MAX_CACHE_MB 1: a few contexts fill it, so the soak also runs through evictions
    code = load_soak().main(["--model-dir", str(model_dir), "--duration", "15", "--clients", "4", "--bucket-s", "10",
                             "--max-cache-mb", "1", "--malformed-p", "0.05", "--disconnect-p", "0.05",
                             "--check", "50", "--log", str(tmp_path / "server.log"), "--json", str(out)])
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert code == 0, printed
    assert rep["ok"] and not rep["failures"] and not rep["errors"]["unexpected"]
    assert printed.startswith("cpu capability ") and "result: PASS" in printed

    req = rep["requests"]
    assert req["served"] > 0 and req["by_status"]["200"] == req["served"]
    assert set(req["by_kind"]) == {"extend", "branch", "new"}
    assert all(int(s) in (200, 503) for kind in req["by_kind"].values() for s in kind)  # well-formed: no 4xx/5xx

    mal = rep["malformed"]  # every client sends at least one
    assert mal["sent"] >= 4 and mal["answered_4xx"] + mal["answered_503"] == mal["sent"]
    assert len(mal["by_case"]) >= 2

    dis = rep["disconnects"]  # every client abandons at least one request, and the server kept serving
    assert dis["sent"] >= 4 and dis["how"].get("cut_off_mid_body", 0) >= 1
    assert dis["served_after_first"] > 0

    drafts = rep["drafts"]
    assert 0 < drafts["checked"] <= 50 and drafts["equal"] == drafts["checked"] and not drafts["mismatches"]

    rss = rep["rss"]
    assert rss["samples"] and rss["within_bound"] and rss["max_after_warmup_mib"] <= rss["bound_mib"]
    assert len(rep["buckets"]) == 2 and sum(b["served"] for b in rep["buckets"]) == req["served"]
    assert rep["server_counters"]["cache"]["evictions"] > 0


def test_short_soak_with_a_target_mixes_generations_cleanly(generation_dirs, tmp_path, capsys):
    """With --target half the clients generate on /v1 (streamed or not, logprobs sometimes, long prompts read in
    chunks, bad bodies, hang-ups) beside /draft, after a phase of /draft alone: no unexpected error, the answers
    re-sent alone come back with the same text, and /draft's latency is reported without and with generations."""
    target_dir, drafter_dir = generation_dirs
    out = tmp_path / "soak.json"
    code = load_soak().main(["--model-dir", str(drafter_dir), "--target", str(target_dir), "--duration", "15",
                             "--clients", "4", "--generate-every", "2", "--bucket-s", "15", "--max-len", "200",
                             "--draft-only-s", "5", "--settle-s", "1", "--long-prompt-p", "0.3",
                             "--set", "GENERATION_PREFILL_CHUNK=16", "--check", "40",
                             "--log", str(tmp_path / "server.log"), "--json", str(out)])
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert code == 0 and rep["ok"] and not rep["errors"]["unexpected"], printed
    assert rep["settings"]["kinds"] == {"extend": 1, "new": 1, "generate": 2}
    assert set(rep["requests"]["by_kind"]["generate"]) <= {"200", "503"}
    gen = rep["generations"]
    assert sum(gen["by_outcome"].get(k, 0) for k in ("whole", "streamed")) > 0
    assert 0 < gen["checked"] == gen["equal"] and not gen["mismatches"]
    assert any(case.startswith("v1_") for case in rep["malformed"]["by_case"])  # each generate client sent one
    assert rep["malformed"]["answered_4xx"] + rep["malformed"]["answered_503"] == rep["malformed"]["sent"]
    assert rep["disconnects"]["how"].get("hung_up_on_generation", 0) >= 1
    lat = rep["draft_latency"]
    assert lat["draft_only_s"] == 5 and lat["without_generations"]["served"] > 0
    assert lat["with_generations"]["served"] > 0 and lat["p99_ratio"] > 0 and "/draft latency without" in printed
