"""Export a packed drafter to a plain transformers checkpoint, so transformers' own assisted generation
(`target.generate(..., assistant_model=drafter)`) can use it as a baseline.

    specdraft-export --format hf OUT [--model-dir model]

The exported weights are exactly what the engine restores from the pack (`restore_weight`, fp32), so the exported
model's greedy drafts equal the engine's fp32 drafts.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from drafter_lib.common.layout import REPO_ROOT
from drafter_lib.model import draft_vocab
from drafter_lib.packed.config_keys import STUDY_KEYS
from drafter_lib.packed.model_dir import read_model_dir


def _full_head(state: dict, vocab: int) -> tuple[dict, list[int]]:
    """A reduced draft-vocabulary head travels as a full-vocabulary head whose other rows are zero; those ids go
    into the generation config's suppress_tokens, so greedy generation picks among the draft vocabulary only."""
    import torch

    state = dict(state)
    ids = state.pop(draft_vocab.IDS_TENSOR)
    small = state[draft_vocab.LM_HEAD]
    head = torch.zeros(vocab, small.shape[1], dtype=small.dtype)
    head[ids] = small
    state[draft_vocab.LM_HEAD] = head
    inside = set(ids.tolist())
    return state, [t for t in range(vocab) if t not in inside]


def export_hf(model_dir: str | os.PathLike, out_dir: str | os.PathLike):
    """Write `out_dir` as a transformers checkpoint (config.json + model.safetensors); returns the loaded model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    packed = read_model_dir(model_dir)
    cfg = {k: v for k, v in packed.config.items() if k not in (*STUDY_KEYS, draft_vocab.CONFIG_KEY)}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state, suppress = packed.state_dict, []
    if packed.config.get(draft_vocab.CONFIG_KEY):
        state, suppress = _full_head(state, int(config.vocab_size))
    # a pack whose tensors do not cover the model (or carry extra ones) must not export silently
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"pack {model_dir} does not match a {model_type} model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    # the engine drafts without stop tokens; an exported assistant must not stop early either
    model.generation_config.eos_token_id = packed.config.get("eos_token_id")
    if suppress:
        model.generation_config.suppress_tokens = suppress
    out = Path(out_dir)
    model.save_pretrained(out)
    return model


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description="Export a packed drafter to another format.")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers checkpoint")
    ap.add_argument("--model-dir", default=str(REPO_ROOT / "model"), help="packed model dir (default: model/)")
    args = ap.parse_args(argv)
    export_hf(args.model_dir, args.out)
    print(f"exported {args.model_dir} -> {args.out}")
    return Path(args.out)
