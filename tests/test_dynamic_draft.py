"""Dynamic draft length: `min_confidence` stops a draft before the first model-drafted token whose probability under
the drafter is below it; per request, with a model-dir default; batched, cached and copied tokens behave."""
import json
import random

import pytest
import torch
from test_model import tiny_hf

from drafter_lib.engine.draft_engine import RECOMMENDED, DraftEngine

V = 61
COPY = {"enabled": True, "max_ngram": 3, "min_ngram": 2, "max_copy": 5, "mode": "prefix"}


def sharp(std: float, seed: int = 0):
    """A tiny Llama whose matrices have std `std`: 0.5 spreads greedy-token probabilities over ~0.1..0.99; 1.0 makes
    logits sharp enough that rounding differences between paths would flip tokens."""
    m = tiny_hf("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std, generator=torch.Generator().manual_seed(p.numel() + seed))
    return m


@pytest.fixture(scope="module")
def hf():
    return sharp(0.5)


def make_engine(m, **kw):
    kw.setdefault("dtype", "float32")
    return DraftEngine.from_state_dict(m.config.to_dict(), m.state_dict(), **kw)


def rand_tokens(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy_probs(m, prompt, n):
    """transformers' greedy continuation and the probability of each of its tokens (fp32 softmax)."""
    ids = torch.tensor([prompt])
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                     eos_token_id=None)[0].tolist()
    with torch.no_grad():
        logits = m(torch.tensor([out])).logits[0, len(prompt) - 1:-1].float()
    toks = out[len(prompt):]
    return toks, torch.softmax(logits, -1)[torch.arange(n), toks].tolist()


def stop_cases(probs):
    """(threshold, stop index) pairs with a clear margin: position j is a new running minimum, the threshold sits
    halfway between it and every earlier probability."""
    cases = []
    for j in range(len(probs)):
        above = min(probs[:j], default=1.0)
        if probs[j] < above - 0.02:
            cases.append(((probs[j] + above) / 2, j))
    return cases


def test_stops_at_first_token_below_threshold_like_transformers(hf):
    eng = make_engine(hf)
    checked = 0
    for seed, n in enumerate((7, 20, 33)):
        p = rand_tokens(n, seed)
        ref, ref_probs = hf_greedy_probs(hf, p, 16)
        full = eng.draft(p, 16, return_probs=True)
        assert full == ref and full.probs == pytest.approx(ref_probs, abs=1e-5)
        for c, j in stop_cases(ref_probs):
            d = eng.draft(p, 16, min_confidence=c)
            assert d == ref[:j] and d.probs == pytest.approx(ref_probs[:j], abs=1e-5), (seed, c, j)
            checked += 1
        never = min(ref_probs) - 0.01  # active, never below: the full draft
        assert eng.draft(p, 16, min_confidence=never) == ref
    assert checked >= 4
    assert eng.draft(rand_tokens(9, 1), 16, min_confidence=1.0) == []  # no greedy token has probability >= 1 here


def test_default_off_and_per_request_override(hf, tmp_path):
    p = rand_tokens(25, 5)
    plain = make_engine(hf)
    full = plain.draft(p, 12)
    assert full.probs is None and len(full) == 12  # no threshold, no probs asked: nothing computed
    probs = plain.draft(p, 12, return_probs=True).probs
    c, j = stop_cases(probs)[-1]
    eng = make_engine(hf, min_confidence=c)  # the engine's default
    assert eng.draft(p, 12) == full[:j] and j < 12
    assert eng.draft(p, 12, min_confidence=0) == full  # 0 turns it off
    c2, j2 = stop_cases(probs)[0]
    assert eng.draft(p, 12, min_confidence=c2) == full[:j2]  # a request's own value wins
    assert eng.info()["min_confidence"] == c
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="min_confidence"):
            plain.draft(p, 4, min_confidence=bad)
    with pytest.raises(ValueError, match="2 values for 1 requests"):
        plain.draft_batch([p], 4, min_confidence=[0.1, 0.2])


