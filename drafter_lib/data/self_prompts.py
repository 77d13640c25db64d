"""User turns written by the teacher itself: its chat template's user header, sampled (as in Magpie).

Given only the text a chat turn starts with (`<|im_start|>user\\n`), an instruct model writes the kind of request it
was tuned to answer: open writing, advice, plans, code, explanations - the chat prompts the shared corpora (T0 tasks,
GSM8K questions) lack. A turn is kept only when the model closed it itself (a stop token before the cap). Each batch
draws from its own seed, so the rows do not depend on how many batches ran before; batches are appended to a JSONL
cache as they finish, a line each, so an interrupted data stage resumes where it stopped and a finished one is read
back.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from drafter_lib.common.progress import progress_bar

CORPUS = "self_prompts"
_MARK = "\u2063specdraft-user-turn\u2063"  # a placeholder no template rewrites
# Sampling: temperature 1 with a 0.95 nucleus keeps the model's own spread of requests; a turn longer than 128
# tokens is dropped (data.max_prompt_tokens would drop most of them anyway). A batch: `batch_rows` rows drawn from
# one seed and cached together, decoded `decode_rows` at a time.
DEFAULT_SAMPLING = {"max_new_tokens": 128, "batch_rows": 256, "decode_rows": 64, "temperature": 1.0,
                    "top_p": 0.95, "backend": "auto"}


def user_header(tokenizer) -> str:
    """The chat-templated text up to where a first user turn's content begins (system prompt included, if the
    template adds a default one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if _MARK not in text:
        raise ValueError("the tokenizer's chat template dropped the user's content: no user header to sample from")
    return text.split(_MARK)[0]


def record(text: str) -> dict:
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {"id": f"{CORPUS}/{digest}", "source": CORPUS, "category": CORPUS,
            "messages": [{"role": "user", "content": text}]}


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                   prefilter: int = 256) -> torch.Tensor:
    """One token per row of logits [B, V] from the smallest set of tokens holding top_p of the probability.

    Sorting a whole 49k vocabulary per row costs more than a decode step, so each row first takes its `prefilter`
    most likely tokens; only a row whose nucleus reaches past them is sorted whole. The kept set is the same."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    top, top_ids = probs.topk(min(prefilter, probs.shape[-1]), dim=-1)
    wide = top.sum(-1) < top_p
    out = torch.empty(len(probs), dtype=torch.long)
    if not wide.all():
        out[~wide] = _draw(top[~wide], top_ids[~wide], top_p, generator)
    if wide.any():
        out[wide] = _draw(*probs[wide].sort(dim=-1, descending=True), top_p, generator)
    return out


def _draw(p: torch.Tensor, ids: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Sample from probabilities sorted descending, keeping a token while the mass above it is < top_p."""
    p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0)
    return ids.gather(-1, torch.multinomial(p, 1, generator=generator)).squeeze(-1)


@torch.inference_mode()
def sample_native(model, header_ids: list[int], rows: int, seed: int, max_new_tokens: int, temperature: float,
                  top_p: float, stop_ids: list[int], decode_rows: int = 64) -> list[list[int]]:
    """`rows` sampled continuations of one header on the hand-written decoder (`model.Transformer`), `decode_rows`
    at a time with continuous batching (a row that ends is replaced at once); each row ends with its stop token or
    is cut at the cap."""
    from drafter_lib.decoding.generate import stream_generate

    gen = torch.Generator().manual_seed(seed)
    outs: list[list[int]] = [[] for _ in range(rows)]
    for f in stream_generate(model, [header_ids] * rows, max_new_tokens, stop_ids, decode_rows,
                             choose=lambda logits: nucleus_sample(logits, temperature, top_p, gen).tolist()):
        outs[f.index] = f.tokens
    return outs


@torch.inference_mode()
def sample_hf(model, header_ids: list[int], rows: int, seed: int, max_new_tokens: int, temperature: float,
              top_p: float, stop_ids: list[int], decode_rows: int = 64) -> list[list[int]]:
    """The same with transformers' `generate` (any architecture, any device), static batches of `decode_rows`."""
    from drafter_lib.common.chat import cut_at_stop

    torch.manual_seed(seed)
    outs = []
    for i in range(0, rows, decode_rows):
        ids = torch.tensor([header_ids] * min(decode_rows, rows - i), device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                             top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                             pad_token_id=stop_ids[0])
        outs += [cut_at_stop(row, stop_ids, max_new_tokens) for row in out[:, ids.shape[1]:].tolist()]  # no padding
    return outs


