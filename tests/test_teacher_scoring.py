"""The teacher's scoring mode and drafter-written rows: scoring the teacher's own greedy rows gives back those rows
(argmax) and the generating mode's soft labels; resume after a kill equals an uninterrupted run byte for byte; bad
input and changed settings are refused; the drafter's rows are the engine's greedy tokens; scored rows train."""
import json

import pytest
import torch
from server_helpers import write_tiny_model_dir
from test_teacher import records, tiny_model, tiny_tokenizer

from drafter_lib.common.chat import cut_at_stop
from drafter_lib.common.files import read_rows, sha256_file
from drafter_lib.common.layout import repo_relative
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.model.transformer import Transformer
from drafter_lib.teacher import soft_labels
from drafter_lib.teacher import targets as teacher
from drafter_lib.teacher.drafter_rows import draft_continuations
from drafter_lib.teacher.scoring import score_targets

K = 6
STOP = [2]


def by_id(path):
    return {r["id"]: r for r in read_rows(path)}


def meta(path):
    return json.loads(teacher.meta_path(path).read_text())


def drafter_hf(seed=2):
    """Another tiny model of the teacher's vocabulary, the drafter: std-0.3 weights, so that its greedy tokens vary
    with the prompt and some rows stop early (at HF's init scale it repeats one token)."""
    m = tiny_model(seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def drafter_model():
    """The drafter as the hand-written decoder."""
    return Transformer.from_hf_model(drafter_hf())


@pytest.mark.parametrize("backend,prompt", [("native", False), ("native", True), ("hf", False), ("runtime", True)])
def test_scoring_the_teachers_own_rows_gives_its_tokens_and_soft_labels(tmp_path, backend, prompt):
    """(The runtime scores its own rows: row-exact, its labels equal the generating ones bit for bit.)"""
    model, tok = tiny_model(), tiny_tokenizer()
    gen = tmp_path / "gen" / "targets.jsonl"
    teacher.generate_targets(records(11), model, tok, gen, max_new_tokens=10, batch_size=4,
                             backend="runtime" if backend == "runtime" else "native", soft_topk=K, soft_prompt=prompt,
                             progress=False)
    out = tmp_path / "scored" / "targets.jsonl"
    stats = score_targets(gen, model, tok, out, soft_topk=K, soft_prompt=prompt, hard_labels=True, batch_size=4,
                          backend=backend, progress=False)
    rows, scored = by_id(gen), by_id(out)
    assert stats["written"] == 11 and stats["scored_tokens"] == sum(len(r["continuation_ids"]) for r in rows.values())
    a = soft_labels.load_soft_labels(soft_labels.soft_dir_for(gen))
    b = soft_labels.load_soft_labels(soft_labels.soft_dir_for(out))
    for rid, row in rows.items():
        s = scored[rid]
        assert {k: s[k] for k in row} == row  # the rows themselves pass through
        assert s["target_argmax_ids"] == row["continuation_ids"], rid  # the teacher's own greedy tokens
        assert b[rid].start == a[rid].start and torch.equal(b[rid].ids, a[rid].ids), rid
        torch.testing.assert_close(b[rid].logprobs, a[rid].logprobs, atol=2e-3, rtol=0)
        assert backend != "runtime" or torch.equal(b[rid].logprobs, a[rid].logprobs), rid
    m = meta(out)
    assert m["generation"]["mode"] == "score" and m["generation"]["soft_topk"] == K
    assert m["generation"]["source"] == {"file": repo_relative(gen), "rows": 11, "sha256": sha256_file(gen)}
    assert m["teacher"] == meta(gen)["teacher"]
    assert m["output"]["rows"] == 11 and m["output"]["soft"]["rows"] == 11


def test_score_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """Killed between a flush's soft part and its rows, with a half-written line: the resumed file and parts are
    byte for byte those of an uninterrupted run, and its meta records the same output."""
    model, tok = tiny_model(), tiny_tokenizer()
    src = tmp_path / "rows.jsonl"
    draft_continuations(records(17), drafter_model(), tok, src, max_new_tokens=9, batch_size=5, progress=False)
    kw = dict(soft_topk=K, hard_labels=True, batch_size=4, backend="native", progress=False)
    ref = tmp_path / "ref" / "scored.jsonl"
    score_targets(src, model, tok, ref, **kw)

    out = tmp_path / "run" / "scored.jsonl"
    real_write, calls = soft_labels.SoftWriter.write, []

    def write_then_die(self, rows):
        path = real_write(self, rows)
        calls.append(path)
        if len(calls) == 3:  # the part is on disk, its rows never reach the file
            raise KeyboardInterrupt("killed mid-flush")
        return path

    monkeypatch.setattr(soft_labels.SoftWriter, "write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        score_targets(src, model, tok, out, **kw)
    monkeypatch.undo()
    with open(out, "a") as f:
        f.write('{"id": "p0')
    assert "output" not in meta(out) and len(read_rows(out)) == 8
    stats = score_targets(src, model, tok, out, **kw)
    assert stats["already_done"] == 8 and stats["written"] == 9
    assert out.read_bytes() == ref.read_bytes()
    parts = lambda p: {q.name: q.read_bytes() for q in soft_labels.list_parts(soft_labels.soft_dir_for(p))}
    assert parts(out) == parts(ref) and len(parts(ref)) == 5
    assert meta(out)["output"] == meta(ref)["output"]
    assert score_targets(src, model, tok, out, **kw)["written"] == 0  # finished: a no-op


def test_score_refuses_changed_settings_and_bad_input(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    src = tmp_path / "rows.jsonl"
    draft_continuations(records(6), drafter_model(), tok, src, max_new_tokens=5, progress=False)
    out = tmp_path / "scored.jsonl"
    score_targets(src, model, tok, out, soft_topk=K, progress=False)
    with pytest.raises(ValueError, match="different generation"):  # another K
        score_targets(src, model, tok, out, soft_topk=K + 1, progress=False)
    with pytest.raises(ValueError, match="different generation"):  # hard labels asked for now
        score_targets(src, model, tok, out, soft_topk=K, hard_labels=True, progress=False)
    with pytest.raises(ValueError, match="different teacher"):
        score_targets(src, tiny_model(seed=5), tok, out, soft_topk=K, progress=False)
    rows = read_rows(src)
    rows[0]["continuation_ids"] = rows[0]["continuation_ids"][:1]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="different generation"):  # the source changed under the scored file
        score_targets(src, model, tok, out, soft_topk=K, progress=False)

    def bad(rows, match, exc=ValueError):
        p = tmp_path / "bad.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(exc, match=match):
            score_targets(p, model, tok, tmp_path / "never.jsonl", soft_topk=K, progress=False)
        assert not (tmp_path / "never.jsonl").exists()  # nothing written for bad input

    good = {"id": "a", "prompt_ids": [1, 5, 6], "continuation_ids": [7, 2]}
    bad([{**good, "continuation_ids": []}], "no continuation_ids")
    bad([{k: v for k, v in good.items() if k != "continuation_ids"}], "no continuation_ids")
    bad([{**good, "continuation_ids": [7, 64]}], r"continuation_ids\[1\] = 64 is outside the vocabulary")
    bad([{**good, "prompt_ids": [-1]}], "outside the vocabulary")
    bad([good, good], "appears twice")
    bad([], "holds no rows")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        score_targets(tmp_path / "missing.jsonl", model, tok, out, soft_topk=K, progress=False)
    with pytest.raises(ValueError, match="got neither"):
        score_targets(src, model, tok, tmp_path / "x.jsonl", soft_topk=0, progress=False)
    with pytest.raises(ValueError, match="not vllm"):
        score_targets(src, model, tok, tmp_path / "x.jsonl", backend="vllm", progress=False)


@pytest.mark.parametrize("kind", ["transformer", "packed"])
def test_drafter_rows_are_the_engines_greedy_tokens(tmp_path, kind):
    tok = tiny_tokenizer()
    recs = records(9)
    hf = drafter_hf()
    if kind == "packed":
        drafter = write_tiny_model_dir(tmp_path / "model", hf, bits=8)
        engine = DraftEngine.from_dir(drafter, dtype="float32", copy_policy={"enabled": False})
    else:
        drafter = Transformer.from_hf_model(hf)
        engine = DraftEngine(Transformer.from_hf_model(hf), dtype="float32")
    out = tmp_path / "drafted.jsonl"
    stats = draft_continuations(recs, drafter, tok, out, max_new_tokens=12, batch_size=4, dtype="float32",
                                progress=False)
    rows = by_id(out)
    assert stats["written"] == 9 and set(rows) == {r["id"] for r in recs}
    lengths = set()
    for r in recs:
        row = rows[r["id"]]
        assert set(row) == {"id", "category", "source", "prompt_ids", "continuation_ids"}
        assert row["prompt_ids"] == teacher.encode_chat(tok, r["messages"]) and row["category"] == r["category"]
        want = cut_at_stop(engine.draft(row["prompt_ids"], 12), STOP, 12)
        assert row["continuation_ids"] == want, r["id"]
        lengths.add(len(want))
    assert len(lengths) > 1  # some rows stopped early, some ran to the cap
    m = meta(out)
    assert m["generation"]["mode"] == "draft" and m["generation"]["max_new_tokens"] == 12
    assert m["drafter"]["dtype"] == "float32" and m["output"]["rows"] == 9
    assert ("manifest_sha256" if kind == "packed" else "weights_sha256") in m["drafter"]
    again = draft_continuations(recs, drafter, tok, out, max_new_tokens=12, batch_size=4, dtype="float32",
                                progress=False)
    assert again["written"] == 0 and again["already_done"] == 9
    with pytest.raises(ValueError, match="different generation"):
        draft_continuations(recs, drafter, tok, out, max_new_tokens=13, dtype="float32", progress=False)


def test_cli_drafter_writes_target_scores(tmp_path, capsys):
    """`specdraft-teacher --drafter` then `--score`: two calls; bad input stops with one line naming it."""
    tok = tiny_tokenizer()
    tdir, ddir = tmp_path / "teacher", tmp_path / "checkpoint"
    tiny_model().save_pretrained(tdir)
    tok.save_pretrained(tdir)
    drafter_hf().save_pretrained(ddir)  # a training checkpoint: a Hugging Face folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records(5)))
    drafted, scored = tmp_path / "drafted.jsonl", tmp_path / "scored.jsonl"
    teacher.main(["--drafter", str(ddir), "--prompts", str(prompts), "--out", str(drafted), "--teacher", str(tdir),
                  "--max-new-tokens", "6", "--batch-size", "2"])
    teacher.main(["--score", str(drafted), "--out", str(scored), "--teacher", str(tdir), "--soft-topk", "4",
                  "--hard-labels"])
    rows = read_rows(scored)
    assert len(rows) == 5 and all(len(r["target_argmax_ids"]) == len(r["continuation_ids"]) for r in rows)
    assert by_id(drafted).keys() == by_id(scored).keys()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["written"] == 5
    with pytest.raises(SystemExit, match="does not exist"):
        teacher.main(["--score", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--teacher",
                      str(tdir), "--soft-topk", "4"])
    with pytest.raises(SystemExit):
        teacher.main(["--score", str(drafted), "--drafter", str(ddir), "--out", str(tmp_path / "o.jsonl")])


def test_scored_rows_train(tmp_path):
    """Drafter writes, target scores, the drafter trains on it: the hard targets are the target's argmax (not the
    drafter's tokens), the soft labels its distributions there, and a few steps of each loss run."""
    from test_train import QUANT

    from drafter_lib.train import examples as train_data
    from drafter_lib.train import trainer as train
    from drafter_lib.train.examples import IGNORE

    model, tok = tiny_model(), tiny_tokenizer()
    base = tmp_path / "base"
    drafter_hf().save_pretrained(base)
    tok.save_pretrained(base)
    drafted, scored = tmp_path / "drafted.jsonl", tmp_path / "scored.jsonl"
    draft_continuations(records(24), drafter_model(), tok, drafted,
                        max_new_tokens=10, progress=False)
    score_targets(drafted, model, tok, scored, soft_topk=4, hard_labels=True, progress=False)

    exs = train_data.load_examples(scored, 64, soft_labels.soft_dir_for(scored))
    rows = by_id(scored)
    assert all(e.labels == rows[e.id]["target_argmax_ids"] for e in exs)
    assert any(e.labels != e.ids[e.prompt_len:] for e in exs)  # the target disagrees with the drafter somewhere
    b = train_data.collate(exs[:4])
    for i, e in enumerate(exs[:4]):
        cont = b["targets"][i] != IGNORE
        assert b["targets"][i][cont].tolist() == e.labels
        assert torch.equal(b["soft_ids"][i][cont][:, 0], b["targets"][i][cont])  # the target's top-1 is its argmax
    cut = train_data.load_examples(scored, len(exs[0].ids) - 2, soft_labels.soft_dir_for(scored))[0]
    assert cut.labels == exs[0].labels[:len(cut.ids) - cut.prompt_len]  # truncated with the row

    for loss in ("ce", "kl_topk"):
        cfg = train.TrainConfig(train_path=str(scored), out_dir=str(tmp_path / loss), base_model=str(base),
                                keep_layers=None, val_fraction=0.2, max_seq_len=64, batch_size=4, steps=3,
                                qat_steps=0, lr=3e-3, warmup_steps=1, eval_every=100, ckpt_every=100, log_every=1,
                                quant=QUANT, progress=False, seed=1, loss=loss)
        res = train.run_training(cfg)
        tr = [r for r in res["history"] if r["kind"] == "train"]
        assert len(tr) == 3 and all(r["loss"] > 0 and torch.isfinite(torch.tensor(r["loss"])) for r in tr), loss


def test_ce_on_rows_scored_without_hard_labels_is_refused(tmp_path):
    """Scored without --hard-labels, a row's continuation is the drafter's own: loss 'ce' would teach those tokens."""
    from test_train import QUANT

    from drafter_lib.train import trainer as train
    from drafter_lib.train.examples import scored_without_hard_labels

    model, tok = tiny_model(), tiny_tokenizer()
    drafted, soft_only, hard = tmp_path / "drafted.jsonl", tmp_path / "soft.jsonl", tmp_path / "hard.jsonl"
    draft_continuations(records(6), drafter_model(), tok, drafted, max_new_tokens=6, progress=False)
    score_targets(drafted, model, tok, soft_only, soft_topk=4, progress=False)
    score_targets(drafted, model, tok, hard, soft_topk=4, hard_labels=True, progress=False)
    assert scored_without_hard_labels(soft_only) and not scored_without_hard_labels(hard)
    assert not scored_without_hard_labels(drafted)  # rows a model wrote itself
    cfg = train.TrainConfig(train_path=str(soft_only), out_dir=str(tmp_path / "out"), base_model=str(tmp_path),
                            keep_layers=None, max_seq_len=64, batch_size=4, steps=1, qat_steps=0, quant=QUANT,
                            progress=False, loss="ce")
    with pytest.raises(ValueError, match="without --hard-labels"):
        train.run_training(cfg)


def test_the_study_teacher_stage_scores_a_writers_rows(tmp_path):
    """teacher.writer: stage 02 has the writer draft the training prompts and the teacher score them. With the
    teacher itself as the writer its greedy token at every position is the written one."""
    from drafter_lib.common.overrides import ConfigError
    from drafter_lib.study import config as C
    from drafter_lib.study import stages

    cfg, run = stages.open_run(str(tmp_path / "run"), "smoke", {"data.total_prompts": 12})
    stages.build_prompts(cfg, run)
    writer = run.tiny_model_dir("llama")  # the smoke teacher's own checkpoint folder
    cfg, run = stages.open_run(str(tmp_path / "run"), "smoke", {"teacher.writer": str(writer)})
    stats, tok = stages.generate_targets(cfg, run)
    assert stats["mode"] == "score" and stats["draft"]["written"] == stats["score"]["written"] > 0
    drafted, scored = by_id(run.drafted), by_id(run.targets)
    assert drafted.keys() == scored.keys()
    for rid, row in scored.items():
        assert row["continuation_ids"] == drafted[rid]["continuation_ids"]
        assert row["target_argmax_ids"] == row["continuation_ids"]
    assert meta(run.targets)["generation"]["mode"] == "score"
    assert set(soft_labels.stored_row_ids(soft_labels.soft_dir_for(run.targets))) == set(scored)
    assert json.loads(run.teacher_stats.read_text())["new_tokens"] == sum(
        len(r["continuation_ids"]) for r in scored.values())

    from drafter_lib.study import disk_estimate as de
    assert de.estimate(cfg, len(tok)).total >= de.written_bytes(run.targets) > run.targets.stat().st_size

    with pytest.raises(ConfigError, match="teacher.writer: .* is neither a packed model dir"):
        C.build_config("smoke", {"teacher.writer": str(tmp_path / "nowhere")})
