"""server.py over real HTTP: one `./serve.sh` process (offline env + network guard) shared by the module."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import (
    ROOT,
    TINY_MAX_POS,
    TINY_VOCAB,
    ServerProcess,
    guarded_env,
    tiny_hf_model,
    write_tiny_model_dir,
)

MAX_BODY = 64 * 1024  # small limit so the 413 path is cheap to hit; a full-context request is ~3 KB
# The engine's default weight dtype is what ships; set this to check another one (server and reference alike).
ENGINE_DTYPE = os.environ.get("SPECDRAFT_TEST_ENGINE_DTYPE")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_packed"), tiny_hf_model(seed=0))


@pytest.fixture(scope="module")
def engine(model_dir):
    from drafter_lib.engine.draft_engine import DraftEngine

    return DraftEngine.from_dir(model_dir, **({} if ENGINE_DTYPE is None else {"dtype": ENGINE_DTYPE}))


@pytest.fixture(scope="module")
def net_log(tmp_path_factory):
    return tmp_path_factory.mktemp("netguard") / "attempts.log"


@pytest.fixture(scope="module")
def server(model_dir, net_log, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    env = guarded_env(tmp / "guard", net_log)
    extra = {} if ENGINE_DTYPE is None else {"ENGINE_DTYPE": ENGINE_DTYPE}
    srv = ServerProcess(model_dir, tmp / "server.log", env=env, MAX_BODY_BYTES=MAX_BODY, **extra)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


# ------------------------------------------------------------------ happy path

def test_health_and_info(http, model_dir):
    import hashlib

    assert http.get("/health").json()["status"] == "ok"
    info = http.get("/info").json()
    assert info["vocab_size"] == TINY_VOCAB
    assert 0 < info["max_context"] <= TINY_MAX_POS
    model = info["model"]
    assert model["manifest_sha256"] == hashlib.sha256((model_dir / "manifest.json").read_bytes()).hexdigest()
    assert model["quantization"] == json.loads((model_dir / "quantization.json").read_text())
    assert model["config"]["vocab_size"] == TINY_VOCAB and "enabled" in model["copy_policy"]
    assert info["server"]["max_draft_tokens"] >= 16
    assert http.get("/openapi.json").json()["paths"]["/draft"]["post"]["requestBody"]
    assert http.get("/docs").status_code == 200


def test_draft_matches_in_process_engine(http, engine):
    for seed, n, k in [(1, 5, 16), (2, 40, 4), (3, 1, 1), (4, 200, 64)]:
        tokens = _prompt(seed, n)
        r = http.post("/draft", json={"tokens": tokens, "num_draft_tokens": k})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["draft"] == engine.draft(tokens, k)
        assert len(body["draft"]) == k and all(0 <= t < TINY_VOCAB for t in body["draft"])
        assert body["context_len"] == n and body["num_draft_tokens"] == k
        assert body["timing"]["total_ms"] >= body["timing"]["compute_ms"] >= 0


def test_default_num_draft_tokens_is_16(http):
    r = http.post("/draft", json={"tokens": [1, 2, 3]})
    assert r.status_code == 200 and len(r.json()["draft"]) == 16


def test_prefix_extension_reuses_cache_and_stays_exact(http, engine):
    # A speculative loop: each request = previous tokens + some accepted draft tokens + 1 bonus token.
    seq = _prompt(10, 30)
    for step in range(6):
        body = http.post("/draft", json={"tokens": seq, "num_draft_tokens": 8}).json()
        assert body["draft"] == engine.draft(seq, 8)
        if step > 0 and body.get("cached_prefix_len") is not None:
            assert body["cached_prefix_len"] > 0  # the previous request's prefix was reused
        seq = seq + body["draft"][: step % 4] + [(step * 37) % TINY_VOCAB]


# ------------------------------------------------------------------ bad input: 4xx naming the problem, then serving

def _post_raw(http, content: bytes, headers=None):
    return http.post("/draft", content=content, headers={"content-type": "application/json", **(headers or {})})


BAD_REQUESTS = [
    # (id, body (bytes = raw, else JSON), status, words the error message must contain)
    ("malformed_json", b'{"tokens": [1, 2', 400, ["malformed json"]),
    ("not_an_object", [1, 2, 3], 422, ["body"]),
    ("missing_tokens", {"num_draft_tokens": 4}, 422, ["tokens", "required"]),
    ("unknown_field", {"tokens": [1], "temperature": 0.5}, 422, ["temperature", "unknown field"]),
    ("float_token", {"tokens": [1, 2.5]}, 422, ["tokens[1]", "integer"]),
    ("integral_float_token", {"tokens": [1, 2.0]}, 422, ["tokens[1]", "integer"]),
    ("bool_token", {"tokens": [1, True]}, 422, ["tokens[1]", "integer"]),
    ("string_token", {"tokens": ["7"]}, 422, ["tokens[0]", "integer"]),
    ("null_tokens", {"tokens": None}, 422, ["tokens"]),
    ("negative_id", {"tokens": [3, -1]}, 422, ["tokens[1]", "greater than or equal to 0"]),
    ("id_equal_vocab", {"tokens": [3, TINY_VOCAB]}, 422, ["tokens[1]", "vocab_size=512"]),
    ("huge_id", {"tokens": [10 ** 30]}, 422, ["tokens[0]"]),
    ("empty_tokens", {"tokens": []}, 422, ["tokens", "at least 1"]),
    ("context_too_long", {"tokens": [1] * TINY_MAX_POS}, 422, ["maximum context"]),
    ("k_zero", {"tokens": [1], "num_draft_tokens": 0}, 422, ["num_draft_tokens"]),
    ("k_too_big", {"tokens": [1], "num_draft_tokens": 10_000}, 422, ["num_draft_tokens", "less than or equal"]),
    ("k_string", {"tokens": [1], "num_draft_tokens": "16"}, 422, ["num_draft_tokens", "integer"]),
    ("k_bool", {"tokens": [1], "num_draft_tokens": True}, 422, ["num_draft_tokens", "integer"]),
    ("min_confidence_above_1", {"tokens": [1], "min_confidence": 1.5}, 422, ["min_confidence", "less than or equal"]),
    ("min_confidence_negative", {"tokens": [1], "min_confidence": -0.1}, 422, ["min_confidence", "greater than"]),
    ("min_confidence_string", {"tokens": [1], "min_confidence": "0.5"}, 422, ["min_confidence", "number"]),
    ("min_confidence_bool", {"tokens": [1], "min_confidence": True}, 422, ["min_confidence", "number"]),
    ("min_confidence_nan", b'{"tokens": [1], "min_confidence": NaN}', 422, ["min_confidence", "finite"]),
    ("return_probs_int", {"tokens": [1], "return_probs": 1}, 422, ["return_probs", "boolean"]),
]


@pytest.mark.parametrize("name,body,status,words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_4xx_and_server_keeps_serving(http, name, body, status, words):
    r = _post_raw(http, body) if isinstance(body, bytes) else http.post("/draft", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"].lower()
    for w in words:
        assert w.lower() in err, (w, err)
    ok = http.post("/draft", json={"tokens": [5, 6, 7], "num_draft_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["draft"]) == 2


def test_oversized_body_by_content_length(http):
    body = json.dumps({"tokens": [1] * (MAX_BODY // 2)}).encode()
    assert len(body) > MAX_BODY
    r = _post_raw(http, body)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
    assert http.post("/draft", json={"tokens": [1, 2], "num_draft_tokens": 2}).status_code == 200


def test_oversized_body_chunked_without_content_length(server):
    # A chunked upload declares no size: the server must count what actually arrives.
    def chunks():
        yield b'{"tokens": ['
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"1, " * 333 + b" "
        yield b"1]}"

    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/draft", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert r.status_code == 413, r.text
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/draft", json={"tokens": [1, 2], "num_draft_tokens": 2}).status_code == 200


def test_unknown_route_and_method(http):
    assert http.get("/draft").status_code == 405
    assert http.get("/nope").status_code == 404


# ------------------------------------------------------------------ concurrency and micro-batching

def _workload():
    reqs = []
    base = _prompt(100, 50)
    for i in range(8):  # a chain of prefix extensions (the prefix cache's case), interleaved with...
        reqs.append((base + _prompt(200 + i, 3 * i), 16))
    for i in range(8):  # ...unrelated prompts of various lengths...
        reqs.append((_prompt(300 + i, 10 + 17 * i), 16))
    for i in range(4):  # ...and other draft lengths in the same burst.
        reqs.append((_prompt(400 + i, 20), [1, 5, 16, 33][i]))
    return reqs


async def _fire_concurrently(url, reqs):
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=len(reqs))) as c:
        rs = await asyncio.gather(*[c.post("/draft", json={"tokens": t, "num_draft_tokens": k}) for t, k in reqs])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    return [r.json() for r in rs]


def test_concurrent_requests_equal_sequential(server, http):
    reqs = _workload()
    sequential = [http.post("/draft", json={"tokens": t, "num_draft_tokens": k}).json()["draft"] for t, k in reqs]
    before = http.get("/info").json()["server"]["batching"]
    for _ in range(2):  # second round: everything is in the prefix cache now
        concurrent = asyncio.run(_fire_concurrently(server.url, reqs))
        assert [b["draft"] for b in concurrent] == sequential
    after = http.get("/info").json()["server"]["batching"]
    # 40 requests ran in fewer forward-pass batches: clients really shared them.
    assert after["requests"] - before["requests"] == 2 * len(reqs)
    assert after["batches"] - before["batches"] < 2 * len(reqs)
    assert max(b["batch_size"] for b in concurrent) >= 2


def test_eight_clients_speculative_loops_equal_sequential(server, engine):
    # 8 clients each run a prefix-extending loop at the same time; every answer must equal the engine's own.
    async def client_loop(c, cid):
        seq, seen = _prompt(500 + cid, 20 + cid), []
        for step in range(5):
            r = await c.post("/draft", json={"tokens": seq, "num_draft_tokens": 8})
            assert r.status_code == 200, r.text
            d = r.json()["draft"]
            seen.append((list(seq), d))
            seq = seq + d[: (cid + step) % 5] + [(cid * 31 + step) % TINY_VOCAB]
        return seen

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*[client_loop(c, i) for i in range(8)])

    for seen in asyncio.run(main()):
        for seq, d in seen:
            assert d == engine.draft(seq, 8)


# ------------------------------------------------------------------ dynamic draft length

def _threshold(probs: list[float]) -> tuple[float, int] | None:
    """A threshold halfway between the last new running minimum of `probs` (after the first token) and the earlier
    ones, and where it stops; None when the first probability is the lowest."""
    best = None
    for j in range(1, len(probs)):
        above = min(probs[:j])
        if probs[j] < above - 0.005:
            best = ((probs[j] + above) / 2, j)
    return best


def _stoppable(engine, seeds, n, k=16):
    """(tokens, full draft, threshold, stop index) for the first seed whose draft a threshold can stop midway."""
    for seed in seeds:
        tokens = _prompt(seed, n)
        full = engine.draft(tokens, k, return_probs=True)
        if (t := _threshold(full.probs)) is not None:
            return tokens, full, *t
    raise AssertionError("no prompt with a draft to stop midway")


def test_min_confidence_and_return_probs_round_trip(http, engine):
    assert http.get("/info").json()["server"]["default_min_confidence"] is None
    for seeds, n in [(range(20, 40), 5), (range(40, 60), 60), (range(60, 80), 150)]:
        tokens, full, c, j = _stoppable(engine, seeds, n)
        plain = http.post("/draft", json={"tokens": tokens}).json()
        assert plain["draft"] == full and "probs" not in plain  # only when asked
        asked = http.post("/draft", json={"tokens": tokens, "return_probs": True}).json()
        assert asked["draft"] == full and asked["probs"] == pytest.approx(full.probs, abs=1e-4)
        body = http.post("/draft", json={"tokens": tokens, "min_confidence": c, "return_probs": True}).json()
        assert body["draft"] == full[:j] and body["num_draft_tokens"] == 16
        assert body["probs"] == pytest.approx(full.probs[:j], abs=1e-4)
        assert http.post("/draft", json={"tokens": tokens, "min_confidence": 0}).json()["draft"] == full
        assert http.post("/draft", json={"tokens": tokens, "min_confidence": None}).json()["draft"] == full
        assert full.probs[0] < 1 and http.post("/draft", json={"tokens": tokens, "min_confidence": 1}).json()[
            "draft"] == []


async def _post_all(url, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=len(bodies))) as c:
        rs = await asyncio.gather(*[c.post("/draft", json=b) for b in bodies])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    return [r.json() for r in rs]


def test_concurrent_mixed_thresholds_share_batches_and_equal_single(server, http, engine):
    bodies = []
    for i in range(12):
        tokens, _, c, _ = _stoppable(engine, range(600 + 20 * i, 620 + 20 * i), 8 + 11 * i, 12)
        body = {"tokens": tokens, "num_draft_tokens": 12, "return_probs": i % 2 == 0}
        if i % 3:
            body["min_confidence"] = c
        bodies.append(body)
    for _ in range(2):  # cold, then warm
        out = asyncio.run(_post_all(server.url, bodies))
        assert max(o["batch_size"] for o in out) >= 2
        for b, o in zip(bodies, out):
            ref = engine.draft(b["tokens"], 12, min_confidence=b.get("min_confidence"), return_probs=True)
            assert o["draft"] == ref
            assert ("probs" in o) == b["return_probs"]
            if b["return_probs"]:
                assert o["probs"] == pytest.approx(ref.probs, abs=1e-4)
    assert any(len(o["draft"]) < 12 for o in out) and any(len(o["draft"]) == 12 for o in out)


def test_model_dir_threshold_is_only_a_recommendation(model_dir, tmp_path):
    """A pack whose config.json carries draft_min_confidence: /info reports it as recommended, but a request that
    sets no min_confidence still gets exactly num_draft_tokens tokens; an operator's DEFAULT_MIN_CONFIDENCE
    ("recommended" or a number) makes it the server-wide default, and a request's own value (0 = off) wins."""
    import shutil

    from fastapi.testclient import TestClient

    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.serve.app import create_app
    from drafter_lib.serve.settings import Settings

    tokens, full, c, j = _stoppable(DraftEngine.from_dir(model_dir), range(30, 50), 40)
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "draft_min_confidence": c}))
    eng = DraftEngine.from_dir(d, verify=False)  # config.json changed after the manifest was written
    with TestClient(create_app(Settings(model_dir=str(d)), engine=eng)) as tc:
        info = tc.get("/info").json()
        assert info["server"]["default_min_confidence"] is None and info["model"]["recommended_min_confidence"] == c
        assert tc.post("/draft", json={"tokens": tokens}).json()["draft"] == full and len(full) == 16
        assert tc.post("/draft", json={"tokens": tokens, "min_confidence": c}).json()["draft"] == full[:j]
    for default in ("recommended", c):
        s = Settings(model_dir=str(d), default_min_confidence=default)
        eng = DraftEngine.from_dir(d, verify=False, min_confidence=s.default_min_confidence)
        with TestClient(create_app(s, engine=eng)) as tc:
            assert tc.get("/info").json()["server"]["default_min_confidence"] == c
            assert tc.post("/draft", json={"tokens": tokens}).json()["draft"] == full[:j]
            assert tc.post("/draft", json={"tokens": tokens, "min_confidence": 0}).json()["draft"] == full


