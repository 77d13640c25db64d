"""Export a packed drafter to one GGUF file that llama.cpp (llama-server `--model-draft`, llama-speculative,
llama-cpp-python) loads as it is.

    specdraft-export --format gguf OUT.gguf [--model-dir model] [--gguf-type f32|f16|q8_0]
                     [--teacher SPEC | --tokenizer-gguf FILE]

- Architecture: `llama`, `qwen2` or `qwen3`, as the pack's config says; hyperparameters (block_count,
  embedding_length, heads, head size, rope base and scaling, rms eps, context length) from the pack's config.
- Tokenizer: every `tokenizer.*` key (tokenizer.ggml.tokens / merges / token_type / special ids, add_bos_token,
  pre-tokenizer, tokenizer.chat_template), and the license and languages, are copied from a GGUF of the teacher:
  `--tokenizer-gguf FILE`, else the default teacher's packaged GGUF when the pack's teacher (given, recorded, or
  unknown) is the default one. A teacher that is a transformers checkpoint has no GGUF to copy from: see
  `NoGGUFTokenizer`.
- Weights: exactly what the engine restores from the pack (fp32), written as F32 (default), F16 or Q8_0 (2-D
  tensors; norms and biases stay F32). A reduced draft-vocabulary head becomes the full-vocabulary head of
  `hf_export.full_vocab_state`: the other rows are the mean of the draft rows, so greedy decoding never picks them.
- RoPE layout: llama.cpp's `llama` graph rotates adjacent pairs (x0, x1), (x2, x3), ..., while the HF checkpoint's
  q_proj / k_proj rows are laid out for rotate-half pairs (x_i, x_{i+d/2}); so for `llama` the rows of each head
  of q_proj / k_proj (and their biases) are interleaved (`_halves_to_pairs`). llama.cpp's `qwen2` and `qwen3`
  graphs rotate halves (NeoX style) like HF, so their weights go unchanged. tests/test_export_gguf.py checks both ways.
- Biases: attention biases as `blk.N.attn_q.bias` etc. (F32). llama.cpp's `llama` graph adds any of the four, its
  `qwen2` graph those of q/k/v (which a qwen2 pack always has, and never one of o_proj), its `qwen3` graph none.
- RoPE scaling: linear as metadata (rope.scaling.type / factor); llama3 (llama only) as the tensor rope_freqs, each
  frequency's divisor (the unscaled over the scaled frequency, from the engine's own `rope_inv_freq`).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from drafter_lib.interop.hf_export import OUT_OF_VOCAB_ROWS, full_vocab_state, recorded_teacher
from drafter_lib.model import draft_vocab, hf_models
from drafter_lib.model.transformer import ModelConfig, rope_inv_freq
from drafter_lib.packed.model_dir import read_model_dir

GGUF_TYPES = ("f32", "f16", "q8_0")
# does llama.cpp's graph for this architecture rotate adjacent pairs (so HF's q/k rows must be interleaved)?
ARCH_PAIRED_ROPE = {"llama": True, "qwen2": False, "qwen3": False}


class NoGGUFTokenizer(ValueError):
    """The pack's teacher has no GGUF whose tokenizer metadata could be copied."""


# ---------------------------------------------------------------------------------------------- tensors

