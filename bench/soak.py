"""Soak test for server.py: many clients for a bounded time, then a report of what went wrong (nothing, we hope).

Starts `./serve.sh` on a packed model dir (a free loopback port, like the tests do), then runs --clients concurrent
clients for --duration seconds. Each client has one kind of traffic:
  extend  - a speculative loop: prompt, then prompt + accepted part of the draft + one bonus token, repeatedly
            (bench/server.py's extend stream), so the prefix cache is hit;
  branch  - a few prefixes shared by all branch clients, each request with its own random continuation;
  new     - a fresh random prompt of random length every request;
and every client also sends, a few % of the time, a malformed request (each kind of bad body; it must get a 4xx
with a JSON error) or a request it abandons (cancelled after it was sent, or cut off in the middle of its body).
Token ids are random within the vocabulary, seeded; request sizes and thresholds vary.

With --target (the server's TARGET: a target spec or a Hugging Face folder) every --generate-every-th client is a
`generate` client instead: chat and text completions on /v1, streamed or not, with or without logprobs, some with a
prompt long enough to be read in several chunks (GENERATION_PREFILL_CHUNK); a few % of its requests are bad bodies
(a 4xx in OpenAI's error shape) or hung up on (a raw connection closed during a whole answer, or a stream closed
after a few of its events). A 200 must be whole (a finish reason; a stream's `[DONE]` and no error event), a 503
must carry Retry-After; a sample of the answers is re-sent alone after the load and must come back with the same
text (greedy answers depend on nothing else). The generate clients start after a first phase of /draft traffic
alone (--draft-only-s), so that the report can set /draft's p99 latency while generations run beside its p99
without them (the issue's aim: within 2x).

It reports: requests sent and answers by status; errors by kind (clean: 503 with Retry-After, 4xx for malformed
bodies; unexpected: anything else, e.g. a 5xx, a transport error, a 4xx for a well-formed request, a malformed
request answered 200); drafts equal to the same request sent alone (a sample of the soak's answers is re-sent one
at a time after the load stops); the server's RSS every --rss-every-s seconds, with its max after warm-up against
a bound; p50/p99 latency per --bucket-s; with --target, /draft's p50/p99 in the draft-only phase and after it.
Exit status 1 on any unexpected error, draft mismatch or RSS over the bound (or, with --max-draft-p99-ratio, a
/draft p99 with generations above that multiple of its p99 without them), else 0.

  python bench/soak.py                                  # 10 minutes, 16 clients, on model/
  python bench/soak.py --duration 120 --clients 16 --json soak.json
  python bench/soak.py --duration 600 --clients 200 --target smollm2-135m-instruct   # /draft and /v1 mixed
  python bench/soak.py --duration 60 --clients 50 --target smollm2-135m-instruct      # its smoke version
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # server_helpers: how the tests start ./serve.sh on a free port

from server_helpers import ServerProcess, proc_status_kib

from bench.server import Stream, percentile

KINDS = ("extend", "branch", "new")
GENERATE = "generate"  # the /v1 client kind (--target)
RSS_HEADROOM_MB = 300  # in-flight K/V of a decode group, activations, allocator slack
MISMATCHES_SHOWN = 5


# ---------------------------------------------------------------- traffic

class Branch:
    """Same prefix, different continuations: branch clients share a few seeded prefixes, so concurrent requests
    fork from one cached prefix."""

    def __init__(self, rng: random.Random, prefixes: list[list[int]], vocab: int):
        self.rng, self.prefixes, self.vocab = rng, prefixes, vocab

    def next_tokens(self) -> list[int]:
        tail = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 32))]
        return self.rng.choice(self.prefixes) + tail

    def feedback(self, draft: list[int]) -> None:
        pass


class NewPrompts(Stream):
    """A fresh random prompt every request (bench/server.py's "unrelated" stream), of random length."""

    def next_tokens(self) -> list[int]:
        self.prompt_len = self.rng.randint(1, self.max_len)
        return super().next_tokens()


def malformed_bodies(vocab: int, max_tokens: int) -> dict[str, bytes]:
    """One bad body of each kind the server must refuse with a 4xx (raw bytes: some are not even JSON)."""
    as_json = {
        "not_an_object": [1, 2, 3],
        "missing_tokens": {"num_draft_tokens": 4},
        "unknown_field": {"tokens": [1], "temperature": 0.5},
        "float_token": {"tokens": [1, 2.5]},
        "string_token": {"tokens": ["7"]},
        "bool_token": {"tokens": [1, True]},
        "null_tokens": {"tokens": None},
        "negative_id": {"tokens": [3, -1]},
        "id_equal_vocab": {"tokens": [3, vocab]},
        "huge_id": {"tokens": [10 ** 30]},
        "empty_tokens": {"tokens": []},
        "context_too_long": {"tokens": [1] * (max_tokens + 1)},
        "k_zero": {"tokens": [1], "num_draft_tokens": 0},
        "k_too_big": {"tokens": [1], "num_draft_tokens": 10_000},
        "k_string": {"tokens": [1], "num_draft_tokens": "16"},
        "min_confidence_above_1": {"tokens": [1], "min_confidence": 1.5},
        "return_probs_int": {"tokens": [1], "return_probs": 1},
    }
    raw = {"malformed_json": b'{"tokens": [1, 2', "empty_body": b"", "nan_confidence":
           b'{"tokens": [1], "min_confidence": NaN}'}
    return raw | {name: json.dumps(body).encode() for name, body in as_json.items()}


@dataclass
class Config:
    url: str
    vocab: int
    max_len: int  # longest context sent (the server's max_context_tokens at most)
    prompt_len: int
    k: int
    accept_p: float
    malformed_p: float
    disconnect_p: float
    timeout_s: float
    seed: int
    check: int  # size of the sample re-sent alone
    malformed: dict[str, bytes] = field(default_factory=dict)
    prefixes: list[list[int]] = field(default_factory=list)
    target: str | None = None  # the served model's name on /v1, when the server has a target
    generate_every: int = 0  # every n-th client is a generate client (0: none)
    draft_only_s: float = 0.0  # the generate clients start this long after the /draft ones
    long_prompt_p: float = 0.0  # share of generations with a prompt of several prefill chunks
    context: int = 0  # the target's context (bounds a long prompt)
    generation_timeout_s: float = 60.0  # a /v1 request may wait GENERATION_TIMEOUT_S to start, then run

    @property
    def cases(self) -> list[str]:
        return sorted(self.malformed)


@dataclass
class Soak:
    """Everything the clients observed (one event loop: no locks needed)."""
    t0: float
    deadline: float
    sent: Counter = field(default_factory=Counter)  # well_formed / malformed / disconnect
    status: Counter = field(default_factory=Counter)  # answers by HTTP status (well-formed and malformed)
    by_kind: dict = field(default_factory=dict)  # client kind -> Counter of statuses
    unexpected: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)  # the first few unexpected errors, in words
    malformed: dict = field(default_factory=dict)  # case -> Counter(sent, answered_4xx)
    disconnects: Counter = field(default_factory=Counter)
    first_disconnect_t: float | None = None
    done: list = field(default_factory=list)  # (seconds since start, latency) of each 200
    sample: list = field(default_factory=list)  # (body, draft, answer meta): reservoir of 200s
    offered: int = 0
    rss: list = field(default_factory=list)  # (seconds since start, MiB)
    generations: Counter = field(default_factory=Counter)  # /v1 requests by how they went
    generation_sample: list = field(default_factory=list)  # (path, body, text) of whole 200s, re-sent after
    generation_s: list = field(default_factory=list)  # seconds from request to the whole answer, per 200
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def error(self, kind: str, detail: str) -> None:
        self.unexpected[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail}"[:300])

    def keep(self, item: tuple, cap: int) -> None:
        """Reservoir sampling: every 200 has the same chance to be re-checked, whenever it came."""
        self.offered += 1
        if len(self.sample) < cap:
            self.sample.append(item)
        elif (j := self.rng.randrange(self.offered)) < cap:
            self.sample[j] = item


