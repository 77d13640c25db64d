"""The server under a fuzzer, overload, a memory flood and SIGTERM: real processes, loopback traffic only, every
phase bounded in requests and time."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    DELAYED_SERVER,
    TINY_MAX_POS,
    TINY_VOCAB,
    ServerProcess,
    proc_status_kib,
    tiny_hf_model,
    write_tiny_model_dir,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_packed"), tiny_hf_model(seed=0))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def _metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of specdraft:NAME with these labels, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == f"specdraft:{name}" and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"specdraft:{name}{labels} missing from /metrics"
    return sum(found)


def _is_clean_503(r: httpx.Response) -> bool:
    return (r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            and bool(r.json()["error"]) and r.headers["content-type"].startswith("application/json"))


# ------------------------------------------------------------------ the published schema is what is accepted

def test_schemathesis_finds_no_failure(model_dir, tmp_path):
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        doc = httpx.get(srv.url + "/openapi.json").json()
        body = doc["paths"]["/draft"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert doc["openapi"].startswith("3.0")  # draft-4 schemas: 13.0 is not an integer there
        assert body["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0, "maximum": TINY_VOCAB - 1}
        assert body["properties"]["tokens"]["minItems"] == 1
        assert body["properties"]["tokens"]["maxItems"] == TINY_MAX_POS - 64
        k = body["properties"]["num_draft_tokens"]
        assert (k["minimum"], k["maximum"], body["additionalProperties"]) == (1, 64, False)
        out = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", srv.url + "/openapi.json", "--checks", "all",
             "--seed", "20240607", "--max-examples", "150", "--workers", "1", "--generation-database", "none",
             "--no-color", "--phases", "examples,coverage,fuzzing", "--request-timeout", "30"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        report = out.stdout[-4000:] + out.stderr[-2000:]
        assert out.returncode == 0, report
        m = re.search(r"(\d+) generated", out.stdout)
        assert m and int(m.group(1)) >= 150, report  # a few hundred requests actually ran
        print(f"\nschemathesis: {m.group(0)}, no failures")
        assert srv.proc.poll() is None, "server died under the fuzzer"
        r = httpx.post(srv.url + "/draft", json={"tokens": [1, 2, 3], "num_draft_tokens": 4})
        assert r.status_code == 200 and len(r.json()["draft"]) == 4
        assert "Traceback" not in srv.log()


# ------------------------------------------------------------------ the /v1 endpoints under a fuzzer

def _openai_error(r: httpx.Response) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def _send(http: httpx.Client, path: str, body) -> tuple[httpx.Response, list | None]:
    """The answer, and a stream's events (data of each, `[DONE]` included) when it is one."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            r.read()
            return r, None
        return r, [line.removeprefix("data: ") for line in r.iter_lines() if line]


def _unfinished(path: str, r: httpx.Response, events: list | None) -> str | None:
    """What is wrong with a 200: a stream must end with a finish reason and [DONE] and no error event, an answer
    must have its text and finish reason."""
    if events is not None:
        if not events or events[-1] != "[DONE]":
            return f"stream without [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return f"error event: {chunks[-1]}"
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        return None if finishes and finishes[-1] in ("stop", "length") else f"no finish reason: {chunks[-2:]}"
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    return None if isinstance(text, str) and choice["finish_reason"] in ("stop", "length") else f"{choice}"


