"""specdraft-compare-evals: evaluations of several packs compared paired on the prompts they share."""
import json

import pytest

from drafter_lib.common.files import write_json
from drafter_lib.evaluation import bootstrap
from drafter_lib.evaluation.compare import (
    compare_evals,
    curve_points,
    load_eval,
    main,
    markdown,
    teacher_seconds,
    teacher_tokens,
)


def _metrics(ids, groups, rows, origins=None):
    """rows: name -> per-prompt [steps, accepted] in ids' order."""
    return {"item_ids": ids, "item_groups": groups, "item_origins": origins or [None] * len(ids), "trees": {},
            "baselines": {name: {"per_prompt": per, "mean_acceptance_length": 0.0} for name, per in rows.items()}}


IDS = ["a", "b", "c", "d", "e", "f"]
GROUPS = ["writing", "writing", "rag", "rag", "rag", "math"]
BASE = [[10, 5], [8, 2], [12, 12], [9, 3], [7, 7], [10, 1]]
BETTER = [[9, 9], [7, 5], [10, 14], [8, 6], [6, 9], [10, 2]]


def test_paired_on_shared_prompts_in_the_reference_order():
    ref = _metrics(IDS, GROUPS, {"packed": BASE, "other": BASE})
    # the second evaluation scored one extra prompt and lists its prompts in another order
    order = [5, 3, 1, 0, 2, 4]
    other = _metrics([IDS[i] for i in order] + ["z"], [GROUPS[i] for i in order] + ["math"],
                     {"packed": [BETTER[i] for i in order] + [[1, 100]]})
    rep = compare_evals({"base": ref, "new": other})
    assert rep["prompts"] == 6 and list(rep["rows"]) == ["packed"]  # "other" is not in both: not a default row
    assert rep["groups"] == {"writing": 2, "rag": 3, "math": 1}
    e = rep["rows"]["packed"]["new"]
    assert e["all"] == bootstrap.mal_interval(BETTER)
    assert e["vs_reference"] == bootstrap.paired_difference(BETTER, BASE)
    assert e["vs_reference"]["difference"] > 0
    assert e["groups"]["rag"] == bootstrap.mal_interval(BETTER[2:5])
    assert e["vs_reference_groups"]["writing"] == bootstrap.paired_difference(BETTER[:2], BASE[:2])
    assert "vs_reference" not in rep["rows"]["packed"]["base"]
    assert rep["origins"] == {"unknown": 6}
    assert "unknown" not in markdown(rep)  # prompts without an origin get no origin column


def test_errors_name_what_is_wrong(tmp_path):
    ref = _metrics(IDS, GROUPS, {"packed": BASE})
    with pytest.raises(ValueError, match="share no prompt"):
        compare_evals({"a": ref, "b": _metrics(["x"], ["rag"], {"packed": [[1, 1]]})})
    with pytest.raises(ValueError, match=r"rows \['packed \+ copy prior'\] are not in every evaluation"):
        compare_evals({"a": ref, "b": ref}, rows=["packed + copy prior"])
    old = dict(ref)
    del old["item_groups"]
    write_json(tmp_path / "old.json", old)
    with pytest.raises(ValueError, match="older specdraft-eval"):
        load_eval(tmp_path / "old.json")
    with pytest.raises(FileNotFoundError, match="no evaluation metrics"):
        load_eval(tmp_path / "missing.json")


