"""The text of a token stream cut at stop strings (TextStream) and text generation on a TargetRuntime
(TextGeneration), on a tiny random target with the byte tokenizer. The streaming loop beneath: test_speculative.py."""

from __future__ import annotations

import pytest
from target_helpers import CONTEXT, VOCAB, decoded, reference, stop_string_in, tiny_target_model

from drafter_lib.decoding.speculative import FnDrafter
from drafter_lib.decoding.text_stream import TextStream, check_stop_strings


@pytest.fixture(scope="module")
def runtime():
    from drafter_lib.decoding.runtime import runtime_from_model
    from drafter_lib.model.transformer import Transformer

    model, tokenizer = tiny_target_model()
    return runtime_from_model(Transformer.from_hf_model(model), tokenizer, "tiny", numerics="fp32")


def _oracle(prompt, answer, wrong_every=0):
    """Drafts the target's own answer, wrong wherever (context length + position) % wrong_every == 0."""
    full = list(prompt) + list(answer)
    return FnDrafter(lambda toks, k: [(t + 1) % VOCAB if wrong_every and (len(toks) + j) % wrong_every == 0 else t
                                      for j, t in enumerate(full[len(toks):len(toks) + k])])


# ------------------------------------------------------------------ text of a token stream


def _streamed(tokenizer, tokens, stop=None) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop)
    parts = [stream.push(t) for t in tokens]
    return parts + [stream.finish()], stream


@pytest.mark.parametrize("text", ["plain ascii", "é à ü: two bytes each", "snow ☃ and 🦙 emoji", "日本語のテキスト"])
def test_streamed_text_adds_up_to_the_decoded_whole_and_never_splits_a_character(runtime, text):
    tok = runtime.tokenizer
    tokens = tok.encode(text)
    parts, _ = _streamed(tok, tokens)
    assert "".join(parts) == decoded(tok, tokens) == text
    assert not any("\ufffd" in p for p in parts)  # a character cut between tokens waits for its last byte
    if not text.isascii():
        assert "" in parts[:-1]


def test_special_tokens_and_invalid_bytes_decode_as_the_whole_does(runtime):
    tok = runtime.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    lone_lead_byte = tok.encode("é")[:1]  # decodes to a replacement character, in the whole as in the stream
    tokens = [im_start] + tok.encode("a") + lone_lead_byte + tok.encode("b") + [im_end]
    parts, _ = _streamed(tok, tokens)
    assert "".join(parts) == decoded(tok, tokens) == "a\ufffdb"


def test_stop_strings_cut_the_text_before_them_even_across_tokens(runtime):
    tok = runtime.tokenizer
    tokens = tok.encode("one, two; three. END four")
    for stop, expected in [("END", "one, two; three. "), (["; t", "."], "one, two"), ("one", ""),
                           ("e.", "one, two; thre"), ("absent", "one, two; three. END four"),
                           ("fourr", "one, two; three. END four")]:
        parts, stream = _streamed(tok, tokens, stop)
        assert "".join(parts) == expected, stop
        assert stream.stopped == (expected != "one, two; three. END four")
    # text that could start a stop string is held back until it cannot, then released
    stream = TextStream(tok, "ENDING")
    assert [stream.push(t) for t in tok.encode("a END")] == ["a", " ", "", "", ""]
    assert stream.push(tok.encode("!")[0]) == "END!" and stream.finish() == ""
    stream = TextStream(tok, "ENDING")
    [stream.push(t) for t in tok.encode("tail EN")]
    assert stream.finish() == "EN"


