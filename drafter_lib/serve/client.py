"""HTTP clients for the drafter server (server.py).

`SpeculativeClient` is a drafter like any other (`draft(tokens, k, min_confidence=None) -> list[int]`), so the
speculative loop runs against the server with `speculative.speculative_generate(target, prompt, max_new_tokens,
client, k)`. `AsyncSpeculativeClient` has the same methods as coroutines. `draft_many` sends several sequences at
once: the server micro-batches concurrent requests, so this is how a client gets batching. `draft_tree(tokens,
budget, max_depth)` returns the server's draft tree (a `decoding.tree.DraftTree`; budget 8 and max_depth 16 by default,
as the server and the engine), so a client is also a tree drafter for `speculative_generate(..., tree_budget=N)`.

Both clients retry a 503 (queue full, request timed out, server starting or draining) and a request that got no
answer (connection refused or dropped, timeout), waiting the server's `Retry-After` or a short exponential backoff,
both bounded. A 4xx is the caller's mistake and is never retried. Drafting is a pure function of the request, so
sending one again is safe.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from drafter_lib.serve.schema import DEFAULT_TREE_BUDGET

if TYPE_CHECKING:
    from drafter_lib.decoding.tree import DraftTree


class DraftServerError(RuntimeError):
    """The server answered with an error (the message is the server's); `status` is the HTTP status."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """When to try a request again and how long to wait first. There are at most `max_retries` waits of at most
    `max_wait_s` each, so one call never sleeps longer than max_retries * max_wait_s in all."""

    max_retries: int = 3
    max_wait_s: float = 5.0
    backoff_s: float = 0.1  # first wait when the server names none; doubles each retry

    def wait_s(self, tries: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before try `tries + 1`, after try `tries` ended in `response` (None: no answer), or None:
        give up (not retryable, or no retries left)."""
        if tries > self.max_retries or (response is not None and response.status_code != 503):
            return None
        wait = _retry_after_s(response)
        if wait is None:
            wait = self.backoff_s * 2 ** (tries - 1)
        return min(wait, self.max_wait_s)


_NO_RETRY = RetryPolicy(max_retries=0)


def _retry_after_s(response: httpx.Response | None) -> float | None:
    """The server's Retry-After in seconds (it sends whole seconds); None without one, or for an HTTP-date."""
    try:
        seconds = float(response.headers["Retry-After"])
    except (AttributeError, KeyError, ValueError):
        return None
    return seconds if 0 <= seconds < math.inf else None


def draft_body(tokens: Sequence[int], k: int, min_confidence: float | None, return_probs: bool) -> dict:
    """The JSON body of POST /draft. Optional fields are sent only when set: a request without `min_confidence`
    gets the server's default."""
    body = {"tokens": [int(t) for t in tokens], "num_draft_tokens": int(k)}
    if min_confidence is not None:
        body["min_confidence"] = float(min_confidence)
    if return_probs:
        body["return_probs"] = True
    return body


def tree_body(tokens: Sequence[int], budget: int, max_depth: int, branch: int | None) -> dict:
    """The JSON body of a POST /draft tree request (`branch` None: the server's default)."""
    tree = {"budget": int(budget), "max_depth": int(max_depth)}
    if branch is not None:
        tree["branch"] = int(branch)
    return {"tokens": [int(t) for t in tokens], "tree": tree}


def _tree(answer: dict) -> DraftTree:
    from drafter_lib.decoding.tree import DraftTree  # here: importing the client does not import torch

    return DraftTree.from_dict(answer["tree"])


def _result(method: str, path: str, response: httpx.Response, tries: int) -> dict:
    """The JSON of a successful answer; any other answer raises DraftServerError with the server's message."""
    if response.is_success:
        return response.json()
    try:
        body = response.json()
        message = body.get("error") or body.get("status") or response.text  # /health's 503 says {"status": ...}
    except (ValueError, AttributeError):
        message = response.text
    after = f" (after {tries} tries)" if tries > 1 else ""
    raise DraftServerError(f"{method} {path} -> {response.status_code}: {message}{after}", response.status_code)


def _keep_waiting(error: Exception, deadline: float, timeout: float, url: str, proc) -> None:
    """wait_ready's rule, for both clients: poll through "not listening yet" and 503 (loading the model, draining)
    until the deadline; any other answer is final. `proc` (a Popen) makes a crashed server fail fast."""
    if isinstance(error, DraftServerError) and error.status != 503:
        raise error
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"server process exited with code {proc.returncode} before becoming healthy")
    if time.monotonic() > deadline:
        raise TimeoutError(f"server at {url} not healthy after {timeout:.0f}s") from None


class _ClientBase:
    _http_class: type

    def __init__(self, base_url: str, timeout: float = 60.0, *, api_key: str | None = None, max_retries: int = 3,
                 max_retry_wait_s: float = 5.0, max_concurrency: int = 16):
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.retry = RetryPolicy(max_retries, max_retry_wait_s)
        self.max_concurrency = max_concurrency
        # sent on every request; the server ignores it on /health
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = self._http_class(base_url=self.base_url, timeout=timeout, headers=headers)