def test_model_dir_default_pack_and_export(hf, tmp_path):
    from drafter_lib.interop.hf_export import export_hf
    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    qc = QuantConfig.default_for(group_size=16)
    off = DraftEngine.from_dir(pack_checkpoint(hf, hf.config, tmp_path / "off", qc), dtype="float32")
    assert off.min_confidence is None
    p = rand_tokens(30, 6)
    full = off.draft(p, 12, return_probs=True)
    c, j = stop_cases(full.probs)[-1]
    d = pack_checkpoint(hf, hf.config, tmp_path / "on", qc, min_confidence=c)
    assert json.loads((d / "config.json").read_text())["draft_min_confidence"] == c
    for dtype in ("float32", "float16"):
        eng = DraftEngine.from_dir(d, dtype=dtype, min_confidence=RECOMMENDED)  # the pack's threshold, asked for
        ref = DraftEngine.from_dir(d, dtype=dtype)  # the pack only recommends it: off unless asked for
        assert eng.min_confidence == c and ref.min_confidence is None
        assert ref.info()["recommended_min_confidence"] == c
        unstopped = ref.draft(p, 12, return_probs=True)
        stop = next((i for i, q in enumerate(unstopped.probs) if q < c), 12)
        assert eng.draft(p, 12) == unstopped[:stop]
        assert eng.draft(p, 12, min_confidence=0) == unstopped
    assert DraftEngine.from_dir(d, dtype="float32", min_confidence=RECOMMENDED).draft(p, 12) == full[:j]
    assert DraftEngine.from_dir(d, dtype="float32").draft(p, 12) == full
    exported = export_hf(d, tmp_path / "hf")  # a transformers config without the engine-only key
    assert "draft_min_confidence" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not hasattr(exported.config, "draft_min_confidence")