def test_v1_fuzzer_serves_odd_but_valid_bodies_and_refuses_bad_ones_never_a_5xx(generation_dirs, tmp_path):
    """Hypothesis draws /v1 bodies (tests/openai_bodies.py) against serve.sh with a tiny target: each odd but valid
    one gets a whole 200 (a stream with its finish reason and [DONE]), each with one thing wrong and each non-request
    a 4xx in OpenAI's error shape, garbage either, and none a 5xx; the server keeps serving, its log clean."""
    from hypothesis import HealthCheck, example, given, settings
    from openai_bodies import CHAT, COMPLETIONS, MAX_TOKENS, garbage_bodies, invalid_bodies, not_requests, valid_bodies

    target_dir, drafter_dir = generation_dirs
    model, seen = target_dir.name, Counter()
    fuzz = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    srv = ServerProcess(drafter_dir, tmp_path / "server.log", TARGET=target_dir, GENERATION_PREFILL_CHUNK=16,
                        GENERATION_DEFAULT_MAX_TOKENS=MAX_TOKENS)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        @settings(fuzz, max_examples=150)
        @given(valid_bodies(model))
        @example((CHAT, {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "stream_options": {"include_usage": True}}))
        def valid(case):
            r, events = _send(http, *case)
            assert r.status_code == 200, (case, r.status_code, r.text[:300])
            assert _unfinished(case[0], r, events) is None, (case, _unfinished(case[0], r, events))
            seen["valid, 200" + (" streamed" if events is not None else "")] += 1

        @settings(fuzz, max_examples=200)
        @given(invalid_bodies(model) | not_requests())
        @example((COMPLETIONS, {"model": "gpt-4o", "prompt": "x"}))
        def invalid(case):
            r, _ = _send(http, *case)
            assert 400 <= r.status_code < 500 and _openai_error(r), (case, r.status_code, r.text[:300])
            seen[f"invalid, {r.status_code}"] += 1

        @settings(fuzz, max_examples=100)
        @given(garbage_bodies(model))
        def garbage(case):
            r, events = _send(http, *case)
            assert r.status_code < 500, (case, r.status_code, r.text[:300])
            if r.status_code == 200:
                assert _unfinished(case[0], r, events) is None, (case, _unfinished(case[0], r, events))
            else:
                assert _openai_error(r), (case, r.status_code, r.text[:300])
            seen[f"garbage, {r.status_code}"] += 1

        valid()
        invalid()
        garbage()
        print(f"\n/v1 fuzzer: {dict(sorted(seen.items()))}")
        assert seen["valid, 200"] and seen["valid, 200 streamed"] and seen["invalid, 400"] and seen["invalid, 404"]
        assert srv.proc.poll() is None and "Traceback" not in srv.log()


# ------------------------------------------------------------------ bounded overload

def test_queue_bound_answers_503_with_retry_after(model_dir, tmp_path):
    # The engine sleeps 1 s per batch of one: one request runs, MAX_QUEUE=2 wait, the rest are refused at once.
    with ServerProcess(model_dir, tmp_path / "server.log", code=DELAYED_SERVER, TEST_ENGINE_DELAY_S=1.0,
                       MAX_QUEUE=2, MAX_BATCH=1, BATCH_WINDOW_MS=0) as srv:
        reqs = [_prompt(random.Random(i), 5 + i) for i in range(8)]

        async def one(c, t):
            t0 = time.perf_counter()
            r = await c.post("/draft", json={"tokens": t, "num_draft_tokens": 4})
            return r, time.perf_counter() - t0

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                return await asyncio.gather(*[one(c, t) for t in reqs])

        res = asyncio.run(burst())
        ok = [(t, r) for t, (r, _) in zip(reqs, res) if r.status_code == 200]
        refused = [(r, dt) for r, dt in res if r.status_code != 200]
        assert all(_is_clean_503(r) and "MAX_QUEUE" in r.json()["error"] for r, _ in refused), \
            [(r.status_code, r.text) for r, _ in refused]
        assert 1 <= len(ok) <= 3 and len(refused) >= 5  # at most 1 running + MAX_QUEUE waiting
        assert all(dt < 0.9 for _, dt in refused)  # refused without waiting for the busy engine
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for t, r in ok:  # the accepted ones got what the same request gets alone
                assert r.json()["draft"] == c.post("/draft", json={"tokens": t, "num_draft_tokens": 4}).json()["draft"]
            text = c.get("/metrics").text
        assert _metric(text, "requests_total", status="503", reason="queue_full") == len(refused)
        assert _metric(text, "num_requests_waiting") == 0


def test_request_timeout_answers_503_not_a_hang(model_dir, tmp_path):
    with ServerProcess(model_dir, tmp_path / "server.log", code=DELAYED_SERVER, TEST_ENGINE_DELAY_S=2.0,
                       REQUEST_TIMEOUT_S=0.5, MAX_BATCH=1) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        t0 = time.perf_counter()
        r = c.post("/draft", json={"tokens": [1, 2, 3], "num_draft_tokens": 4})
        assert _is_clean_503(r) and "REQUEST_TIMEOUT_S" in r.json()["error"], r.text
        assert time.perf_counter() - t0 < 1.8
        time.sleep(2.0)  # the engine finishes the abandoned batch; the server keeps serving
        assert c.get("/health").json()["status"] == "ok"
        assert _metric(c.get("/metrics").text, "requests_total", status="503", reason="timeout") == 1


