"""The hf teacher backend keeps only each step's top-K (a logits processor), never every step's full-vocabulary
logits, and gives exactly what it gave when it asked generate for `output_logits=True`: the same targets and the
same soft labels, bit for bit (`reference_stream` below is that former implementation, kept here as the oracle)."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from drafter_lib.common.chat import cut_at_stop, encode_chat, prompt_messages, stop_token_ids
from drafter_lib.decoding import backends
from drafter_lib.decoding.backends import HFBackend, TopKRecorder, make_backend
from drafter_lib.decoding.generate import Finished, topk_logprobs
from drafter_lib.teacher import targets as teacher

sys.path.insert(0, str(Path(__file__).parent))
from test_teacher import records, tiny_model, tiny_tokenizer  # noqa: E402


def varied_model(seed=1):
    """test_teacher's tiny Llama (vocab 64) with sharper weights: varied greedy rows, some ending on the stop id."""
    model = tiny_model(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(6.0)
        model.model.embed_tokens.weight[2] *= 2.0
    return model


@torch.inference_mode()
def reference_stream(be: HFBackend, prompts, max_new_tokens, stop_ids, batch_size, top_k=0, prompt_top_k=False):
    """HFBackend.stream as it was before the top-K processor: generate(output_logits=True) keeps [B, V] logits of
    every step, then the top-K of each row's steps."""
    stop = set(stop_ids)
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0:b0 + batch_size]
        ids, mask = backends.left_padded(batch, be.pad_id)
        T = ids.shape[1]
        out = be.model.generate(
            input_ids=ids.to(be.device), attention_mask=mask.to(be.device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=stop_ids, pad_token_id=be.pad_id, top_p=None, top_k=None,
            temperature=None, output_logits=top_k > 0, return_dict_in_generate=True,
        )
        for i, row in enumerate(out.sequences[:, T:].tolist()):
            toks = cut_at_stop(row, stop, max_new_tokens)
            if not top_k:
                yield Finished(b0 + i, toks)
                continue
            sid, slp = topk_logprobs(torch.stack([out.logits[j][i] for j in range(len(toks))]), top_k)
            start = len(batch[i]) - 1
            if prompt_top_k and len(batch[i]) > 1:
                full = be.model(input_ids=torch.tensor([batch[i]], device=be.device)).logits[0, :-1]
                pid, plp = topk_logprobs(full, top_k)
                sid, slp, start = torch.cat([pid, sid]), torch.cat([plp, slp]), 0
            elif prompt_top_k:
                start = 0
            yield Finished(b0 + i, toks, start, sid.cpu(), slp.float().cpu())


def _prompts(tok, n=11):
    return [encode_chat(tok, prompt_messages(r)) for r in records(n)]


def _same(a: Finished, b: Finished):
    assert (a.index, a.tokens, a.soft_start) == (b.index, b.tokens, b.soft_start)
    for x, y in ((a.soft_ids, b.soft_ids), (a.soft_logprobs, b.soft_logprobs)):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch_size", [1, 4, 11])
@pytest.mark.parametrize("top_k,prompt_top_k", [(0, False), (5, False), (5, True), (64, True)])
def test_stream_identical_to_output_logits_path(seed, batch_size, top_k, prompt_top_k):
    """Same tokens, start, top-K ids and log-probs (bit for bit) as the output_logits implementation; K = 64 is the
    whole vocabulary. Seed 0 is test_teacher's model (rows run to max_new_tokens), seed 1 a sharper one (rows end
    on the stop id at different steps: rows of one batch finish at different times)."""
    model, tok = (tiny_model(0) if seed == 0 else varied_model()), tiny_tokenizer()
    prompts, stop = _prompts(tok), stop_token_ids(tok)
    be = make_backend("hf", model, tok)
    new = list(be.stream(prompts, 9, stop, batch_size, top_k=top_k, prompt_top_k=prompt_top_k))
    old = list(reference_stream(be, prompts, 9, stop, batch_size, top_k, prompt_top_k))
    assert len(new) == len(old) == len(prompts)
    for a, b in zip(new, old):
        _same(a, b)
    if seed == 1:
        assert {f.tokens[-1] in stop for f in new} == {True, False}


def _stage_files(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_teacher_stage_files_identical(tmp_path, monkeypatch):
    """The whole teacher stage (targets file, soft-label parts, meta) is byte-identical to the one the
    output_logits implementation writes."""
    model, tok = varied_model(), tiny_tokenizer()
    kw = dict(max_new_tokens=9, batch_size=4, backend="hf", progress=False, soft_topk=6, soft_prompt=True)
    teacher.generate_targets(records(11), model, tok, tmp_path / "new" / "t.jsonl", **kw)
    monkeypatch.setattr(HFBackend, "stream", reference_stream)
    teacher.generate_targets(records(11), model, tok, tmp_path / "old" / "t.jsonl", **kw)
    new, old = _stage_files(tmp_path / "new"), _stage_files(tmp_path / "old")
    assert new == old and any(k.startswith("t.soft/part_") for k in new)


def test_only_top_k_per_step_is_kept(monkeypatch):
    """generate is asked for no logits, scores or cache back; what the backend holds for a batch is its recorder's
    [B, K] ids and log-probs per step: 2 x steps x batch x K numbers, against steps x batch x V floats before."""
    model, tok = tiny_model(0), tiny_tokenizer()  # rows run the full max_new_tokens: steps is known
    prompts, stop = _prompts(tok, 6), stop_token_ids(tok)
    be = make_backend("hf", model, tok)
    seen = []
    generate = model.generate

    def spy(*a, **kw):
        seen.append(kw)
        out = generate(*a, **kw)
        assert isinstance(out, torch.Tensor)  # the sequences only: no dict holding logits or the KV cache
        return out

    monkeypatch.setattr(model, "generate", spy)
    K, steps, B, V = 3, 12, len(prompts), model.config.vocab_size
    rows = list(be.stream(prompts, steps, stop, batch_size=B, top_k=K))
    kw = seen[0]
    assert not kw.get("output_logits") and not kw.get("output_scores") and not kw.get("return_dict_in_generate")
    rec = be.last_recorder
    assert isinstance(rec, TopKRecorder) and len(rec.ids) >= steps  # deferred stop checks may add a step
    assert all(t.shape == (B, K) for t in rec.ids + rec.logprobs)
    assert rec.stored_floats() == 2 * len(rec.ids) * B * K < len(rec.ids) * B * V
    assert all(len(f.tokens) == steps and f.soft_ids.shape == (steps, K) for f in rows)


def test_recorder_checks_its_steps():
    rec = TopKRecorder(2, prompt_width=3)
    scores = torch.randn(2, 10)
    assert rec(torch.zeros(2, 3, dtype=torch.long), scores) is scores
    with pytest.raises(RuntimeError, match="step 2"):
        rec(torch.zeros(2, 5, dtype=torch.long), scores)
    ids, lps = rec.row(1, 1)
    ref = topk_logprobs(scores[1:2], 2)
    assert torch.equal(ids, ref[0]) and torch.equal(lps, ref[1])


def test_backend_names():
    from drafter_lib.study.config_checks import BACKENDS

    assert backends.BACKEND_NAMES == BACKENDS == ("auto", "native", "hf", "vllm", "runtime")
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("tgi", tiny_model(0), tiny_tokenizer())
    with pytest.raises(ValueError, match="numerics"):  # the runtime's option only
        make_backend("native", tiny_model(0), tiny_tokenizer(), numerics="w8a8")
    with pytest.raises(ValueError, match="runtime backend takes"):
        make_backend("runtime", tiny_model(0), tiny_tokenizer(), dtype="bfloat16")


def test_auto_runs_every_architecture_of_the_hand_written_decoder_natively():
    from drafter_lib.model.tiny_models import tiny_random_model

    for arch in ("llama", "qwen2", "qwen3"):
        model, tok = tiny_random_model(arch, tokenizer="bytes", num_hidden_layers=1)
        assert make_backend("auto", model, tok, sliced_head=False).name == "native", arch
