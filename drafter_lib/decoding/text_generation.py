"""Text generation on a `TargetRuntime`: a prompt in, text out as the speculative loop accepts it, and the numbers a
user sees (tokens in and out, why it stopped, tokens per target step).

`specdraft-generate` and the server's OpenAI-compatible endpoints both iterate a `TextGeneration`: one `TextDelta`
per target step, the last one with its finish reason ("stop": a stop token or stop string; "length": `max_tokens`
or the end of the context). Decoding is greedy, so the text is the target's own plain greedy answer, decoded
(`text_stream.py`), whatever drafts the drafter proposes; only the speed depends on them.

With `prefill_chunk` a prompt longer than that is read in passes of that many tokens before the first step, one
empty `TextDelta` each, so that the server runs /draft batches and other generations between them; the runtime's
rows do not depend on the other rows of their pass, so the answer and its log-probabilities are the same bits
whatever the chunk. With `own_cache` the generation runs on a KV cache of its own (`TargetRuntime.new_target`),
dropped when it ends: generations that take turns on one runtime.

Asked for (`top_logprobs`), each delta also carries the log-probabilities of its step's tokens: the target's
log-softmax at each token's position, from the verify pass's own logits (a drafted token's row as much as the
bonus token's), so they equal plain decoding's bit for bit wherever the target's rows do not depend on the other
rows of their pass (the runtime's row-exact numerics), with the `top_logprobs` most likely tokens there.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from drafter_lib.common.chat import encode_chat
from drafter_lib.common.checks import check_token_ids
from drafter_lib.decoding.runtime import TargetRuntime
from drafter_lib.decoding.speculative import mean_acceptance_length, prefill, speculative_stream
from drafter_lib.decoding.text_stream import TextStream, TokenText, check_stop_strings

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


class GenerationInputError(ValueError):
    """A generation that cannot run as asked; `param` names the input at fault ("prompt", "max_tokens", "stop")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int = 0  # tokens generated, a stop token that ended the answer included
    target_steps: int = 0  # target forward passes that drafted and verified (the first reads the prompt's rest)
    prefill_passes: int = 0  # target passes over the prompt alone before the first step (prefill_chunk)
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # of those, accepted by the target
    seconds: float = 0.0  # from the first target pass (a prefill's included) to the last

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target step (plain decoding: 1.0); NaN before the first step."""
        return mean_acceptance_length(self.completion_tokens, self.target_steps)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class TokenLogprob:
    """One generated token under the target: its text and bytes on its own (text_stream.TokenText), its
    log-probability, the characters of the answer before it, and the most likely tokens at its position (most
    likely first) as (text, bytes, log-probability)."""
    text: str
    bytes: bytes
    logprob: float
    offset: int
    top: list[tuple[str, bytes, float]]


@dataclass
class TextDelta:
    text: str  # text that became final with this step ("" while a character or a possible stop string is open)
    finish_reason: str | None = None  # set on the last delta only
    # asked for: one per token of this step, the one that ended the answer (an end-of-turn token) excepted
    logprobs: list[TokenLogprob] | None = None


def completion_prompt_ids(runtime: TargetRuntime, prompt: str | Sequence[int]) -> list[int]:
    """A raw completion prompt as token ids: text through the tokenizer (which adds its special tokens, e.g. a BOS,
    as it always does), or ids checked against the target's vocabulary."""
    if isinstance(prompt, str):
        ids = [int(t) for t in runtime.tokenizer.encode(prompt)]
        if not ids:
            raise GenerationInputError("prompt is empty", "prompt")
        return ids
    try:
        return check_token_ids(list(prompt), runtime.target.vocab_size, "prompt")
    except ValueError as e:
        raise GenerationInputError(str(e), "prompt") from None


def chat_prompt_ids(runtime: TargetRuntime, messages: list[dict]) -> list[int]:
    """Chat messages through the tokenizer's chat template, ending with the assistant's header."""
    if not messages:
        raise GenerationInputError("messages must hold at least one message", "messages")
    try:
        return encode_chat(runtime.tokenizer, messages)
    except Exception as e:  # noqa: BLE001 - a template's own check (e.g. roles that must alternate) is the user's
        raise GenerationInputError(f"the chat template refused the messages: {e}", "messages") from None