def test_200_concurrent_clients_get_their_draft_or_a_clean_503(model_dir, tmp_path):
    rng = random.Random(7)
    bases = [_prompt(rng, 40 + 20 * i) for i in range(10)]
    reqs = [(_prompt(rng, rng.randrange(8, 300)), 16) for _ in range(100)]  # unrelated, 8-300 tokens (the issue's)
    reqs += [(bases[i % 10] + _prompt(rng, i), 16) for i in range(60)]  # prefix-sharing
    reqs += [(_prompt(rng, rng.randrange(8, 200)), rng.choice([1, 4, 33, 64])) for _ in range(40)]  # other k
    with ServerProcess(model_dir, tmp_path / "server.log", MAX_QUEUE=48, REQUEST_TIMEOUT_S=60) as srv:
        async def one(c, t, k):
            try:
                return await c.post("/draft", json={"tokens": t, "num_draft_tokens": k})
            except httpx.HTTPError as e:  # a lost request: connection reset, timeout...
                return e

        async def burst():
            limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
                return await asyncio.wait_for(asyncio.gather(*[one(c, t, k) for t, k in reqs]), 300)

        res = asyncio.run(burst())
        lost = [r for r in res if not isinstance(r, httpx.Response)]
        assert not lost, lost[:3]
        codes = [r.status_code for r in res]
        assert set(codes) <= {200, 503}, [r.text for r in res if r.status_code not in (200, 503)][:3]
        assert all(_is_clean_503(r) for r in res if r.status_code == 503)
        served = [(t, k, r.json()) for (t, k), r in zip(reqs, res) if r.status_code == 200]
        assert served
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for t, k, body in served:  # the same request sent alone (now with another cache state)
                alone = c.post("/draft", json={"tokens": t, "num_draft_tokens": k}).json()
                assert body["draft"] == alone["draft"], (len(t), k)
                assert body["cached_prefix_len"] is not None and 0 <= body["cached_prefix_len"] < len(t)
            text = c.get("/metrics").text
        print(f"\n200 clients: {codes.count(200)} answered 200, {codes.count(503)} answered 503")
        assert _metric(text, "requests_total", status="503", reason="queue_full") == codes.count(503)
        assert _metric(text, "requests_total", status="200") == codes.count(200) + len(served)
        assert _metric(text, "num_requests_waiting") == 0 and _metric(text, "num_requests_running") == 0
        assert _metric(text, "batch_size_count") >= 1 and _metric(text, "batch_size_bucket", le="+Inf") >= 1
        assert _metric(text, "request_latency_seconds_sum") > 0
        assert _metric(text, "request_latency_seconds_count") == codes.count(200) + len(served)
        assert 0 < _metric(text, "prefix_cache_hits_total") <= _metric(text, "prefix_cache_lookups_total")
        assert srv.proc.poll() is None and "Traceback" not in srv.log()


# ------------------------------------------------------------------ bounded memory

