"""Prompt selection, references, the end-to-end check, reports and the CLI (drafter_lib.evaluation.evaluate)."""
import json

import pytest

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.decoding.speculative import FnDrafter, speculative_generate
from drafter_lib.evaluation import evaluate as ev
from drafter_lib.evaluation.acceptance import simulate


def oracle(full):
    """A drafter that knows the reference: drafts exactly what the target will say."""
    return FnDrafter(lambda toks, k: full[len(toks):len(toks) + k])


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
    from drafter_lib.model.tiny_models import byte_tokenizer

    ids = ev.encode_records(byte_tokenizer(), picked[:1])[0]
    assert byte_tokenizer().decode(ids).endswith("writing q0?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        ev.spread_over_categories(recs, 0)


def test_baselines_table_lists_every_drafter():
    prompt, ref = [1], [2, 3, 4, 5]
    res = {"perfect": simulate(oracle(prompt + ref), [prompt], [ref], k=2, categories=["x"]).to_dict(),
           "none": simulate(FnDrafter(lambda t, k: []), [prompt], [ref], k=2, categories=["x"]).to_dict()}
    table = ev.baselines_table(res, counts={"x": 1})
    assert "perfect" in table and "none" in table
    cat_rows = ev.category_table(res, {"x": 1}).splitlines()
    assert cat_rows[0].split() == ["category", "n", "perfect", "none"] and cat_rows[2].split() == ["x", "1", "2.500",
                                                                                                   "1.000"]
    assert ev.position_table(res).splitlines()[0].split() == ["drafter", "p@1", "p@2"]
    assert ev.category_table(res, {"x": 1}) in table and ev.position_table(res) in table


def test_end_to_end_is_lossless(tiny_target):
    model, tok = tiny_target
    prompts = [list(tok.encode("hello world, hello world")), list(tok.encode("abc abc abc"))]
    greedy = [speculative_generate(model, p, 24).tokens for p in prompts]
    full = [p + g for p, g in zip(prompts, greedy)]
    by_prefix = {tuple(f[:n]): f for f in full for n in range(len(f))}
    perfect = FnDrafter(lambda toks, k: by_prefix[tuple(toks)][len(toks):len(toks) + k])
    rep = ev.end_to_end(model, perfect, prompts, 24, k=6)
    assert rep["lossless"] and rep["speedup"] > 0 and rep["prompts"] == 2
    assert rep["generated_tokens"] == 48 and rep["mean_acceptance_length"] == pytest.approx(6.0)  # 24 in 4 steps
    wrong = ev.end_to_end(model, FnDrafter(lambda t, k: [7] * k), prompts, 24, k=6)
    assert wrong["lossless"] and wrong["mean_acceptance_length"] >= 1.0


def test_references_match_plain_greedy(tiny_target):
    model, tok = tiny_target
    prompts = ev.encode_records(tok, [{"messages": [{"role": "user", "content": c}]} for c in ["hi", "a longer one"]])
    refs = ev.greedy_references(model, tok, prompts, 12, batch_size=2, backend="hf")
    for p, r in zip(prompts, refs):
        assert r == speculative_generate(model, p, 12, stop_ids=stop_token_ids(tok)).tokens


def test_cli_on_tiny_target_and_packed_drafter(tmp_path, tiny_target, capsys):
    from drafter_lib.model.hf_models import prune_layers
    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    model, tok = tiny_target
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    drafter, _ = prune_layers(model, "first:1")
    pack_checkpoint(drafter, drafter.config, tmp_path / "model", QuantConfig.default_for(group_size=32),
                    copy_policy={"enabled": True, "mode": "prefix"}, min_confidence=0.25)
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} number {i} {c}?"]}) + "\n"
                         for i, c in enumerate(["a", "a", "a", "b", "b", "c"])))
    out = tmp_path / "m.json"
    ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), "--target", str(target_dir), "--limit", "3",
             "--max-new-tokens", "12", "--k", "4", "--e2e-prompts", "2", "--out", str(out),
             "--plots", str(tmp_path / "plots"), "--tree-budgets"])  # no tree rows (test_tree_eval.py has them)
    m = json.loads(out.read_text())
    assert m["num_prompts"] == 3 and set(m["per_category"]) == {"a", "b", "c"}  # spread, not the first three
    assert m["prompts_per_category"] == {"a": 1, "b": 1, "c": 1} and m["prompts"] == [str(q)]
    assert m["lossless"] is True and m["end_to_end"]["prompts"] == 2
    # the end-to-end run uses the pack as shipped (its threshold); the acceptance table drafts a fixed k
    assert m["end_to_end"]["drafter"] == "pack as shipped" and m["end_to_end"]["min_confidence"] == 0.25
    assert len(m["per_position_acceptance"]) == 4 and 1.0 <= m["mean_acceptance_length"] <= 5.0
    assert list(m["baselines"]) == ["packed", "n-gram lookup", "packed + copy prior"] and m["trees"] == {}
    assert (tmp_path / "plots" / "position_acceptance.png").stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "packed + copy prior" in printed and "lossless: True" in printed


