"""Soft labels: the teacher stage's top-K parts (equal to the teacher's full logits, resumable, mergeable,
verified) and the top-K losses (zero at the teacher, gradients)."""
import json
from pathlib import Path

import pytest
import torch
from test_teacher import records, tiny_model, tiny_tokenizer

from drafter_lib.teacher import soft_labels
from drafter_lib.teacher import targets as teacher
from drafter_lib.train.loss import topk_divergence

K = 6
V_LM = 50  # the tiny model's vocabulary in the LossModule test


def rows_by_id(path):
    return {r["id"]: r for r in teacher.read_rows(path)}


def hf_logprobs(model, seq):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("prompt", [False, True])
def test_teacher_soft_labels_equal_transformers_topk(tmp_path, backend, prompt):
    model, tok = tiny_model(), tiny_tokenizer()
    out = tmp_path / "targets.jsonl"
    teacher.generate_targets(records(9), model, tok, out, max_new_tokens=10, batch_size=4, backend=backend,
                             soft_topk=K, soft_prompt=prompt, progress=False)
    rows = rows_by_id(out)
    soft = soft_labels.load_soft_labels(soft_labels.soft_dir_for(out))
    assert set(soft) == set(rows) and soft_labels.soft_dir_for(out) == tmp_path / "targets.soft"
    for rid, row in rows.items():
        p, c = row["prompt_ids"], row["continuation_ids"]
        s = soft[rid]
        start = 0 if prompt else len(p) - 1
        assert s.start == start and s.ids.shape == (len(p) + len(c) - 1 - start, K)
        assert s.ids.dtype == torch.int32 and s.logprobs.dtype == torch.float16
        ref = hf_logprobs(model, p + c)[start:len(p) + len(c) - 1]  # recomputed by transformers, teacher-forced
        torch.testing.assert_close(s.logprobs.float(), ref.topk(K, -1).values, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(ref.gather(1, s.ids.long()), s.logprobs.float(), atol=2e-3, rtol=2e-3)
        assert s.ids[len(p) - 1 - start:, 0].tolist() == c  # the greedy token is the stored top-1
    meta = json.loads(teacher.meta_path(out).read_text())
    assert meta["generation"]["soft_topk"] == K and meta["generation"]["soft_prompt"] is prompt
    rec = meta["output"]["soft"]
    assert rec["dir"] == "targets.soft" and rec["k"] == K and rec["rows"] == 9
    assert rec["entries"] == sum(len(s) for s in soft.values())


def test_default_meta_has_no_soft_fields(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    out = tmp_path / "t.jsonl"
    teacher.generate_targets(records(3), model, tok, out, max_new_tokens=4, backend="native", progress=False)
    meta = json.loads(teacher.meta_path(out).read_text())
    assert "soft_topk" not in meta["generation"] and "soft" not in meta["output"]
    assert not soft_labels.soft_dir_for(out).exists()


def test_soft_resume_after_kill_mid_flush(tmp_path, monkeypatch):
    """Killed between writing a part and appending its rows (plus a half-written line): the resumed run holds
    every row exactly once, in the targets file and in the parts, equal to an uninterrupted run."""
    model, tok = tiny_model(), tiny_tokenizer()
    recs = records(17)
    kw = dict(max_new_tokens=8, batch_size=4, flush_rows=3, backend="native", soft_topk=K, soft_prompt=True,
              progress=False)
    ref = tmp_path / "ref" / "targets.jsonl"
    teacher.generate_targets(recs, model, tok, ref, **kw)

    out = tmp_path / "run" / "targets.jsonl"
    real_write, calls = soft_labels.SoftWriter.write, []

    def write_then_die(self, rows):
        path = real_write(self, rows)
        calls.append(path)
        if len(calls) == 3:  # the part is on disk, its rows never reach targets.jsonl
            raise KeyboardInterrupt("killed mid-flush")
        return path

    monkeypatch.setattr(soft_labels.SoftWriter, "write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        teacher.generate_targets(recs, model, tok, out, **kw)
    monkeypatch.undo()
    with open(out, "a") as f:
        f.write('{"id": "p0')  # and a line cut off mid-write
    sdir = soft_labels.soft_dir_for(out)
    assert len(teacher.read_rows(out)) == 6 and len(soft_labels.stored_row_ids(sdir)) == 9  # 3 orphans

    stats = teacher.generate_targets(recs, model, tok, out, **kw)
    assert stats["already_done"] == 6 and stats["written"] == 11
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 17
    part_ids = [i for p in soft_labels.list_parts(sdir) for i in soft_labels.part_row_ids(p)]
    assert len(part_ids) == len(set(part_ids)) == 17 and set(part_ids) == set(ids)
    assert rows_by_id(out) == rows_by_id(ref)
    a, b = soft_labels.load_soft_labels(sdir), soft_labels.load_soft_labels(soft_labels.soft_dir_for(ref))
    for rid in ids:
        assert a[rid].start == b[rid].start and torch.equal(a[rid].ids, b[rid].ids), rid
        torch.testing.assert_close(a[rid].logprobs, b[rid].logprobs, atol=2e-3, rtol=0)
    meta = json.loads(teacher.meta_path(out).read_text())
    assert meta["output"]["soft"]["rows"] == 17
    with pytest.raises(ValueError, match="generation"):  # a different K is a different run
        teacher.generate_targets(recs, model, tok, out, **{**kw, "soft_topk": K + 1})


def test_merge_shards_with_soft_labels(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    recs = records(12)
    kw = dict(max_new_tokens=6, batch_size=4, backend="native", soft_topk=K, progress=False)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"s{i}.jsonl")
        teacher.generate_targets(recs, model, tok, paths[-1], shard_index=i, num_shards=3, **kw)
    merged = tmp_path / "targets.jsonl"
    assert teacher.merge_shards(paths, merged) == 12
    soft = soft_labels.load_soft_labels(soft_labels.soft_dir_for(merged))
    assert set(soft) == set(rows_by_id(merged))
    meta = json.loads(teacher.meta_path(merged).read_text())
    assert meta["output"]["soft"]["rows"] == 12


def test_verify_checks_soft_parts(tmp_path):
    from drafter_lib.study.verify import verify_run

    model, tok = tiny_model(), tiny_tokenizer()
    run = tmp_path / "run"
    (run / "teacher").mkdir(parents=True)
    (run / "architecture.json").write_text("{}")
    out = run / "teacher" / "targets.jsonl"
    teacher.generate_targets(records(8), model, tok, out, max_new_tokens=5, batch_size=4, flush_rows=3,
                             backend="native", soft_topk=K, progress=False)
    rep = verify_run(run, teacher_weights=False)
    keys = [c.key for c in rep.checks]
    assert rep.ok, rep.lines()
    assert sum(k.startswith("output.soft.parts[") for k in keys) == 3 and "output.soft.rows" in keys
    part = soft_labels.list_parts(soft_labels.soft_dir_for(out))[1]
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    bad = verify_run(run, teacher_weights=False)
    assert [c.key for c in bad.mismatches] == [f"output.soft.parts[{part.name}].sha256"]
    part.unlink()
    gone = verify_run(run, teacher_weights=False)
    assert {c.key for c in gone.mismatches} == {f"output.soft.parts[{part.name}].sha256", "output.soft.rows"}


# ---------------------------------------------------------------- losses

def teacher_topk(V=40, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 2, -1)
    lp, ids = full.topk(K, -1)
    return full, ids, lp


def student_matching(ids, lp, V):
    """Logits whose softmax gives each top-K id the teacher's probability and spreads the tail mass evenly."""
    p_tail = 1 - lp.exp().sum(-1, keepdim=True)
    logits = (p_tail / (V - K)).log().expand(-1, V).clone()
    return logits.scatter(1, ids, lp)


@pytest.mark.parametrize("kind", ["kl_topk", "tv"])
def test_topk_loss_zero_at_teacher_positive_elsewhere(kind):
    V = 40
    full, ids, lp = teacher_topk(V)
    zero = topk_divergence(student_matching(ids, lp, V), ids, lp, kind)
    assert zero.abs().max() < 1e-9
    # the full teacher distribution differs inside the tail only: still zero
    assert topk_divergence(full, ids, lp, kind).abs().max() < 1e-9
    # any other distribution of the top-K mass is penalised
    other = student_matching(ids, lp, V)
    other[torch.arange(5), ids[:, 1]] += 0.5  # each row's second most likely id
    assert (topk_divergence(other, ids, lp, kind) > 1e-4).all()
    assert (topk_divergence(torch.zeros(5, V, dtype=torch.float64), ids, lp, kind) > 1e-3).all()
    # fp16-stored teacher log-probs (as on disk) and float32 student: still ~0 at the teacher
    lp16 = lp.half().double()
    near = topk_divergence(student_matching(ids, lp16, V).float(), ids, lp16.half(), kind)
    assert near.abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["kl_topk", "tv"])
def test_topk_loss_gradcheck(kind):
    V = 12
    _, ids, lp = teacher_topk(V, N=3, seed=1)
    x = torch.randn(3, V, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: topk_divergence(z, ids, lp, kind), (x,), eps=1e-6, atol=1e-5)
    # KL's gradient is q - p on the K+1 buckets: check it against the closed form
    if kind == "kl_topk":
        y = x.detach().clone().requires_grad_(True)
        topk_divergence(y, ids, lp, kind).sum().backward()
        q = torch.softmax(y.detach(), -1)
        p_tail = 1 - lp.exp().sum(-1, keepdim=True)
        q_tail = 1 - q.gather(1, ids).sum(-1, keepdim=True)
        want = q - q * (p_tail / q_tail)                       # tail ids: q_i - p_tail * q_i / q_tail
        want.scatter_(1, ids, q.gather(1, ids) - lp.exp())     # top-K ids: q_k - p_k
        torch.testing.assert_close(y.grad, want)


def test_a_part_is_byte_identical_across_processes(tmp_path):
    """safetensors writes its header map in no fixed order: a part's bytes (whose sha256 the teacher meta records)
    must not depend on the process that wrote it."""
    import subprocess
    import sys

    code = ("import sys, torch; from drafter_lib.teacher.soft_labels import SoftRow, write_part, read_part; "
            "rows = [SoftRow(f'r{i}', i, torch.arange(8, dtype=torch.int32).view(2, 4) + i, "
            "torch.full((2, 4), -1.5 - i, dtype=torch.float16)) for i in range(3)]; "
            "write_part(sys.argv[1], rows, 4); assert [r.id for r in read_part(sys.argv[1])] == ['r0', 'r1', 'r2']")
    outs = []
    for n in range(4):
        out = tmp_path / f"p{n}.safetensors"
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, cwd=Path(__file__).resolve().parents[1])
        outs.append(out.read_bytes())
    assert all(o == outs[0] for o in outs[1:])


@pytest.mark.parametrize("kind", ["kl_topk", "tv"])
def test_topk_loss_when_the_students_tail_underflows(kind):
    """A student that puts (numerically) all its mass on the teacher's top-K: the tail's log-mass is recomputed
    exactly instead of log(0), so the loss and its gradient stay finite and equal the float64 values."""
    V = 40
    _, ids, lp = teacher_topk(V)
    x = torch.full((5, V), -300.0, dtype=torch.float64)
    x.scatter_(1, ids, 0.0)
    want = topk_divergence(x, ids, lp, kind)
    y = x.float().requires_grad_(True)
    got = topk_divergence(y, ids, lp.float(), kind)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert torch.isfinite(y.grad).all()


@pytest.mark.parametrize("loss", ["kl_topk", "tv", "ce"])
def test_loss_module_equals_the_losses_written_out(loss):
    """The training objective over continuation and soft-labelled prompt positions, and the continuation CE it
    reports, against the same sums computed position by position from the model's full logits."""
    from test_model import tiny_hf

    from drafter_lib.train.examples import IGNORE
    from drafter_lib.train.loss import LossModule

    lm = tiny_hf("llama", vocab_size=V_LM)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V_LM, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    targets = torch.full_like(ids, IGNORE)
    targets[:, 5:8] = torch.randint(0, V_LM, (2, 3), generator=g)        # continuation positions
    soft_mask = torch.zeros_like(ids, dtype=torch.bool)
    soft_mask[:, 1:8] = True                                              # prompt positions 1-4 + continuation
    soft_lp, soft_ids = torch.log_softmax(torch.randn(2, 9, V_LM, generator=g) * 2, -1).topk(K, -1)
    soft_ids[0, 2, 0] = -1                                                # a top-1 outside the draft vocab
    obj, ce = LossModule(lm)(ids, mask, targets, soft_ids=soft_ids, soft_logprobs=soft_lp, soft_mask=soft_mask,
                             loss=loss, loss_on_prompt=True, prompt_weight=0.5)
    with torch.no_grad():
        logits = lm(ids, attention_mask=mask).logits
    want_obj, want_ce = 0.0, 0.0
    for b in range(2):
        for t in range(9):
            cont = bool(targets[b, t] != IGNORE)
            if cont:
                want_ce += torch.nn.functional.cross_entropy(logits[b, t][None], targets[b, t][None])
            if not (cont or soft_mask[b, t]):
                continue
            if loss == "ce":
                hard = targets[b, t] if cont else soft_ids[b, t, 0]
                per = torch.nn.functional.cross_entropy(logits[b, t][None], hard[None]) if hard >= 0 else 0.0
            else:
                per = topk_divergence(logits[b, t][None].double(), soft_ids[b, t][None], soft_lp[b, t][None].double(),
                                      loss)[0]
            want_obj += per * (1.0 if cont else 0.5)
    torch.testing.assert_close(ce.double(), torch.as_tensor(want_ce).double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(obj.detach().double(), torch.as_tensor(want_obj).double(), rtol=1e-5, atol=1e-5)