def test_cache_bytes_and_rss_stay_bounded_under_a_flood(tmp_path):
    # 4 layers x 4 KV heads x 64 dims: 8 KiB of fp32 K/V per token, so each ~1.6k-token context holds ~13 MiB.
    # 40 distinct contexts would keep ~520 MiB under a token-count bound; MAX_CACHE_MB=16 must hold.
    model = tiny_hf_model(seed=1, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                          intermediate_size=256, max_position_embeddings=2048)
    md = write_tiny_model_dir(tmp_path / "bigkv", model)
    bound_mb, batch_tokens, kv_per_token = 16, 4096, 8192
    # Stated slack over (RSS after a warm-up request) + bound: the in-flight K/V of one decode group (row caches +
    # the batch cache, <= 2 x MAX_BATCH_TOKENS slots) plus 48 MiB for activations and the allocator.
    slack = 2 * batch_tokens * kv_per_token + (48 << 20)
    rng = random.Random(3)
    with ServerProcess(md, tmp_path / "server.log", MAX_CACHE_MB=bound_mb, MAX_BATCH_TOKENS=batch_tokens,
                       MAX_BATCH=4) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        assert c.post("/draft", json={"tokens": _prompt(rng, 1900), "num_draft_tokens": 16}).status_code == 200
        base = proc_status_kib(srv.proc.pid, "VmRSS") * 1024
        limit = base + (bound_mb << 20) + slack
        peak_seen, samples = 0, []

        async def client(ac, cid):
            nonlocal peak_seen
            for i in range(10):
                r = await ac.post("/draft", json={"tokens": _prompt(random.Random(cid * 100 + i), 1400 + 50 * i),
                                                  "num_draft_tokens": 16})
                assert r.status_code == 200, r.text
                text = (await ac.get("/metrics")).text
                peak_seen = max(peak_seen, _metric(text, "prefix_cache_bytes"))
                samples.append(proc_status_kib(srv.proc.pid, "VmRSS") * 1024)

        async def flood():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as ac:
                await asyncio.wait_for(asyncio.gather(*[client(ac, i) for i in range(4)]), 300)

        asyncio.run(flood())
        text = c.get("/metrics").text
        hwm = proc_status_kib(srv.proc.pid, "VmHWM") * 1024
    names = ("cache_bytes", "cache_peak_bytes", "cache_max_bytes", "cache_evictions_total")
    cache = {n: _metric(text, "prefix_" + n) for n in names}
    print(f"\nflood: RSS base {base / 2**20:.0f} MiB, max sampled {max(samples) / 2**20:.0f} MiB, peak (VmHWM) "
          f"{hwm / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB; cache {cache}")
    assert cache["cache_max_bytes"] == bound_mb << 20
    assert max(peak_seen, cache["cache_bytes"], cache["cache_peak_bytes"]) <= bound_mb << 20
    assert cache["cache_evictions_total"] >= 20  # the flood did press against the bound
    assert max(samples) <= limit and hwm <= limit


# ------------------------------------------------------------------ graceful shutdown

def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", code=DELAYED_SERVER, TEST_ENGINE_DELAY_S=1.5,
                        MAX_BATCH=8, REQUEST_TIMEOUT_S=20, SHUTDOWN_TIMEOUT_S=15)
    with srv:
        reqs = [_prompt(random.Random(50 + i), 10 + i) for i in range(4)]
        with httpx.Client(base_url=srv.url, timeout=60) as c:  # the answers they must get (from a warm engine)
            expected = [c.post("/draft", json={"tokens": t, "num_draft_tokens": 8}).json()["draft"] for t in reqs]

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                inflight = [asyncio.ensure_future(c.post("/draft", json={"tokens": t, "num_draft_tokens": 8}))
                            for t in reqs]
                await asyncio.sleep(0.5)  # the batch is now in the (slow) engine
                srv.proc.send_signal(signal.SIGTERM)
                t_term = time.perf_counter()
                await asyncio.sleep(0.3)
                async with httpx.AsyncClient(base_url=srv.url, timeout=10) as fresh:
                    late = await fresh.post("/draft", json={"tokens": [1, 2, 3], "num_draft_tokens": 2})
                    health = await fresh.get("/health")
                return await asyncio.gather(*inflight), late, health, t_term

        done, late, health, t_term = asyncio.run(scenario())
        assert [r.status_code for r in done] == [200] * 4
        assert [r.json()["draft"] for r in done] == expected
        assert _is_clean_503(late) and "shutting down" in late.json()["error"]
        assert health.status_code == 503 and health.json()["status"] == "draining"
        rc = srv.proc.wait(timeout=20)
        exit_s = time.perf_counter() - t_term
    print(f"\nSIGTERM with 4 requests in flight (1.5 s batch): exit code {rc} after {exit_s:.2f} s")
    assert rc == 0 and exit_s < 10, srv.log()


