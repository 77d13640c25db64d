"""Acceptance simulation, prompt selection and lossless speculative decoding (drafter_lib.evaluate)."""
import json
import random

import pytest

from drafter_lib import evaluate as ev
from drafter_lib.evaluate import AcceptanceStats, FnDrafter, simulate


def oracle(full):
    """A drafter that knows the reference: drafts exactly what the target will say."""
    return FnDrafter(lambda toks, k: full[len(toks):len(toks) + k])


def test_perfect_drafter_gets_k_plus_one():
    k = 4
    prompt, ref = [1, 2, 3], list(range(100, 100 + 5 * (k + 1)))  # 5 full steps of k accepted + 1 bonus
    res = simulate(oracle(prompt + ref), [prompt], [ref], k=k)
    assert res.overall.steps == 5
    assert res.overall.mean_acceptance_length == pytest.approx(k + 1)
    assert res.overall.per_position_acceptance == [1.0] * k
    assert res.overall.hist == [0, 0, 0, 0, 5]


def test_useless_drafter_gets_one():
    prompt, ref = [1, 2], [5, 6, 7, 8, 9, 10]
    res = simulate(FnDrafter(lambda toks, k: [0] * k), [prompt], [ref], k=3)
    assert res.overall.mean_acceptance_length == pytest.approx(1.0)
    assert res.overall.steps == len(ref)  # one target step per token, as plain decoding
    assert res.overall.per_position_acceptance == [0.0, 0.0, 0.0]
    # an empty draft (e.g. no n-gram match) is also plain decoding
    res = simulate(FnDrafter(lambda toks, k: []), [prompt], [ref], k=3)
    assert res.overall.mean_acceptance_length == pytest.approx(1.0)


def test_partial_drafter_positions_and_histogram():
    # Drafts the truth for 2 tokens, then garbage: every step accepts exactly 2 and the target adds 1.
    k = 4
    prompt, ref = [9], list(range(10, 22))  # 12 tokens -> 4 steps of 3 tokens
    full = prompt + ref
    res = simulate(FnDrafter(lambda toks, kk: full[len(toks):len(toks) + 2] + [0] * (kk - 2)), [prompt], [ref], k=k)
    assert res.overall.steps == 4
    assert res.overall.mean_acceptance_length == pytest.approx(3.0)
    assert res.overall.per_position_acceptance == [1.0, 1.0, 0.0, 0.0]
    assert res.overall.hist == [0, 0, 4, 0, 0]


def test_walk_matches_hand_computation():
    # ref = a b c d e f; drafter proposes [a, x] then [c, d] then [f] -> accepted 1, 2, then the final bonus.
    prompt, ref = [0], [1, 2, 3, 4, 5, 6]
    plan = {1: [1, 99], 3: [3, 4], 6: [6, 7]}
    calls = []

    def fn(toks, k):
        calls.append(len(toks))
        return plan.get(len(toks), [])

    res = simulate(FnDrafter(fn), [prompt], [ref], k=2)
    assert calls == [1, 3, 6]  # i=0 -> accept 1 (+1 bonus) -> i=2 -> accept 2 (+1) -> i=5 -> accept 1 (end)
    assert res.overall.hist == [0, 2, 1]
    assert res.overall.steps == 3
    assert res.overall.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    # position 2 was verifiable in the first two steps only (one token of reference left in the third)
    assert res.overall.pos_trials == [3, 2]
    assert res.overall.per_position_acceptance == [1.0, 0.5]


