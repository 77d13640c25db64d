"""The qwen-coder preset as configuration only (no model is loaded or installed): its keys, its mixture of the vendored
coding and chat corpora, the CLI accepting it, and the disk estimate for its 151,936-token models."""
import functools
import json
import shutil

import pytest

from drafter_lib.common import layout
from drafter_lib.data import corpora as D
from drafter_lib.study import config as C
from drafter_lib.study import config_checks
from drafter_lib.study import disk_estimate as de
from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS

# Qwen2.5-Coder's configs (hf_models.model_sizes' keys), written out so no GGUF has to be installed or read
SIZES = {
    "qwen2.5-coder-1.5b-instruct": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                                    "attention_width": 1536, "vocab_size": 151936, "model_type": "qwen2",
                                    "hidden_act": "silu"},
    "qwen2.5-coder-0.5b-instruct": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                    "attention_width": 896, "vocab_size": 151936, "model_type": "qwen2",
                                    "hidden_act": "silu"},
}
CODING = ("gpteacher_code_instruct", "octopack_oasst")


@pytest.fixture(scope="module")
def cfg():
    return C.build_config("qwen-coder", check_models=False)


def test_the_preset_builds_validates_and_round_trips(cfg):
    assert "qwen-coder" in C.PRESETS
    assert C.StudyConfig.from_dict(cfg.to_dict()) == cfg
    s, d, t, tr, e = cfg.study, cfg.data, cfg.teacher, cfg.train, cfg.eval
    assert (s.teacher, s.drafter_base, s.keep_layers) == (C.QWEN_CODER_TEACHER, C.QWEN_CODER_DRAFTER_BASE,
                                                          C.QWEN_CODER_KEEP_LAYERS)
    assert (s.teacher, s.drafter_base) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert s.device == "cpu"
    assert s.keep_layers is None  # the whole 0.5B, as the seed kept the whole Qwen3-1.7B
    assert tr.draft_vocab_size == C.QWEN_CODER_DRAFT_VOCAB == 32768  # of 151,936 ids: a head of its own
    # the CPU recipe for a drafter of ~0.5B parameters; the teacher is the runtime, in the numerics it serves with
    assert (tr.mixed_precision, tr.freeze_layers) == ("bf16", C.QWEN_CODER_FREEZE_LAYERS) and 0 < tr.freeze_layers < 24
    assert (t.backend, t.numerics) == ("runtime", "w8a8")
    # moderate lengths; training rows hold the longest prompt and answer, so nothing is cut
    assert (d.max_prompt_tokens, t.max_new_tokens, tr.max_seq_len) == (256, 128, 384)
    assert config_checks.waste_notes(cfg) == []
    assert d.total_prompts * t.max_new_tokens <= 160_000  # the runtime teacher's ~70 tokens/s: <= ~40 min
    assert tr.total_steps <= 240 and tr.loss == "kl_topk"
    assert d.humaneval is True and e.limit <= 32 and e.max_new_tokens <= 64 and e.e2e_prompts <= 2
    assert all((layout.REPO_ROOT / f).is_file() for f in e.heldout_files)
    # the named parameters change what they name and nothing else
    other = C.PRESETS["qwen-coder"](keep_layers="even:6", draft_vocab_size=8192)  # a pruned shape to compare
    assert (other.study.keep_layers, other.train.draft_vocab_size) == ("even:6", 8192)
    assert C.build_config("qwen-coder", {"study.keep_layers": "first:4"}, check_models=False).study.keep_layers \
        == "first:4"
    # the other presets keep their mixture: the coding corpora enter only where a mixture names them
    assert not set(CODING) & set(DEFAULT_SOURCE_WEIGHTS)
    for name in ("default", "long"):
        assert not set(CODING) & set(C.preset(name).data.source_weights)


def test_the_mixture_names_every_corpus_it_loads(cfg):
    weights = cfg.data.source_weights
    assert set(CODING) <= set(weights) and "dolly_15k" in weights and weights["gpteacher_code_instruct"] == max(
        weights.values())
    sources = D.default_sources(layout.resolve_shared_data(cfg.data.shared_data), synthetic_n=cfg.data.synthetic_n,
                                humaneval=cfg.data.humaneval, corpora=D.corpora_for(weights))
    trained = {s["name"] for s in sources if not s.get("heldout_only")}
    assert trained == set(weights)  # none enters unnamed (build_prompt_set gives an unnamed source weight 1)
    if D.humaneval_path() is not None:
        assert [s["name"] for s in sources if s.get("heldout_only")] == ["humaneval"]