class SpeculativeClient(_ClientBase):
    """Synchronous client; keeps its connections open. `max_concurrency` bounds the requests `draft_many` has in
    flight at once."""

    _http_class = httpx.Client

    def _request(self, method: str, path: str, body: dict | None = None, retry: bool = True) -> dict:
        policy = self.retry if retry else _NO_RETRY
        for tries in itertools.count(1):
            try:
                response = self._http.request(method, path, json=body)
            except httpx.TransportError:
                if (wait := policy.wait_s(tries, None)) is None:
                    raise
            else:
                if (wait := policy.wait_s(tries, response)) is None:
                    return _result(method, path, response, tries)
            time.sleep(wait)

    def draft(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None) -> list[int]:
        """Up to k draft tokens; min_confidence None = the server's default, 0 = off (always k tokens)."""
        return self.draft_response(tokens, k, min_confidence)["draft"]

    def draft_response(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None,
                       return_probs: bool = False) -> dict:
        return self._request("POST", "/draft", draft_body(tokens, k, min_confidence, return_probs))

    def draft_tree(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET, max_depth: int = 16,
                   branch: int | None = None) -> DraftTree:
        """A draft tree of at most `budget` nodes and `max_depth` levels (`branch`: candidates per expanded node; None:
        the server's default), parents before children, with each node's path probability."""
        return _tree(self.draft_tree_response(tokens, budget, max_depth, branch))

    def draft_tree_response(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET, max_depth: int = 16,
                            branch: int | None = None) -> dict:
        return self._request("POST", "/draft", tree_body(tokens, budget, max_depth, branch))

    def draft_many(self, sequences: Sequence[Sequence[int]], k: int = 16,
                   min_confidence: float | None = None) -> list[list[int]]:
        """One draft per sequence, in input order, sent concurrently so that the server batches them. All requests
        finish before the first failure (in input order) is raised. (httpx.Client is safe to share between
        threads.)"""
        sequences = list(sequences)
        if not sequences:
            return []
        with ThreadPoolExecutor(min(self.max_concurrency, len(sequences))) as pool:
            futures = [pool.submit(self.draft, tokens, k, min_confidence) for tokens in sequences]
        return [f.result() for f in futures]

    def health(self) -> dict:
        """/health's answer; a 503 (starting, draining) raises DraftServerError. Not retried: it is a probe."""
        return self._request("GET", "/health", retry=False)

    def info(self) -> dict:
        return self._request("GET", "/info")

    def wait_ready(self, timeout: float = 120.0, proc=None) -> dict:
        """Poll /health until the server is ready; `proc` (a Popen) makes a crashed server fail fast."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except (httpx.TransportError, DraftServerError) as e:
                _keep_waiting(e, deadline, timeout, self.base_url, proc)
            time.sleep(0.1)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSpeculativeClient(_ClientBase):
    """The same client for asyncio: every method is a coroutine; `async with` closes it (or `await aclose()`)."""

    _http_class = httpx.AsyncClient

    async def _request(self, method: str, path: str, body: dict | None = None, retry: bool = True) -> dict:
        policy = self.retry if retry else _NO_RETRY
        for tries in itertools.count(1):
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.TransportError:
                if (wait := policy.wait_s(tries, None)) is None:
                    raise
            else:
                if (wait := policy.wait_s(tries, response)) is None:
                    return _result(method, path, response, tries)
            await asyncio.sleep(wait)

    async def draft(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None) -> list[int]:
        return (await self.draft_response(tokens, k, min_confidence))["draft"]

    async def draft_response(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None,
                             return_probs: bool = False) -> dict:
        return await self._request("POST", "/draft", draft_body(tokens, k, min_confidence, return_probs))

    async def draft_tree(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET, max_depth: int = 16,
                         branch: int | None = None) -> DraftTree:
        return _tree(await self.draft_tree_response(tokens, budget, max_depth, branch))

    async def draft_tree_response(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET, max_depth: int = 16,
                                  branch: int | None = None) -> dict:
        return await self._request("POST", "/draft", tree_body(tokens, budget, max_depth, branch))

    async def draft_many(self, sequences: Sequence[Sequence[int]], k: int = 16,
                         min_confidence: float | None = None) -> list[list[int]]:
        """As SpeculativeClient.draft_many: at most max_concurrency requests in flight, answers in input order."""
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(tokens):
            async with gate:
                return await self.draft(tokens, k, min_confidence)

        # return_exceptions: let every request finish (none left running behind the caller), then raise the first
        results = await asyncio.gather(*(one(tokens) for tokens in sequences), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def health(self) -> dict:
        return await self._request("GET", "/health", retry=False)

    async def info(self) -> dict:
        return await self._request("GET", "/info")

    async def wait_ready(self, timeout: float = 120.0, proc=None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self.health()
            except (httpx.TransportError, DraftServerError) as e:
                _keep_waiting(e, deadline, timeout, self.base_url, proc)
            await asyncio.sleep(0.1)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