def test_second_turn_is_prompted_with_the_targets_own_first_answer(tiny_target, tmp_path):
    from drafter_lib.common.chat import encode_chat
    from drafter_lib.data.heldout import conversation_items

    model, tok = tiny_target
    u1, u2 = {"role": "user", "content": "tell me a story"}, {"role": "user", "content": "shorter, please"}
    items = conversation_items([{"id": "c", "category": "writing", "messages": [u1, u2]}])
    cache = tmp_path / "refs.jsonl"
    prompts, refs = ev.conversation_references(model, tok, items, 16, cache)
    stop = stop_token_ids(tok)
    assert prompts[0] == encode_chat(tok, [u1])
    assert refs[0] == speculative_generate(model, prompts[0], 16, stop_ids=stop).tokens  # the target's greedy answer
    answer = tok.decode(refs[0][:-1] if refs[0][-1] in stop else refs[0])
    assert prompts[1] == encode_chat(tok, [u1, {"role": "assistant", "content": answer}, u2])
    assert refs[1] == speculative_generate(model, prompts[1], 16, stop_ids=stop).tokens
    assert [r["id"] for r in map(json.loads, cache.read_text().splitlines())] == ["c", "c#turn2"]
    # both turns come from the cache now: no target needed
    assert ev.conversation_references(None, tok, items, 16, cache) == (prompts, refs)


def test_pool_by_origin_merges_groups_and_marks_mixed_ones():
    from drafter_lib.evaluation.acceptance import AcceptanceStats, pool_by_origin

    a, b, c = AcceptanceStats(2), AcceptanceStats(2), AcceptanceStats(2)
    a.add(2, 2), a.add(0, 2), b.add(1, 2), c.add(0, 1)
    got = pool_by_origin({"x": a, "y": b, "z": c}, ["x", "y", "z", "z"], ["o1", "o1", "o1", "o2"])
    assert got["o1"]["groups"] == ["x", "y"] and got["o1"]["steps"] == 3 and got["o1"]["accepted_tokens"] == 3
    assert got["o1"]["per_position_acceptance"] == [2 / 3, 1 / 3]
    assert got["mixed"]["groups"] == ["z"] and got["mixed"]["accepted_length_hist"] == [1, 0, 0]
    assert pool_by_origin({"x": a}, ["x"], [None]) == {}