@pytest.mark.parametrize("text, expected", [("recommended", "recommended"), ("Recommended", "recommended"),
                                            ("0.4", 0.4), ("0", 0.0), ("", None)])
def test_default_min_confidence_setting(monkeypatch, text, expected):
    from drafter_lib.serve.settings import Settings

    monkeypatch.setenv("DEFAULT_MIN_CONFIDENCE", text)
    assert Settings.from_env().default_min_confidence == expected


@pytest.mark.parametrize("text", ["1.5", "-0.1", "nan", "often"])
def test_default_min_confidence_setting_rejects(monkeypatch, text):
    from pydantic import ValidationError

    from drafter_lib.serve.settings import Settings, describe_errors

    monkeypatch.setenv("DEFAULT_MIN_CONFIDENCE", text)
    with pytest.raises(ValidationError) as err:
        Settings.from_env()
    assert describe_errors(err.value) == [f"DEFAULT_MIN_CONFIDENCE={text!r}: must be a number in [0, 1] or "
                                          "'recommended'"]


@pytest.mark.slow
def test_shipped_model_answers_tokens_only_request_with_16_tokens(tmp_path):
    """The README's first request against `./serve.sh` and the shipped model/: a body with only `tokens` gets the
    contract's 16 draft tokens, although model/config.json recommends a threshold."""
    shipped = ROOT / "model"
    if not (shipped / "config.json").is_file():
        pytest.skip("no shipped model/ in this checkout")
    with ServerProcess(shipped, tmp_path / "server.log") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = c.post("/draft", json={"tokens": [1, 504, 3250, 314, 260, 3575, 28, 198]}).json()
        assert len(body["draft"]) == 16 and body["num_draft_tokens"] == 16, body
        assert c.get("/info").json()["model"]["recommended_min_confidence"] is not None


