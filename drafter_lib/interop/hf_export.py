"""Export a packed drafter to a plain transformers checkpoint that other runtimes load as it is: transformers'
assisted generation (`target.generate(..., assistant_model=drafter)`), and vLLM / SGLang as a draft model.

    specdraft-export --format hf OUT [--model-dir model] [--teacher SPEC]

OUT holds config.json + model.safetensors (exactly what the engine restores from the pack, fp32, so the exported
model's greedy drafts equal the engine's fp32 drafts), generation_config.json, the teacher's tokenizer files with
its chat template (`AutoTokenizer.from_pretrained(OUT)`), and specdraft_export.json (where it came from).

The tokenizer is the teacher's: `--teacher SPEC` (any spec `hf_models.parse_model_spec` accepts), else the teacher
the pack records (manifest.json `teacher`, else the architecture.json of the run that made this very pack), else
the default teacher when its vocabulary fits the pack (else no tokenizer is written, with a warning).

A reduced draft-vocabulary head (model/draft_vocab.py) travels as a full-vocabulary head (`full_vocab_state`) whose
other rows are the mean of the draft-vocabulary rows, so no runtime can pick them greedily (see there); their ids
also go into the generation config's suppress_tokens, which transformers applies and other runtimes may ignore.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from drafter_lib.common.files import read_json, write_json
from drafter_lib.common.layout import REPO_ROOT, RunLayout
from drafter_lib.model import draft_vocab, hf_models
from drafter_lib.packed.config_keys import STUDY_KEYS
from drafter_lib.packed.model_dir import PackedModel, read_model_dir

log = logging.getLogger(__name__)

# how the rows of a full-vocabulary head outside the draft vocabulary are filled (recorded in the export)
OUT_OF_VOCAB_ROWS = "mean of the draft-vocabulary rows"
EXPORT_RECORD = "specdraft_export.json"


def full_vocab_state(state: dict, vocab: int) -> tuple[dict, list[int]]:
    """(state dict with a full-vocabulary lm_head, the ids outside the draft vocabulary) of a reduced-head pack.

    Every row outside the draft vocabulary is the mean of the N draft-vocabulary rows, so its logit is the mean of
    the N draft-vocabulary logits: never above their maximum, equal to it only when all N logits are equal. Greedy
    decoding therefore picks a draft-vocabulary token in any runtime, with or without suppress_tokens, and the
    draft-vocabulary logits are unchanged (zero rows, logit 0, would win wherever every draft logit is negative).
    Sampling at a temperature may still pick such a token; a runtime that can should suppress them."""
    import torch

    state = dict(state)
    ids = state.pop(draft_vocab.IDS_TENSOR).to(torch.long)
    small = state[draft_vocab.LM_HEAD]
    mean = small.double().mean(0).to(small.dtype)
    head = mean.expand(vocab, small.shape[1]).clone()
    head[ids] = small
    state[draft_vocab.LM_HEAD] = head
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[ids] = True
    return state, torch.nonzero(~inside).flatten().tolist()


# ---------------------------------------------------------------------------------------------- the teacher

def _spec_from_record(rec, run_root: Path | None) -> str | None:
    """A model spec from a manifest `teacher` value (a spec string, or an architecture.json record)."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    source = str(rec.get("source", ""))
    if source == f"pypi:{hf_models.DEFAULT_TEACHER_PACKAGE}" or rec.get("name") == hf_models.DEFAULT_TEACHER:
        return hf_models.DEFAULT_TEACHER
    if source.startswith("pypi:") and hf_models.parse_model_spec(rec.get("name") or "?")[0] == "parted":
        return rec["name"]
    if source.startswith("hf:"):
        return f"{source[3:]}@{rec['revision']}" if rec.get("revision") else source[3:]
    if source == "local" and rec.get("path"):
        for base in ([run_root] if run_root else []) + [REPO_ROOT]:
            if (base / rec["path"]).is_dir():
                return str(base / rec["path"])
    return None


def recorded_teacher(packed: PackedModel) -> str | None:
    """The teacher spec a pack records: manifest.json `teacher`, else the teacher in architecture.json of the run
    that made this very pack (the pack's parent dir, or runs/<manifest run>/, whose model/ has the same files);
    None when unknown."""
    manifest = packed.manifest or {}
    if manifest.get("teacher"):
        return _spec_from_record(manifest["teacher"], None)
    roots = [packed.path.parent] if packed.path else []
    if isinstance(manifest.get("run"), str) and manifest["run"]:
        try:
            roots.append(RunLayout.named(manifest["run"]).root)
        except (OSError, ValueError):
            pass
    for root in roots:
        run = RunLayout(Path(root))
        try:
            same = read_json(run.model_dir / "manifest.json").get("files") == manifest.get("files")
            models = read_json(run.architecture).get("models", [])
        except (OSError, ValueError):
            continue
        if same:
            for rec in models:
                if rec.get("role") == "teacher":
                    return _spec_from_record(rec, run.root)
    return None