class BoundedDrafter:
    """A drafter asked for no more tokens than its own context holds (a DraftEngine refuses more), with fixed draft
    options (e.g. `min_confidence`): the target's context may be longer than the drafter's."""

    def __init__(self, drafter, max_context: int | None = None, **options):
        self.drafter, self.options = drafter, options
        self.max_context = max_context if max_context is not None else getattr(drafter, "max_context", None)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        if self.max_context is not None:
            k = min(k, self.max_context - len(tokens))
        return list(self.drafter.draft(tokens, k, **self.options)) if k > 0 else []

    def prefill(self, tokens: list[int]) -> None:
        """Read `tokens` ahead of the first draft: a DraftEngine keeps their K/V in its prefix cache, and a later
        context that extends them reads only the rest, so a long prompt's drafter pass is split as the target's."""
        self.draft(tokens, 1)


def drafter_for(runtime: TargetRuntime, engine, min_confidence: float | None = None) -> BoundedDrafter:
    """A DraftEngine as the drafter of `runtime`'s target, checked to speak the same vocabulary. Its drafts stop
    below `min_confidence`; None: the engine's default threshold, else the one its pack recommends (the setting
    the pack's end-to-end speed-ups were measured at)."""
    if int(engine.vocab_size) != int(runtime.target.vocab_size):
        raise ValueError(f"the drafter's vocabulary ({engine.vocab_size} tokens) is not the target's "
                         f"({runtime.target.vocab_size} tokens, {runtime.name}): it was packed for another target")
    if min_confidence is None and getattr(engine, "min_confidence", None) is None:
        min_confidence = engine.info().get("recommended_min_confidence")
    return BoundedDrafter(engine, **({} if min_confidence is None else {"min_confidence": min_confidence}))


GENERATION_DRAFTERS = ("model", "prompt-lookup", "none")
PROMPT_LOOKUP_TOKENS = 4  # prompt lookup's k: its drafts are free but have no confidence to stop them, and a verify
# pass over many tokens costs several one-token passes on a CPU (bench/pass_cost.py: 5 tokens ~2-3 passes)


def generation_drafter(kind: str, runtime: TargetRuntime, engine=None, min_confidence: float | None = None
                       ) -> BoundedDrafter | None:
    """What drafts `runtime`'s generations: "model", the packed drafter `engine` (`drafter_for`); "prompt-lookup",
    n-gram matches in the generation's own context (no model runs: free drafts, right where the answer repeats its
    prompt or itself, as code does); "none", plain greedy decoding."""
    if kind == "model":
        return drafter_for(runtime, engine, min_confidence)
    if kind == "prompt-lookup":
        from drafter_lib.packed.copy_policy import CopyDrafter

        return BoundedDrafter(CopyDrafter())
    if kind == "none":
        return None
    raise ValueError(f"the generation drafter must be one of {GENERATION_DRAFTERS}, got {kind!r}")


