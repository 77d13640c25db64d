"""self_prompts: user turns sampled from a model's own user header - whole turns, seeded, resumable, a data source."""
import json

import pytest
import torch

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.data import corpora as D
from drafter_lib.data.self_prompts import (
    DEFAULT_SAMPLING,
    nucleus_sample,
    sample_hf,
    sample_native,
    self_prompts,
    user_header,
)
from drafter_lib.decoding.backends import NativeBackend
from drafter_lib.model.tiny_models import tiny_random_model

SAMPLING = dict(max_new_tokens=24, batch_rows=8, decode_rows=3)


@pytest.fixture(scope="module")
def tiny():
    """A random byte-level model with weights scaled up (its next token depends on what came before, so a wrong
    cache row shows) whose head row for <|im_end|> points along its mean hidden state, so it ends a turn often
    and most turns end within 24 tokens."""
    model, tok = tiny_random_model("llama", tokenizer="bytes", hidden_size=32, num_hidden_layers=2, seed=5,
                                   tie_word_embeddings=False)
    ids = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(4.0)
        mean = model.model(ids).last_hidden_state.reshape(-1, 32).mean(0)
        model.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>")] = 3.0 * mean / (mean @ mean)
    return model, tok


def texts(recs):
    return [r["messages"][0]["content"] for r in recs]


def test_user_header_is_the_template_up_to_the_users_content(tiny):
    _, tok = tiny
    assert user_header(tok) == "<|im_start|>user\n"
    broken = tiny_random_model("llama", tokenizer="bytes", hidden_size=32, num_hidden_layers=1)[1]
    broken.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="dropped the user's content"):
        user_header(broken)


@pytest.mark.parametrize("prefilter", [3, 1])  # 1: the top token holds < top_p, so rows are sorted whole
def test_nucleus_sample_keeps_the_top_p_set(prefilter):
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.0]])).expand(4000, 4)
    got = nucleus_sample(logits, 1.0, 0.7, gen, prefilter=prefilter)
    counts = torch.bincount(got, minlength=4).tolist()
    assert counts[0] == counts[3] == 0  # 0.5 + 0.3 already hold 0.7
    assert abs(counts[1] / 4000 - 0.5 / 0.8) < 0.03  # renormalized over the kept set
    assert nucleus_sample(logits[:3], 1.0, 1e-6, gen, prefilter=prefilter).tolist() == [1, 1, 1]  # greedy
    # with prefilter 1 the first row's nucleus reaches past its top token (sorted whole), the second's does not
    mixed = torch.stack([logits[0], torch.log(torch.tensor([0.05, 0.05, 0.1, 0.8]))]).repeat(200, 1)
    got = nucleus_sample(mixed, 1.0, 0.7, gen, prefilter=1).view(200, 2)
    assert set(got[:, 0].tolist()) == {1, 2} and set(got[:, 1].tolist()) == {3}


@pytest.mark.parametrize("sampler", ["native", "hf"])
def test_every_sampled_token_lies_in_the_models_own_nucleus(tiny, sampler):
    """Teacher-forced logits of each returned row must hold its tokens in their top-p set: a decode step that read
    a wrong cache row (rows leave the batch as they end) would sample from other logits."""
    model, tok = tiny
    header = tok(user_header(tok), add_special_tokens=False)["input_ids"]
    stop = stop_token_ids(tok)
    net, sample = (NativeBackend(model).model, sample_native) if sampler == "native" else (model, sample_hf)
    rows = sample(net, header, 8, seed=0, max_new_tokens=24, temperature=1.0, top_p=0.5, stop_ids=stop,
                  decode_rows=3)  # rows end at different steps, and their slots are refilled
    assert len({len(r) for r in rows}) > 1  # rows ended at different steps
    for row in rows:
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([header + row])).logits[0, len(header) - 1:-1], -1)
        for p, t in zip(probs, row):
            above = p[p > p[t]].sum()  # the mass ranked above the token: it is kept while that is < top_p
            assert above < 0.5 + 1e-4


def test_whole_distinct_turns_seeded(tiny):
    model, tok = tiny
    a = self_prompts(model, tok, 6, seed=1, progress=False, **SAMPLING)
    assert len(a) == 6 and len(set(texts(a))) == 6 and len({r["id"] for r in a}) == 6
    for r in a:
        assert r["source"] == r["category"] == "self_prompts" and r["id"].startswith("self_prompts/")
        assert r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip()
        assert "<|im_end|>" not in r["messages"][0]["content"]  # cut at the turn's end, specials dropped
    assert self_prompts(model, tok, 6, seed=1, progress=False, **SAMPLING) == a
    assert texts(self_prompts(model, tok, 6, seed=2, progress=False, **SAMPLING)) != texts(a)


