"""data / synthetic: determinism, dedup, held-out split, file formats, response dropping, architecture.json."""
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from drafter_lib.common.files import sha256_file
from drafter_lib.data import corpora as D
from drafter_lib.data.synthetic import FAMILIES, synthetic_prompts
from drafter_lib.model import hf_models as H
from drafter_lib.model.tiny_models import byte_tokenizer, tiny_random_model

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_synthetic_deterministic_per_seed():
    a, b, c = synthetic_prompts(300, seed=7), synthetic_prompts(300, seed=7), synthetic_prompts(300, seed=8)
    assert a == b
    assert a != c
    assert {r["category"] for r in a} == set(FAMILIES) and len(FAMILIES) >= 3
    texts = [r["messages"][0]["content"] for r in a]
    assert len(set(texts)) == 300  # n distinct prompts
    assert all(r["messages"][0]["role"] == "user" and r["id"].startswith(f"synthetic/{r['category']}/") for r in a)
    only = synthetic_prompts(50, seed=1, families=["code"])
    assert {r["category"] for r in only} == {"code"}
    with pytest.raises(ValueError, match="unknown synthetic families"):
        synthetic_prompts(5, families=["poetry"])


def test_open_ended_families_varied_and_named_apart_from_mt_bench():
    mt_bench = {json.loads(line)["category"] for line in (ROOT / "data/heldout/mt_bench.jsonl").open()}
    for fam in ("compose", "persona", "explain"):
        recs = synthetic_prompts(250, seed=0, families=[fam])  # raises if the family cannot give 250 distinct ones
        assert fam not in mt_bench and {r["category"] for r in recs} == {fam}
        first_words = Counter(r["messages"][0]["content"].split()[0] for r in recs)
        assert len(first_words) >= 3, first_words  # several templates, not one sentence with slots


def test_default_mixture_without_shared_corpora(tmp_path):
    from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS, DataConfig

    assert DataConfig().source_weights == DEFAULT_SOURCE_WEIGHTS
    full = D.only_present(DEFAULT_SOURCE_WEIGHTS, D.default_sources(SHARED, humaneval=False)) \
        if (SHARED / "prompts").is_dir() else None
    assert full is None or full == DEFAULT_SOURCE_WEIGHTS  # every corpus it names is in ../shared/data
    sources = D.default_sources(None, synthetic_n=200, humaneval=False)
    weights = D.only_present(DEFAULT_SOURCE_WEIGHTS, sources)
    assert weights == {"synthetic": DEFAULT_SOURCE_WEIGHTS["synthetic"]}
    s = D.build_prompt_set(tmp_path / "run", sources=sources, weights=weights, total=4200, heldout_frac=0.1)
    assert s["train"] + s["heldout"] == 200  # the only source gives all it has


def test_dedup_normalized_text():
    recs = [{"id": "a", "source": "s", "category": "c", "messages": [{"role": "user", "content": "Hello  World"}]},
            {"id": "b", "source": "s", "category": "c", "messages": [{"role": "user", "content": " hello world\n"}]},
            {"id": "c", "source": "s", "category": "c", "messages": [{"role": "user", "content": "hello, world"}]},
            {"id": "a", "source": "s", "category": "c", "messages": [{"role": "user", "content": "other"}]}]
    kept, dropped = D.dedup(recs)
    assert [r["id"] for r in kept] == ["a", "c"] and dropped == 2


def test_heldout_split_stable_and_disjoint():
    recs = synthetic_prompts(2000, seed=0)
    tr, he = D.split_heldout(recs, 0.1)
    assert 120 < len(he) < 280 and len(tr) + len(he) == 2000
    assert not {r["id"] for r in tr} & {r["id"] for r in he}
    # stability: a record's side does not depend on order or on the rest of the set
    tr2, he2 = D.split_heldout(list(reversed(recs[:1000])), 0.1)
    assert {r["id"] for r in he2} == {r["id"] for r in he} & {r["id"] for r in recs[:1000]}
    assert D.is_heldout("synthetic/math/abc", 0.3) == D.is_heldout("synthetic/math/abc", 0.3)
    with pytest.raises(ValueError):
        D.split_heldout(recs, 1.0)