def json_error(r: httpx.Response) -> bool:
    try:
        return isinstance(r.json().get("error"), str)
    except (ValueError, AttributeError):
        return False


def request_body(rng: random.Random, tokens: list[int], cfg: Config) -> dict:
    # mostly the default size and no threshold (exactly k tokens); sometimes other sizes or a dynamic length
    k = cfg.k if rng.random() < 0.75 else rng.choice([1, 4, 32])
    body = {"tokens": tokens, "num_draft_tokens": k}
    conf = rng.choice([None, None, None, 0.0, 0.3])
    if conf is not None:
        body["min_confidence"] = conf
    return body


async def send_draft(http: httpx.AsyncClient, soak: Soak, cfg: Config, kind: str, body: dict) -> list[int] | None:
    soak.sent["well_formed"] += 1
    t = time.perf_counter()
    try:
        r = await http.post("/draft", json=body)
    except httpx.TransportError as e:
        soak.error(f"transport_{type(e).__name__}", f"{kind} request of {len(body['tokens'])} tokens: {e!r}")
        await asyncio.sleep(0.1)  # a dead server must not turn this loop into a busy spin
        return None
    lat = time.perf_counter() - t
    soak.status[r.status_code] += 1
    soak.by_kind.setdefault(kind, Counter())[r.status_code] += 1
    if r.status_code == 200:
        ans = r.json()
        draft, k = ans.get("draft"), body["num_draft_tokens"]
        exact = body.get("min_confidence") in (None, 0.0)  # the contract: no threshold -> exactly k tokens
        if (not isinstance(draft, list) or not all(isinstance(x, int) and 0 <= x < cfg.vocab for x in draft)
                or (len(draft) != k if exact else len(draft) > k)):
            soak.error("bad_draft", f"k={k} min_confidence={body.get('min_confidence')} -> {str(draft)[:80]}")
            return None
        soak.done.append((soak.now(), lat))
        soak.keep((body, draft, {"batch_size": ans.get("batch_size"), "cached_prefix_len":
                                 ans.get("cached_prefix_len")}), cfg.check)
        return draft
    if r.status_code == 503:  # overload is a clean answer if it says when to come back
        if "retry-after" not in r.headers or not json_error(r):
            soak.error("503_without_retry_after", r.text[:100])
        await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", 1))))
        return None
    what = "4xx_for_well_formed" if 400 <= r.status_code < 500 else f"http_{r.status_code}"
    soak.error(what, f"{kind} request of {len(body['tokens'])} tokens -> {r.status_code} {r.text[:160]}")
    return None


async def send_malformed(http: httpx.AsyncClient, rng: random.Random, soak: Soak, cfg: Config,
                         case: str | None = None) -> None:
    case = case or rng.choice(cfg.cases)
    soak.sent["malformed"] += 1
    counts = soak.malformed.setdefault(case, Counter())
    counts["sent"] += 1
    try:
        r = await http.post("/draft", content=cfg.malformed[case], headers={"content-type": "application/json"})
    except httpx.TransportError as e:
        soak.error(f"transport_{type(e).__name__}", f"malformed {case}: {e!r}")
        return
    soak.status[r.status_code] += 1
    if 400 <= r.status_code < 500 and r.status_code != 408 and json_error(r):
        counts["answered_4xx"] += 1
    elif r.status_code == 503:  # overloaded before it was even read: clean, not a verdict on the body
        counts["answered_503"] += 1
    else:
        soak.error("malformed_not_refused", f"{case} -> {r.status_code} {r.text[:120]}")