def test_engine_is_loaded_and_run_on_one_thread(model_dir, monkeypatch):
    """create_app loads the engine on the thread that then runs every batch, not the main thread: one OpenMP team
    per process, so libgomp keeps its full spin between ops (batching.py)."""
    import threading

    from fastapi.testclient import TestClient

    from drafter_lib.serve import app as server_app

    seen, real_load = {"runs": set()}, server_app.load_engine

    def load(settings):
        seen["load"] = threading.get_ident()
        eng = real_load(settings)
        run = eng.draft_batch

        def draft_batch(*args, **kw):
            seen["runs"].add(threading.get_ident())
            return run(*args, **kw)

        eng.draft_batch = draft_batch
        return eng

    monkeypatch.setattr(server_app, "load_engine", load)
    with TestClient(server_app.create_app(server_app.Settings(model_dir=str(model_dir)))) as tc:
        deadline = time.monotonic() + 120
        while tc.get("/health").status_code != 200 and time.monotonic() < deadline:  # the load runs in the background
            time.sleep(0.05)
        for n in (5, 9, 6):
            assert tc.post("/draft", json={"tokens": _prompt(n, n)}).status_code == 200
    assert seen["runs"] == {seen["load"]} and seen["load"] != threading.main_thread().ident


SLOW_LOAD = """
import time
from drafter_lib.serve import app as server_app
from drafter_lib.serve.cli import main
real = server_app.load_engine
server_app.load_engine = lambda settings: time.sleep(float(__import__("os").environ["LOAD_DELAY_S"])) or real(settings)
main()
"""


