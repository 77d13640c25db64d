import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter_lib.common.files import sha256_file
from drafter_lib.packed.model_dir import ModelDirError, read_model_dir, write_model_dir
from drafter_lib.quantization import QuantConfig, QuantSpec, fake_quant

V, H, I = 96, 64, 128


def _config(tie=True):
    return {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": tie}


def _state_dict(tie=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(32, H),
                   p + "self_attn.v_proj.weight": r(32, H), p + "self_attn.o_proj.weight": r(H, H),
                   p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                   p + "mlp.down_proj.weight": r(H, I),
                   p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H)})
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if tie else r(V, H)
    return sd


QC = QuantConfig.default_for(group_size=32, scale_dtype="bfloat16")


@pytest.fixture
def packed_dir(tmp_path):
    out = tmp_path / "model"
    write_model_dir(out, _config(), _state_dict(), QC, copy_policy={"enabled": True, "ngram_max": 4},
                    extra_manifest={"source_checkpoint": "runs/x/ckpt-100", "training_run": "x"})
    return out


def test_round_trip_restores_fake_quant_bit_for_bit(packed_dir):
    sd = _state_dict()
    pm = read_model_dir(packed_dir)
    assert set(pm.state_dict) == set(sd)
    for name, w in sd.items():
        spec = QC.spec_for(name, w)
        want = w if spec is None else fake_quant(w, spec)
        got = pm.state_dict[name]
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    # tied: stored once, rebuilt as the same tensor
    stored = load_file(packed_dir / "weights.safetensors")
    assert not any(k.startswith("lm_head") for k in stored)
    assert pm.state_dict["lm_head.weight"] is pm.state_dict["model.embed_tokens.weight"]
    assert stored["model.layers.0.mlp.up_proj.weight.packed"].dtype == torch.uint8
    assert stored["model.layers.0.mlp.up_proj.weight.scale"].dtype == torch.bfloat16
    assert stored["model.embed_tokens.weight.packed"].dtype == torch.int8
    assert stored["model.norm.weight"].dtype == torch.float32
    # metadata
    assert pm.config == _config()
    assert pm.copy_policy == {"enabled": True, "ngram_max": 4}
    assert pm.manifest["source_checkpoint"] == "runs/x/ckpt-100" and pm.manifest["training_run"] == "x"
    assert pm.manifest["files"]["weights.safetensors"]["sha256"] == sha256_file(packed_dir / "weights.safetensors")
    assert pm.manifest_sha256 == sha256_file(packed_dir / "manifest.json")
    q = pm.quantization
    assert q["int4_packing"]["order"] == "low_nibble_first" and q["tied"] == {"lm_head.weight":
                                                                            "model.embed_tokens.weight"}
    assert q["tensors"]["model.layers.1.self_attn.o_proj.weight"]["quant"] == {"bits": 4, "group_size": 32,
                                                                               "scale_dtype": "bfloat16"}
    assert q["tensors"]["model.norm.weight"]["quant"] is None
    assert QuantConfig.from_dict(q["qconfig"]) == QC


def test_untied_lm_head_is_stored_and_packing_is_deterministic(tmp_path):
    sd = _state_dict(tie=False)
    a = write_model_dir(tmp_path / "a", _config(tie=False), sd, QC.to_dict())
    b = write_model_dir(tmp_path / "b", _config(tie=False), sd, QC)
    pm = read_model_dir(a)
    assert torch.equal(pm.state_dict["lm_head.weight"], fake_quant(sd["lm_head.weight"], QuantSpec(8, None,
                                                                                                   "bfloat16")))
    assert not torch.equal(pm.state_dict["lm_head.weight"], pm.state_dict["model.embed_tokens.weight"])
    for f in ("manifest.json", "weights.safetensors"):  # same input -> same bytes (reproducible packs)
        assert sha256_file(a / f) == sha256_file(b / f)
    assert pm.copy_policy == {"enabled": False}


def test_float_only_pack_keeps_weights_exact(tmp_path):
    sd = _state_dict()
    pm = read_model_dir(write_model_dir(tmp_path / "m", _config(), sd, None))
    assert all(torch.equal(pm.state_dict[k], v) for k, v in sd.items())


def test_writer_rejects_bad_input(tmp_path):
    sd = _state_dict()
    bad = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        write_model_dir(tmp_path / "m", _config(), bad, QC)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        write_model_dir(tmp_path / "m", _config(), sd,
                        QuantConfig(QuantSpec(4, 32), [("*.down_proj.weight", QuantSpec(4, 96))]))
    with pytest.raises(ValueError, match="reserved"):
        write_model_dir(tmp_path / "m", _config(), sd, QC, extra_manifest={"files": {}})


def _rewrite_weights(d, fn):
    t = load_file(d / "weights.safetensors")
    fn(t)
    save_file(t, d / "weights.safetensors")


def test_hash_mismatch(packed_dir):
    cfg = json.loads((packed_dir / "config.json").read_text())
    cfg["hidden_size"] = 65
    (packed_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="sha256 mismatch for config.json"):
        read_model_dir(packed_dir)