def test_question_jsonl_and_project_format(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]})
                 + "\n" + json.dumps({"question_id": 82, "category": "math", "turns": ["1+1?"]}) + "\n")
    recs = D.load_prompt_file(q)
    assert recs[0] == {"id": "81", "source": "question", "category": "writing",
                       "messages": [{"role": "user", "content": "Write a poem."},
                                    {"role": "user", "content": "Shorter."}]}
    first = D.load_prompt_file(q, turns="first")
    assert first[0]["messages"] == [{"role": "user", "content": "Write a poem."}]
    p = tmp_path / "own.jsonl"
    own = {"id": "x1", "source": "mine", "category": "cat", "messages": [{"role": "user", "content": "Hi"}]}
    p.write_text(json.dumps(own) + "\n")
    assert D.load_prompt_file(p) == [own]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "foo": "bar"}\n')
    with pytest.raises(ValueError, match="no messages/turns/prompt"):
        D.load_prompt_file(bad)
    bad.write_text('{"id": 1\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        D.load_prompt_file(bad)


def test_responses_dropped_multi_turn(tmp_path):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
    assert D.prompt_messages(conv) == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Q1"}, {"role": "user", "content": "Q2"}]
    assert D.prompt_messages(conv, turns="first") == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Q1"}]
    assert D.prompt_messages([{"role": "assistant", "content": "only a reply"}]) == []
    share = {"conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "yo"}]}
    # parquet with multi-turn chats and ShareGPT rows; no assistant text may survive
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"id": "m1", "messages": conv}]), tmp_path / "chat.parquet")
    recs = D.load_prompt_file(tmp_path / "chat.parquet")
    assert [m["content"] for m in recs[0]["messages"]] == ["Be brief.", "Q1", "Q2"]
    (tmp_path / "sg.jsonl").write_text(json.dumps(share) + "\n")
    recs = D.load_prompt_file(tmp_path / "sg.jsonl")
    assert recs[0]["messages"] == [{"role": "user", "content": "hey"}]
    assert recs[0]["id"].startswith("sg/")


def test_length_filter(tok):
    recs = [{"id": str(i), "source": "s", "category": "c", "messages": [{"role": "user", "content": "x" * i}]}
            for i in (1, 5, 50)]
    kept, dropped = D.length_filter(recs, tok, min_tokens=2, max_tokens=10)  # byte tokenizer: 1 token per char
    assert [r["id"] for r in kept] == ["5"] and dropped == 2


def test_humaneval_reader(tmp_path):
    p = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"double\"\"\"\n",
                            "canonical_solution": "    return 2 * x\n"}) + "\n")
    recs = D.load_humaneval(p)
    assert recs[0]["id"] == "HumanEval/0" and recs[0]["category"] == "code"
    assert "def f(x)" in recs[0]["messages"][0]["content"]
    assert "return 2 * x" not in recs[0]["messages"][0]["content"]  # the solution is a response: dropped