def test_report_has_every_drafter_per_category_and_position(tiny_target, tmp_path):
    from drafter_lib.data.heldout import MULTI_TURN, conversation_items
    from drafter_lib.evaluation.acceptance import simulate
    from drafter_lib.evaluation.drafters import engine_from_state_dict, ngram_drafter

    model, tok = tiny_target
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    records = [{"id": "w", "category": "writing", "messages": [user("write about the sea"), user("now in rhyme")],
                "origin": "sets"},
               {"id": "m", "category": "math", "messages": [user("what is 12 + 30? " * 3)], "origin": "split"},
               {"id": "long", "category": "summarization", "messages": [user("Summarize: " + "word " * 600)]}]
    drafters = {"self": engine_from_state_dict(model.config, model.state_dict()),  # drafts what the target says
                "n-gram lookup": ngram_drafter({"enabled": True, "max_ngram": 3, "min_ngram": 2})}
    drafters["self"].max_context = 1024  # the 3k-token article does not fit
    k = 4
    m = ev.run_evaluation(model, tok, records, drafters, k=k, max_new_tokens=20, e2e_prompts=1,
                          references_path=tmp_path / "refs.jsonl", log=lambda s: None)
    assert m["left_out_too_long"] == ["long"] and m["item_ids"] == ["w", "m", "w#turn2"]
    assert m["prompts_per_category"] == {"writing": 1, "math": 1, MULTI_TURN: 1} and m["multi_turn_prompts"] == 1
    items = [it for it in conversation_items(records) if it["id"] != "long"]
    prompts, refs = ev.conversation_references(model, tok, items, 20, tmp_path / "refs.jsonl")
    groups = [it["category"] for it in items]
    for name, d in drafters.items():
        plain = simulate(d, prompts, refs, k=k, categories=groups).to_dict()  # one k-token draft per step
        got = m["baselines"][name]
        for key in ("mean_acceptance_length", "per_position_acceptance", "accepted_length_hist", "steps"):
            assert got[key] == plain[key], (name, key)
        assert m["mal_by_category"][name] == {"all": plain["mean_acceptance_length"], **{
            c: v["mean_acceptance_length"] for c, v in plain["per_category"].items()}}
        assert m["per_position_by_drafter"][name] == plain["per_position_acceptance"] and len(plain[
            "per_position_acceptance"]) == k
    assert m["mal_by_category"]["self"]["all"] > 3.0  # the target's own weights draft its greedy tokens
    for name, r in m["baselines"].items():  # pooled by origin: the second turn inherits its record's
        cat = r["per_category"]
        by = m["acceptance_by_origin"][name]
        assert by["split"]["groups"] == ["math"] and by["sets"]["groups"] == [MULTI_TURN, "writing"]
        assert by["split"]["accepted_length_hist"] == cat["math"]["accepted_length_hist"]
        assert by["sets"]["steps"] == cat["writing"]["steps"] + cat[MULTI_TURN]["steps"]
        assert by["sets"]["accepted_tokens"] == cat["writing"]["accepted_tokens"] + cat[MULTI_TURN]["accepted_tokens"]
    # intervals over the same per-prompt counts: each point estimate is the pooled MAL the report gives
    for name, r in m["baselines"].items():
        assert [sum(c[0] for c in r["per_prompt"]), sum(c[1] for c in r["per_prompt"])] == [r["steps"],
                                                                                          r["accepted_tokens"]]
        ci = m["mal_ci"][name]
        assert ci["all"]["mal"] == pytest.approx(r["mean_acceptance_length"]) and ci["all"]["prompts"] == 3
        assert ci["math"]["mal"] == pytest.approx(r["per_category"]["math"]["mean_acceptance_length"])
        assert ci["all"]["ci"][0] <= ci["all"]["mal"] <= ci["all"]["ci"][1]
        assert m["mal_ci_by_origin"][name]["sets"]["prompts"] == 2
    d = m["paired_vs_primary"]["self"]  # the primary is the last drafter: n-gram lookup
    assert d["difference"] == pytest.approx(m["mal_by_category"]["self"]["all"]
                                            - m["mal_by_category"]["n-gram lookup"]["all"])
    assert "n-gram lookup" not in m["paired_vs_primary"]
    assert "minus n-gram lookup, same prompts" in ev.interval_table(m)
    assert "split" in ev.origin_table(m["acceptance_by_origin"])
    table = ev.baselines_table(m["baselines"], k, m["prompts_per_category"])
    assert f"{MULTI_TURN}  " in table and "p@4" in table
    # the same tables as DataFrames (what the notebook shows), one row per drafter, cells as in the text
    frames = ev.report_frames(m)
    summary, by_origin, intervals, paired = frames.values()
    assert list(summary.index) == list(m["baselines"]) and list(summary.columns) == ["MAL", "steps", "p@1", "p@2",
                                                                                     "p@4"]
    assert summary.loc["self", "MAL"] == f"{m['baselines']['self']['mean_acceptance_length']:.3f}"
    assert set(by_origin.columns) == {"sets", "split"} and list(intervals.columns)[0] == "all"
    assert list(paired.index) == ["self"] and "minus n-gram lookup" in list(frames)[3]
    assert not any("tree" in title for title in frames)  # no tree budgets
    pngs = ev.save_plots(m, tmp_path / "plots")
    assert [p.name for p in pngs][-1] == "category_heatmap.png" and pngs[-1].stat().st_size > 5000


def test_one_drafter_under_two_names_is_simulated_once(tiny_target, tmp_path):
    """The peer that is the whole drafter base (the stage's eval.peer) is the base row's engine: one simulation,
    both rows its numbers, each paired with the primary."""
    from drafter_lib.data.heldout import conversation_items
    from drafter_lib.evaluation.drafters import engine_from_state_dict, ngram_drafter

    model, tok = tiny_target
    engine = engine_from_state_dict(model.config, model.state_dict())
    calls = []
    counted = FnDrafter(lambda toks, k: calls.append(len(toks)) or engine.draft(toks, k))
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    records = [{"id": "a", "category": "x", "messages": [user("say hello")]},
               {"id": "b", "category": "y", "messages": [user("count to ten")]}]
    drafters = {"peer: base": counted, "pruned base (untrained)": counted,
                "n-gram lookup": ngram_drafter({"enabled": True, "max_ngram": 3, "min_ngram": 2})}
    logs = []
    m = ev.run_evaluation(model, tok, records, drafters, k=4, max_new_tokens=12, e2e_prompts=0,
                          references_path=tmp_path / "refs.jsonl", log=logs.append)
    once = len(calls)
    prompts, refs = ev.conversation_references(model, tok, conversation_items(records), 12, tmp_path / "refs.jsonl")
    simulate(counted, prompts, refs, k=4, grow=True)
    assert once and len(calls) == 2 * once  # the evaluation drafted for one row only
    peer, base = m["baselines"]["peer: base"], m["baselines"]["pruned base (untrained)"]
    assert peer == base and peer is not base and m["mal_ci"]["peer: base"] == m["mal_ci"]["pruned base (untrained)"]
    assert m["paired_vs_primary"]["peer: base"] == m["paired_vs_primary"]["pruned base (untrained)"]
    assert any(line.startswith("pruned base (untrained)") and "(the drafter of 'peer: base')" in line
               for line in logs)
