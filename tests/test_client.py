"""Speculative decoding through a real server is lossless (output == the target's greedy `generate`) and takes the
same steps as the same loop with the engine in process. The clients' retries, api key and concurrency are checked
against a scripted HTTP stub on loopback (real sockets, real httpx)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from server_helpers import TINY_VOCAB, ServerProcess, tiny_hf_model, write_tiny_model_dir

from drafter_lib.decoding.speculative import NativeTarget, speculative_generate
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.model.transformer import Transformer
from drafter_lib.serve.client import AsyncSpeculativeClient, DraftServerError, SpeculativeClient

EOS = 258  # the byte tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def target():
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    # The drafter is the target itself, packed to int8: drafts agree often but not always, so both the
    # accept and the reject paths of verification run.
    return write_tiny_model_dir(tmp_path_factory.mktemp("drafter") / "model", target, bits=8)


@pytest.fixture(scope="module")
def client(drafter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client")
    with ServerProcess(drafter_dir, tmp / "server.log", via_serve_sh=False) as srv, SpeculativeClient(srv.url) as c:
        yield c


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_speculative_output_equals_greedy_generate(target, client, k):
    means = []
    for prompt in _prompts():
        with torch.inference_mode():
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=EOS,
                                  pad_token_id=EOS)[0, len(prompt):].tolist()
        out = speculative_generate(target, prompt, max_new_tokens=32, drafter=client, k=k, stop_ids=[EOS])
        assert out.tokens == ref
        if out.tokens[-1] != EOS:  # (an EOS inside an accepted draft cuts the last step short)
            assert sum(out.accepted_lengths) + out.steps == len(out.tokens)
        assert all(0 <= a <= d <= k for a, d in zip(out.accepted_lengths, out.draft_lengths))
        means.append(out.mean_acceptance_length)
    # A quantized copy of the target drafts well: clearly more than one token per target step on average.
    assert sum(means) / len(means) > 1.5


def test_wrong_drafter_is_still_lossless(target, client):
    # A different target (other seed) barely agrees with the drafter, so nearly every draft gets rejected.
    other = tiny_hf_model(seed=1)
    prompt = _prompts()[1]
    with torch.inference_mode():
        ref = other.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS)[0, len(prompt):].tolist()
    out = speculative_generate(other, prompt, max_new_tokens=24, drafter=client, k=8, stop_ids=[EOS])
    assert out.tokens == ref


def test_in_process_and_http_loops_agree(target, client, drafter_dir):
    # The same packed drafter in this process and behind the server: same drafts, so the same loop takes the same
    # steps; the native decoder as target verifies the HTTP drafts the same way the transformers model does.
    engine = DraftEngine.from_dir(drafter_dir)
    native = NativeTarget(Transformer.from_hf(target.config.to_dict(), target.state_dict()))
    for prompt in _prompts():
        for k in (4, 16):
            local = speculative_generate(target, prompt, 32, engine, k, stop_ids=[EOS])
            remote = speculative_generate(target, prompt, 32, client, k, stop_ids=[EOS])
            native_remote = speculative_generate(native, prompt, 32, client, k, stop_ids=[EOS])
            assert local.tokens == remote.tokens == native_remote.tokens
            assert local.steps == remote.steps == native_remote.steps
            assert local.accepted_lengths == remote.accepted_lengths == native_remote.accepted_lengths
            assert local.draft_lengths == remote.draft_lengths
            assert local.mean_acceptance_length == remote.mean_acceptance_length > 1.0


def test_client_surfaces_server_errors(client):
    with pytest.raises(DraftServerError, match="tokens\\[0\\]"):
        client.draft([TINY_VOCAB + 5], 4)
    assert len(client.draft([1, 2, 3], 4)) == 4
    assert client.info()["vocab_size"] == TINY_VOCAB


def test_min_confidence_passes_through_and_stays_lossless(target, client, drafter_dir):
    eng = DraftEngine.from_dir(drafter_dir)
    for p in _prompts() + [[5, 6, 7, 8], [100, 3, 250, 7, 7]]:
        full = eng.draft(p, 8, return_probs=True)
        # a threshold halfway between a new running minimum of the probabilities and the earlier ones: stops there
        cases = [((full.probs[j] + min(full.probs[:j])) / 2, j) for j in range(1, 8)
                 if full.probs[j] < min(full.probs[:j]) - 0.005]
        if cases:
            break
    c, j = cases[-1]
    assert client.draft_response(p, 8, return_probs=True)["probs"] == pytest.approx(full.probs, abs=1e-4)
    assert client.draft(p, 8, min_confidence=c) == eng.draft(p, 8, min_confidence=c) == full[:j]
    assert client.draft(p, 8, min_confidence=0) == full

    class Dynamic:
        def draft(self, tokens, k):
            return client.draft(tokens, k, min_confidence=0.5)

    native = NativeTarget(Transformer.from_hf(target.config.to_dict(), target.state_dict()).eval())
    plain = speculative_generate(native, p, 24, None, stop_ids=[EOS])
    dyn = speculative_generate(native, p, 24, Dynamic(), k=8, stop_ids=[EOS])
    assert dyn.tokens == plain.tokens


def test_async_client_and_draft_many_match_sync_drafts(client):
    prompts = _prompts() + [[5, 6, 7, 8], [100, 3, 250, 7, 7], [1]]
    want = [client.draft(p, 8) for p in prompts]
    want_dyn = [client.draft(p, 8, min_confidence=0.5) for p in prompts]
    assert client.draft_many(prompts, k=8) == want
    assert client.draft_many(prompts, k=8, min_confidence=0.5) == want_dyn
    assert client.draft_many([]) == []

    async def run():
        async with AsyncSpeculativeClient(client.base_url, max_concurrency=3) as ac:
            assert (await ac.wait_ready(10))["status"] == "ok"
            assert (await ac.health())["status"] == "ok"
            assert (await ac.info())["vocab_size"] == TINY_VOCAB
            full = await ac.draft_response(prompts[0], 8, return_probs=True)
            assert full["draft"] == want[0] and len(full["probs"]) == 8
            with pytest.raises(DraftServerError, match="tokens\\[0\\]") as err:
                await ac.draft([TINY_VOCAB + 5], 4)
            assert err.value.status == 422
            assert await ac.draft(prompts[1], 8, min_confidence=0.5) == want_dyn[1]
            return await ac.draft_many(prompts, k=8), await ac.draft_many(prompts, 8, min_confidence=0.5)

    assert asyncio.run(run()) == (want, want_dyn)


# ---------------------------------------------------------------- retries, api key, concurrency: a scripted stub

def _reply(status, body, **headers):
    return status, headers, body


class Stub:
    """A real HTTP/1.1 server on a free loopback port, in threads. Request i gets script[i] (the last entry repeats):
    (status, headers, body), body a dict or a function of the request's JSON; "drop" closes the connection with no
    answer. Records every request and the most requests it had in flight at once."""

    def __init__(self, *script, delay_s: float = 0.0):
        self.script, self.delay_s = script, delay_s
        self.requests: list[tuple[str, str, object, object]] = []  # (method, path, headers, JSON body)
        self.inflight = self.peak = 0
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn does

            def do_GET(self):
                stub._answer(self)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown

    def _answer(self, h):
        raw = h.rfile.read(int(h.headers.get("Content-Length", 0)))
        request = json.loads(raw) if raw else None
        with self._lock:
            self.requests.append((h.command, h.path, h.headers, request))
            step = self.script[min(len(self.requests), len(self.script)) - 1]
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        try:
            time.sleep(self.delay_s)
            if step == "drop":
                h.close_connection = True
                return
            status, headers, body = step
            data = json.dumps(body(request) if callable(body) else body).encode()
            h.send_response(status)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                **headers}.items():
                h.send_header(name, value)
            h.end_headers()
            h.wfile.write(data)
        finally:
            with self._lock:
                self.inflight -= 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


BUSY = _reply(503, {"error": "queue full (128 waiting)"}, **{"Retry-After": "1"})
OK = _reply(200, lambda req: {"draft": req["tokens"][::-1]})  # the answer says which request it answers


def test_503_is_retried_after_retry_after():
    with Stub(BUSY, BUSY, OK) as stub, SpeculativeClient(stub.url) as c:
        t0 = time.monotonic()
        assert c.draft([1, 2, 3], 4) == [3, 2, 1]
        waited = time.monotonic() - t0
    assert len(stub.requests) == 3
    assert 1.8 < waited < 4.5  # two Retry-After: 1

    async def run():
        async with AsyncSpeculativeClient(stub.url) as ac:
            t0 = time.monotonic()
            return await ac.draft([4, 5], 4), time.monotonic() - t0

    with Stub(BUSY, OK) as stub:
        draft, waited = asyncio.run(run())
    assert draft == [5, 4] and len(stub.requests) == 2
    assert 0.9 < waited < 3.0


def test_retries_are_bounded_in_count_and_time():
    # always 503, no Retry-After: backoff 0.1 s then 0.2 s, then the server's message is raised
    with Stub(_reply(503, {"error": "request timed out"})) as stub, SpeculativeClient(stub.url, max_retries=2) as c:
        t0 = time.monotonic()
        with pytest.raises(DraftServerError, match="503: request timed out \\(after 3 tries\\)") as err:
            c.draft([1], 4)
        assert 0.25 < time.monotonic() - t0 < 2.0
    assert err.value.status == 503 and len(stub.requests) == 3
    # a Retry-After beyond max_retry_wait_s is cut to it: 2 waits of 0.2 s, not of 100 s
    with Stub(_reply(503, {"error": "busy"}, **{"Retry-After": "100"})) as stub, \
            SpeculativeClient(stub.url, max_retries=2, max_retry_wait_s=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(DraftServerError, match="busy"):
            c.draft([1], 4)
        assert time.monotonic() - t0 < 2.0
    assert len(stub.requests) == 3

    async def run(url):
        async with AsyncSpeculativeClient(url, max_retries=1, max_retry_wait_s=0.2) as ac:
            await ac.draft([1], 4)

    with Stub(_reply(503, {"error": "busy"}, **{"Retry-After": "100"})) as stub:
        with pytest.raises(DraftServerError, match="503: busy"):
            asyncio.run(run(stub.url))
    assert len(stub.requests) == 2


def test_4xx_is_raised_at_once():
    bad = _reply(422, {"error": "tokens[0] = 600 is out of range"})
    with Stub(bad, OK) as stub, SpeculativeClient(stub.url) as c:
        with pytest.raises(DraftServerError, match="POST /draft -> 422: tokens\\[0\\] = 600") as err:
            c.draft([600], 4)
        assert err.value.status == 422 and len(stub.requests) == 1
        assert c.draft([1, 2], 4) == [2, 1]  # the client is still usable


def test_dropped_connection_is_retried():
    with Stub("drop", OK) as stub, SpeculativeClient(stub.url) as c:
        assert c.draft([7, 8], 4) == [8, 7]
    assert len(stub.requests) == 2
    # nothing listening: the connection error itself comes out once the retries are spent (backoff 0.1 + 0.2 s)
    with Stub(OK) as stub:
        url = stub.url
    with SpeculativeClient(url, max_retries=2) as c:
        t0 = time.monotonic()
        with pytest.raises(httpx.ConnectError):
            c.draft([1], 4)
        assert 0.25 < time.monotonic() - t0 < 3.0


def test_api_key_is_sent_on_every_request():
    with Stub(_reply(200, {"status": "ok", "draft": [1]})) as stub:
        with SpeculativeClient(stub.url, api_key="s3cret") as c:
            c.draft([1], 1)
            c.info()
            c.health()

        async def run():
            async with AsyncSpeculativeClient(stub.url, api_key="s3cret") as ac:
                await ac.draft_many([[1], [2]], 1)

        asyncio.run(run())
        with SpeculativeClient(stub.url) as c:
            c.draft([1], 1)
    auth = [headers.get("Authorization") for _, _, headers, _ in stub.requests]
    assert auth == ["Bearer s3cret"] * 5 + [None]


def test_wait_ready_polls_through_503_starting():
    starting = _reply(503, {"status": "starting"}, **{"Retry-After": "1"})
    with Stub(starting, starting, starting, _reply(200, {"status": "ok"})) as stub:
        with SpeculativeClient(stub.url) as c:
            assert c.wait_ready(10) == {"status": "ok"}

        async def run():
            async with AsyncSpeculativeClient(stub.url) as ac:
                return await ac.wait_ready(10)

        assert asyncio.run(run()) == {"status": "ok"}
    assert len(stub.requests) == 5  # 3 x 503, then 200 for each client
    # a 503 that never ends is a timeout; any other status is final at once
    with Stub(starting) as stub, SpeculativeClient(stub.url) as c:
        with pytest.raises(TimeoutError):
            c.wait_ready(0.3)
    with Stub(_reply(404, {"error": "not found"})) as stub, SpeculativeClient(stub.url) as c:
        with pytest.raises(DraftServerError, match="404"):
            c.wait_ready(10)
    assert len(stub.requests) == 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_draft_many_is_concurrent_bounded_and_in_order(asynchronous):
    sequences = [[i, i + 1, i + 2] for i in range(0, 60, 10)]
    with Stub(OK, delay_s=0.2) as stub:
        if asynchronous:
            async def run():
                async with AsyncSpeculativeClient(stub.url, max_concurrency=2) as ac:
                    return await ac.draft_many(sequences, k=3)

            drafts = asyncio.run(run())
        else:
            with SpeculativeClient(stub.url, max_concurrency=2) as c:
                drafts = c.draft_many(sequences, k=3)
    assert drafts == [s[::-1] for s in sequences]
    assert stub.peak == 2  # concurrent (the server can batch them), but never more than max_concurrency
    assert sorted(tuple(r[3]["tokens"]) for r in stub.requests) == sorted(tuple(s) for s in sequences)


def test_draft_many_raises_the_first_failure():
    with Stub(OK, OK, _reply(422, {"error": "bad"}), OK) as stub, SpeculativeClient(stub.url, max_concurrency=1) as c:
        with pytest.raises(DraftServerError, match="422: bad"):
            c.draft_many([[1]] * 6, 1)
        assert len(stub.requests) == 6  # every request ran to its end before the error came out


def test_tree_defaults_are_the_engines():
    """A client's draft_tree asks for what the engine and the server default to: budget 8 (the tree measured fastest
    end to end) and 16 levels."""
    import inspect

    from drafter_lib.engine import tree_draft

    for cls in (SpeculativeClient, AsyncSpeculativeClient):
        for method in (cls.draft_tree, cls.draft_tree_response):
            params = inspect.signature(method).parameters
            assert (params["budget"].default, params["max_depth"].default) == (
                tree_draft.DEFAULT_TREE_BUDGET, tree_draft.DEFAULT_MAX_DEPTH) == (8, 16)
