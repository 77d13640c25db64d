"""HTTP client for the drafter server (server.py).

`SpeculativeClient` is a drafter like any other (`draft(tokens, k, min_confidence=None) -> list[int]`), so the
speculative loop runs against the server with `speculative.speculative_generate(target, prompt, max_new_tokens,
client, k)`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx


class DraftServerError(RuntimeError):
    """The server answered with an error (the message is the server's)."""


class SpeculativeClient:
    """Thin synchronous HTTP client for server.py (keeps one connection open)."""

    def __init__(self, base_url: str, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def draft(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None) -> list[int]:
        """Up to k draft tokens; min_confidence None = the server's default, 0 = off (always k tokens)."""
        return self.draft_response(tokens, k, min_confidence)["draft"]

    def draft_response(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None,
                       return_probs: bool = False) -> dict:
        body = {"tokens": [int(t) for t in tokens], "num_draft_tokens": int(k)}
        if min_confidence is not None:
            body["min_confidence"] = float(min_confidence)
        if return_probs:
            body["return_probs"] = True
        r = self._http.post("/draft", json=body)
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