def test_stop_strings_are_checked():
    assert check_stop_strings(None) == [] and check_stop_strings("x") == ["x"] and check_stop_strings([]) == []
    with pytest.raises(ValueError, match="at most 4"):
        check_stop_strings(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings(["a", ""])
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings([3])


# ------------------------------------------------------------------ text generation on a runtime


def _generate(runtime, prompt_ids, max_tokens, drafter=None, stop=None):
    from drafter_lib.decoding.text_generation import TextGeneration

    gen = TextGeneration(runtime, prompt_ids, max_tokens, drafter, k=8, stop=stop)
    deltas = list(gen)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == gen.finish_reason
    return "".join(d.text for d in deltas), gen


def test_generation_is_the_targets_greedy_text_with_any_drafter(runtime):
    from drafter_lib.decoding.text_generation import chat_prompt_ids, completion_prompt_ids

    for ids in (completion_prompt_ids(runtime, "Once upon"), chat_prompt_ids(runtime, [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])):
        text, tokens, finish = reference(runtime, ids, 32)
        for drafter in (None, _oracle(ids, tokens), _oracle(ids, tokens, 4)):
            out, gen = _generate(runtime, ids, 32, drafter)
            assert out == text and gen.finish_reason == finish
            s = gen.stats
            assert (s.prompt_tokens, s.completion_tokens) == (len(ids), len(tokens))
            assert s.mean_acceptance_length == pytest.approx(len(tokens) / s.target_steps)
            assert s.accepted_tokens <= s.draft_tokens and s.seconds > 0
            if drafter is None:
                assert s.target_steps == len(tokens) and s.draft_tokens == 0


def test_generation_ends_at_a_stop_token_without_its_text(runtime):
    """A runtime whose end-of-turn token is one its greedy answer reaches: finish "stop", the token counted in the
    usage but not in the text."""
    import dataclasses

    from drafter_lib.decoding.text_generation import completion_prompt_ids

    ids = completion_prompt_ids(runtime, "Stop token")
    _, plain, _ = reference(runtime, ids, 24)
    ends = dataclasses.replace(runtime, stop_ids=(plain[12],))
    text, tokens, finish = reference(ends, ids, 24)
    assert finish == "stop" and tokens == plain[:plain.index(plain[12]) + 1]
    out, gen = _generate(ends, ids, 24, _oracle(ids, plain, 5))
    assert (out, gen.finish_reason, gen.stats.completion_tokens) == (text, "stop", len(tokens))
    assert text == decoded(runtime.tokenizer, tokens[:-1])


def test_generation_cut_by_a_stop_string_counts_the_tokens_up_to_it(runtime):
    from drafter_lib.decoding.text_generation import completion_prompt_ids

    ids = completion_prompt_ids(runtime, "Cut me short")
    text, tokens, _ = reference(runtime, ids, 60)
    stop, i = stop_string_in(text, start=len(text) // 3)
    needed = next(n for n in range(1, len(tokens) + 1) if stop in decoded(runtime.tokenizer, tokens[:n]))
    for drafter in (None, _oracle(ids, tokens)):
        out, gen = _generate(runtime, ids, 60, drafter, stop=["\x00never", stop])
        assert out == text[:i] and gen.finish_reason == "stop"
        assert gen.stats.completion_tokens == needed  # however many tokens the drafter got accepted past it


def test_generation_checks_its_lengths(runtime):
    from drafter_lib.decoding.text_generation import (
        GenerationInputError,
        TextGeneration,
        chat_prompt_ids,
        completion_prompt_ids,
    )

    def error(fn, *args, **kw):
        with pytest.raises(GenerationInputError) as e:
            fn(*args, **kw)
        return e.value.param, str(e.value)

    assert error(TextGeneration, runtime, [1] * CONTEXT)[0] == "prompt"
    param, msg = error(TextGeneration, runtime, [1] * (CONTEXT - 10), 11)
    assert param == "max_tokens" and "at most 10 new tokens" in msg
    assert error(TextGeneration, runtime, [1], 0)[0] == "max_tokens"
    assert error(TextGeneration, runtime, [1], 4, stop=["a"] * 5)[0] == "stop"
    assert error(completion_prompt_ids, runtime, "")[0] == "prompt"
    assert error(completion_prompt_ids, runtime, [1, VOCAB])[0] == "prompt"
    assert error(chat_prompt_ids, runtime, [])[0] == "messages"
    # without max_tokens: up to the end of the context
    gen = TextGeneration(runtime, [1] * (CONTEXT - 3))
    assert gen.max_tokens == 3 and len(list(gen)) >= 1 and gen.stats.completion_tokens <= 3


def test_bounded_drafter_asks_no_more_than_the_drafters_context_holds(runtime):
    from drafter_lib.decoding.text_generation import BoundedDrafter, drafter_for

    asked = []

    class Engine:
        vocab_size, max_context, min_confidence = VOCAB, 20, None

        def draft(self, tokens, k, **options):
            asked.append((len(tokens), k, options))
            return [1] * k

        def info(self):
            return {"recommended_min_confidence": 0.4}

    bounded = BoundedDrafter(Engine(), min_confidence=0.3)
    assert bounded.draft([0] * 10, 16) == [1] * 10 and bounded.draft([0] * 20, 16) == []
    assert asked == [(10, 10, {"min_confidence": 0.3})]
    assert drafter_for(runtime, Engine()).options == {"min_confidence": 0.4}  # the pack's recommendation
    assert drafter_for(runtime, Engine(), 0.0).options == {"min_confidence": 0.0}
    Engine.vocab_size = VOCAB + 1
    with pytest.raises(ValueError, match="vocabulary"):
        drafter_for(runtime, Engine())


# ------------------------------------------------------------------ log-probabilities


@pytest.fixture(scope="module")
def w8a8_runtime():
    """The tiny target in the server's default numerics (W8A8, row-exact)."""
    from drafter_lib.decoding.runtime import runtime_from_model
    from drafter_lib.model.transformer import Transformer

    model, tokenizer = tiny_target_model()
    return runtime_from_model(Transformer.from_hf_model(model), tokenizer, "tiny", numerics="w8a8")


def _logprobs(runtime, ids, max_tokens, drafter, top, stop=None):
    from drafter_lib.decoding.text_generation import TextGeneration

    gen = TextGeneration(runtime, ids, max_tokens, drafter, k=8, stop=stop, top_logprobs=top)
    deltas = list(gen)
    return "".join(d.text for d in deltas), [e for d in deltas for e in d.logprobs], gen


def test_logprobs_under_speculation_are_plain_decodings_bit_for_bit(w8a8_runtime):
    """Every token's log-probability and the top alternatives at its position, from the verify pass's rows (drafted
    tokens' and bonus tokens' alike), equal plain decoding's (one row per pass) exactly, whatever the drafter."""
    import math

    from drafter_lib.decoding.text_generation import completion_prompt_ids

    rt, tok = w8a8_runtime, w8a8_runtime.tokenizer
    ids = completion_prompt_ids(rt, "Once upon a time")
    text, tokens, _ = reference(rt, ids, 48)
    plain_text, plain, gen = _logprobs(rt, ids, 48, None, 5)
    assert plain_text == text and gen.stats.target_steps == len(tokens)
    stopped = tokens[-1] in rt.stop_ids
    assert len(plain) == len(tokens) - stopped  # every token but an end-of-turn one
    for drafter in (_oracle(ids, tokens), _oracle(ids, tokens, 3)):
        out, entries, gen = _logprobs(rt, ids, 48, drafter, 5)
        assert out == text and gen.stats.target_steps < len(tokens)  # several tokens per pass
        assert entries == plain  # floats compared exactly
    for e in plain:
        assert len(e.bytes) == 1 and len(e.top) == 5  # a byte tokenizer: one byte a token
        assert e.top[0][2] == e.logprob and e.top[0][1] == e.bytes  # greedy: the token is the most likely
        assert [v for *_, v in e.top] == sorted((v for *_, v in e.top), reverse=True)
        assert sum(math.exp(v) for *_, v in e.top) <= 1 + 1e-6
    assert b"".join(e.bytes for e in plain).decode("utf-8", errors="replace") == text  # no special tokens here
    assert [e.offset for e in plain] == [len(decoded(tok, tokens[:i])) for i in range(len(plain))]
    # no alternatives asked: the token's own log-probability alone; a stop string: the tokens up to it
    _, bare, _ = _logprobs(rt, ids, 48, _oracle(ids, tokens), 0)
    assert [(e.text, e.logprob, e.top) for e in bare] == [(e.text, e.logprob, []) for e in plain]
    stop, i = stop_string_in(text, start=len(text) // 3)
    needed = next(n for n in range(1, len(tokens) + 1) if stop in decoded(tok, tokens[:n]))
    assert _logprobs(rt, ids, 48, _oracle(ids, tokens), 1, stop=stop)[1] == [
        dataclasses_replace_top(e, 1) for e in plain[:needed]]


def test_a_prompt_read_in_chunks_gives_the_same_answer_and_logprobs_bit_for_bit(w8a8_runtime):
    """prefill_chunk (the server's GENERATION_PREFILL_CHUNK): a prompt several chunks long is read in passes of
    its own, one empty delta each, and the answer, its tokens and their log-probabilities are the unchunked ones
    exactly, with or without drafts; the drafter reads each chunk too, and a cache of its own is dropped at the
    end."""
    import dataclasses

    from drafter_lib.decoding.text_generation import BoundedDrafter, TextGeneration, completion_prompt_ids

    rt = w8a8_runtime
    ids = completion_prompt_ids(rt, "A prompt long enough for several chunks of the target's prefill. " * 2)
    assert len(ids) > 6 * 16
    text, tokens, _ = reference(rt, ids, 40)
    read = []

    class Reading(BoundedDrafter):  # an oracle that records what it is asked to read ahead
        def prefill(self, tokens):
            read.append(len(tokens))

    oracle = Reading(_oracle(ids, tokens, 4))
    made = []
    own = dataclasses.replace(rt)
    own.new_target = lambda: made.append(rt.new_target()) or made[-1]
    for drafter in (None, oracle):
        plain = TextGeneration(rt, ids, 40, drafter, k=8, top_logprobs=3)
        want = [e for d in plain for e in d.logprobs]
        assert plain.stats.prefill_passes == 0
        for chunk, own_cache in ((16, False), (16, True), (37, True), (len(ids) - 1, False), (len(ids), False)):
            read.clear()
            gen = TextGeneration(own, ids, 40, drafter, k=8, top_logprobs=3, prefill_chunk=chunk, own_cache=own_cache)
            before = rt.target.cached_len
            deltas = list(gen)
            assert not own_cache or rt.target.cached_len == before  # the runtime's own target untouched
            passes = len(range(chunk, len(ids), chunk))
            assert gen.stats.prefill_passes == passes and [d.text for d in deltas[:passes]] == [""] * passes
            assert "".join(d.text for d in deltas) == text and gen.stats.completion_tokens == len(tokens)
            assert [e for d in deltas for e in d.logprobs] == want  # floats compared exactly
            assert gen.stats.target_steps == plain.stats.target_steps  # prefill passes are not steps
            assert read == ([chunk * (i + 1) for i in range(passes)] if drafter else [])
    assert len(made) == 4 and all(t.cache is None for t in made)  # each own cache dropped once its generation ended
    with pytest.raises(ValueError, match="prefill_chunk"):
        TextGeneration(rt, ids, 4, prefill_chunk=0)


def test_a_bounded_drafter_reads_ahead_within_its_context():
    from drafter_lib.decoding.text_generation import BoundedDrafter

    asked = []

    class Engine:
        max_context = 20

        def draft(self, tokens, k, **options):
            asked.append((len(tokens), k, options))
            return [1] * k

    bounded = BoundedDrafter(Engine(), min_confidence=0.3)
    bounded.prefill([0] * 10)
    bounded.prefill([0] * 20)  # no room for a token: nothing to read ahead for
    assert asked == [(10, 1, {"min_confidence": 0.3})]


def dataclasses_replace_top(entry, n: int):
    import dataclasses

    return dataclasses.replace(entry, top=entry.top[:n])


def test_token_text_is_the_tokens_own_bytes(runtime):
    from drafter_lib.decoding.text_stream import TokenText

    tok, names = runtime.tokenizer, TokenText(runtime.tokenizer)
    ids = tok.encode("é☃ a")
    assert [names.bytes(t) for t in ids] == [bytes([b]) for b in "é☃ a".encode()]  # pieces of characters too
    assert [names.text(t) for t in ids][-2:] == [" ", "a"] and names.text(ids[0]) == "\ufffd"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (names.bytes(im_end), names.in_text(im_end), names.in_text(ids[-1])) == (b"<|im_end|>", b"", b"a")


def test_logprobs_are_checked(w8a8_runtime):
    from drafter_lib.decoding.text_generation import GenerationInputError, TextGeneration

    for bad in (-1, 21):
        with pytest.raises(GenerationInputError) as e:
            TextGeneration(w8a8_runtime, [1, 2], 4, top_logprobs=bad)
        assert e.value.param == "top_logprobs"
    assert all(d.logprobs is None for d in TextGeneration(w8a8_runtime, [1, 2], 4))  # not asked: none computed
