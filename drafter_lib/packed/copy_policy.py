"""Copy prior: n-gram prompt lookup built only from the current request's tokens.

If the request ends with an n-gram (n = max_ngram down to min_ngram) that also occurs earlier in the request,
the tokens that followed its most recent earlier occurrence are proposed (at most `max_copy`). Nothing is kept
between requests.

How the engine combines it with the model draft (`mode`):
- "prefix":     the copied tokens become the first draft positions; the model is then run over them (one
                forward, so its KV cache stays consistent with the draft) and greedily continues the remaining
                k - len(copy) positions. Changes the draft: it wins when the target copies from its context
                (code, quotes, repeated names) more faithfully than the small drafter predicts.
- "accelerate": the copied tokens are only a guess for the drafter itself: one forward over them verifies how
                many the model would have produced greedily anyway; those are kept, the model continues from the
                first disagreement. The draft is identical to the model's plain greedy draft, only faster.
With `enabled: false` the engine drafts from the model alone.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MODES = ("prefix", "accelerate")


@dataclass(frozen=True)
class CopyPolicy:
    enabled: bool = False
    max_ngram: int = 3
    min_ngram: int = 2
    max_copy: int = 16
    mode: str = "prefix"

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"copy policy needs 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")
        if self.max_copy < 1:
            raise ValueError(f"copy policy max_copy must be >= 1, got {self.max_copy}")
        if self.mode not in MODES:
            raise ValueError(f"copy policy mode {self.mode!r} unknown; expected one of {MODES}")

    @classmethod
    def from_dict(cls, d: dict | None) -> CopyPolicy:
        if not d:
            return cls(enabled=False)
        known = {k: d[k] for k in ("enabled", "max_ngram", "min_ngram", "max_copy", "mode") if k in d}
        return cls(**known)

    @classmethod
    def load(cls, path: str | Path) -> CopyPolicy:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return asdict(self)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to min(k, max_copy) tokens that followed the latest earlier match of the request's suffix."""
        if not self.enabled or k <= 0:
            return []
        toks = list(tokens)
        n_tok = len(toks)
        limit = min(k, self.max_copy)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = toks[n_tok - n:]
            first = suffix[0]
            # scan backwards for the most recent earlier occurrence (start j < n_tok - n)
            for j in range(n_tok - n - 1, -1, -1):
                if toks[j] == first and toks[j:j + n] == suffix:
                    cont = toks[j + n:j + n + limit]
                    if cont:
                        return cont
        return []


class CopyDrafter:
    """n-gram prompt lookup alone, as a drafter: proposals come only from the current context (`policy.propose`,
    switched on whatever the policy says; default: CopyPolicy's n-gram settings)."""

    def __init__(self, policy: CopyPolicy | None = None):
        self.policy = replace(policy or CopyPolicy(), enabled=True)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.policy.propose(list(tokens), k))[:k]