def _loop_requests(eng, n, k, seed):
    """Requests of speculative loops (prompt, then prompt + accepted + bonus) with assorted thresholds."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(V) for _ in range(rng.randrange(4, 40))]
        if i % 3 == 0:
            p = p + p[:3]  # a suffix seen earlier: the copy prior proposes something
        c = [None, 0.0, 0.2, 0.4, 0.6, 0.9][i % 6]
        d = eng.draft(p, k, min_confidence=c)
        out.append((p + d[:i % 4] + [rng.randrange(V)], c))
    return out


@pytest.mark.parametrize("dtype,copy", [("float32", None), ("float16", None), ("float16", COPY),
                                        ("float16", {**COPY, "mode": "accelerate"}), ("int8", None),
                                        ("auto", COPY)])
def test_mixed_thresholds_batch_equals_single_and_warm_equals_cold(dtype, copy, tmp_path):
    """Rows that stop leave the batch; every request's draft (and its probabilities) equals the same request sent
    alone to a cold engine, and the loop's next request after an early stop equals a cold one (only computed
    positions were cached). float16 and auto load a packed dir, so the head is the exact-argmax Int8Head."""
    m = sharp(1.0, seed=3)
    if dtype in ("float16", "auto"):
        from drafter_lib.packed.model_dir import write_model_dir
        from drafter_lib.quantization import QuantConfig

        write_model_dir(tmp_path / "m", m.config.to_dict(), m.state_dict(), QuantConfig.default_for(group_size=16))

        def new():
            return DraftEngine.from_dir(tmp_path / "m", dtype=dtype, copy_policy=copy or {})
    else:
        def new():
            return make_engine(m, dtype=dtype, copy_policy=copy)
    loop, cold, batched = new(), new(), new()
    reqs = _loop_requests(loop, 36, 12, seed=7)
    answers = []
    for r, c in reqs:
        warm = loop.draft(r, 12, min_confidence=c, return_probs=True)
        cold.clear_cache()
        ref = cold.draft(r, 12, min_confidence=c, return_probs=True)
        # tokens are exact; probabilities carry the last bits of a prefill vs a decode step (so a threshold within
        # ~1e-6 of a probability could stop one token apart, like a near-tie flips a greedy token)
        assert warm == ref and warm.probs == pytest.approx(ref.probs, abs=1e-4)
        # the token is the same argmax with or without the confidence path: a stopped draft is a prefix
        assert cold.draft(r, 12)[:len(ref)] == ref
        answers.append(ref)
    assert any(len(a) < 12 for a in answers) and any(len(a) == 12 for a in answers)
    for s in range(0, len(reqs), 9):
        chunk = reqs[s:s + 9]
        out = batched.draft_batch([r for r, _ in chunk], 12, min_confidence=[c for _, c in chunk],
                                  return_probs=[i % 2 == 0 for i in range(len(chunk))])
        for i, (d, ref) in enumerate(zip(out, answers[s:s + 9])):
            assert d == ref
            if i % 2 == 0 or chunk[i][1]:
                assert d.probs == pytest.approx(ref.probs, abs=1e-4)
            else:
                assert d.probs is None
        # the loops' next step after the batch (every draft token accepted + a bonus) reuses the K/V the batched
        # decode computed, rows that stopped and left the batch included: equal to cold
        nxt = [r + d + [5] for (r, _), d in zip(chunk, out)]
        again = batched.draft_batch(nxt, 12, min_confidence=[c for _, c in chunk])
        for n, (_, c), d in zip(nxt, chunk, again):
            cold.clear_cache()
            assert d == cold.draft(n, 12, min_confidence=c)


def test_cache_after_an_early_stop_holds_only_computed_positions(hf):
    eng = make_engine(hf)
    p = rand_tokens(40, 8)
    full = eng.draft(p, 12, return_probs=True)
    c, j = stop_cases(full.probs)[-1]
    assert j >= 2
    eng.clear_cache()
    d = eng.draft(p, 12, min_confidence=c)
    assert d == full[:j]
    before = dict(eng.stats)
    nxt = p + d + [3]  # every drafted token accepted, then the bonus
    warm = eng.draft(nxt, 12, min_confidence=c)
    assert eng.stats["reused_tokens"] - before["reused_tokens"] == len(p) + j  # the drafted tokens' K/V were kept
    assert warm == make_engine(hf).draft(nxt, 12, min_confidence=c)


def test_copied_tokens_are_not_subject_to_the_threshold(hf):
    p = rand_tokens(20, 9)
    req = p + p[:3]  # copy proposes p[3:8]
    eng = make_engine(hf, copy_policy=COPY)
    d = eng.draft(req, 12, min_confidence=1.0, return_probs=True)
    assert d == p[3:8] and d.probs == [None] * 5  # copied as proposed; the model's next token stops it
    full = eng.draft(req, 12, return_probs=True)
    assert full[:5] == p[3:8] and full.probs[:5] == [None] * 5 and all(0 < q <= 1 for q in full.probs[5:])
    assert eng.draft(req, 4, min_confidence=1.0) == p[3:7]  # a copy covering k: no model token at all


def test_int8_head_logits_are_fp32_accurate():
    """The confidence path's logits of an int8-row head: as close to float64 as the dequantizing forward."""
    from drafter_lib.engine.weight_formats import Int8Head, int8_rows

    g = torch.Generator().manual_seed(1)
    q, scale = int8_rows(torch.randn(3000, 96, generator=g) * 0.05)
    head = Int8Head(q, scale)
    x = torch.randn(5, 96, generator=g) * 4
    x[0] = 0  # a zero row must not divide by zero
    exact = x.double() @ (q.double() * scale.double()).T
    got, fwd = head.approx_logits(x)[0].float(), head(x)
    assert got.dtype == torch.float32 and got.shape == (5, 3000)
    assert (got.double() - exact).abs().max() <= 2 * (fwd.double() - exact).abs().max() + 1e-6
    assert torch.allclose(got.softmax(-1), fwd.softmax(-1), atol=1e-6)
    for i in range(5):  # a row's logits and bound are the same bits alone as in a batch (per-row scales)
        alone = head.approx_logits(x[i:i + 1])
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, head.approx_logits(x)))
    assert torch.equal(head.argmax(x), torch.stack([head.argmax(x[i:i + 1])[0] for i in range(5)]))


def test_packed_int8_head_probs_equal_softmax_of_its_logits(tmp_path):
    """The default engine of a pack (Int8Head: the exact argmax, probabilities from Int8Head.approx_logits): its tokens
    are the argmax and its probabilities the softmax of the head's dequantized fp32 logits over the same hidden
    states (recomputed here as one prefill)."""
    from drafter_lib.engine.weight_formats import Int8Head
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    m = sharp(0.5, seed=1)
    write_model_dir(tmp_path / "m", m.config.to_dict(), m.state_dict(), QuantConfig.default_for(group_size=16))
    eng = DraftEngine.from_dir(tmp_path / "m")
    head = eng.model.lm_head
    assert isinstance(head, Int8Head)
    for seed in range(3):
        p = rand_tokens(15 + 10 * seed, 50 + seed)
        d = eng.draft(p, 10, return_probs=True)
        seq = torch.tensor([p + d])
        with torch.inference_mode():
            h = eng.model.hidden(seq, torch.arange(seq.shape[1])[None])[0, len(p) - 1:-1]
            probs = head(h).softmax(-1)
        assert probs.argmax(-1).tolist() == d
        assert d.probs == pytest.approx(probs[torch.arange(10), d].tolist(), abs=1e-4)