def test_sigterm_on_serve_sh_exits_0_promptly(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log")
    with srv:
        assert httpx.post(srv.url + "/draft", json={"tokens": [4, 5]}).status_code == 200
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)  # serve.sh execs python, so the signal reaches the server itself
        rc = srv.proc.wait(timeout=20)
        assert rc == 0 and time.perf_counter() - t0 < 5, (rc, srv.log())


# ------------------------------------------------------------------ the micro-batcher's bounds alone (fake engine)

def test_micro_batcher_queue_bound_timeout_and_stop():
    from drafter_lib.serve.batching import MicroBatcher, Overloaded

    def run_batch(token_lists, k):
        time.sleep(0.3)
        return [[t[0]] * k for t in token_lists]

    async def main():
        b = MicroBatcher(run_batch, window_s=0, max_batch=1, max_queue=2, request_timeout_s=1.0)
        await b.start()
        try:
            res = await asyncio.gather(*[b.submit([i], 2) for i in range(6)], return_exceptions=True)
            over = [r for r in res if isinstance(r, Overloaded)]
            assert {o.reason for o in over} <= {"queue_full", "timeout"} and len(over) >= 3
            assert all(o.retry_after_s >= 1 for o in over)
            assert [r.draft for r in res if not isinstance(r, Exception)][0] == [0, 0]
            assert b.queue_depth == 0 and b.inflight == 0 and b.stats["rejected_queue_full"] >= 3
            # a request that waits past the timeout gives up with "timeout"; the queue depth does not leak
            slow = [asyncio.ensure_future(b.submit([9], 2)) for _ in range(2)]
            res = await asyncio.gather(*slow, return_exceptions=True)
            assert all(not isinstance(r, Exception) for r in res)
            b.request_timeout_s = 0.1
            with pytest.raises(Overloaded, match="REQUEST_TIMEOUT_S"):
                await b.submit([1], 2)
            assert b.stats["timeouts"] >= 1
            b.request_timeout_s = 5
            pending = asyncio.ensure_future(b.submit([3], 2))
            queued = asyncio.ensure_future(b.submit([4], 2))
            await asyncio.sleep(0.05)
        finally:
            await b.stop()
        # stop() answers what is still queued instead of leaving it hanging
        results = await asyncio.gather(pending, queued, return_exceptions=True)
        assert any(isinstance(r, Overloaded) and r.reason == "shutting_down" for r in results), results
        with pytest.raises(Overloaded, match="shutting down"):
            await b.submit([5], 2)
        assert json.dumps(b.stats)

    asyncio.run(main())


def test_shipped_model_drafts_ignore_batch_and_cache_state_under_8_clients(tmp_path):
    """The shipped model/ behind serve.sh, with its own engine dtype: 8 concurrent clients each run a speculative
    loop (its request grows by 2 draft tokens and a bonus token per round). Every draft equals the same request sent
    alone afterwards in reverse order (another cache state: a longer cached entry to branch from, no batch) and sent
    to a second server that caches nothing (every request cold)."""
    model_dir = Path(__file__).resolve().parents[1] / "model"
    if not (model_dir / "config.json").is_file():
        pytest.skip("no shipped model/")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def full(t):  # threshold 0: all 16 tokens compared (the pack's own would stop most drafts on random ids early)
        return {"tokens": t, "num_draft_tokens": 16, "min_confidence": 0}

    rng = random.Random(11)
    loops = [[rng.randrange(vocab) for _ in range(rng.randrange(30, 150))] for _ in range(8)]
    served = []
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        async def rounds():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                for _ in range(6):
                    res = await asyncio.gather(*[c.post("/draft", json=full(t))
                                                 for t in loops])
                    for t, r in zip(loops, res):
                        assert r.status_code == 200, r.text
                        served.append((list(t), r.json()["draft"]))
                        t += r.json()["draft"][:2] + [rng.randrange(vocab)]

        asyncio.run(rounds())
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for t, draft in reversed(served):
                assert c.post("/draft", json=full(t)).json()["draft"] == draft
    with ServerProcess(model_dir, tmp_path / "cold.log", MAX_CACHE_MB=0.01) as cold, \
            httpx.Client(base_url=cold.url, timeout=60) as c:
        for t, draft in served:
            body = c.post("/draft", json=full(t)).json()
            assert body["cached_prefix_len"] == 0 and body["draft"] == draft
