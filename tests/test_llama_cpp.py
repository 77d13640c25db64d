"""llama.cpp as a target (`LlamaCppTarget`) and this drafter behind llama-cpp-python's `draft_model` hook, on the
default teacher's own GGUF and the shipped pack. Skipped where the `llama-cpp` extra is not installed."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install '.[llama-cpp]')")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.llama_cpp_rows import Recorded, greedy_by_pass  # noqa: E402
from drafter_lib.common.chat import encode_chat, stop_token_ids  # noqa: E402
from drafter_lib.decoding.llama_cpp_target import LlamaCppTarget, load_llama  # noqa: E402
from drafter_lib.decoding.speculative import speculative_generate  # noqa: E402
from drafter_lib.interop.llama_cpp_draft import SpecdraftDraftModel  # noqa: E402

QUESTIONS = ["Explain why the sky is blue in three sentences.",
             "Write a Python function that returns the n-th Fibonacci number.",
             "List three differences between a list and a tuple in Python."]


@pytest.fixture(scope="module")
def setup():
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.model import hf_models

    tok = hf_models.default_tokenizer()
    gguf = hf_models.default_teacher_gguf()
    target = LlamaCppTarget(gguf, n_ctx=1024)
    engine = DraftEngine.from_dir(ROOT / "model")
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    yield {"tok": tok, "gguf": gguf, "target": target, "engine": engine, "prompts": prompts,
           "stop": stop_token_ids(tok)}
    target.close()


def test_rollback_restores_the_cache(setup):
    """Logits after a rolled-back pass equal those of the same pass on the same prefix: the rejected tail's K/V is
    gone from llama.cpp's memory."""
    t, p = setup["target"], setup["prompts"][0]
    t.reset()
    first = t.score(p, keep=1)
    assert first.shape == (1, t.vocab_size) and t.cached_len == len(p)
    draft = [int(first.argmax()), 13, 42, 7]
    a = t.score(draft, keep=len(draft))
    t.rollback(len(p))
    assert t.cached_len == len(p)
    t.score([99, 98], keep=2)  # something else in the rejected slots
    t.rollback(len(p))
    b = t.score(draft, keep=len(draft))
    assert a.shape == (4, t.vocab_size)
    assert np.array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="roll back"):
        t.rollback(t.cached_len + 1)


def test_a_prompt_longer_than_a_batch_goes_in_chunks(setup):
    """n_batch 16: a 3-question prompt (~60 tokens) is decoded in chunks, logits only from the last `keep`
    positions, and its greedy choices are those of one whole batch."""
    whole, p = setup["target"], sum(setup["prompts"], [])
    small = LlamaCppTarget(setup["gguf"], n_ctx=1024, n_batch=16)
    try:
        assert len(p) > 3 * small.n_batch
        whole.reset()
        a = whole.score(p, keep=3)
        b = small.score(p, keep=3)
        assert b.shape == (3, small.vocab_size) and small.cached_len == len(p)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        assert small.score([5], keep=None).shape == (1, small.vocab_size)
        with pytest.raises(ValueError, match="at least one"):
            small.score([])
    finally:
        small.close()


def test_plain_decoding_equals_llama_cpp_pythons_own(setup):
    """This target's one-token loop gives llama-cpp-python's greedy `generate` tokens (the same passes)."""
    t, stop = setup["target"], setup["stop"]
    llm = load_llama(setup["gguf"], n_ctx=1024)
    try:
        for p in setup["prompts"]:
            mine = speculative_generate(t, p, 48, None, stop_ids=stop).tokens
            llm.reset()
            theirs = []
            for tok in llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0):
                theirs.append(int(tok))
                if tok in stop or len(theirs) >= 48:
                    break
            assert mine == theirs
    finally:
        llm.close()


@pytest.mark.parametrize("k", [1, 4, 16])
def test_every_token_is_the_greedy_choice_of_its_pass(setup, k):
    """Lossless on llama.cpp: rebuilt from the recorded passes alone (each pass's greedy tokens and the draft it
    checked), the output is the accepted draft prefix plus the pass's next greedy token, pass after pass."""
    rec = Recorded(setup["target"])
    for p in setup["prompts"]:
        r = speculative_generate(rec, p, 64, setup["engine"], k=k, stop_ids=setup["stop"])
        tokens, margins = greedy_by_pass(rec.runs[-1])
        assert tokens[:len(r.tokens)] == r.tokens and len(margins) == len(tokens)
        assert r.steps == len(rec.runs[-1]) and max(r.draft_lengths) <= k
        if k > 1:
            assert r.mean_acceptance_length > 1.0  # the drafter's tokens are taken, not just checked