async def abandon(rng: random.Random, soak: Soak, cfg: Config, body: dict, cut_off: bool) -> None:
    """A client that goes away mid-request: half its body sent then the socket closed, or the whole request sent
    and cancelled before the answer (a connection of its own, as a real client's would be)."""
    soak.sent["disconnect"] += 1
    if soak.first_disconnect_t is None:
        soak.first_disconnect_t = soak.now()
    if cut_off:
        await cut_off_upload(rng, soak, cfg, json.dumps(body).encode())
        return
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s) as c:
        task = asyncio.ensure_future(c.post("/draft", json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.03))  # within the batch window: usually still queued
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, httpx.TransportError):
                await task
            soak.disconnects["cancelled_before_answer"] += 1
            return
    soak.disconnects["answered_before_cancel"] += 1
    if task.exception() is not None:
        soak.error(f"transport_{type(task.exception()).__name__}", f"abandoned request: {task.exception()!r}")
    elif task.result().status_code not in (200, 503):
        soak.error(f"http_{task.result().status_code}", f"abandoned request -> {task.result().text[:120]}")


async def cut_off_upload(rng: random.Random, soak: Soak, cfg: Config, data: bytes) -> None:
    host, port = httpx.URL(cfg.url).host, httpx.URL(cfg.url).port
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        soak.error(f"transport_{type(e).__name__}", f"connect for a cut-off upload: {e!r}")
        return
    head = (f"POST /draft HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    writer.write(head + data[: len(data) // 2])
    with suppress(OSError):
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, 0.05))
    writer.close()
    with suppress(OSError):
        await writer.wait_closed()
    soak.disconnects["cut_off_mid_body"] += 1


# ---------------------------------------------------------------- /v1 traffic

V1_MALFORMED = {  # name -> (path, body, status): what the server must refuse, in OpenAI's error shape
    "no_messages": ("/v1/chat/completions", {"messages": []}, 400),
    "sampling": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}, 400),
    "n_2": ("/v1/completions", {"prompt": "x", "n": 2}, 400),
    "json_mode": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "response_format": {"type": "json_object"}}, 400),
    "image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400),
    "string_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": "16"}, 400),
    "top_logprobs_21": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                 "top_logprobs": 21}, 400),
    "unknown_model": ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}, 404),
    "unknown_path": ("/v1/chat/completion", {"messages": []}, 404),
}
WORDS = ("the", "a", "river", "prime", "numbers", "explain", "why", "code", "list", "three", "cats", "sky")


