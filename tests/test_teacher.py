"""Teacher targets: equal to HF greedy, resumable after a crash, shardable."""
import importlib.util
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from drafter_lib.common.files import sha256_file
from drafter_lib.common.layout import portable_value
from drafter_lib.teacher import targets as teacher

CHARS = "abcdefghijklmnopqrstuvwxyz .,?!\n"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """Character-level tokenizer with a ChatML template, built offline."""
    vocab = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = TEMPLATE
    return t


def tiny_model(seed=0, vocab=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    # bias the stop token so some answers end early and some run to max_new_tokens
    with torch.no_grad():
        m.model.embed_tokens.weight[2] *= 3.0
    return m


def records(n=23):
    words = ["hello", "why is the sky blue?", "tell me a story", "abc", "list three fruits, please"]
    return [{"id": f"p{i:03d}", "category": ["chat", "code"][i % 2], "source": "test",
             "messages": [{"role": "user", "content": words[i % len(words)] + " " + "x" * (i % 7)}]}
            for i in range(n)]


def hf_greedy(model, prompt_ids, max_new, stop_ids):
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=stop_ids, pad_token_id=0)
    return teacher.cut_at_stop(out[0, len(prompt_ids):].tolist(), stop_ids, max_new)


def by_id(path):
    return {r["id"]: r for r in teacher.read_rows(path)}


def test_encode_chat_and_stop_ids():
    tok = tiny_tokenizer()
    ids = teacher.encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[-11:] == [1] + [tok.convert_tokens_to_ids(c) for c in "assistant\n"]
    assert teacher.stop_token_ids(tok) == [2]
    assert teacher.cut_at_stop([5, 6, 2, 7], [2], 10) == [5, 6, 2]
    assert teacher.cut_at_stop([5, 6, 7], [2], 2) == [5, 6]


@pytest.mark.parametrize("backend", [
    "hf",
    pytest.param("native", marks=pytest.mark.skipif(importlib.util.find_spec("drafter_lib.decoding.generate") is None,
                                                   reason="drafter_lib.decoding.generate not written yet")),
])
def test_rows_equal_hf_greedy(tmp_path, backend):
    model, tok = tiny_model(), tiny_tokenizer()
    recs = records(9)
    out = tmp_path / "t.jsonl"
    stats = teacher.generate_targets(recs, model, tok, out, max_new_tokens=12, batch_size=4, backend=backend,
                                     progress=False)
    rows = by_id(out)
    assert stats["written"] == 9 and set(rows) == {r["id"] for r in recs}
    lengths = set()
    for r in recs:
        row = rows[r["id"]]
        p = teacher.encode_chat(tok, r["messages"])
        assert row["prompt_ids"] == p and row["category"] == r["category"] and row["source"] == "test"
        assert row["continuation_ids"] == hf_greedy(model, p, 12, [2]), r["id"]
        lengths.add(len(row["continuation_ids"]))
    meta = json.loads(teacher.meta_path(out).read_text())
    assert meta["teacher"]["weights_sha256"] == teacher.weights_sha256(model)
    assert meta["generation"]["max_new_tokens"] == 12