def test_per_category_and_batched_drafter_agree():
    rng = random.Random(0)
    prompts = [[rng.randrange(50) for _ in range(5)] for _ in range(6)]
    refs = [[rng.randrange(50) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    cats = ["a", "b", "a", "c", "b", "a"]

    def fn(toks, k):  # deterministic pseudo-drafter: right on some tokens
        return [(t * 7 + len(toks)) % 3 for t in toks[-k:]]

    calls = []
    batched = FnDrafter(fn, batch_fn=lambda cs, k: (calls.append(len(cs)), [fn(c, k) for c in cs])[1])
    one = simulate(FnDrafter(fn), prompts, refs, k=4, categories=cats)
    many = simulate(batched, prompts, refs, k=4, categories=cats, batch_size=4)
    assert max(calls) == 4 and one.to_dict()["mean_acceptance_length"] == many.to_dict()["mean_acceptance_length"]
    assert set(one.per_category) == {"a", "b", "c"}
    merged = AcceptanceStats(4)
    for s in one.per_category.values():
        merged.merge(s)
    assert merged.to_dict() == one.overall.to_dict()


def test_bad_inputs():
    with pytest.raises(ValueError, match="k must be"):
        AcceptanceStats(0)
    with pytest.raises(ValueError, match="references"):
        simulate(FnDrafter(lambda t, k: []), [[1]], [], k=2)


def test_question_jsonl_and_limit_spreads_over_categories(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = []
    for cat, n in [("writing", 5), ("math", 5), ("coding", 2)]:
        for i in range(n):
            rows.append({"question_id": len(rows) + 81, "category": cat, "turns": [f"{cat} q{i}?", "follow-up"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = ev.load_eval_prompts(path)
    assert len(recs) == 12
    picked = ev.load_eval_prompts(path, limit=7)
    cats = [r["category"] for r in picked]
    assert cats.count("coding") == 2 and cats.count("math") >= 2 and cats.count("writing") >= 2
    assert cats[:3] == ["writing", "math", "coding"]  # round-robin, not the first N
    from drafter_lib.hf_models import byte_tokenizer

    ids = ev.encode_records(byte_tokenizer(), picked[:1])[0]
    assert byte_tokenizer().decode(ids).endswith("writing q0?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        ev.spread_over_categories(recs, 0)


def test_baselines_table_lists_every_drafter():
    prompt, ref = [1], [2, 3, 4, 5]
    res = {"perfect": simulate(oracle(prompt + ref), [prompt], [ref], k=2, categories=["x"]).to_dict(),
           "none": simulate(FnDrafter(lambda t, k: []), [prompt], [ref], k=2, categories=["x"]).to_dict()}
    table = ev.baselines_table(res)
    assert "perfect" in table and "none" in table and "MAL[x]" in table


@pytest.fixture(scope="module")
def tiny_target():
    from drafter_lib.hf_models import tiny_random_model

    model, tok = tiny_random_model("llama", tokenizer="bytes", hidden_size=32, num_hidden_layers=2, seed=3)
    return model, tok


def test_speculative_decoding_is_lossless(tiny_target):
    model, tok = tiny_target
    prompts = [list(tok.encode("hello world, hello world")), list(tok.encode("abc abc abc"))]
    greedy = [ev.speculative_generate(model, p, 24).tokens for p in prompts]
    assert all(len(g) == 24 for g in greedy)
    full = [p + g for p, g in zip(prompts, greedy)]
    by_prefix = {tuple(f[:n]): f for f in full for n in range(len(f))}
    perfect = FnDrafter(lambda toks, k: by_prefix[tuple(toks)][len(toks):len(toks) + k])
    rng = random.Random(0)
    noisy = FnDrafter(lambda toks, k: [t if rng.random() < 0.7 else (t + 1) % 259
                                       for t in by_prefix[tuple(toks)][len(toks):len(toks) + k]])
    for drafter, min_mal in [(perfect, 5.0), (noisy, 1.0), (FnDrafter(lambda t, k: [7] * k), 1.0)]:
        for p, g in zip(prompts, greedy):
            r = ev.speculative_generate(model, p, 24, drafter, k=6)
            assert r.tokens == g
            assert (len(r.tokens) - 1) / r.steps >= min_mal - 1e-9  # first token comes from prefill
    # perfect drafter: 23 tokens after prefill in ceil(23/7) target steps
    assert ev.speculative_generate(model, prompts[0], 24, perfect, k=6).steps == 4
    rep = ev.end_to_end(model, perfect, prompts, 24, k=6)
    assert rep["lossless"] and rep["speedup"] > 0 and rep["prompts"] == 2


def test_references_match_plain_greedy(tiny_target):
    model, tok = tiny_target
    prompts = ev.encode_records(tok, [{"messages": [{"role": "user", "content": c}]} for c in ["hi", "a longer one"]])
    refs = ev.greedy_references(model, tok, prompts, 12, batch_size=2, backend="hf")
    for p, r in zip(prompts, refs):
        assert r == ev.speculative_generate(model, p, 12, eos_ids=ev.stop_token_ids(tok)).tokens


def test_cli_on_tiny_target_and_packed_drafter(tmp_path, tiny_target, capsys):
    from drafter_lib.hf_models import prune_layers
    from drafter_lib.pack import pack_checkpoint
    from drafter_lib.quantization import QuantConfig

    model, tok = tiny_target
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    drafter, _ = prune_layers(model, "first:1")
    pack_checkpoint(drafter, drafter.config, tmp_path / "model", QuantConfig.default_for(group_size=32),
                    copy_policy={"enabled": True, "mode": "prefix"})
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} number {i} {c}?"]}) + "\n"
                         for i, c in enumerate(["a", "a", "a", "b", "b", "c"])))
    out = tmp_path / "m.json"
    ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), "--target", str(target_dir), "--limit", "3",
             "--max-new-tokens", "12", "--k", "4", "--e2e-prompts", "2", "--out", str(out),
             "--plots", str(tmp_path / "plots")])
    m = json.loads(out.read_text())
    assert m["num_prompts"] == 3 and set(m["per_category"]) == {"a", "b", "c"}  # spread, not the first three
    assert m["lossless"] is True and m["end_to_end"]["prompts"] == 2
    assert len(m["per_position_acceptance"]) == 4 and 1.0 <= m["mean_acceptance_length"] <= 5.0
    assert list(m["baselines"]) == ["packed", "n-gram lookup", "packed + copy prior"]
    assert (tmp_path / "plots" / "position_acceptance.png").stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "packed + copy prior" in printed and "lossless: True" in printed