class TextGeneration:
    """One greedy generation of `runtime` after `prompt` (token ids): iterate it for `TextDelta`s, one per target
    step; `stats` counts as it goes and `finish_reason` is set at the end. At most `max_tokens` new tokens (None: up
    to the end of the context); `stop`: up to 4 strings, the text ends before the first one that appears;
    `top_logprobs` (0..20; None: none): each delta's tokens' log-probabilities, with that many most likely tokens
    at each position. `prefill_chunk` (None: none) reads a longer prompt in passes of that many tokens first,
    one empty delta each (a drafter with `prefill`, e.g. a BoundedDrafter, reads each chunk too); `own_cache` runs
    on a KV cache of its own, dropped at the end (see the module doc)."""

    def __init__(self, runtime: TargetRuntime, prompt: Sequence[int], max_tokens: int | None = None, drafter=None,
                 k: int = 16, stop: str | Sequence[str] | None = None, top_logprobs: int | None = None,
                 prefill_chunk: int | None = None, own_cache: bool = False):
        self.runtime, self.prompt, self.drafter, self.k = runtime, list(prompt), drafter, k
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk, self.own_cache = prefill_chunk, own_cache
        room = runtime.context_length - len(self.prompt)
        if not self.prompt:
            raise GenerationInputError("prompt is empty", "prompt")
        if room < 1:
            raise GenerationInputError(f"the prompt is {len(self.prompt)} tokens long and leaves no room for an "
                                       f"answer: {runtime.name}'s context is {runtime.context_length} tokens",
                                       "prompt")
        if max_tokens is not None and max_tokens < 1:
            raise GenerationInputError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens > room:
            raise GenerationInputError(f"max_tokens={max_tokens} does not fit: the prompt is {len(self.prompt)} "
                                       f"tokens and {runtime.name}'s context is {runtime.context_length}, so at "
                                       f"most {room} new tokens", "max_tokens")
        self.max_tokens = room if max_tokens is None else max_tokens
        try:
            self.stop = check_stop_strings(stop)
        except ValueError as e:
            raise GenerationInputError(str(e), "stop") from None
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationInputError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}",
                                       "top_logprobs")
        self.top_logprobs = top_logprobs
        self.stats = GenerationStats(prompt_tokens=len(self.prompt))
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[TextDelta]:
        target = self.runtime.new_target() if self.own_cache else self.runtime.target
        try:
            yield from self._deltas(target)
        finally:  # run to the end, or dropped by a reader that stopped: the cache's memory goes back at once
            if self.own_cache:
                target.release()

    def _deltas(self, target) -> Iterator[TextDelta]:
        stop_ids = set(self.runtime.stop_ids)
        text = TextStream(self.runtime.tokenizer, self.stop)
        stats, t0 = self.stats, time.perf_counter()
        scored = self._scorer() if self.top_logprobs is not None else None
        prefilled, read_ahead = 0, getattr(self.drafter, "prefill", None)
        for prefilled in prefill(target, self.prompt, self.prefill_chunk) if self.prefill_chunk else ():
            if read_ahead is not None:
                read_ahead(self.prompt[:prefilled])
            stats.prefill_passes += 1
            stats.seconds = time.perf_counter() - t0
            yield TextDelta("", logprobs=None if scored is None else [])
        for step in speculative_stream(target, self.prompt, self.max_tokens, self.drafter, self.k, stop_ids,
                                       prefilled=prefilled):
            stats.target_steps += 1
            stats.draft_tokens += step.drafted
            stats.accepted_tokens += step.accepted
            parts, logprobs = [], None if scored is None else []
            for i, token in enumerate(step.tokens):
                stats.completion_tokens += 1
                if token in stop_ids:  # the end of the answer: its text is not part of it
                    parts.append(text.finish())
                    self.finish_reason = "stop"
                    break
                if scored is not None:
                    logprobs.append(scored(token, step.logits[i]))
                parts.append(text.push(token))
                if text.stopped:
                    self.finish_reason = "stop"
                    break
            stats.seconds = time.perf_counter() - t0
            if self.finish_reason:
                yield TextDelta("".join(parts), self.finish_reason, logprobs)
                return
            yield TextDelta("".join(parts), logprobs=logprobs)
        self.finish_reason = "length"
        yield TextDelta(text.finish(), self.finish_reason, [] if scored is not None else None)

    def _scorer(self):
        """token, the logits row that chose it -> its TokenLogprob. Each row is normalised alone, so a row's
        log-probabilities do not depend on how many rows its pass had."""
        import torch

        names, top_n, answer = TokenText(self.runtime.tokenizer), self.top_logprobs, bytearray()

        def scored(token: int, logits) -> TokenLogprob:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            values, ids = torch.topk(logprobs, top_n) if top_n else (logprobs[:0], logprobs[:0].long())
            offset = len(answer.decode("utf-8", errors="replace"))  # the answer's characters before this token
            answer.extend(names.in_text(token))
            return TokenLogprob(names.text(token), names.bytes(token), float(logprobs[token]), offset,
                                [(names.text(t), names.bytes(t), float(v)) for t, v in zip(ids.tolist(),
                                                                                            values.tolist())])

        return scored

    def text(self) -> str:
        """Run to the end; the whole text."""
        return "".join(d.text for d in self)