def test_teacher_tokens_from_answers_or_a_single_runs_stats(tmp_path):
    run = tmp_path / "run"
    (run / "teacher").mkdir(parents=True)
    rows = [{"id": "x", "prompt_ids": [1, 2, 3], "continuation_ids": [4, 5]},
            {"id": "y", "prompt_ids": [1], "continuation_ids": [6, 7, 8]}]
    (run / "teacher" / "targets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert teacher_tokens(run) == 5
    pub = tmp_path / "published"
    (pub / "teacher").mkdir(parents=True)
    write_json(pub / "teacher" / "stats.json", {"written": 2, "already_done": 0, "new_tokens": 695})
    assert teacher_tokens(pub) == 695
    write_json(pub / "teacher" / "stats.json", {"written": 1, "already_done": 1, "new_tokens": 300})
    with pytest.raises(FileNotFoundError, match="single teacher run"):
        teacher_tokens(pub)  # a resumed run's stats count only its last part
    assert teacher_seconds(pub) is None and teacher_seconds(run) is None
    write_json(pub / "teacher" / "stats.json", {"mode": "score", "draft": {"already_done": 0, "seconds": 5.0},
                                                "score": {"already_done": 3, "seconds": 7.0}, "seconds": 12.0})
    assert teacher_seconds(pub) is None  # the scoring was resumed: its seconds are a part of the time
    write_json(pub / "teacher" / "stats.json", {"written": 2, "already_done": 0, "new_tokens": 695, "seconds": 9.5})
    assert teacher_seconds(pub) == 9.5


def test_curve_points_group_labels_by_mixture():
    rep = compare_evals({"default @ small": _metrics(IDS, GROUPS, {"packed": BASE}),
                         "default @ full": _metrics(IDS, GROUPS, {"packed": BETTER}),
                         "+ Dolly @ small": _metrics(IDS, GROUPS, {"packed": BETTER})})
    pts = curve_points(rep, {"default @ full": 700, "default @ small": 100, "+ Dolly @ small": 120}, "packed")
    assert [p["tokens"] for p in pts["default"]] == [100, 700]
    assert pts["default"][1]["mal"] == pytest.approx(bootstrap.mal_interval(BETTER)["mal"])
    assert [p["label"] for p in pts["+ Dolly"]] == ["+ Dolly @ small"]


def test_cli_writes_tables_and_plots(tmp_path, capsys):
    origins = ["held-out sets"] * 6
    write_json(tmp_path / "a.json", _metrics(IDS, GROUPS, {"packed": BASE, "packed + copy prior": BETTER}, origins))
    write_json(tmp_path / "b.json", _metrics(IDS, GROUPS, {"packed": BETTER, "packed + copy prior": BETTER}, origins))
    for name, n in (("ra", 2), ("rb", 3)):
        (tmp_path / name / "teacher").mkdir(parents=True)
        (tmp_path / name / "teacher" / "targets.jsonl").write_text(
            json.dumps({"id": "x", "prompt_ids": [1], "continuation_ids": list(range(n))}) + "\n")
    write_json(tmp_path / "ra" / "teacher" / "stats.json", {"already_done": 0, "new_tokens": 2, "seconds": 3600.0})
    write_json(tmp_path / "rb" / "teacher" / "stats.json",  # a writer drafted, the teacher scored
               {"mode": "score", "draft": {"already_done": 0, "seconds": 600.0},
                "score": {"already_done": 0, "seconds": 1200.0}, "seconds": 1800.0, "new_tokens": 3})
    out = tmp_path / "out"
    main([f"base @ s={tmp_path / 'a.json'}", f"new @ s={tmp_path / 'b.json'}", "--out", str(out),
          "--teacher", f"base @ s={tmp_path / 'ra'}", "--teacher", f"new @ s={tmp_path / 'rb'}"])
    text = capsys.readouterr().out
    assert "**packed + copy prior**" in text and "held-out sets" in text and "teacher tokens: base @ s 2" in text
    rep = json.loads((out / "compare.json").read_text())
    assert rep["teacher_tokens"] == {"base @ s": 2, "new @ s": 3}
    assert rep["teacher_seconds"] == {"base @ s": 3600.0, "new @ s": 1800.0}
    assert "teacher seconds: base @ s 3,600" in text
    assert (out / "compare.md").read_text().strip() == text.split("\n\nteacher tokens")[0].strip()
    for png in ("data_curve.png", "data_curve_time.png", "per_group_packed.png", "per_group_packed___copy_prior.png"):
        assert (out / png).stat().st_size > 1000
    with pytest.raises(SystemExit):
        main([f"a={tmp_path / 'a.json'}", "--out", str(out), "--teacher", f"nope={tmp_path / 'ra'}"])
