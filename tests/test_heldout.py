"""The held-out evaluation sets (drafter_lib.data.heldout): committed files and their provenance, the generated RAG
prompts, chat turns as items, and that nothing held out was ever a training prompt."""
import json
import re
import shutil
from collections import Counter

import pytest

from drafter_lib.common.files import sha256_file
from drafter_lib.common.layout import REPO_ROOT, resolve_shared_data
from drafter_lib.data import heldout as H
from drafter_lib.study import config as C
from drafter_lib.study import config_sections as S


def readme_rows():
    """The provenance table of data/heldout/README.md: file -> {repo, path, commit, license, sha256, rows}."""
    rows = {}
    for line in (H.HELDOUT_DIR / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].endswith(".jsonl"):
            rows[cells[0]] = dict(zip(("repo", "path", "commit", "license", "sha256", "rows"), cells[1:]))
    return rows


def test_committed_files_match_their_readme_and_load_by_category():
    table = readme_rows()
    assert set(table) == set(H.COMMITTED) == {p.name for p in H.HELDOUT_DIR.glob("*.jsonl")}
    for name, meta in H.COMMITTED.items():
        assert sha256_file(H.HELDOUT_DIR / name) == table[name]["sha256"] == meta["sha256"], name
        assert {k: str(meta[k]) for k in table[name]} == table[name], name
    mt, decl = H.load_entry("data/heldout/mt_bench.jsonl")
    assert Counter(r["category"] for r in mt) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math",
                                                                   "coding", "extraction", "stem", "humanities")}
    assert all(sum(m["role"] == "user" for m in r["messages"]) == 2 for r in mt)
    assert mt[0]["id"] == "mt_bench/81" and decl["commit"] == H.COMMITTED["mt_bench.jsonl"]["commit"]
    assert decl["input_sha256"] == H.COMMITTED["mt_bench.jsonl"]["sha256"] and decl["rows"] == 80
    summ, _ = H.load_entry("data/heldout/spec_bench_summarization.jsonl")
    assert len(summ) == 16 and {r["category"] for r in summ} == {"summarization"}
    assert all(len(r["messages"]) == 1 and r["messages"][0]["content"].startswith("Summarize: ") for r in summ)
    assert max(len(r["messages"][0]["content"]) for r in summ) > 5000  # long inputs


def test_a_changed_committed_file_is_refused(tmp_path, monkeypatch):
    shutil.copy(H.HELDOUT_DIR / "mt_bench.jsonl", tmp_path / "mt_bench.jsonl")
    monkeypatch.setattr(H, "HELDOUT_DIR", tmp_path)
    assert H.check_committed(tmp_path / "mt_bench.jsonl")["rows"] == 80
    with open(tmp_path / "mt_bench.jsonl", "a") as f:
        f.write(json.dumps({"question_id": 999, "category": "x", "turns": ["extra"]}) + "\n")
    with pytest.raises(ValueError, match="sha256"):
        H.load_entry(str(tmp_path / "mt_bench.jsonl"))


def test_rag_prompts_are_seeded_long_and_answerable():
    a, b = H.rag_prompts(6, seed=0), H.rag_prompts(6, seed=0)
    assert a == b and H.records_sha256(a) == H.records_sha256(b)
    assert H.records_sha256(H.rag_prompts(6, seed=1)) != H.records_sha256(a)
    for r in a:
        text = r["messages"][0]["content"]
        heads = re.findall(r"^Document \d+: (\S+)$", text, flags=re.M)
        assert len(heads) == 5 and r["answer_in"] in heads  # the question's subject is one of the documents
        assert text.rsplit("Question: ", 1)[1].count(f"`{r['answer_in']}`") == 1
        assert len(text) > 2000 and r["category"] == "rag"
    recs, decl = H.load_entry("rag:0:6")
    assert recs == a and decl["sha256"] == H.records_sha256(a) and decl["python_version"]


def test_entries_parse_or_say_what_is_wrong():
    assert H.parse_entry("rag:3") == {"kind": "rag", "seed": 3, "n": H.RAG_DEFAULT_N}
    assert H.parse_entry("rag:3:5")["n"] == 5
    assert H.parse_entry("data/heldout/mt_bench.jsonl")["path"] == REPO_ROOT / "data/heldout/mt_bench.jsonl"
    for bad, msg in (("rag:", "rag:SEED"), ("rag:1:0", "N must be"), ("nope.jsonl", "not found"), ("", "expected")):
        with pytest.raises(ValueError, match=msg):
            H.parse_entry(bad)
    # the default config's entries are valid; the study's check names the key of a bad one
    assert C.build_config("default", check_models=False).eval.heldout_files == list(S.DEFAULT_HELDOUT_FILES)
    with pytest.raises(C.ConfigError, match=r"eval.heldout_files\[0\]"):
        C.build_config("smoke", {"eval.heldout_files": ["no/such/file.jsonl"]})