def test_missing_tensor(packed_dir):
    _rewrite_weights(packed_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight.scale"))
    with pytest.raises(ModelDirError, match="sha256 mismatch for weights.safetensors"):
        read_model_dir(packed_dir)
    with pytest.raises(ModelDirError, match=r"missing tensor.*model.layers.1.mlp.up_proj.weight.scale"):
        read_model_dir(packed_dir, verify=False)


def test_wrong_shape(packed_dir):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight.packed"] = t["model.layers.0.self_attn.q_proj.weight.packed"][:8]
        t["model.norm.weight"] = t["model.norm.weight"][:10]
    _rewrite_weights(packed_dir, shrink)
    with pytest.raises(ModelDirError, match=r"(model.layers.0.self_attn.q_proj.weight|model.norm.weight).*shape"):
        read_model_dir(packed_dir, verify=False)


def test_unexpected_tensor(packed_dir):
    _rewrite_weights(packed_dir, lambda t: t.update({"stray": torch.zeros(2)}))
    with pytest.raises(ModelDirError, match="stray"):
        read_model_dir(packed_dir, verify=False)


@pytest.mark.parametrize("file,key,value,match", [
    ("manifest.json", "format", "gguf", "unknown format 'gguf'"),
    ("manifest.json", "version", 99, "version 99"),
    ("quantization.json", "version", 2, "version 2"),
    ("quantization.json", "int4_packing", {"order": "high_nibble_first"}, "int4 packing"),
])
def test_unknown_format_or_version(packed_dir, file, key, value, match):
    doc = json.loads((packed_dir / file).read_text())
    doc[key] = value
    (packed_dir / file).write_text(json.dumps(doc))
    with pytest.raises(ModelDirError, match=match):
        read_model_dir(packed_dir, verify=False)


def test_unknown_quant_spec(packed_dir):
    doc = json.loads((packed_dir / "quantization.json").read_text())
    doc["tensors"]["model.layers.0.mlp.up_proj.weight"]["quant"]["bits"] = 3
    (packed_dir / "quantization.json").write_text(json.dumps(doc))
    with pytest.raises(ModelDirError, match="model.layers.0.mlp.up_proj.weight.*bits"):
        read_model_dir(packed_dir, verify=False)


def test_missing_files_and_dir(packed_dir, tmp_path):
    with pytest.raises(ModelDirError, match="not found"):
        read_model_dir(tmp_path / "nope")
    (packed_dir / "copy_policy.json").unlink()
    with pytest.raises(ModelDirError, match="missing copy_policy.json"):
        read_model_dir(packed_dir)
    (packed_dir / "manifest.json").unlink()
    with pytest.raises(ModelDirError, match="missing manifest.json"):
        read_model_dir(packed_dir)


def test_reader_does_not_import_transformers():
    code = ("import sys, drafter_lib.packed.model_dir, drafter_lib.quantization; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pack_carries_no_machine_path(tmp_path):
    """The loader's `_name_or_path` (the packing machine's checkpoint dir) stays out of config.json, and paths in
    the manifest metadata are stored repository-relative: two packs of the same weights are byte-identical."""
    from drafter_lib.common.layout import REPO_ROOT

    docs = []
    for name in ("a", "b"):
        ckpt = REPO_ROOT / "runs" / name / "train" / "best"
        out = write_model_dir(tmp_path / name / "model", {**_config(), "_name_or_path": str(ckpt)}, _state_dict(),
                              QC, extra_manifest={"checkpoint": ckpt / "model.safetensors"})
        text = {f: (out / f).read_text() for f in ("config.json", "manifest.json")}
        assert str(REPO_ROOT) not in text["manifest.json"] and str(tmp_path) not in text["config.json"]
        assert "_name_or_path" not in json.loads(text["config.json"])
        assert json.loads(text["manifest.json"])["checkpoint"] == f"runs/{name}/train/best/model.safetensors"
        docs.append(text)
    assert docs[0]["config.json"] == docs[1]["config.json"]
    assert read_model_dir(tmp_path / "a" / "model").config == _config()


def test_committed_provenance_is_the_shipped_packs_run():
    """The repository's architecture.json describes the run that made model/: the run named in model/manifest.json,
    whose published report (results/<run>/) records the same pack file sizes and the same provenance, byte for
    byte. Publishing a run's report over the shipped pack's run rewrites both together (study.run.publish_results)."""
    from drafter_lib.common.layout import MODEL_DIR, REPO_ROOT, RESULTS_DIR

    if not (MODEL_DIR / "manifest.json").is_file():
        pytest.skip("no shipped model/ in this checkout")
    manifest = json.loads((MODEL_DIR / "manifest.json").read_text())
    report = RESULTS_DIR / manifest["run"]
    sizes = json.loads((report / "pack_report.json").read_text())["sizes"]
    assert sizes == {f.name: f.stat().st_size for f in MODEL_DIR.iterdir() if f.name in sizes}
    assert (REPO_ROOT / "architecture.json").read_bytes() == (report / "architecture.json").read_bytes()
