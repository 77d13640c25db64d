"""Prompt selection, references, the end-to-end check, reports and the CLI (drafter_lib.evaluate)."""
import json

import pytest

from drafter_lib import evaluate as ev
from drafter_lib.acceptance import simulate
from drafter_lib.speculative import FnDrafter, speculative_generate
from drafter_lib.teacher import stop_token_ids


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
    from drafter_lib.tiny_models import byte_tokenizer

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