def test_build_prompt_set_and_architecture(tmp_path, tok):
    extra = tmp_path / "extra.jsonl"
    rows = [{"id": f"e{i}", "source": "extra", "category": "chat",
             "messages": [{"role": "user", "content": f"Tell me fact number {i}."}]} for i in range(200)]
    rows.append({"id": "dup", "source": "extra", "category": "chat",
                 "messages": [{"role": "user", "content": "TELL me fact  number 3."}]})
    extra.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = [{"name": "synthetic", "kind": "synthetic", "n": 600, "seed": 3},
               {"name": "extra", "kind": "file", "path": str(extra), "upstream": {"commit": "0" * 40}}]
    arch = tmp_path / "architecture.json"
    s = D.build_prompt_set(tmp_path / "run", sources=sources, weights={"synthetic": 3, "extra": 1}, total=400,
                           tokenizer=tok, min_tokens=4, max_tokens=400, heldout_frac=0.1, seed=0,
                           architecture_path=arch, models=[H.model_record("Qwen/Qwen3-8B", role="teacher")])
    assert s["duplicates_dropped"] == 1
    assert s["by_source"]["synthetic"]["train"] == 300 and s["by_source"]["extra"]["train"] == 100
    train = D.load_prompt_file(tmp_path / "run" / "train.jsonl")
    held = D.load_prompt_file(tmp_path / "run" / "heldout.jsonl")
    assert len(train) == s["train"] == 400
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert all(D.is_heldout(r["id"], 0.1) for r in held) and not any(D.is_heldout(r["id"], 0.1) for r in train)
    doc = json.loads(arch.read_text())
    files = {f["file"]: f for f in doc["prompt_files"]}
    for name in ("train.jsonl", "heldout.jsonl"):
        assert files[name]["sha256"] == sha256_file(tmp_path / "run" / name)
        # recorded relative to architecture.json's folder: no machine path in a committed record
        assert files[name]["path"] == f"run/{name}"
        assert s["files"][name]["path"] == name  # prompts_summary.json: relative to the data folder
    assert str(tmp_path) not in arch.read_text() and str(tmp_path) not in (tmp_path / "run" / "prompts_summary.json"
                                                                           ).read_text()
    corp = {c["name"]: c for c in doc["corpora"]}
    assert corp["synthetic"]["seed"] == 3 and corp["extra"]["input_sha256"] == sha256_file(extra)
    assert corp["extra"]["counts"]["train"] == 100
    assert doc["models"][0]["revision"] == H.HUB_MODELS["Qwen/Qwen3-8B"]
    # same inputs -> byte-identical outputs
    s2 = D.build_prompt_set(tmp_path / "run2", sources=sources, weights={"synthetic": 3, "extra": 1}, total=400,
                            tokenizer=tok, min_tokens=4, max_tokens=400, heldout_frac=0.1, seed=0)
    assert s2["files"]["train.jsonl"]["sha256"] == s["files"]["train.jsonl"]["sha256"]
    with pytest.raises(ValueError, match="unknown sources"):
        D.build_prompt_set(tmp_path / "run3", sources=sources, weights={"nope": 1})


def test_default_sources_embedded_only_and_shared(tmp_path):
    srcs = D.default_sources(None, humaneval=False)
    assert [s["kind"] for s in srcs] == ["synthetic"]
    with pytest.raises(FileNotFoundError):
        D.default_sources(tmp_path / "missing")
    if (SHARED / "prompts").is_dir():
        names = [s["name"] for s in D.default_sources(SHARED, humaneval=False)]
        assert "gsm8k_train_questions" in names
        recs, prov = D.load_source({"name": "seed", "kind": "file",
                                    "path": str(SHARED / "prompts" / "self_instruct_seed_tasks.jsonl")})
        assert prov["commit"] == D.SHARED_CORPORA["self_instruct_seed_tasks.jsonl"]["commit"]
        assert all(m["role"] == "user" for r in recs for m in r["messages"])


def test_write_architecture_validates(tmp_path):
    with pytest.raises(ValueError, match="revision, commit, seed"):
        D.write_architecture(tmp_path / "a.json", corpora=[{"name": "x", "source": "y"}], models=[])


def test_hf_dataset_pinned_train_only(monkeypatch):
    """The hub route, offline: datasets.load_dataset is replaced by an in-memory dataset."""
    import datasets
    calls = []
    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
            {"messages": [{"role": "assistant", "content": "no user turn"}]}]

    def fake_load(name, config=None, split=None, revision=None):
        calls.append((name, config, split, revision))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    recs, prov = D.load_source({"name": "chat", "kind": "hf", "dataset": "org/chat", "revision": "a" * 40})
    assert calls == [("org/chat", None, "train", "a" * 40)]
    assert len(recs) == 1 and recs[0]["messages"] == [{"role": "user", "content": "Q"}]
    assert prov["revision"] == "a" * 40
    with pytest.raises(ValueError, match="only train splits"):
        D.load_hf_dataset("org/chat", "a" * 40, split="test")
    with pytest.raises(ValueError, match="pinned revision"):
        D.load_hf_dataset("org/chat", None)


def test_local_model_record_is_relative(tmp_path):
    run = tmp_path / "run"
    model, tok = tiny_random_model("llama", tokenizer="bytes", num_hidden_layers=1)
    model.save_pretrained(run / "tiny_llama")
    rec = H.model_record(str(run / "tiny_llama"), role="teacher", relative_to=run)
    assert rec["name"] == "tiny_llama" and rec["path"] == "tiny_llama" and rec["source"] == "local"
    assert rec["config_sha256"] == sha256_file(run / "tiny_llama" / "config.json")
    outside = H.model_record(str(run / "tiny_llama"))  # outside the repository: no absolute path either
    assert not outside["path"].startswith("/")

