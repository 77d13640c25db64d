"""The text of generated tokens as they arrive, cut before the first stop string.

Tokens are decoded incrementally over a short window (the offsets text-generation-inference and vLLM use): each
new token's text is the window's decoding minus the decoding of the window without it, so tokenizers whose pieces
change with their neighbours (a SentencePiece word's leading space) still add up to the text of the whole; text
that ends inside a multi-byte character waits for the next token. Special tokens decode to nothing
(`skip_special_tokens`), as in a plain `tokenizer.decode(tokens, skip_special_tokens=True)`.

Stop strings are matched on the text, across token boundaries: text that could still be the start of a stop
string is held back until it is not (or the stream ends), so nothing before a stop string is released twice and
nothing from it is released at all.

`TokenText` says what one token stands for on its own (the log-probabilities of an answer list tokens one by one):
its bytes, a piece of a character included, and those bytes as text.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence

MAX_STOP_STRINGS = 4  # as OpenAI's API
INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces


def check_stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """`stop` as a list of 0..4 non-empty strings (one string is a list of one); ValueError naming the problem."""
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else list(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return strings


class TextStream:
    """`push` generated tokens one at a time; each call returns the text that became final with it ("" while a
    character or a possible stop string is incomplete). Once a stop string appears, `stopped` is set, the text
    before it has been returned and every later push returns "". `finish()` returns what was held back when the
    tokens end without a stop string."""

    def __init__(self, tokenizer, stop: str | Sequence[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = check_stop_strings(stop)
        self.tokens: list[int] = []
        self.stopped = False
        self._prefix = self._read = 0  # the window: tokens[_prefix:_read] is decoded already, tokens[_read:] not
        self._held = ""  # decoded text not yet returned: it could be the start of a stop string

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        return self._release(self._decode_new())

    def finish(self) -> str:
        """The rest of the text (held back as a possible stop string, or an incomplete character) once no more
        tokens come."""
        if self.stopped:
            return ""
        rest = self._held + self._decode_new(final=True)
        self._held = ""
        return rest

    def _decode_new(self, final: bool = False) -> str:
        window = self.tokens[self._prefix:]
        before = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(window)
        if len(text) <= len(before) or (text.endswith(INCOMPLETE) and not final):
            return ""  # nothing new yet, or a character cut in the middle: wait for the next token
        self._prefix, self._read = self._read, len(self.tokens)
        return text[len(before):]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _release(self, new: str) -> str:
        text = self._held + new
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = max((n for s in self.stop for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])),
                   default=0)  # the longest end of the text that a stop string starts with
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]


class TokenText:
    """What a token of `tokenizer` stands for on its own: `bytes(id)` are its bytes (a byte-level BPE piece's bytes,
    a byte-fallback piece's byte, else its decoded text's UTF-8; a special token: its name, which the answer's text
    leaves out), `text(id)` those bytes as text (a piece of a character as U+FFFD) and `in_text(id)` the bytes it
    adds to the answer's text (none for a special token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_of = _byte_level_chars() if type(decoder).__name__ == "ByteLevel" else None
        self._known: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if token_id not in self._known:
            self._known[token_id] = self._bytes(token_id)
        return self._known[token_id]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.special:
            return str(piece).encode()
        if (m := BYTE_PIECE.fullmatch(str(piece))) is not None:
            return bytes([int(m[1], 16)])
        if self.byte_of is not None and all(c in self.byte_of for c in piece):
            return bytes(self.byte_of[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def in_text(self, token_id: int) -> bytes:
        return b"" if int(token_id) in self.special else self.bytes(token_id)


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in of each byte (GPT-2's table), inverted: character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}