def _halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or its bias) from HF's rotate-half order to llama.cpp's adjacent-pair order: in
    each head of d rows, row i < d/2 goes to 2i and row d/2 + i to 2i + 1."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(config: dict, state: dict, paired_rope: bool | None = None) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> fp32 tensor for a pack's config and restored state dict (a full-vocabulary head).
    `paired_rope` None: as the architecture needs (ARCH_PAIRED_ROPE); the tests force the other way to show the
    difference. Every tensor of `state` must be placed, else ValueError."""
    import gguf

    cfg = ModelConfig.from_hf(config)
    if cfg.arch not in ARCH_PAIRED_ROPE:
        raise ValueError(f"GGUF export supports {sorted(ARCH_PAIRED_ROPE)}, not {cfg.arch!r}")
    if cfg.mlp_bias:
        raise ValueError("GGUF export: MLP biases (mlp_bias) are not supported")
    if cfg.arch == "qwen3" and (cfg.qkv_bias or cfg.o_proj_bias):
        raise ValueError("GGUF export: llama.cpp's qwen3 graph has no attention biases")
    paired = ARCH_PAIRED_ROPE[cfg.arch] if paired_rope is None else paired_rope
    T, name = gguf.MODEL_TENSOR, lambda t, **kw: gguf.TENSOR_NAMES[t].format(**kw)
    places = {"model.embed_tokens.weight": name(T.TOKEN_EMBD) + ".weight",
              "model.norm.weight": name(T.OUTPUT_NORM) + ".weight",
              "lm_head.weight": name(T.OUTPUT) + ".weight"}
    per_layer = {"input_layernorm": T.ATTN_NORM, "post_attention_layernorm": T.FFN_NORM,
                 "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K, "self_attn.v_proj": T.ATTN_V,
                 "self_attn.o_proj": T.ATTN_OUT, "self_attn.q_norm": T.ATTN_Q_NORM,
                 "self_attn.k_norm": T.ATTN_K_NORM, "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP,
                 "mlp.down_proj": T.FFN_DOWN}
    for i in range(cfg.num_hidden_layers):
        for hf, t in per_layer.items():
            for suffix in ("weight", "bias"):
                places[f"model.layers.{i}.{hf}.{suffix}"] = f"{name(t, bid=i)}.{suffix}"
    out, unplaced = {}, []
    for k, v in state.items():
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        if k not in places:
            unplaced.append(k)
            continue
        v = v.detach().float().contiguous()
        if paired and (".self_attn.q_proj." in k or ".self_attn.k_proj." in k):
            v = _halves_to_pairs(v, cfg.num_attention_heads if ".q_proj." in k else cfg.num_key_value_heads)
        out[places[k]] = v
    if unplaced:
        raise ValueError(f"GGUF export: no GGUF place for {unplaced[:5]}")
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        raise ValueError("GGUF export: an untied model without lm_head.weight (llama.cpp would tie it silently)")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) != "linear":
        if cfg.arch != "llama":
            raise ValueError(f"GGUF export: rope scaling {cfg.rope_scaling} is supported for llama only")
        # llama.cpp divides each rotation frequency by rope_freqs[i]: the unscaled over the scaled frequency
        plain = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
        out[name(T.ROPE_FREQS) + ".weight"] = (plain / rope_inv_freq(cfg)).float()
    return out


def _encode(t: torch.Tensor, gguf_type: str):
    """(numpy array, raw GGML type or None) of one tensor: norms, biases and rope factors (1-D) stay F32."""
    import gguf
    import numpy as np

    a = t.numpy().astype(np.float32)
    if a.ndim < 2 or gguf_type == "f32":
        return a, None
    if gguf_type == "q8_0" and a.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        return gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return a.astype(np.float16), None  # f16, or a q8_0 row length that is not a whole number of blocks


# ---------------------------------------------------------------------------------------------- tokenizer

def tokenizer_gguf_for(packed, teacher: str | None = None, tokenizer_gguf=None) -> Path:
    """The GGUF whose tokenizer metadata the export copies: `tokenizer_gguf`, else the default teacher's packaged
    GGUF when the pack's teacher (given, recorded, or unknown) is the default one; NoGGUFTokenizer otherwise."""
    if tokenizer_gguf is not None:
        return Path(tokenizer_gguf)
    spec = teacher or recorded_teacher(packed)
    if spec is None or hf_models.parse_model_spec(spec)[0] == "default":
        return hf_models.default_teacher_gguf()
    raise NoGGUFTokenizer(
        f"the pack's teacher {spec!r} is a transformers checkpoint: there is no GGUF tokenizer to copy. Export a "
        f"transformers directory instead (`specdraft-export --format hf OUT`, which writes the teacher's tokenizer) "
        f"and convert it with llama.cpp's convert_hf_to_gguf.py (`python convert_hf_to_gguf.py OUT --outtype f32`), "
        f"or pass --tokenizer-gguf with a GGUF of the teacher (e.g. made by that script).")


def _copy_field(writer, field) -> None:
    """One metadata key, with its exact type (strings as their raw bytes)."""
    from gguf import GGUFValueType as VT

    main = field.types[0]
    if main == VT.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not copied")
        val = [bytes(field.parts[i]) for i in field.data] if sub == VT.STRING else list(field.contents())
        writer.add_key_value(field.name, val, VT.ARRAY, sub_type=sub)
    elif main == VT.STRING:
        writer.add_key_value(field.name, bytes(field.parts[field.data[0]]), VT.STRING)
    else:
        writer.add_key_value(field.name, field.contents(), main)


# general.* keys of the teacher's GGUF that hold for a drafter distilled from it
TEACHER_GENERAL_KEYS = ("general.license", "general.license.name", "general.license.link", "general.languages")


def _tokenizer_fields(path: Path, vocab: int) -> list:
    """The metadata fields copied from the teacher's GGUF: every tokenizer.* key and TEACHER_GENERAL_KEYS."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    tok = [f for k, f in fields.items() if k.startswith("tokenizer.") or k in TEACHER_GENERAL_KEYS]
    n = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else 0
    if n == 0:
        raise NoGGUFTokenizer(f"{path} has no tokenizer.ggml.tokens")
    if n != vocab:
        raise ValueError(f"{path} has {n} tokens but the pack's vocab_size is {vocab}: pass --tokenizer-gguf with a "
                         f"GGUF of the pack's teacher")
    return tok


# ---------------------------------------------------------------------------------------------- export

def export_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, gguf_type: str = "f32",
                teacher: str | None = None, tokenizer_gguf: str | os.PathLike | None = None,
                paired_rope: bool | None = None) -> Path:
    """Write the pack as one GGUF file (see the module doc); returns its path. `paired_rope`: tests only."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type must be one of {GGUF_TYPES}, got {gguf_type!r}")
    packed = read_model_dir(model_dir)
    config = packed.config
    cfg = ModelConfig.from_hf(config)
    vocab = int(config["vocab_size"])
    tok_fields = _tokenizer_fields(tokenizer_gguf_for(packed, teacher, tokenizer_gguf), vocab)
    state = packed.state_dict
    if config.get(draft_vocab.CONFIG_KEY):
        state, _ = full_vocab_state(state, vocab)
    tensors = gguf_tensors(config, state, paired_rope)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    w = gguf.GGUFWriter(str(tmp), cfg.arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"specdraft drafter ({packed.manifest.get('run', 'pack')}, {cfg.num_hidden_layers} layers)")
    w.add_description("speculative-decoding drafter exported by specdraft"
                      + (f"; rows outside the {cfg.draft_vocab_size}-token draft vocabulary: {OUT_OF_VOCAB_ROWS}"
                         if cfg.draft_vocab_size else ""))
    w.add_vocab_size(vocab)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    if gguf_type == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for f in tok_fields:
        _copy_field(w, f)
    for k, t in tensors.items():
        a, raw = _encode(t, gguf_type)
        w.add_tensor(k, a, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
