"""Client for the drafter server and a complete greedy speculative decoding loop around it.

Each step: fetch a draft of k tokens for the current sequence from the server, run the target model once over
[uncached tokens + draft], accept the longest draft prefix that matches the target's greedy choices, then append
the target's own next token (the "bonus" token). The output therefore equals the target's plain greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx


class DraftServerError(RuntimeError):
    """The server answered with an error (the message is the server's)."""


class SpeculativeClient:
    """Thin synchronous HTTP client for server.py (keeps one connection open)."""

    def __init__(self, base_url: str, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def draft(self, tokens: Sequence[int], k: int = 16) -> list[int]:
        return self.draft_response(tokens, k)["draft"]

    def draft_response(self, tokens: Sequence[int], k: int = 16) -> dict:
        r = self._http.post("/draft", json={"tokens": [int(t) for t in tokens], "num_draft_tokens": int(k)})
        if r.status_code != 200:
            try:
                message = r.json().get("error", r.text)
            except ValueError:
                message = r.text
            raise DraftServerError(f"POST /draft -> {r.status_code}: {message}")
        return r.json()

    def health(self) -> dict:
        r = self._http.get("/health")
        r.raise_for_status()
        return r.json()

    def info(self) -> dict:
        r = self._http.get("/info")
        r.raise_for_status()
        return r.json()

    def wait_ready(self, timeout: float = 120.0, proc=None) -> dict:
        """Poll /health until the server answers; `proc` (a Popen) makes a crashed server fail fast."""
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server process exited with code {proc.returncode} before becoming healthy")
            try:
                return self.health()
            except (httpx.TransportError, httpx.HTTPStatusError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server at {self.base_url} not healthy after {timeout:.0f}s") from None
                time.sleep(0.1)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class SpeculativeResult:
    tokens: list[int]  # generated tokens only (prompt excluded)
    accepted_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per target step
    draft_lengths: list[int] = field(default_factory=list)  # draft tokens proposed per target step
    wall_s: float = 0.0

    @property
    def target_steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target step, bonus token included (plain decoding = 1.0), as vLLM reports it.
        Counts tokens actually emitted, so a last step cut short by EOS / max_new_tokens counts what it kept."""
        return len(self.tokens) / max(self.target_steps, 1)


def greedy_verify(draft: Sequence[int], target_choices: Sequence[int]) -> tuple[int, int]:
    """`target_choices[i]` is the target's greedy token after context + draft[:i] (len(draft) + 1 of them).
    Returns (accepted draft tokens n, bonus token = target_choices[n])."""
    n = 0
    while n < len(draft) and draft[n] == target_choices[n]:
        n += 1
    return n, int(target_choices[n])


def speculative_generate(target, client: SpeculativeClient, prompt_ids: Sequence[int], max_new_tokens: int,
                         num_draft_tokens: int = 16, eos_token_id: int | Sequence[int] | None = None
                         ) -> SpeculativeResult:
    """Greedy speculative decoding: `target` (a transformers causal LM) verifies drafts from the server.

    One target forward pass per step over the tokens not yet in its KV cache plus the draft. After verification
    the cache is cropped back to the accepted tokens (the bonus token enters the cache with the next step).
    """
    import inspect

    import torch
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    device = next(target.parameters()).device
    # transformers 5.x renamed `past_key_values` to `cache`; support both.
    cache_kw = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
    seq = [int(t) for t in prompt_ids]
    cache = DynamicCache()
    n_cached = 0  # tokens of `seq` whose keys/values are in `cache`
    out = SpeculativeResult(tokens=[])
    t0 = time.perf_counter()
    with torch.inference_mode():
        while len(out.tokens) < max_new_tokens:
            # No point drafting past the end: at most (remaining - 1) drafts + 1 bonus are still needed.
            k = min(num_draft_tokens, max_new_tokens - len(out.tokens) - 1)
            draft = client.draft(seq, k) if k > 0 else []
            new = seq[n_cached:] + draft
            ids = torch.tensor([new], dtype=torch.long, device=device)
            logits = target(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[0]
            # Row j predicts the token after new[j]; the first prediction we need follows seq[-1].
            first = len(seq) - n_cached - 1
            choices = logits[first:].argmax(dim=-1).tolist()
            n, bonus = greedy_verify(draft, choices)
            rejected = cache.get_seq_length() - (len(seq) + n)
            if rejected > 0:
                cache.crop(-rejected)  # drop keys/values of the rejected draft tokens (negative = how many)
            n_cached = len(seq) + n
            step = draft[:n] + [bonus]
            out.accepted_lengths.append(n)
            out.draft_lengths.append(len(draft))
            for t in step:
                seq.append(t)
                out.tokens.append(t)
                if t in eos or len(out.tokens) >= max_new_tokens:
                    out.wall_s = time.perf_counter() - t0
                    return out
    out.wall_s = time.perf_counter() - t0
    return out