def generation_body(rng: random.Random, cfg: Config, chat: bool | None = None) -> tuple[str, dict]:
    """A /v1 request: chat or text completion, streamed or not, sometimes with log-probabilities, sometimes with a
    long prompt (up to a tenth of the context in words, at most 600: a few chunks of GENERATION_PREFILL_CHUNK's
    default)."""
    chat = rng.random() < 0.5 if chat is None else chat
    n = rng.randint(2, 24)
    if rng.random() < cfg.long_prompt_p:
        n = rng.randint(min(100, cfg.context // 20), min(600, cfg.context // 10))
    words = " ".join(rng.choice(WORDS) for _ in range(n))
    body = {"model": cfg.target, "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        top = rng.randint(0, 5)
        body |= {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": words}]}
    return "/v1/completions", body | {"prompt": words}


def openai_error_shape(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
        return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return False


async def send_generation(http: httpx.AsyncClient, soak: Soak, cfg: Config, path: str, body: dict) -> None:
    soak.sent["generation"] += 1
    chat = "chat" in path
    t = time.perf_counter()
    try:
        if body["stream"]:
            async with http.stream("POST", path, json=body, timeout=cfg.generation_timeout_s) as r:
                if r.status_code != 200:
                    await r.aread()
                    status, events = r.status_code, []
                else:
                    status = 200
                    events = [ln.removeprefix("data: ") async for ln in r.aiter_lines() if ln]
        else:
            r = await http.post(path, json=body, timeout=cfg.generation_timeout_s)
            status, events = r.status_code, []
    except httpx.TransportError as e:
        soak.error(f"transport_{type(e).__name__}", f"{path}: {e!r}")
        await asyncio.sleep(0.1)
        return
    soak.status[status] += 1
    soak.by_kind.setdefault(GENERATE, Counter())[status] += 1
    if status == 503:
        if "retry-after" not in r.headers or not openai_error_shape(r):
            soak.error("503_without_retry_after", r.text[:100])
        soak.generations["503"] += 1
        await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", 1))))
        return
    if status != 200:
        soak.error(f"v1_http_{status}", f"{path} {json.dumps(body)[:80]} -> {r.text[:160]}")
        return
    asked = "logprobs" in body
    if body["stream"]:
        chunks = [json.loads(e) for e in events[:-1]] if events and events[-1] == "[DONE]" else None
        if not chunks or any("error" in c for c in chunks):
            soak.error("v1_stream_broken", f"{path}: {str(events[-3:])[:200]}")
            return
        choices = [c["choices"][0] for c in chunks if c.get("choices")]
        if not choices or choices[-1]["finish_reason"] not in ("stop", "length"):
            soak.error("v1_stream_unfinished", f"{path}: {str(chunks[-1])[:160]}")
            return
        if asked and not any(ch.get("logprobs") for ch in choices):
            soak.error("v1_no_logprobs", f"{path} stream")
        soak.generations["streamed"] += 1
        soak.generation_s.append(time.perf_counter() - t)
        return
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    if choice["finish_reason"] not in ("stop", "length") or not isinstance(text, str) or (
            asked and not choice.get("logprobs")):
        soak.error("v1_answer_incomplete", f"{path}: {str(choice)[:160]}")
        return
    soak.generations["whole"] += 1
    soak.generation_s.append(time.perf_counter() - t)
    if len(soak.generation_sample) < cfg.check // 4:
        soak.generation_sample.append((path, body, text))


async def send_v1_malformed(http: httpx.AsyncClient, rng: random.Random, soak: Soak, cfg: Config) -> None:
    case = rng.choice(sorted(V1_MALFORMED))
    path, body, want = V1_MALFORMED[case]
    soak.sent["malformed"] += 1
    counts = soak.malformed.setdefault("v1_" + case, Counter())
    counts["sent"] += 1
    try:
        r = await http.post(path, json={"model": cfg.target} | body)
    except httpx.TransportError as e:
        soak.error(f"transport_{type(e).__name__}", f"v1 malformed {case}: {e!r}")
        return
    soak.status[r.status_code] += 1
    if r.status_code == want and openai_error_shape(r):
        counts["answered_4xx"] += 1
    elif r.status_code == 503:
        counts["answered_503"] += 1
    else:
        soak.error("v1_malformed_not_refused", f"{case} -> {r.status_code} {r.text[:120]}")


async def hang_up_on_generation(rng: random.Random, soak: Soak, cfg: Config) -> None:
    """A client that leaves during its answer: the whole request on a raw connection, closed after a moment (a
    whole answer) or in the middle of a stream, after its first few events."""
    path, body = generation_body(rng, cfg, chat=True)
    del body["max_tokens"]  # as long as the server allows: GENERATION_DEFAULT_MAX_TOKENS, or the context's rest
    soak.sent["disconnect"] += 1
    if soak.first_disconnect_t is None:
        soak.first_disconnect_t = soak.now()
    host, port = httpx.URL(cfg.url).host, httpx.URL(cfg.url).port
    data = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        soak.error(f"transport_{type(e).__name__}", f"connect for a hang-up: {e!r}")
        return
    writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    with suppress(OSError, asyncio.TimeoutError):
        await writer.drain()
        if body["stream"]:
            await asyncio.wait_for(read_events(reader, rng.randint(1, 6)), timeout=cfg.generation_timeout_s)
        else:
            await asyncio.sleep(rng.uniform(0.05, 0.5))
    writer.close()
    with suppress(OSError):
        await writer.wait_closed()
    soak.disconnects["hung_up_on_generation"] += 1


async def read_events(reader: asyncio.StreamReader, n: int) -> None:
    """Until `n` server-sent events have come, or the stream ended; at once for an answer that is no stream (a
    503: the connection would stay open)."""
    if b" 200 " not in await reader.readline():
        return
    seen = 0
    while seen < n and (line := await reader.readline()):
        seen += line.startswith(b"data: ")


async def generate_client(cid: int, http: httpx.AsyncClient, soak: Soak, cfg: Config) -> None:
    rng = random.Random(cfg.seed * 1000 + cid)
    await asyncio.sleep(max(0.0, soak.t0 + cfg.draft_only_s - time.perf_counter()))  # /draft alone first
    n = 0
    while time.perf_counter() < soak.deadline:
        n += 1
        u = rng.random()
        # its 1st request is a bad body and its 2nd hung up on (both quick), so even a short, slow run has both
        if n == 1 or (n > 2 and u < cfg.malformed_p):
            await send_v1_malformed(http, rng, soak, cfg)
        elif n == 2 or (n > 2 and u < cfg.malformed_p + cfg.disconnect_p):
            await hang_up_on_generation(rng, soak, cfg)
        else:
            await send_generation(http, soak, cfg, *generation_body(rng, cfg))


async def replay_generations(cfg: Config, soak: Soak, max_s: float) -> dict:
    """Each sampled whole answer asked again, alone: a greedy answer is the same whatever ran beside it."""
    equal, checked, mismatches = 0, 0, []
    stop = time.perf_counter() + max_s
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.generation_timeout_s) as http:
        for path, body, text in soak.generation_sample:
            if time.perf_counter() > stop:
                break
            try:
                r = await http.post(path, json=body)
            except httpx.TransportError as e:
                soak.error(f"transport_{type(e).__name__}", f"generation replay: {e!r}")
                continue
            if r.status_code != 200:
                soak.error(f"replay_http_{r.status_code}", r.text[:120])
                continue
            choice = r.json()["choices"][0]
            alone, checked = (choice["message"]["content"] if "chat" in path else choice["text"]), checked + 1
            if alone == text:
                equal += 1
            else:
                mismatches.append({"path": path, "body": body, "soak_text": text, "alone_text": alone})
    return {"sampled": len(soak.generation_sample), "checked": checked, "equal": equal, "mismatches": mismatches}


# ---------------------------------------------------------------- the clients


async def client(cid: int, http: httpx.AsyncClient, soak: Soak, cfg: Config) -> None:
    if cfg.generate_every and cid % cfg.generate_every == cfg.generate_every - 1:
        return await generate_client(cid, http, soak, cfg)
    rng = random.Random(cfg.seed * 1000 + cid)
    kind = KINDS[cid % len(KINDS)]
    if kind == "extend":
        stream = Stream("extend", rng, cfg.vocab, cfg.prompt_len, cfg.max_len, cfg.accept_p)
    elif kind == "branch":
        stream = Branch(rng, cfg.prefixes, cfg.vocab)
    else:
        stream = NewPrompts("unrelated", rng, cfg.vocab, cfg.prompt_len, cfg.max_len, cfg.accept_p)
    n = 0
    while time.perf_counter() < soak.deadline:
        n += 1
        u = rng.random()
        # every client's 2nd request is malformed and its 3rd abandoned, so even a short, slow run has both
        if n == 2 or (n > 3 and u < cfg.malformed_p):
            await send_malformed(http, rng, soak, cfg, case=cfg.cases[cid % len(cfg.cases)] if n == 2 else None)
        elif n == 3 or (n > 3 and u < cfg.malformed_p + cfg.disconnect_p):
            cut_off = cid % 2 == 0 if n == 3 else rng.random() < 0.5
            await abandon(rng, soak, cfg, request_body(rng, stream.next_tokens(), cfg), cut_off)
        else:
            draft = await send_draft(http, soak, cfg, kind, request_body(rng, stream.next_tokens(), cfg))
            if draft is not None:
                stream.feedback(draft)


async def watch_rss(srv: ServerProcess, soak: Soak, every_s: float) -> None:
    """Samples the server's VmRSS; a server that dies ends the soak at once (and is an unexpected error)."""
    while True:
        if srv.proc.poll() is not None:
            soak.error("server_died", f"exit code {srv.proc.returncode} at {soak.now():.0f}s")
            soak.deadline = time.perf_counter()
            return
        with suppress(OSError, KeyError):  # gone between the poll and the read: the next poll says so
            soak.rss.append((round(soak.now(), 2), proc_status_kib(srv.proc.pid, "VmRSS") / 1024))
        await asyncio.sleep(every_s)


async def run_load(srv: ServerProcess, cfg: Config, clients: int, duration: float, rss_every_s: float) -> Soak:
    t0 = time.perf_counter()
    soak = Soak(t0=t0, deadline=t0 + duration, rng=random.Random(cfg.seed))
    watcher = asyncio.ensure_future(watch_rss(srv, soak, rss_every_s))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s, limits=limits) as http:
        tasks = [asyncio.ensure_future(client(i, http, soak, cfg)) for i in range(clients)]
        # each client stops at the deadline once its request is answered (bounded by the request timeout)
        longest = max(cfg.timeout_s, cfg.generation_timeout_s if cfg.generate_every else 0)
        _, stuck = await asyncio.wait(tasks, timeout=duration + 2 * longest + 10)
        for t in stuck:
            soak.error("client_stuck", "a client was still waiting long past the deadline")
            t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                soak.error(f"client_crashed_{type(t.exception()).__name__}", repr(t.exception()))
    watcher.cancel()
    with suppress(asyncio.CancelledError):
        await watcher
    return soak


async def replay(cfg: Config, soak: Soak, max_s: float) -> dict:
    """Each sampled request again, alone and one at a time: the engine promises the same draft whatever the
    cache state and whatever shared the batch. Stops after `max_s` seconds (what was compared is reported)."""
    equal, checked, mismatches, lat = 0, 0, [], []
    stop = time.perf_counter() + max_s
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s) as http:
        for body, draft, meta in soak.sample:
            if time.perf_counter() > stop:
                break
            t = time.perf_counter()
            try:
                r = await http.post("/draft", json=body)
            except httpx.TransportError as e:
                soak.error(f"transport_{type(e).__name__}", f"replay: {e!r}")
                continue
            if r.status_code != 200:
                soak.error(f"replay_http_{r.status_code}", r.text[:120])
                continue
            lat.append(time.perf_counter() - t)
            alone, checked = r.json()["draft"], checked + 1
            if alone == draft:
                equal += 1
            else:
                mismatches.append({"context_len": len(body["tokens"]), "num_draft_tokens": body["num_draft_tokens"],
                                   "min_confidence": body.get("min_confidence"), **meta, "soak_draft": draft,
                                   "alone_draft": alone, "tokens": body["tokens"]})
    return {"sampled": len(soak.sample), "checked": checked, "equal": equal, "mismatches": mismatches,
            "alone_p50_ms": round(percentile(lat, 50) * 1e3, 1) if lat else None}


# ---------------------------------------------------------------- report

def per_bucket(soak: Soak, bucket_s: float, duration: float) -> list[dict]:
    n = max(1, math.ceil(duration / bucket_s))
    rows = []
    for i in range(n):
        lo, hi = i * bucket_s, (i + 1) * bucket_s
        last = i == n - 1  # answers that came in the grace after the deadline count in the last bucket
        lat = [x for t, x in soak.done if lo <= t < hi or (last and t >= hi)]
        rss = [m for t, m in soak.rss if lo <= t < hi or (last and t >= hi)]
        rows.append({"from_s": lo, "to_s": min(hi, duration), "served": len(lat),
                     "p50_ms": round(percentile(lat, 50) * 1e3, 1) if lat else None,
                     "p99_ms": round(percentile(lat, 99) * 1e3, 1) if lat else None,
                     "rss_max_mib": round(max(rss), 1) if rss else None})
    return rows


def draft_phases(soak: Soak, draft_only_s: float, settle_s: float, max_ratio: float | None) -> dict | None:
    """/draft's latency without generations (the first phase) and with them (the rest), each past its first
    `settle_s` seconds (cold caches, clients starting); None without generate clients."""
    if not draft_only_s:
        return None

    def stats(lat: list[float]) -> dict:
        return {"served": len(lat), "p50_ms": round(percentile(lat, 50) * 1e3, 1) if lat else None,
                "p99_ms": round(percentile(lat, 99) * 1e3, 1) if lat else None}

    alone = stats([x for t, x in soak.done if settle_s <= t < draft_only_s])
    mixed = stats([x for t, x in soak.done if t >= draft_only_s + settle_s])
    ratio = round(mixed["p99_ms"] / alone["p99_ms"], 2) if alone["p99_ms"] and mixed["p99_ms"] else None
    return {"draft_only_s": draft_only_s, "settle_s": settle_s, "without_generations": alone,
            "with_generations": mixed, "p99_ratio": ratio, "max_ratio": max_ratio}


def rss_summary(soak: Soak, warmup_s: float, ready_mib: float, bound_mib: float, bound_rule: str) -> dict:
    after = [m for t, m in soak.rss if t >= warmup_s]
    half = len(after) // 2  # flat after warm-up: the second half peaks no higher than the first (cache full)
    growth = round(max(after[half:]) - max(after[:half]), 1) if half else None
    return {"samples": soak.rss, "at_ready_mib": round(ready_mib, 1), "warmup_s": warmup_s,
            "max_after_warmup_mib": round(max(after), 1) if after else None,
            "min_after_warmup_mib": round(min(after), 1) if after else None,
            "growth_second_half_mib": growth, "max_mib": round(max((m for _, m in soak.rss), default=ready_mib), 1),
            "bound_mib": round(bound_mib, 1), "bound_rule": bound_rule,
            "within_bound": bool(after) and max(after) <= bound_mib}


def print_report(rep: dict) -> None:
    req, mal, dis, drafts, rss = rep["requests"], rep["malformed"], rep["disconnects"], rep["drafts"], rep["rss"]
    print(f"\n{'from s':>7} {'to s':>6} {'served':>7} {'p50 ms':>8} {'p99 ms':>8} {'RSS MiB':>8}")
    for b in rep["buckets"]:
        cells = [f"{b[k]:>8.1f}" if b[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p99_ms", "rss_max_mib")]
        print(f"{b['from_s']:>7.0f} {b['to_s']:>6.0f} {b['served']:>7} " + " ".join(cells))
    print(f"\nrequests: {req['sent_total']} sent in {rep['wall_s']:.0f}s ({dict(req['sent'])}); "
          f"answers by status {req['by_status']}; served {req['served']} ({req['served'] / rep['wall_s']:.1f}/s)")
    print(f"  by client kind: {req['by_kind']}")
    print(f"malformed: {mal['sent']} sent, {mal['answered_4xx']} answered 4xx with a JSON error, "
          f"{mal['answered_503']} 503 ({len(mal['by_case'])} kinds of bad body)")
    print(f"disconnects: {dis['sent']} ({dis['how']}); {dis['served_after_first']} requests served after the first")
    print(f"errors: clean {rep['errors']['clean']}; unexpected {rep['errors']['unexpected'] or 'none'}")
    for e in rep["errors"]["examples"]:
        print(f"  {e}")
    print(f"drafts equal to the same request sent alone: {drafts['equal']}/{drafts['checked']} "
          f"(of {drafts['sampled']} sampled; alone p50 {drafts['alone_p50_ms']} ms)")
    for m in drafts["mismatches"][:MISMATCHES_SHOWN]:
        print(f"  MISMATCH context {m['context_len']} k={m['num_draft_tokens']} min_confidence={m['min_confidence']} "
              f"batch {m['batch_size']} cached {m['cached_prefix_len']}: soak {m['soak_draft']} alone "
              f"{m['alone_draft']}")
    growth = rss["growth_second_half_mib"]
    gen = rep["generations"]
    if gen.get("by_outcome") or gen.get("sampled"):
        print(f"generations (/v1): {gen['by_outcome']}, seconds to the whole answer p50 {gen['p50_s']} p99 "
              f"{gen['p99_s']}; answers equal to the same request alone: {gen.get('equal')}/{gen.get('checked')} "
              f"(of {gen.get('sampled')} sampled)")
        for m in gen.get("mismatches", [])[:MISMATCHES_SHOWN]:
            print(f"  MISMATCH {m['path']}: soak {m['soak_text'][:60]!r} alone {m['alone_text'][:60]!r}")
    if (lat := rep.get("draft_latency")) is not None:
        alone, mixed = lat["without_generations"], lat["with_generations"]
        ratio = lat["p99_ratio"]
        aim = "" if ratio is None else f" (the issue's aim, within 2x: {'yes' if ratio <= 2 else 'no'})"
        print(f"/draft latency without generations (from {lat['settle_s']:.0f}s to {lat['draft_only_s']:.0f}s): "
              f"p50 {alone['p50_ms']} ms, p99 {alone['p99_ms']} ms ({alone['served']} served); with generations "
              f"(from {lat['draft_only_s'] + lat['settle_s']:.0f}s): p50 {mixed['p50_ms']} ms, p99 {mixed['p99_ms']} "
              f"ms ({mixed['served']} served); p99 ratio {ratio}{aim}")
    print(f"RSS: at ready {rss['at_ready_mib']:.0f} MiB; after warm-up ({rss['warmup_s']:.0f}s) "
          f"{rss['min_after_warmup_mib']}..{rss['max_after_warmup_mib']} MiB, the second half's peak "
          f"{'-' if growth is None else f'{growth:+.1f}'} MiB over the first's; bound {rss['bound_mib']:.0f} MiB "
          f"({rss['bound_rule']}): {'within' if rss['within_bound'] else 'OVER'}")
    print(f"server: {rep['server_counters']}")
    print(f"result: {'PASS' if rep['ok'] else 'FAIL: ' + '; '.join(rep['failures'])}")


def build_report(soak: Soak, checked: dict, wall_s: float, buckets: list[dict], rss: dict, counters: dict,
                 settings: dict, generated: dict | None = None, draft_latency: dict | None = None) -> dict:
    mal = soak.malformed.values()
    served_after = sum(1 for t, _ in soak.done if soak.first_disconnect_t is not None and t > soak.first_disconnect_t)
    rep = {
        "settings": settings, "wall_s": round(wall_s, 1),
        "requests": {"sent": dict(soak.sent), "sent_total": sum(soak.sent.values()),
                     "by_status": {str(k): v for k, v in sorted(soak.status.items())},
                     "served": soak.status.get(200, 0),
                     "by_kind": {k: {str(s): n for s, n in sorted(c.items())} for k, c in soak.by_kind.items()}},
        "malformed": {"sent": sum(c["sent"] for c in mal), "answered_4xx": sum(c["answered_4xx"] for c in mal),
                      "answered_503": sum(c["answered_503"] for c in mal),
                      "by_case": {k: dict(c) for k, c in sorted(soak.malformed.items())}},
        "disconnects": {"sent": soak.sent["disconnect"], "how": dict(soak.disconnects),
                        "served_after_first": served_after},
        "errors": {"clean": {"503": soak.status.get(503, 0),
                             "4xx_for_malformed": sum(c["answered_4xx"] for c in mal)},
                   "unexpected": dict(soak.unexpected), "examples": soak.examples},
        "drafts": {**checked, "mismatches": checked["mismatches"][:50]},
        "buckets": buckets, "rss": rss, "server_counters": counters,
        "generations": {"by_outcome": dict(soak.generations), **(generated or {}),
                        "p50_s": round(percentile(soak.generation_s, 50), 2) if soak.generation_s else None,
                        "p99_s": round(percentile(soak.generation_s, 99), 2) if soak.generation_s else None},
        "draft_latency": draft_latency,
    }
    failures = []
    if draft_latency and draft_latency["max_ratio"] and (draft_latency["p99_ratio"] or 0) > draft_latency["max_ratio"]:
        failures.append(f"/draft p99 with generations {draft_latency['p99_ratio']}x its p99 without them, bound "
                        f"{draft_latency['max_ratio']}x")
    if generated and generated["equal"] != generated["checked"]:
        failures.append(f"{generated['checked'] - generated['equal']} answers differ from the same request alone")
    if soak.unexpected:
        failures.append(f"{sum(soak.unexpected.values())} unexpected errors")
    if checked["sampled"] and not checked["checked"]:
        failures.append("no sampled draft was re-checked")
    if checked["equal"] != checked["checked"]:
        failures.append(f"{checked['checked'] - checked['equal']} drafts differ from the same request sent alone")
    if not rss["within_bound"]:
        failures.append(f"RSS {rss['max_after_warmup_mib']} MiB after warm-up, bound {rss['bound_mib']:.0f} MiB")
    if not rep["requests"]["served"]:
        failures.append("nothing served")
    rep["failures"], rep["ok"] = failures, not failures
    return rep


def server_counters(url: str) -> dict:
    """The server's own view at the end: answers by status, 503s by reason, cache fill and evictions."""
    m = httpx.get(url + "/info", timeout=30).json()["server"]["metrics"]
    cache = m.get("cache", {})
    keep = ("cached_bytes", "peak_cache_bytes", "max_cache_bytes", "entries", "evictions", "hit_rate")
    return {"responses": m["responses"], "rejected": {k: v for k, v in m["rejected"].items() if v},
            "cache": {k: cache[k] for k in keep if k in cache}}


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "model"), help="packed model to serve (default: model/)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (kinds round-robin: "
                    + ", ".join(KINDS) + ")")
    ap.add_argument("--k", type=int, default=16, help="num_draft_tokens of most requests (some ask 1, 4 or 32)")
    ap.add_argument("--prompt-len", type=int, default=128, help="extend/branch prompt length")
    ap.add_argument("--max-len", type=int, default=384, help="longest context sent (extend restarts past it)")
    ap.add_argument("--accept-p", type=float, default=0.7, help="extend: per-token acceptance probability")
    ap.add_argument("--malformed-p", type=float, default=0.03, help="share of requests with a bad body")
    ap.add_argument("--disconnect-p", type=float, default=0.03, help="share of requests abandoned mid-request")
    ap.add_argument("--check", type=int, default=200, help="answers sampled to re-send alone after the load")
    ap.add_argument("--check-max-s", type=float, default=120.0, help="longest re-sending of the sample")
    ap.add_argument("--bucket-s", type=float, default=60.0, help="latency/RSS table granularity (default 60)")
    ap.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampling period")
    ap.add_argument("--warmup-s", type=float, help="RSS before this is not held to the bound (default: a fifth of "
                    "the duration, at most 60s)")
    ap.add_argument("--rss-bound-mb", type=float, help="RSS bound in MiB. Default: the server's RSS once ready "
                    "(interpreter, torch and the loaded weights) + its MAX_CACHE_MB (the prefix cache's bound) + "
                    f"{RSS_HEADROOM_MB} MiB headroom (in-flight K/V of a decode group, activations, allocator slack)")
    ap.add_argument("--max-cache-mb", type=float, help="the server's MAX_CACHE_MB (default: the server's default)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="another server setting (env var, e.g. MAX_QUEUE=8); repeatable")
    ap.add_argument("--target", help="the server's TARGET (a target spec or a Hugging Face folder): adds /v1 "
                    "generate clients")
    ap.add_argument("--generate-every", type=int, default=4, help="with --target, every n-th client is a generate "
                    "client (default 4)")
    ap.add_argument("--draft-only-s", type=float, help="with --target, seconds of /draft traffic alone before the "
                    "generate clients start (default: a fifth of the duration, at most 120)")
    ap.add_argument("--settle-s", type=float, default=5.0, help="latency of the first seconds of each phase is not "
                    "counted in its p50/p99 (default 5)")
    ap.add_argument("--long-prompt-p", type=float, default=0.1, help="with --target, share of generations with a "
                    "prompt of several prefill chunks (default 0.1)")
    ap.add_argument("--max-draft-p99-ratio", type=float, help="fail if /draft's p99 with generations exceeds this "
                    "multiple of its p99 without them (default: report only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", help="server log file (default: a temporary file; its tail is printed on failure)")
    ap.add_argument("--json", help="also write the report here")
    return ap.parse_args(argv)


def start_server(args, log_path: Path) -> ServerProcess:
    settings = dict(s.split("=", 1) for s in args.set)
    if args.max_cache_mb is not None:
        settings["MAX_CACHE_MB"] = args.max_cache_mb
    if args.target is not None:
        settings["TARGET"] = args.target
    env = dict(os.environ)
    env.pop("DEFAULT_MIN_CONFIDENCE", None)  # the soak checks the default contract: no threshold -> exactly k
    srv = ServerProcess(Path(args.model_dir), log_path, env=env, **settings)
    try:
        srv.wait_ready(300)
    except BaseException:
        srv.stop()
        raise
    return srv


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()} (server side: the same machine)", flush=True)
    if not (Path(args.model_dir) / "config.json").exists():
        sys.exit(f"{args.model_dir} holds no packed model (config.json missing); pass --model-dir")
    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    log_path = Path(args.log) if args.log else Path(tmp.name) / "server.log"
    srv = start_server(args, log_path)
    try:
        rep = soak_server(srv, args)
        log = srv.log()
    finally:
        srv.stop()
    if "Traceback" in log:
        rep["errors"]["unexpected"]["server_log_traceback"] = log.count("Traceback")
        rep["failures"].append("tracebacks in the server log")
        rep["ok"] = False
    print_report(rep)
    if not rep["ok"]:
        print("--- server log (tail) ---\n" + "\n".join(log.splitlines()[-30:]))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    tmp.cleanup()
    return 0 if rep["ok"] else 1


def soak_server(srv: ServerProcess, args) -> dict:
    info = httpx.get(srv.url + "/info", timeout=30).json()
    server = info["server"]
    vocab, max_tokens = info["vocab_size"], server["max_context_tokens"]
    ready_mib = proc_status_kib(srv.proc.pid, "VmRSS") / 1024  # before any request: runtime + weights
    if args.rss_bound_mb is not None:
        bound, rule = args.rss_bound_mb, "--rss-bound-mb"
    else:
        bound = ready_mib + server["max_cache_mb"] + RSS_HEADROOM_MB
        rule = f"RSS at ready + MAX_CACHE_MB {server['max_cache_mb']:.0f} + {RSS_HEADROOM_MB} headroom"
    warmup = args.warmup_s if args.warmup_s is not None else min(60.0, args.duration / 5)
    max_len = min(args.max_len, max_tokens)
    prompt_len = max(1, min(args.prompt_len, max_len - 32))  # branch prompts get up to 32 more tokens
    rng = random.Random(args.seed)
    target = info.get("target") or {}
    generate_every = args.generate_every if target else 0
    draft_only = (min(120.0, args.duration / 5) if args.draft_only_s is None else args.draft_only_s) \
        if generate_every else 0.0
    cfg = Config(url=srv.url, vocab=vocab, max_len=max_len, prompt_len=prompt_len, k=args.k, accept_p=args.accept_p,
                 malformed_p=args.malformed_p, disconnect_p=args.disconnect_p,
                 timeout_s=server["request_timeout_s"] + 30, seed=args.seed, check=args.check,
                 malformed=malformed_bodies(vocab, max_tokens),
                 prefixes=[[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(4)],
                 target=target.get("name"), generate_every=generate_every, draft_only_s=draft_only,
                 long_prompt_p=args.long_prompt_p, context=target.get("context_length", 0),
                 generation_timeout_s=server.get("generation_timeout_s", 300) + 60)
    kinds = Counter(GENERATE if cfg.generate_every and i % cfg.generate_every == cfg.generate_every - 1
                    else KINDS[i % len(KINDS)] for i in range(args.clients))
    model = server.get("model_dir") or server.get("model") or args.model_dir
    print(f"server {srv.url}  model {model}  vocab {vocab}  max_context {info['max_context']}  "
          f"MAX_CACHE_MB {server['max_cache_mb']:.0f}  RSS at ready {ready_mib:.0f} MiB", flush=True)
    print(f"soak: {args.duration:.0f}s, {args.clients} clients {dict(kinds)}, k={args.k}, prompts up to {max_len} "
          f"tokens, malformed {args.malformed_p:.0%}, disconnect {args.disconnect_p:.0%}, seed {args.seed}"
          + (f"; /draft alone for the first {draft_only:.0f}s, then generations on {cfg.target} (long prompts "
             f"{args.long_prompt_p:.0%})" if draft_only else ""), flush=True)

    t0 = time.perf_counter()
    soak = asyncio.run(run_load(srv, cfg, args.clients, args.duration, args.rss_every_s))
    wall = time.perf_counter() - t0
    print(f"load done after {wall:.0f}s; re-sending {len(soak.sample)} sampled requests alone", flush=True)
    checked = (asyncio.run(replay(cfg, soak, args.check_max_s)) if srv.proc.poll() is None else
               {"sampled": len(soak.sample), "checked": 0, "equal": 0, "mismatches": [], "alone_p50_ms": None})
    generated = (asyncio.run(replay_generations(cfg, soak, args.check_max_s)) if srv.proc.poll() is None else
                 {"sampled": len(soak.generation_sample), "checked": 0, "equal": 0, "mismatches": []})
    alive = srv.proc.poll() is None
    counters = server_counters(srv.url) if alive else {}
    if alive and httpx.get(srv.url + "/health", timeout=30).status_code != 200:
        soak.error("unhealthy_after_soak", "/health did not answer 200")
    settings = {"duration_s": args.duration, "clients": args.clients, "kinds": dict(kinds), "k": args.k,
                "max_len": max_len, "malformed_p": args.malformed_p, "disconnect_p": args.disconnect_p,
                "seed": args.seed, "model": model, "max_cache_mb": server["max_cache_mb"],
                "vocab_size": vocab, "max_context": info["max_context"], "draft_only_s": draft_only,
                "long_prompt_p": args.long_prompt_p if draft_only else None}
    return build_report(soak, checked, wall, per_bucket(soak, args.bucket_s, args.duration),
                        rss_summary(soak, warmup, ready_mib, bound, rule), counters, settings, generated,
                        draft_phases(soak, draft_only, args.settle_s, args.max_draft_p99_ratio))


if __name__ == "__main__":
    sys.exit(main())
