"""The one verification rule, the one speculative loop, and its two targets (drafter_lib.decoding.speculative)."""
import random

import pytest
import torch
from server_helpers import tiny_hf_model

from drafter_lib.decoding.speculative import (
    FnDrafter,
    HFTarget,
    NativeTarget,
    accept_draft,
    accepted_length,
    greedy_decode,
    mean_acceptance_length,
    speculative_generate,
    speculative_stream,
)
from drafter_lib.model.transformer import Transformer

VOCAB = 512


def test_greedy_verify():
    assert accept_draft([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert accept_draft([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert accept_draft([5, 6, 7], [4, 6, 7, 8]) == (0, 4)
    assert accept_draft([], [3]) == (0, 3)
    with pytest.raises(ValueError, match="target choices"):
        accept_draft([5, 6], [5, 6])
    # the simulation's reference may end before the draft does
    assert accepted_length([1, 2, 3], [1, 2]) == 2 and accepted_length([], [1]) == 0


def test_mean_acceptance_length():
    assert mean_acceptance_length(10, 10) == 1.0  # plain decoding
    assert mean_acceptance_length(24, 4) == 6.0
    assert mean_acceptance_length(0, 0) != mean_acceptance_length(0, 0)  # NaN without steps


def test_speculative_decoding_is_lossless(tiny_target):
    model, tok = tiny_target
    prompts = [list(tok.encode("hello world, hello world")), list(tok.encode("abc abc abc"))]
    greedy = [speculative_generate(model, p, 24).tokens for p in prompts]
    assert all(len(g) == 24 for g in greedy)
    full = [p + g for p, g in zip(prompts, greedy)]
    by_prefix = {tuple(f[:n]): f for f in full for n in range(len(f))}
    perfect = FnDrafter(lambda toks, k: by_prefix[tuple(toks)][len(toks):len(toks) + k])
    rng = random.Random(0)
    noisy = FnDrafter(lambda toks, k: [t if rng.random() < 0.7 else (t + 1) % 259
                                       for t in by_prefix[tuple(toks)][len(toks):len(toks) + k]])
    for drafter, min_mal in [(perfect, 5.0), (noisy, 1.0), (FnDrafter(lambda t, k: [7] * k), 1.0)]:
        for p, g in zip(prompts, greedy):
            r = speculative_generate(model, p, 24, drafter, k=6)
            assert r.tokens == g
            # tokens per target step; the first step (prompt + first draft) is a step like the others
            assert r.mean_acceptance_length >= min_mal - 1e-9
            assert r.mean_acceptance_length == len(r.tokens) / r.steps
    # perfect drafter: 24 tokens in ceil(24/7) target steps
    assert speculative_generate(model, prompts[0], 24, perfect, k=6).steps == 4


@pytest.fixture(scope="module")
def targets():
    # std-0.3 random weights: varied, context-dependent greedy output (HF's default init repeats one token)
    hf = tiny_hf_model(seed=0)
    hf.generation_config.eos_token_id = None
    native = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    return hf, native


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40)]


def oracle(full, wrong_every=0):
    """Drafts what the target will say; with wrong_every=m, wrong wherever (context length + position) % m == 0,
    so both the accept and the reject path of the rule run."""
    def fn(toks, k):
        d = full[len(toks):len(toks) + k]
        return [(t + 1) % VOCAB if wrong_every and (len(toks) + j) % wrong_every == 0 else t for j, t in enumerate(d)]
    return FnDrafter(fn)


def _hf_greedy(hf, prompt, n):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hf_and_native_targets_agree_and_equal_plain_greedy(targets):
    hf, native = targets
    hf_t, native_t = HFTarget(hf), NativeTarget(native)  # reused across calls: each run starts a new sequence
    for prompt in _prompts():
        ref = _hf_greedy(hf, prompt, 20)
        full = prompt + ref
        perfect, noisy = oracle(full), oracle(full, wrong_every=3)
        wrong = FnDrafter(lambda toks, k: [7] * k)
        for drafter, k in [(None, 4), (perfect, 5), (noisy, 3), (wrong, 8), (FnDrafter(lambda t, k: []), 4)]:
            a = speculative_generate(hf_t, prompt, 20, drafter, k)
            b = speculative_generate(native_t, prompt, 20, drafter, k)
            assert a.tokens == b.tokens == ref
            assert a.accepted_lengths == b.accepted_lengths and a.draft_lengths == b.draft_lengths
            assert all(0 <= n <= d <= k for n, d in zip(a.accepted_lengths, a.draft_lengths))
            if drafter is None:
                assert a.steps == 20 and a.mean_acceptance_length == 1.0  # plain decoding
            if drafter is perfect:
                assert a.steps == 4  # 20 tokens, 6 per step
        # a raw model is wrapped in its target automatically
        assert greedy_decode(native, prompt, 20) == greedy_decode(hf, prompt, 20) == ref


def test_stop_ids_and_bad_input(targets):
    hf, native = targets
    prompt = _prompts()[1]
    ref = _hf_greedy(hf, prompt, 20)
    stop = ref[6]
    perfect = oracle(prompt + ref)
    for target in (hf, native):
        out = speculative_generate(target, prompt, 20, perfect, k=16, stop_ids=[stop])
        assert out.tokens == ref[:ref.index(stop) + 1]  # a stop token inside an accepted draft ends the run
        assert speculative_generate(target, prompt, 0, perfect).tokens == []
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_generate(native, [], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(native, [1, VOCAB], 4)
    with pytest.raises(ValueError, match="draft"):
        speculative_generate(native, prompt, 4, FnDrafter(lambda t, k: [VOCAB + 1]), k=2)


def test_stream_steps_add_up_to_speculative_generate(targets):
    target, prompt = NativeTarget(targets[1]), _prompts()[1]
    plain = greedy_decode(target, prompt, 20)
    for drafter, k in [(None, 4), (oracle(prompt + plain), 6), (oracle(prompt + plain, wrong_every=3), 5)]:
        steps = list(speculative_stream(target, prompt, 20, drafter, k))
        whole = speculative_generate(target, prompt, 20, drafter, k)
        assert [t for s in steps for t in s.tokens] == whole.tokens == plain
        assert [s.accepted for s in steps] == whole.accepted_lengths
        assert [s.drafted for s in steps] == whole.draft_lengths
        # a step adds its accepted draft tokens and the target's own (the last one may be cut at the end)
        assert all(len(s.tokens) == s.accepted + 1 for s in steps[:-1]) and all(s.tokens for s in steps)
        assert all(s.draft_seconds >= 0 and s.verify_seconds > 0 for s in steps)
        if drafter is None:
            assert len(steps) == 20 and all(s.drafted == 0 for s in steps)


def test_stream_stops_at_a_stop_token_and_checks_its_arguments_at_once(targets):
    target, prompt = NativeTarget(targets[1]), _prompts()[1]
    plain = greedy_decode(target, prompt, 20)
    stop = plain[10]
    steps = list(speculative_stream(target, prompt, 20, oracle(prompt + plain), 16, stop_ids=[stop]))
    assert [t for s in steps for t in s.tokens] == plain[:plain.index(stop) + 1]
    # the checks run when the stream is made, not at its first step
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_stream(target, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_stream(target, prompt, -1)
    assert list(speculative_stream(target, prompt, 0)) == []


def test_a_stream_left_early_leaves_the_target_ready_for_the_next(targets):
    target, prompt = NativeTarget(targets[1]), _prompts()[2]
    plain = greedy_decode(target, prompt, 20)
    steps = speculative_stream(target, prompt, 20, None)
    next(steps), next(steps)
    steps.close()
    assert greedy_decode(target, prompt, 20) == plain


def test_rollback(targets):
    hf, native = targets
    prompt = _prompts()[2]
    for target in (HFTarget(hf), NativeTarget(native, chunk=16)):  # chunk < prompt: prefill in pieces
        target.reset()
        first = target.score(prompt, keep=1)
        assert target.cached_len == len(prompt) and first.shape == (1, VOCAB)
        target.score([1, 2, 3])
        target.rollback(len(prompt))
        again = target.score([9], keep=1)  # as if [1, 2, 3] had never been scored
        target.reset()
        fresh = target.score(prompt + [9], keep=1)
        torch.testing.assert_close(again, fresh, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="roll back"):
            target.rollback(target.cached_len + 1)


def test_native_cache_grows_no_further_than_the_context():
    """Doubling stops at the model's context (rounded up to a row bucket): a 300-token context holds 320 slots at
    the end of a generation that fills it, not 512."""
    from drafter_lib.model.transformer import row_keys

    hf = tiny_hf_model(seed=0, max_position_embeddings=300)
    target = NativeTarget(Transformer.from_hf(hf.config.to_dict(), hf.state_dict()))
    prompt = _prompts()[1]
    tokens = greedy_decode(target, prompt, 300 - len(prompt))
    assert len(tokens) == 300 - len(prompt) and target.cached_len == 299
    assert target.cache.capacity == row_keys(299) == 320
    first = target.cache.capacity
    target.reset()
    greedy_decode(target, prompt, 8)
    assert target.cache.capacity == first  # a new sequence reuses it


def test_hf_target_keeps_grouped_kv_heads_in_the_kernel(targets, monkeypatch):
    """On CPU a verify step (several query tokens after a cache, so a mask) runs sdpa with the grouped K/V heads
    as they are, not copied `num_key_value_groups` times; the logits are those of the stock path, and the switch is
    set only around the target's own forward passes."""
    import os

    import transformers.integrations.sdpa_attention as sdpa

    hf, _ = targets
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # the tiny model groups its heads
    copies = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: copies.append(n) or real(h, n))
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    prompt = _prompts()[2]
    logits = {}
    for gqa in (True, False):
        t = HFTarget(hf, gqa_kernel=gqa)
        assert t.gqa_kernel is gqa
        t.score(prompt, keep=1)
        copies.clear()
        logits[gqa] = t.score([3, 4, 5], keep=3)  # a 3-token verify step after the cached prompt
        assert bool(copies) is not gqa
        assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    assert HFTarget(hf).gqa_kernel  # the default on a CPU model


def test_a_target_drafts_its_greedy_tokens_across_requests(tiny_random):
    """TargetDrafter (a Target, e.g. the family's small sibling in this runtime, as a drafter): each draft is its
    model's greedy continuation, whether a request extends the tokens its cache holds or parts from them, and a
    runtime target's speculative output with it equals its plain output."""
    from drafter_lib.decoding.runtime import runtime_target
    from drafter_lib.decoding.speculative import TargetDrafter

    small, _ = tiny_random("qwen2", seed=4, hidden_size=64, num_hidden_layers=1, intermediate_size=128)
    big, _ = tiny_random("qwen2", seed=5, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    drafter = TargetDrafter(runtime_target(Transformer.from_hf_model(small), "gguf"))
    fresh = runtime_target(Transformer.from_hf_model(small), "gguf")

    def greedy(ctx, k):
        fresh.reset()
        return greedy_decode(fresh, ctx, k)

    p = list(range(40, 70))
    first = drafter.draft(p, 6)
    assert first == greedy(p, 6)
    longer = p + first[:3]
    assert drafter.draft(longer, 5) == greedy(longer, 5)  # extends its cache: only the new tokens are read
    assert drafter.model.cached_len == len(longer) + 4
    other = p[:-4] + [13, 42]
    assert drafter.draft(other, 4) == greedy(other, 4)  # parts from it: cut back to the shared prefix
    assert drafter.draft(other, 4) == greedy(other, 4)  # the very same request again
    with pytest.raises(ValueError, match="k >= 1"):
        drafter.draft(p, 0)
    target = runtime_target(Transformer.from_hf_model(big), "gguf")
    plain = greedy_decode(target, p, 40)
    target.reset()
    assert speculative_generate(target, p, 40, drafter, k=4).tokens == plain
