"""A reduced draft vocabulary: the drafter's output head covers only the N tokens the teacher writes most often.

The lm_head is about half of a small drafter's bytes per token (49,152 x 576 for SmolLM2), so a head over the
teacher's N most frequent continuation tokens makes every draft step cheaper; a token outside it can never be
drafted, which costs acceptance only as often as the teacher writes such tokens (`coverage`). The input embedding
stays full, so any context token can be read, and the engine maps head indices back to full-vocabulary ids.

In a packed model dir the id table is the tensor `draft_vocab_ids` (int64 [N], full-vocabulary ids; head row i
predicts id draft_vocab_ids[i]) and config.json describes it:
    "draft_vocab": {"size": N, "tensor": "draft_vocab_ids", "full_vocab_size": V}
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

IDS_TENSOR = "draft_vocab_ids"
CONFIG_KEY = "draft_vocab"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def token_counts(sequences: Iterable[Sequence[int]]) -> Counter:
    """How often each token id occurs (e.g. over the teacher's training continuations)."""
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    return counts


def select_ids(counts: Counter, size: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties broken by id, so the choice is deterministic), always including `always`
    (e.g. the stop tokens), topped up with the lowest unused ids if fewer distinct tokens were seen. Sorted."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocab size must be in [1, {vocab_size}], got {size}")
    keep = [int(t) for t in dict.fromkeys(always)]
    bad = [t for t in keep + list(counts) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(keep) > size:
        raise ValueError(f"{len(keep)} ids must always be kept, more than the draft vocab size {size}")
    chosen = set(keep)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(t)
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(ids: torch.Tensor, counts: Counter) -> float:
    """Fraction of the counted tokens that the draft vocab can produce."""
    total = sum(counts.values())
    inside = set(ids.tolist())
    return sum(n for t, n in counts.items() if t in inside) / total if total else float("nan")


def config_entry(ids: torch.Tensor, vocab_size: int) -> dict:
    return {"size": int(ids.numel()), "tensor": IDS_TENSOR, "full_vocab_size": int(vocab_size)}


def reduce_head(hf_config: dict, state_dict: dict, ids: torch.Tensor) -> tuple[dict, dict]:
    """(config, state dict) of the same model whose lm_head keeps only the rows `ids`; the head is untied from the
    (still full) embedding, and the id table joins the state dict."""
    vocab = int(hf_config["vocab_size"])
    head = state_dict.get(LM_HEAD, state_dict.get(EMBED)) if hf_config.get("tie_word_embeddings") else \
        state_dict.get(LM_HEAD)
    if head is None or head.shape[0] != vocab:
        raise ValueError(f"need a full-vocabulary {LM_HEAD} (or tied {EMBED}) of {vocab} rows to reduce")
    ids = ids.to(torch.long)
    check_ids(ids, vocab)
    sd = dict(state_dict)
    sd[LM_HEAD] = head[ids].clone()
    sd[IDS_TENSOR] = ids.clone()
    cfg = {**hf_config, "tie_word_embeddings": False, CONFIG_KEY: config_entry(ids, vocab)}
    return cfg, sd


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{IDS_TENSOR} must be a non-empty 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{IDS_TENSOR} holds ids outside the vocabulary [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{IDS_TENSOR} holds duplicate ids")


def check_pack(config: dict, state_dict: dict) -> None:
    """A model dir's draft vocab is consistent: the id table exists, matches its description and the head."""
    entry = config.get(CONFIG_KEY)
    if entry is None:
        if IDS_TENSOR in state_dict:
            raise ValueError(f"weights hold {IDS_TENSOR} but config.json has no {CONFIG_KEY!r} entry")
        return
    if not isinstance(entry, dict) or entry.get("tensor") != IDS_TENSOR:
        raise ValueError(f"config.json {CONFIG_KEY!r} must be {{'size', 'tensor': {IDS_TENSOR!r}, "
                         f"'full_vocab_size'}}, got {entry!r}")
    if config.get("tie_word_embeddings"):
        raise ValueError(f"a {CONFIG_KEY} head cannot be tied to the full-vocabulary embedding")
    ids = state_dict.get(IDS_TENSOR)
    if ids is None:
        raise ValueError(f"config.json describes a {CONFIG_KEY} but the weights have no {IDS_TENSOR}")
    if entry.get("full_vocab_size") != config.get("vocab_size") or ids.numel() != entry.get("size"):
        raise ValueError(f"{CONFIG_KEY} says size {entry.get('size')} of vocab {entry.get('full_vocab_size')}, "
                         f"but {IDS_TENSOR} has {ids.numel()} ids and vocab_size is {config.get('vocab_size')}")
    check_ids(ids, int(config["vocab_size"]))
    head = state_dict.get(LM_HEAD)
    if head is None or head.shape[0] != ids.numel():
        raise ValueError(f"{LM_HEAD} must have {ids.numel()} rows (one per draft-vocab id), got "
                         f"{None if head is None else tuple(head.shape)}")


# ---------------------------------------------------------------------------------------------- training side

def reduce_hf_model(model, ids: torch.Tensor):
    """In place, for a transformers causal LM: lm_head keeps only the rows `ids` (a fresh, untied Linear, so the
    full embedding stays trainable on its own), the id table becomes the persistent buffer `draft_vocab_ids`, and
    the config describes it. Returns the model."""
    from torch import nn

    vocab = int(model.config.vocab_size)
    ids = ids.to(torch.long).cpu()
    check_ids(ids, vocab)
    old = model.get_output_embeddings().weight
    head = nn.Linear(old.shape[1], ids.numel(), bias=False, dtype=old.dtype, device=old.device)
    with torch.no_grad():
        head.weight.copy_(old[ids.to(old.device)])
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None if isinstance(model._tied_weights_keys, list) else {}
    model.lm_head = head
    model.register_buffer(IDS_TENSOR, ids.to(old.device), persistent=True)
    setattr(model.config, CONFIG_KEY, config_entry(ids, vocab))
    return model


def ids_for_continuations(tokenizer, continuations: Iterable[Sequence[int]], size: int, vocab_size: int
                          ) -> torch.Tensor:
    """The draft vocabulary training picks: the `size` tokens most frequent in the teacher's `continuations`, the
    tokenizer's stop tokens always included."""
    from drafter_lib.common.chat import stop_token_ids

    return select_ids(token_counts(continuations), size, vocab_size, always=stop_token_ids(tokenizer))


def reduce_for_continuations(model, tokenizer, continuations: Iterable[Sequence[int]], size: int) -> torch.Tensor:
    """Reduce a transformers drafter's head (in place) to `ids_for_continuations`; returns the ids."""
    ids = ids_for_continuations(tokenizer, continuations, size, int(model.config.vocab_size))
    reduce_hf_model(model, ids)
    return ids


def full_vocab_logits(logits: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Logits over a reduced head [..., N] -> [..., vocab_size] with -inf outside the draft vocabulary, so an argmax
    (greedy decoding, verification) yields full-vocabulary ids. No-op without a draft vocabulary."""
    if ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids.to(logits.device)] = logits
    return full


def head_targets(targets: torch.Tensor, ids: torch.Tensor, vocab_size: int, ignore: int = -100) -> torch.Tensor:
    """Full-vocabulary target ids -> head row indices; targets outside the draft vocab (and `ignore`) -> ignore,
    so the loss is taken over the draft vocabulary only."""
    lookup = torch.full((vocab_size,), ignore, dtype=torch.long, device=targets.device)
    lookup[ids.to(targets.device)] = torch.arange(ids.numel(), device=targets.device)
    valid = targets != ignore
    out = torch.full_like(targets, ignore)
    out[valid] = lookup[targets[valid]]
    return out


def load_hf_drafter(path, dtype=torch.float32):
    """from_pretrained for a drafter checkpoint that may carry a reduced head (whose lm_head shape transformers
    would reject against vocab_size): build the full model, reduce it, then load the saved weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    entry = getattr(config, CONFIG_KEY, None)
    if not entry:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reduce_hf_model(model, torch.arange(int(entry["size"])))  # placeholder ids, overwritten by the load
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: draft-vocab checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()