def test_later_turns_become_multi_turn_items():
    recs = [{"id": "w1", "category": "writing", "messages": [{"role": "user", "content": "a"},
                                                             {"role": "user", "content": "b"}]},
            {"id": "w2", "category": "writing", "messages": [{"role": "user", "content": "c"},
                                                             {"role": "user", "content": "d"}]},
            {"id": "m1", "category": "math", "messages": [{"role": "system", "content": "s"},
                                                          {"role": "user", "content": "e"},
                                                          {"role": "user", "content": "f"},
                                                          {"role": "user", "content": "g"}]}]
    items = H.conversation_items(recs)
    assert [(it["id"], it["category"], it["turn"]) for it in items] == [
        ("w1", "writing", 1), ("w2", "writing", 1), ("m1", "math", 1),
        ("w1#turn2", H.MULTI_TURN, 2), ("m1#turn2", H.MULTI_TURN, 2),  # round-robin over the parent categories
        ("w2#turn2", H.MULTI_TURN, 2), ("m1#turn3", H.MULTI_TURN, 3)]
    m3 = items[-1]
    assert [m["content"] for m in m3["messages"]] == ["s", "e", "f", "g"] and m3["parent_category"] == "math"
    assert H.with_answers(m3["messages"], ["A1", "A2"]) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "e"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "f"}, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "g"}]


def test_overlap_check_finds_shared_ids_texts_and_13_grams():
    held = H.load_entry("data/heldout/mt_bench.jsonl")[0][:3]
    q = re.findall(r"\w+", held[1]["messages"][0]["content"])  # words, as the check counts them
    train = [{"id": "t/1", "messages": [{"role": "user", "content": "unrelated words " + " ".join(q[:13])}]},
             {"id": held[2]["id"], "messages": [{"role": "user", "content": "other"}]},
             {"id": "t/2", "messages": [{"role": "user", "content": held[0]["messages"][0]["content"].upper()}]}]
    assert H.training_overlap(held, train[1:2]) == [held[2]["id"]]
    assert H.training_overlap(held, train[2:]) == [held[0]["id"]]  # case and spacing do not hide a copy
    assert len(q) >= 13 and H.training_overlap(held, train[:1]) == [held[1]["id"]]
    twelve = [{"id": "t/3", "messages": [{"role": "user", "content": " ".join(q[:12])}]}]
    assert H.training_overlap(held, twelve) == [] and H.training_overlap(held, []) == []


def test_heldout_sets_never_overlap_the_training_prompts():
    """Every default held-out set against the default study's training sources: the synthetic families and the
    shared corpora of the default mixture (t0, gsm8k train, self-instruct), read as the default study reads them
    (data.shared_data "auto": the vendored copies in data/corpora/, so this runs on every machine)."""
    from drafter_lib.data import corpora as data

    held, _ = H.load_heldout_sets(S.DEFAULT_HELDOUT_FILES)
    cfg = S.DataConfig()
    sources = data.default_sources(resolve_shared_data(cfg.shared_data), synthetic_n=cfg.synthetic_n,
                                   humaneval=False, corpora=data.corpora_for(cfg.source_weights))
    assert {s["name"] for s in sources if s["kind"] == "file"} == set(data.DEFAULT_CORPORA)
    train = []
    for src in sources:
        train += data.load_source(src)[0]
    assert {r["corpus"] for r in train} == {"synthetic", *data.DEFAULT_CORPORA}
    assert len(train) >= cfg.synthetic_n
    assert H.training_overlap(held, train) == []


def test_eval_stage_leaves_out_what_the_run_trained_on_and_declares_the_sets(tmp_path):
    from drafter_lib.common.files import read_json, write_json, write_jsonl
    from drafter_lib.common.layout import RunLayout
    from drafter_lib.study import stages

    run = RunLayout.of(tmp_path / "run")
    mt, _ = H.load_entry("data/heldout/mt_bench.jsonl")
    copied = {"id": "t0/x", "source": "t0", "category": "t0_tasks", "messages": [mt[4]["messages"][0]]}
    write_jsonl(run.train_prompts, [copied, {"id": "s/1", "source": "s", "category": "math",
                                             "messages": [{"role": "user", "content": "2 + 2?"}]}])
    own = {"id": "s/2", "source": "s", "category": "math", "messages": [{"role": "user", "content": "3 + 4?"}]}
    write_jsonl(run.heldout_prompts, [own])
    cfg = C.build_config("smoke", {"eval.heldout_files": ["data/heldout/mt_bench.jsonl", "rag:2:3"]})
    records, decls, left_out = stages.eval_records(cfg, run)
    assert left_out == [mt[4]["id"]]  # trained on by this run: not held out
    assert [r["id"] for r in records] == ["s/2"] + [r["id"] for r in mt if r["id"] != mt[4]["id"]] + [
        "rag:2/0", "rag:2/1", "rag:2/2"]
    assert [d["name"] for d in decls] == ["mt_bench", "rag:2"]
    assert [r["origin"] for r in records] == [stages.ORIGIN_RUN_SPLIT] + [stages.ORIGIN_SETS] * (len(records) - 1)
    write_json(run.architecture, {"corpora": [], "models": []})
    H.declare_eval_corpora(run.architecture, decls)
    assert read_json(run.architecture)["eval_corpora"] == json.loads(json.dumps(decls))
    assert stages.architecture_rows(run)[0]["input_sha256"] == H.COMMITTED["mt_bench.jsonl"]["sha256"]
    from drafter_lib.study.verify import verify_run

    checks = [c for c in verify_run(run.root, teacher_weights=False).checks if c.key.startswith("eval_corpora")]
    assert [(c.key, c.ok) for c in checks] == [("eval_corpora[mt_bench].input_sha256", True),
                                               ("eval_corpora[rag:2].sha256", True)]
    decls[1]["sha256"] = "0" * 64  # a generated set that no longer comes out the same is a mismatch
    H.declare_eval_corpora(run.architecture, decls)
    checks = [c for c in verify_run(run.root, teacher_weights=False).checks if c.key.startswith("eval_corpora")]
    assert [c.ok for c in checks] == [True, False]