def whole_turns(tokenizer, rows: list[list[int]], stop_ids: list[int]) -> list[str]:
    """The rows the model ended itself (a stop token), decoded up to it and stripped; rows cut by the cap dropped."""
    texts = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in stop_ids), None)
        if end is not None:
            text = tokenizer.decode(row[:end], skip_special_tokens=True).strip()
            if text:
                texts.append(text)
    return texts


def sampling_settings(**overrides) -> dict:
    """DEFAULT_SAMPLING with `overrides` (an unknown name is an error): what a run records."""
    unknown = sorted(set(overrides) - set(DEFAULT_SAMPLING))
    if unknown:
        raise ValueError(f"unknown self-prompt sampling settings {unknown}; known: {sorted(DEFAULT_SAMPLING)}")
    return {**DEFAULT_SAMPLING, **overrides}


def self_prompts(model, tokenizer, n: int, seed: int = 0, cache_path: str | Path | None = None,
                 progress: bool = True, **sampling) -> list[dict]:
    """n distinct user turns sampled from the HF `model` (fewer only if 4x n rows' batches yield fewer distinct
    ones). Batch b draws from seed `seed * 100003 + b`; with `cache_path`, finished batches are read back from it
    and new ones appended. `sampling`: DEFAULT_SAMPLING's names. backend: "native" (the hand-written decoder,
    several times faster on CPU), "hf" (`generate`) or "auto" (native on CPU for Llama/Qwen3, as the teacher stage
    chooses); each gives its own rows for a seed."""
    from drafter_lib.common.chat import stop_token_ids
    from drafter_lib.common.files import read_rows
    from drafter_lib.decoding.backends import NativeBackend, make_backend

    cfg = sampling_settings(**sampling)
    max_new_tokens, batch_rows, temperature, top_p = (cfg[k] for k in ("max_new_tokens", "batch_rows",
                                                                       "temperature", "top_p"))
    if n < 0 or batch_rows < 1 or cfg["decode_rows"] < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 0, batch_rows >= 1, decode_rows >= 1, max_new_tokens >= 1; got {n}, "
                         f"{batch_rows}, {cfg['decode_rows']}, {max_new_tokens}")
    if not 0 < temperature or not 0 < top_p <= 1:
        raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    cache = Path(cache_path) if cache_path else None
    by_text, next_batch = {}, 0
    # one line per batch: a line cut by a kill is that whole batch, dropped (and drawn again) by the repair
    for line in read_rows(cache, repair=True) if cache is not None else []:
        next_batch = max(next_batch, line["batch"] + 1)
        for text in line["turns"]:
            by_text.setdefault(text, record(text))
    header = tokenizer(user_header(tokenizer), add_special_tokens=False)["input_ids"]
    stop = stop_token_ids(tokenizer)
    if len(by_text) < n:
        chosen = make_backend(cfg["backend"], model, tokenizer)
        sample, net = (sample_native, chosen.model) if isinstance(chosen, NativeBackend) else (sample_hf, model)
    max_batches = max(1, -(-4 * n // batch_rows))
    bar = progress_bar(total=n, initial=min(len(by_text), n), desc="self prompts", unit="turn", disable=not progress)
    while len(by_text) < n and next_batch < max_batches:
        new = []  # the batch's turns not seen before (maybe none: the line still marks the batch as drawn)
        rows = sample(net, header, batch_rows, seed * 100003 + next_batch, max_new_tokens, temperature, top_p, stop,
                      cfg["decode_rows"])
        for text in whole_turns(tokenizer, rows, stop):
            if text not in by_text:
                by_text[text] = record(text)
                new.append(text)
        if cache is not None:  # one line per batch: a kill loses at most the batch in flight
            cache.parent.mkdir(parents=True, exist_ok=True)
            with open(cache, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"batch": next_batch, "turns": new}, ensure_ascii=False) + "\n")
        bar.update(min(len(by_text), n) - bar.n)
        next_batch += 1
    bar.close()
    return list(by_text.values())[:n]
