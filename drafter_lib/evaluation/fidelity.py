"""How closely a target implementation's greedy output follows a reference implementation of the same model (the
fp32 model): whole answers, the first token where they part, and top-1 agreement under teacher forcing.

- `identical`: share of prompts whose greedy answer (up to `max_new_tokens`, or a stop token) equals the reference's;
- `tokens_to_first_difference`: mean over prompts of the index of the first token that differs (an identical answer
  counts its length): how long an answer stays the reference's;
- `top1_agreement`: the candidate fed the prompt and the reference's answer in one pass; the share of positions
  whose argmax is the reference's next token (differences cannot compound, unlike the free-running answers).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from drafter_lib.decoding.speculative import greedy_decode


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where a and b differ (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@torch.inference_mode()
def teacher_forced_top1(target, prompt: Sequence[int], answer: Sequence[int]) -> list[bool]:
    """For each token of `answer`: whether `target`'s argmax after prompt + answer[:i] is answer[i] (one pass)."""
    if not answer:
        return []
    target.reset()
    logits = target.score(list(prompt) + list(answer[:-1]), keep=len(answer))
    return (logits.argmax(-1) == torch.tensor(list(answer))).tolist()


def fidelity(candidate, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
             max_new_tokens: int, stop_ids: Iterable[int] = ()) -> dict:
    """`candidate` (a speculative.Target) against the reference answers `references` (one per prompt, greedy, at the
    same `max_new_tokens` and stop tokens). Returns the figures of the module doc and the per-prompt values."""
    if len(prompts) != len(references) or not prompts:
        raise ValueError(f"need one reference answer per prompt, got {len(prompts)} prompts, {len(references)} answers")
    stop = list(stop_ids)
    firsts, same, forced = [], [], []
    for prompt, ref in zip(prompts, references):
        out = greedy_decode(candidate, prompt, max_new_tokens, stop)
        same.append(out == list(ref))
        firsts.append(first_difference(out, ref))
        forced += teacher_forced_top1(candidate, prompt, ref)
    return dict(prompts=len(prompts), identical=sum(same) / len(same),
                tokens_to_first_difference=sum(firsts) / len(firsts),
                top1_agreement=sum(forced) / max(len(forced), 1), positions=len(forced),
                first_difference=firsts)
