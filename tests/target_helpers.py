"""A tiny random target with a chat template (a Hugging Face folder), a drafter packed from it, and the target's own
plain greedy answers: shared by the tests of text generation, specdraft-generate and the OpenAI-compatible
endpoints."""

from __future__ import annotations

from pathlib import Path

from server_helpers import tiny_hf_model, write_tiny_model_dir

CONTEXT = 256  # the tiny target's context: a prompt too long for it is cheap to send
VOCAB = 259  # the byte tokenizer's: 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|>


def tiny_target_model(seed: int = 3):
    """(HF model, byte tokenizer): std-0.3 random weights, so greedy answers vary with the prompt."""
    from drafter_lib.model.tiny_models import byte_tokenizer

    return tiny_hf_model(seed=seed, vocab_size=VOCAB, max_position_embeddings=CONTEXT), byte_tokenizer()


def write_target_dir(out: Path, seed: int = 3) -> Path:
    """The tiny target as a Hugging Face folder: what TARGET and --target take."""
    model, tokenizer = tiny_target_model(seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


def write_drafter_dir(out: Path, seed: int = 3) -> Path:
    """The tiny target packed as its own drafter (int8: most drafts accepted, some not; fewer and shorter target
    steps than an int4 pack's, whose drafts mostly miss)."""
    return write_tiny_model_dir(out, tiny_target_model(seed)[0], bits=8)


def decoded(tokenizer, tokens) -> str:
    """The text of generated tokens as the endpoints define it: special tokens skipped, no clean-up of spaces."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def reference(runtime, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int], str]:
    """(text, tokens, finish reason) of the runtime's own plain greedy decoding: no drafter, one token per step."""
    from drafter_lib.decoding.speculative import greedy_decode

    tokens = greedy_decode(runtime.target, prompt_ids, max_tokens, runtime.stop_ids)
    stopped = bool(tokens) and tokens[-1] in runtime.stop_ids
    return decoded(runtime.tokenizer, tokens[:-1] if stopped else tokens), tokens, "stop" if stopped else "length"


def stop_string_in(text: str, length: int = 2, start: int = 4) -> tuple[str, int]:
    """(s, i): a printable ASCII string of `length` characters from `text`, first found at index i >= start."""
    for i in range(start, len(text) - length):
        s = text[i:i + length]
        if s.isascii() and s.isprintable() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no printable stop string in {text!r}")