def test_the_prompt_set_follows_the_weights(cfg, tmp_path):
    """01_data without the length filter (no tokenizer): every source gets its share of data.total_prompts."""
    d = cfg.data
    sources = D.default_sources(layout.resolve_shared_data(d.shared_data), synthetic_n=d.synthetic_n, humaneval=False,
                                corpora=D.corpora_for(d.source_weights))
    summary = D.build_prompt_set(tmp_path, sources=sources, weights=d.source_weights, total=d.total_prompts,
                                 heldout_frac=d.heldout_frac, seed=0)
    wsum = sum(d.source_weights.values())
    want = {n: round(d.total_prompts * w / wsum) for n, w in d.source_weights.items()}
    assert {n: s["train"] for n, s in summary["by_source"].items()} == want
    assert abs(summary["train"] - d.total_prompts) <= len(want)
    cats = summary["by_category"]["train"]
    assert cats["code_requests"] == want["gpteacher_code_instruct"] and cats["oasst"] == want["octopack_oasst"]
    assert {c["name"]: c["license"] for c in summary["corpora"] if c["name"] in CODING} == {
        "gpteacher_code_instruct": "MIT (repo LICENSE)",
        "octopack_oasst": "MIT (repo LICENSE); OpenAssistant data Apache-2.0"}


def test_disk_estimate_for_the_qwen_models(cfg):
    est = de.estimate(cfg, SIZES[cfg.study.teacher]["vocab_size"])
    assert (est.prompts, est.prompt_tokens, est.answer_tokens) == (1200, 256, 128)
    assert de.id_bytes(151936) == 8 and est.total < 100e6  # tens of MB: the answers are short
    base = SIZES[cfg.study.drafter_base]
    params = de.drafter_params(base, base["num_hidden_layers"], cfg.train.draft_vocab_size)
    assert 540e6 < params < 570e6  # 24 layers ~391M (k, v counted as wide as q: more), embedding 136M, head 29.4M
    assert de.drafter_params(base, 24, None) - params == (151936 - 32768) * 896  # what the reduced head saves
    # the disk check counts every layer where keep_layers is None (it once skipped the check)
    assert config_checks._train_bytes(cfg, dict(base))[1] == params


def test_the_cli_accepts_the_preset(monkeypatch, capsys):
    from drafter_lib.study import run as study

    with pytest.raises(SystemExit) as e:
        study.main(["--help"])
    assert e.value.code == 0 and "qwen-coder" in capsys.readouterr().out
    # --check without installing or reading the models: the checks that need them off, their sizes given
    monkeypatch.setattr(C, "build_config", functools.partial(C.build_config, check_models=False))
    monkeypatch.setattr(config_checks, "_offline_sizes", lambda spec: dict(SIZES[spec]))
    real = shutil.disk_usage
    monkeypatch.setattr(config_checks.shutil, "disk_usage", lambda p: real(p)._replace(free=10 ** 13))
    res = study.main(["--preset", "qwen-coder", "--check", "--name", "never-created-qwen-coder"])
    out = capsys.readouterr()
    printed = json.loads(out.out[:out.out.rindex("}") + 1])
    assert printed == res["config"].to_dict() and printed["study"]["teacher"] == "qwen2.5-coder-1.5b-instruct"
    assert "1200 prompts [data.total_prompts] x (256 prompt + 128 answer tokens)" in out.err
    assert "[study] disk: training keeps at most" in out.err and "M drafter parameters" in out.err
    assert not layout.RunLayout.named("never-created-qwen-coder").root.exists()


def test_the_eval_has_the_untouched_drafter_base_as_its_peer(cfg):
    """05_eval adds the row "peer: qwen2.5-coder-0.5b-instruct", paired with the pack, on the run's own references."""
    assert cfg.eval.peer == C.QWEN_CODER_DRAFTER_BASE == cfg.study.drafter_base
    assert C.build_config("qwen-coder", {"eval.peer": None}, check_models=False).eval.peer is None
    assert config_checks._model_specs(cfg) == [("study.teacher", C.QWEN_CODER_TEACHER),
                                               ("study.drafter_base", C.QWEN_CODER_DRAFTER_BASE)]  # installed once