def test_listens_at_once_answers_starting_then_ok_and_ctrl_c_during_the_load_exits_at_once(model_dir, tmp_path):
    """The server answers while the drafter loads (a slow load here): /health 503 "starting", /draft 503 with
    Retry-After; once loaded, drafts. Ctrl-C during a load ends the process at once (exit 0): the load runs on
    its own daemon thread."""
    import signal
    import time

    srv = ServerProcess(model_dir, tmp_path / "slow.log", code=SLOW_LOAD, LOAD_DELAY_S=3,
                        LOG_LEVEL="info")  # not entered: no wait for readiness
    try:
        seen, refused = set(), 0
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    h = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                seen.add(h.json()["status"])
                if h.status_code == 200:
                    break
                assert h.status_code == 503 and h.headers["retry-after"] == "1"
                d = c.post("/draft", json={"tokens": [1, 2, 3]})
                if d.status_code == 503:  # (the load may finish between the two requests)
                    assert "loading" in d.json()["error"] and d.headers["retry-after"] == "1"
                    refused += 1
                time.sleep(0.2)
            assert seen == {"starting", "ok"} and refused > 0, (seen, refused)
            assert len(c.post("/draft", json={"tokens": [1, 2, 3]}).json()["draft"]) == 16
        assert "loading the drafter" in srv.log() and "ready in" in srv.log()
    finally:
        srv.stop()

    srv = ServerProcess(model_dir, tmp_path / "interrupted.log", code=SLOW_LOAD, LOAD_DELAY_S=60)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if c.get("/health").json()["status"] == "starting":
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=30) == 0, srv.log()
        assert time.perf_counter() - t0 < 15, "the process waited for the interrupted load"
    finally:
        srv.stop()