def test_turns_cut_off_by_the_cap_are_dropped(tiny):
    model, tok = tiny
    # 2 tokens rarely hold a whole turn: most rows are cut off, and the batches allowed (4n rows) run out first
    got = self_prompts(model, tok, 8, seed=0, max_new_tokens=2, batch_rows=4, progress=False)
    assert len(got) < 8


def test_resume_from_cache_equals_one_run(tiny, tmp_path):
    model, tok = tiny
    whole = self_prompts(model, tok, 10, seed=3, progress=False, **SAMPLING)
    cache = tmp_path / "turns.jsonl"
    part = self_prompts(model, tok, 4, seed=3, cache_path=cache, progress=False, **SAMPLING)
    assert part == whole[:4]
    lines = cache.read_text().splitlines()
    assert all(json.loads(line)["batch"] >= 0 for line in lines)
    with open(cache, "a") as fh:  # a kill in the middle of the next batch's write
        fh.write(lines[-1][: len(lines[-1]) // 2])
    assert self_prompts(model, tok, 10, seed=3, cache_path=cache, progress=False, **SAMPLING) == whole
    assert self_prompts(model, tok, 10, seed=3, cache_path=cache, progress=False, **SAMPLING) == whole


def test_bad_settings_are_clear_errors(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="decode_rows"):
        self_prompts(model, tok, 4, decode_rows=0)
    with pytest.raises(ValueError, match="top_p"):
        self_prompts(model, tok, 4, top_p=0.0)


def test_a_data_source_with_provenance(tiny, tmp_path, monkeypatch):
    from drafter_lib.model import hf_models

    monkeypatch.setattr(hf_models, "load_teacher", lambda spec: tiny if spec == "runs/x/tiny" else None)
    src = {"name": "self_prompts", "kind": "self_prompts", "n": 5, "seed": 0, "model": "runs/x/tiny",
           "model_label": "tiny", "cache": str(tmp_path / "run" / "self_prompts.jsonl"), "sampling": SAMPLING}
    s = D.build_prompt_set(tmp_path / "run", sources=[src], heldout_frac=0.2, architecture_path=tmp_path / "a.json")
    assert s["train"] + s["heldout"] == 5
    corpus = json.loads((tmp_path / "a.json").read_text())["corpora"][0]
    assert corpus["source"] == "drafter_lib.self_prompts" and corpus["model"] == "tiny" and corpus["seed"] == 0
    assert corpus["sampling"] == {**DEFAULT_SAMPLING, **SAMPLING}
    with pytest.raises(ValueError, match="unknown self-prompt sampling settings"):
        D.load_source({**src, "sampling": {"temprature": 0.7}})
    cached = [json.loads(line) for line in (tmp_path / "run" / "self_prompts.jsonl").read_text().splitlines()]
    assert sum(len(batch["turns"]) for batch in cached) >= 5


def test_the_study_data_stage_samples_from_its_teacher(tmp_path):
    from drafter_lib.study import stages

    cfg, run = stages.open_run(str(tmp_path / "run"), "smoke", {"data.self_prompts": 6})
    summary, _ = stages.build_prompts(cfg, run)
    counts = summary["by_source"]["self_prompts"]
    assert counts["loaded"] == 6 and counts["train"] + counts["heldout"] == counts["after_filters"] > 0
    arch = json.loads(run.architecture.read_text())
    corpus = next(c for c in arch["corpora"] if c["name"] == "self_prompts")
    teacher = next(m for m in arch["models"] if m["role"] == "teacher")
    assert corpus["model"] == teacher["name"] and not corpus["model"].startswith("/")  # the teacher's own record
    assert corpus["seed"] == cfg.study.seed
    assert corpus["sampling"] == DEFAULT_SAMPLING
    cached = (run.data_dir / "self_prompts.jsonl").read_text()
    assert stages.build_prompts(cfg, run)[0]["by_source"] == summary["by_source"]  # read back, not sampled again
    assert (run.data_dir / "self_prompts.jsonl").read_text() == cached
