"""Input checks shared by the server, the engine and generation: token ids are validated the same way
everywhere, and per-request options are checked one value per request."""
from __future__ import annotations

from collections.abc import Sequence


def check_token_ids(tokens: Sequence[int], vocab_size: int, what: str = "tokens") -> list[int]:
    """Validate a list of token ids -> plain ints. Raises ValueError naming the first problem: empty, a non-integer
    (bools and non-integral floats included), or an id outside [0, vocab_size)."""
    if len(tokens) == 0:
        raise ValueError(f"{what} is empty")
    if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return list(tokens)  # the common case at C speed (a speculative loop checks its whole context every step)
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            if hasattr(t, "item") and getattr(t, "ndim", 1) == 0:
                t = t.item()  # numpy / torch integer scalar
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{what}[{i}] = {t!r} is not an integer token id")
        if t < 0 or t >= vocab_size:
            raise ValueError(f"{what}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def check_bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be a bool, got {value!r}")
    return value


def per_request(value, n: int, what: str, check) -> list:
    """One checked value per request: a scalar applies to all, a sequence must have one per request."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} values for {n} requests")
        return [check(v, f"{what}[{i}]") for i, v in enumerate(value)]
    return [check(value, what)] * n