# ------------------------------------------------------------------ offline

def test_serves_offline_without_network(http, net_log, server):
    info = http.get("/info").json()
    assert info["offline"]["HF_HUB_OFFLINE"] == "1" and info["offline"]["TRANSFORMERS_OFFLINE"] == "1"
    assert info["offline"]["imported"]["huggingface_hub"] is False
    assert info["offline"]["imported"]["transformers"] is False
    assert not net_log.exists() or net_log.read_text() == "", net_log.read_text()
    assert "Traceback" not in server.log()


def test_network_guard_is_live(tmp_path):
    # The guard used for the server above really blocks and logs a non-loopback connection.
    log = tmp_path / "attempts.log"
    env = guarded_env(tmp_path / "guard", log)
    code = ("import socket\n"
            "try:\n    socket.create_connection(('10.255.255.1', 80), timeout=1)\n"
            "except OSError as e:\n    print('blocked' if 'blocked by test guard' in str(e) else 'other')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "blocked", out.stdout + out.stderr
    assert "10.255.255.1" in log.read_text()


# ------------------------------------------------------------------ the micro-batcher alone (no HTTP, fake engine)

def _fake_engine(calls, delay=0.05):
    import threading
    import time

    owner = []

    def run_batch(token_lists, k):
        owner.append(threading.get_ident())
        calls.append([list(t) for t in token_lists])
        time.sleep(delay)
        if any(t[0] == 666 for t in token_lists):
            raise ValueError("poisoned request")
        return [[t[0] + i for i in range(k)] for t in token_lists]

    return run_batch, owner


def test_micro_batcher_gathers_and_isolates_failures():
    from drafter_lib.serve.batching import MicroBatcher

    async def main():
        calls = []
        run_batch, owner = _fake_engine(calls)
        b = MicroBatcher(run_batch, window_s=0.05, max_batch=8)
        await b.start()
        try:
            lone = await b.submit([7], 3)  # a lone request runs at once, alone
            assert lone.draft == [7, 8, 9] and lone.batch_size == 1 and lone.queue_ms < 20
            # 8 concurrent requests while a batch runs: at most two batches (the first may start alone)
            outs = await asyncio.gather(*[b.submit([10 * i], 2) for i in range(8)])
            assert [o.draft for o in outs] == [[10 * i, 10 * i + 1] for i in range(8)]
            assert len(calls) <= 3 and max(o.batch_size for o in outs) >= 4
            # one bad request in a batch fails alone; its neighbours still get their drafts
            res = await asyncio.gather(*[b.submit([t], 2) for t in (1, 666, 2)], return_exceptions=True)
            assert res[0].draft == [1, 2] and res[2].draft == [2, 3]
            assert isinstance(res[1], ValueError) and "poisoned" in str(res[1])
            # different k in one burst: separate draft_batch calls, each answer has its own k
            ks = await asyncio.gather(*[b.submit([5], k) for k in (1, 2, 3)])
            assert [len(o.draft) for o in ks] == [1, 2, 3]
        finally:
            await b.stop()
        assert len(set(owner)) == 1  # every engine call ran on the same single worker thread

    asyncio.run(main())


def test_micro_batcher_passes_per_request_options_in_one_batch():
    from drafter_lib.serve.batching import MicroBatcher

    calls = []

    def run_batch(token_lists, k, **opts):
        calls.append(opts)
        return [[t[0]] * k for t in token_lists]

    async def main():
        b = MicroBatcher(run_batch, window_s=0.05, max_batch=8)
        await b.start()
        try:
            await b.submit([1], 2)  # defaults only: the plain run_batch(tokens, k) call
            outs = await asyncio.gather(b.submit([2], 2, min_confidence=0.5), b.submit([3], 2),
                                        b.submit([4], 2, return_probs=True))
            assert [o.draft for o in outs] == [[2, 2], [3, 3], [4, 4]]
            with pytest.raises(TypeError, match="unknown draft options"):
                await b.submit([5], 2, temperature=1.0)
        finally:
            await b.stop()

    asyncio.run(main())
    assert calls[0] == {}
    shared = [c for c in calls[1:] if c]
    assert {"min_confidence": [0.5, None, None], "return_probs": [False, False, True]} in shared or all(
        len(v) == 1 for c in shared for v in c.values())  # one batch with one value per request (or run apart)