def test_the_draft_model_hook_drafts_with_the_engine(setup):
    """SpecdraftDraftModel answers the hook with the engine's draft as intc ids, and llama-cpp-python's own loop
    runs with it: the hook is called, and the text is the teacher's answer, not noise."""
    engine, p = setup["engine"], setup["prompts"][0]
    hook = SpecdraftDraftModel(engine, k=8, min_confidence=0.0)
    ids = np.asarray(p, dtype=np.intc)
    d = hook(ids)
    assert d.dtype == np.intc and d.tolist() == list(engine.draft(p, 8, min_confidence=0.0))
    llm = load_llama(setup["gguf"], n_ctx=1024, draft_model=hook)
    try:
        out = llm.create_completion(p, max_tokens=40, temperature=0.0, top_k=1, repeat_penalty=1.0)
    finally:
        llm.close()
    assert hook.calls > 1
    assert "blue" in out["choices"][0]["text"].lower() or "scatter" in out["choices"][0]["text"].lower()
    with pytest.raises(ValueError, match="k must be"):
        SpecdraftDraftModel(engine, k=0)


def test_the_draft_model_hook_over_http(setup, tmp_path):
    """From a real server on 127.0.0.1: the hook's drafts equal the engine's, with the request's min_confidence."""
    from server_helpers import ServerProcess

    p = setup["prompts"][1]
    import torch

    with ServerProcess(ROOT / "model", tmp_path / "server.log", via_serve_sh=False,
                       OMP_NUM_THREADS=torch.get_num_threads()) as srv:
        srv.wait_ready(600)
        for c in (0.0, 0.4):
            hook = SpecdraftDraftModel.from_server(srv.url, k=16, min_confidence=c)
            assert hook(np.asarray(p, dtype=np.intc)).tolist() == list(setup["engine"].draft(p, 16,
                                                                                              min_confidence=c))


def test_the_hook_never_stops_a_generation(tmp_path):
    """A context longer than the drafter's is drafted from its most recent tokens; a server that cannot be reached
    gives an empty draft (counted), not an exception inside llama-cpp-python's loop."""
    from server_helpers import free_port

    from drafter_lib.serve.client import SpeculativeClient

    seen = []

    class Short:  # a drafter with a 20-token window
        max_context = 20

        def draft(self, tokens, k, min_confidence=None):
            seen.append(list(tokens))
            return [7] * k

    hook = SpecdraftDraftModel(Short(), k=4)
    assert hook(np.arange(50, dtype=np.intc)).tolist() == [7] * 4
    assert seen[-1] == list(range(34, 50))  # 16 + 4 drafted = the drafter's 20
    down = SpecdraftDraftModel(SpeculativeClient(f"http://127.0.0.1:{free_port()}", max_retries=0), k=4)
    assert down(np.arange(10, dtype=np.intc)).tolist() == [] and down.failures == 1


def test_a_llama_cpp_drafter_drafts_its_models_greedy_tokens_across_requests(setup, tiny_random):
    """LlamaCppDrafter (a GGUF draft model, as llama.cpp users pair a small sibling with a target): each draft is its
    model's greedy continuation, whether the request extends the tokens it holds (prefix kept) or parts from them
    (cut back), and the runtime's speculative output with it equals its plain output."""
    from drafter_lib.decoding.llama_cpp_target import LlamaCppDrafter
    from drafter_lib.decoding.runtime import runtime_target
    from drafter_lib.decoding.speculative import greedy_decode
    from drafter_lib.model.transformer import Transformer

    p, stop = setup["prompts"][1], setup["stop"]
    fresh = LlamaCppTarget(setup["gguf"], n_ctx=1024)
    drafter = LlamaCppDrafter(setup["gguf"], n_ctx=1024)
    try:
        def greedy(ctx, k):
            fresh.reset()
            return greedy_decode(fresh, ctx, k)

        first = drafter.draft(p, 6)
        assert first == greedy(p, 6)
        longer = p + first[:3]
        assert drafter.draft(longer, 5) == greedy(longer, 5)  # extends the cached prefix
        other = p[:-4] + [13, 42]
        assert drafter.draft(other, 4) == greedy(other, 4)  # parts from it: cut back, not reused
        assert drafter.draft(other, 4) == greedy(other, 4)  # the very same request again
        with pytest.raises(ValueError, match="k >= 1"):
            drafter.draft(p, 0)
        hf, _ = tiny_random("llama", tokenizer="default")  # the default tokenizer's vocabulary, like the drafter's
        target = runtime_target(Transformer.from_hf_model(hf))
        plain = greedy_decode(target, p, 40, stop)
        for k in (1, 4, 9):
            assert speculative_generate(target, p, 40, drafter, k=k, stop_ids=stop).tokens == plain
    finally:
        drafter.close()
        fresh.close()