def test_kill_and_resume_gives_identical_full_set(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    recs = records(23)
    ref = tmp_path / "ref.jsonl"
    teacher.generate_targets(recs, model, tok, ref, max_new_tokens=8, batch_size=4, backend="hf", progress=False)

    out = tmp_path / "run.jsonl"

    def crash(batch_index, rows):
        if batch_index == 2:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        teacher.generate_targets(recs, model, tok, out, max_new_tokens=8, batch_size=4, backend="hf",
                                 on_batch=crash, progress=False)
    assert "output" not in json.loads(teacher.meta_path(out).read_text())
    assert len(teacher.read_rows(out)) == 12
    with open(out, "a") as f:  # a write cut off mid-line by the kill
        f.write('{"id": "p999", "category": "ch')
    assert len(teacher.read_rows(out)) == 12  # the partial line is ignored

    stats = teacher.generate_targets(recs, model, tok, out, max_new_tokens=8, batch_size=4, backend="hf",
                                     progress=False)
    assert stats["already_done"] == 12 and stats["written"] == 11
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 23  # no duplicates, no lost rows, no leftover partial line
    assert by_id(out) == by_id(ref)
    # the finished file's hash is recorded once generation completes (the killed call recorded none)
    assert json.loads(teacher.meta_path(out).read_text())["output"] == {"file": "run.jsonl", "rows": 23,
                                                                         "sha256": sha256_file(out)}

    # a finished file resumes to a no-op; changed settings are refused
    assert teacher.generate_targets(recs, model, tok, out, max_new_tokens=8, batch_size=4, backend="hf",
                                    progress=False)["written"] == 0
    with pytest.raises(ValueError, match="generation"):
        teacher.generate_targets(recs, model, tok, out, max_new_tokens=9, backend="hf", progress=False)


def test_shards_partition_and_merge(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    recs = records(20)
    parts = [teacher.select_shard(recs, i, 3) for i in range(3)]
    ids = [r["id"] for p in parts for r in p]
    assert sorted(ids) == sorted(r["id"] for r in recs) and len(ids) == len(set(ids))
    assert all(parts), "every shard should get some of 20 ids"
    assert teacher.shard_of("p001", 3) == teacher.shard_of("p001", 3)  # stable across calls/processes

    paths = []
    for i in range(3):
        p = tmp_path / f"s{i}.jsonl"
        teacher.generate_targets(recs, model, tok, p, max_new_tokens=6, batch_size=8, backend="hf",
                                 shard_index=i, num_shards=3, progress=False)
        assert {r["id"] for r in teacher.read_rows(p)} == {r["id"] for r in parts[i]}
        paths.append(p)
    merged = tmp_path / "all.jsonl"
    assert teacher.merge_shards(paths, merged) == 20
    full = tmp_path / "full.jsonl"
    teacher.generate_targets(recs, model, tok, full, max_new_tokens=6, batch_size=8, backend="hf", progress=False)
    assert by_id(merged) == by_id(full)
    assert "merged_from" in json.loads(teacher.meta_path(merged).read_text())
    mmeta = json.loads(teacher.meta_path(merged).read_text())
    assert mmeta["output"] == {"file": "all.jsonl", "rows": 20, "sha256": sha256_file(merged)}
    assert not any(str(tmp_path) in p for p in mmeta["merged_from"])  # no machine paths in the record
    with pytest.raises(ValueError, match="shard_index"):
        teacher.select_shard(recs, 3, 3)


def test_meta_records_no_machine_path(tmp_path):
    """A teacher loaded from a local dir is recorded by a repository-relative id, never this machine's path."""
    from drafter_lib.common.layout import REPO_ROOT

    model, tok = tiny_model(), tiny_tokenizer()
    model.config._name_or_path = str(REPO_ROOT / "runs" / "x" / "tiny_llama")  # what from_pretrained(dir) sets
    out = tmp_path / "t.jsonl"
    teacher.generate_targets(records(3), model, tok, out, max_new_tokens=4, backend="hf", progress=False)
    text = teacher.meta_path(out).read_text()
    assert json.loads(text)["teacher"]["id"] == "runs/x/tiny_llama"
    assert str(REPO_ROOT) not in text and str(tmp_path) not in text
    assert portable_value("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


def test_runtime_backend_rows_are_the_runtimes_own_greedy_answers_and_resume(tmp_path, tiny_random):
    """teacher.backend='runtime': prompts decoded together through the target runtime (row-exact), each row
    equal to the runtime's plain greedy answer to its prompt alone, its soft labels the top-K of the same logits;
    a killed run resumes to the same file, and a resume in other numerics is refused."""
    from drafter_lib.decoding.generate import topk_logprobs
    from drafter_lib.decoding.runtime import EXACT_NUMERICS, runtime_target
    from drafter_lib.decoding.smoothing import calibration_rows
    from drafter_lib.decoding.speculative import NativeTarget
    from drafter_lib.model.tiny_models import TINY_WEIGHT_SCALE
    from drafter_lib.model.transformer import Transformer
    from drafter_lib.teacher.soft_labels import load_soft_labels, soft_dir_for

    model, tok = tiny_random("qwen2", seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128)
    with torch.no_grad():  # sharper weights: varied answers (tiny_models.TINY_WEIGHT_SCALE)
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(TINY_WEIGHT_SCALE)
    stop = teacher.stop_token_ids(tok)
    recs = records(11)
    out = tmp_path / "t.jsonl"

    def crash(batch_index, rows):
        if batch_index == 1:
            raise KeyboardInterrupt("simulated kill")

    kw = dict(max_new_tokens=12, batch_size=3, backend="runtime", soft_topk=8, progress=False)
    with pytest.raises(KeyboardInterrupt):
        teacher.generate_targets(recs, model, tok, out, on_batch=crash, **kw)
    assert len(teacher.read_rows(out)) == 6
    stats = teacher.generate_targets(recs, model, tok, out, **kw)
    assert stats["backend"] == "runtime" and stats["already_done"] == 6 and stats["written"] == 5
    meta = json.loads(teacher.meta_path(out).read_text())
    numerics = meta["generation"]["numerics"]  # the runtime's default, as resolved here ("auto": gguf or w8a8)
    assert meta["generation"]["backend"] == "runtime" and numerics in EXACT_NUMERICS
    with pytest.raises(ValueError, match="generation"):
        teacher.generate_targets(recs, model, tok, out, numerics="fp32", **kw)

    target = runtime_target(Transformer.from_hf_model(model), numerics, calibration=calibration_rows(tok))
    rows, soft = by_id(out), load_soft_labels(soft_dir_for(out))
    answers = set()
    for r in recs:
        row, p = rows[r["id"]], teacher.encode_chat(tok, r["messages"])
        alone = NativeTarget(target.model, linears="stock")
        logits = [alone.score(p, keep=1)]
        while len(logits) < 12 and int(logits[-1].argmax()) not in stop:
            logits.append(alone.score([int(logits[-1].argmax())], keep=1))
        answer = [int(x.argmax()) for x in logits]
        assert row["continuation_ids"] == answer, r["id"]
        ids, logprobs = topk_logprobs(torch.cat(logits), 8)
        assert torch.equal(soft[r["id"]].ids, ids) and torch.equal(soft[r["id"]].logprobs, logprobs.half())
        answers.add(tuple(answer))
    assert len(answers) > 5