def load_tokenizer(spec: str):
    """The tokenizer of a teacher spec (default teacher: offline, from its GGUF or converted copy)."""
    from transformers import AutoTokenizer

    kind, name, rev = hf_models.parse_model_spec(spec)
    if kind == "default":
        return hf_models.default_tokenizer()
    if kind == "parted":
        return hf_models.parted_tokenizer(name)
    if kind == "local":
        return AutoTokenizer.from_pretrained(name)
    return AutoTokenizer.from_pretrained(hf_models.hub_snapshot(name, rev))


def teacher_tokenizer(packed: PackedModel, teacher: str | None = None):
    """(tokenizer or None, spec or None, how it was chosen) for a pack: `teacher`, else the recorded teacher, else
    the default teacher if its vocabulary fits the pack. A given or recorded teacher that does not fit is an error;
    the default that does not fit (or is not installed) gives None."""
    vocab = int(packed.config["vocab_size"])
    spec, how = (teacher, "given") if teacher else (recorded_teacher(packed), "recorded")
    if spec is None:
        spec, how = hf_models.DEFAULT_TEACHER, "default (the pack records no teacher)"
        try:
            tok = load_tokenizer(spec)
        except (FileNotFoundError, ImportError) as e:
            return None, None, f"no tokenizer: the pack records no teacher and the default is unavailable ({e})"
        if len(tok) > vocab:
            return None, None, (f"no tokenizer: the pack records no teacher and the default teacher's {len(tok)} "
                                f"tokens do not fit its vocab_size {vocab}")
        return tok, spec, how
    tok = load_tokenizer(spec)
    if len(tok) > vocab:
        raise ValueError(f"teacher {spec} ({how}) has {len(tok)} tokens, more than the pack's vocab_size {vocab}")
    return tok, spec, how


# ---------------------------------------------------------------------------------------------- export

def export_hf(model_dir: str | os.PathLike, out_dir: str | os.PathLike, teacher: str | None = None,
              tokenizer: bool = True):
    """Write `out_dir` as a transformers checkpoint (config, weights, generation config and, when `tokenizer`, the
    teacher's tokenizer and chat template, see `teacher_tokenizer`); returns the loaded model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    packed = read_model_dir(model_dir)
    cfg = {k: v for k, v in packed.config.items() if k not in (*STUDY_KEYS, draft_vocab.CONFIG_KEY)}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state, suppress = packed.state_dict, []
    if packed.config.get(draft_vocab.CONFIG_KEY):
        state, suppress = full_vocab_state(state, int(config.vocab_size))
    # a pack whose tensors do not cover the model (or carry extra ones) must not export silently
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"pack {model_dir} does not match a {model_type} model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    tok, spec, how = teacher_tokenizer(packed, teacher) if tokenizer else (None, None, "not asked for")
    gen = model.generation_config
    # the engine drafts without stop tokens; an exported assistant must not stop early either
    gen.eos_token_id = packed.config.get("eos_token_id")
    gen.bos_token_id = packed.config.get("bos_token_id")
    pad = packed.config.get("pad_token_id")
    gen.pad_token_id = pad if pad is not None else (tok.pad_token_id if tok is not None else None)
    if suppress:
        gen.suppress_tokens = suppress
    out = Path(out_dir)
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)
    elif tokenizer:
        log.warning("%s: %s", out, how)
    record = {"format": "specdraft-hf-export", "pack_manifest_sha256": packed.manifest_sha256,
              "teacher": spec, "tokenizer": how if tok is not None else None,
              "chat_template": bool(tok is not None and getattr(tok, "chat_template", None))}
    if suppress:
        record["draft_vocab"] = {"size": int(packed.config[draft_vocab.CONFIG_KEY]["size"]),
                                 "out_of_vocab_rows": OUT_OF_VOCAB_ROWS, "suppress_tokens": len(suppress)}
    write_json(out / EXPORT_RECORD, record, indent=1)
    return model


def main(argv=None) -> Path:
    """The hf format alone (kept for callers of this module); `specdraft-export` is interop/export.py's main."""
    ap = argparse.ArgumentParser(description="Export a packed drafter to a transformers checkpoint.")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers checkpoint")
    ap.add_argument("--model-dir", default=str(REPO_ROOT / "model"), help="packed model dir (default: model/)")
    ap.add_argument("--teacher", default=None, help="teacher spec whose tokenizer to write (default: recorded)")
    args = ap.parse_args(argv)
    export_hf(args.model_dir, args.out, teacher=args.teacher)
    print(f"exported {args.model_dir} -> {args.out}")
    return Path(args.out)
