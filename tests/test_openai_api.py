"""The OpenAI-compatible endpoints, with the official `openai` client against real servers on 127.0.0.1: a tiny
random target (a Hugging Face folder, TARGET) drafted by itself packed at int8 (MODEL_DIR). Every answer's text must
be the target runtime's own plain greedy decoding of the same prompt, its prompt read in chunks of a few tokens
(GENERATION_PREFILL_CHUNK). The queue bound, the drain, hang-ups and /draft between a prompt's chunks are checked on
a server whose target passes wait behind a gate file; the generation runner alone in test_generations.py."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess
from target_helpers import CONTEXT, decoded, reference, stop_string_in

openai = pytest.importorskip("openai")

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}

# server.py's command with the target's passes (every generation's) held while the file TEST_TARGET_GATE names
# exists, unless it holds a number: how many passes may have started in all; each pass and each /draft batch is
# logged, in the order the engine thread runs them, to TEST_ENGINE_LOG ("target <tokens>", "draft batch"; "held"
# when a pass starts waiting at the gate)
GATED_SERVER = """
import os, time
from drafter_lib.decoding.speculative import NativeTarget
from drafter_lib.serve import app as server_app
from drafter_lib.serve.cli import main

gate, log = os.environ.get("TEST_TARGET_GATE"), os.environ.get("TEST_ENGINE_LOG")
score, trimming, started = NativeTarget.score, server_app._trimming, [0]

def note(line):
    if log:
        with open(log, "a") as f:
            f.write(line + "\\n")

def held():
    try:
        allowed = open(gate).read().strip()
    except (TypeError, FileNotFoundError):
        return False
    return not allowed or started[0] >= int(allowed)

def gated_score(self, new_tokens, keep=None):
    if held():
        note("held")
        while held():
            time.sleep(0.01)
    started[0] += 1
    note(f"target {len(new_tokens)}")
    return score(self, new_tokens, keep)

def logged_trimming(engine, tree=False):
    run = trimming(engine, tree)

    def logged(*args, **kwargs):
        note("draft batch")
        return run(*args, **kwargs)

    return logged

NativeTarget.score, server_app._trimming = gated_score, logged_trimming
main()
"""


@pytest.fixture(scope="module")
def server(generation_dirs, tmp_path_factory):
    target_dir, drafter_dir = generation_dirs
    srv = ServerProcess(drafter_dir, tmp_path_factory.mktemp("server") / "server.log", code=GATED_SERVER,
                        TARGET=target_dir, API_KEY=KEY, GENERATION_PREFILL_CHUNK=8)  # every prompt in chunks
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def name(generation_dirs):
    return generation_dirs[0].name


def _extra(obj) -> dict:
    return obj.model_extra or {}


def _complete(client, name, stream: bool, chat: bool, **kw) -> dict:
    """One request through the client, streamed or not: {text, finish_reason, usage, specdraft}."""
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = create(model=name, **kw)
        choice = r.choices[0]
        return {"text": choice.message.content if chat else choice.text, "finish_reason": choice.finish_reason,
                "usage": r.usage.model_dump(exclude_none=True), "specdraft": _extra(r)["specdraft"]}
    chunks = list(create(model=name, stream=True, stream_options={"include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == []  # the usage comes last, without choices
    choices = [c.choices[0] for c in chunks[:-1]]
    texts = [(ch.delta.content if chat else ch.text) or "" for ch in choices]
    finishes = [ch.finish_reason for ch in choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1)  # only the last chunk carries it
    if chat:
        assert choices[0].delta.role == "assistant"
    return {"text": "".join(texts), "finish_reason": finishes[-1],
            "usage": chunks[-1].usage.model_dump(exclude_none=True), "specdraft": _extra(chunks[-2])["specdraft"]}


def _usage(prompt_ids, tokens) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
            "total_tokens": len(prompt_ids) + len(tokens)}


def _check_specdraft(out: dict, tokens) -> None:
    s = out["specdraft"]
    assert s["mean_acceptance_length"] == pytest.approx(len(tokens) / s["target_steps"], abs=1e-3)
    assert 0 <= s["accepted_tokens"] <= s["draft_tokens"] and s["target_steps"] <= len(tokens)


# ------------------------------------------------------------------ answers: the target's own greedy text


def test_models_lists_the_target(client, name):
    assert [m.id for m in client.models.list().data] == [name]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_are_the_targets_greedy_text(client, generation_runtime, name, stream):
    text_prompt = "Once upon a time"
    for prompt in (text_prompt, generation_runtime.tokenizer.encode("def main():")):
        ids = generation_runtime.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        text, tokens, finish = reference(generation_runtime, ids, 48)
        out = _complete(client, name, stream, chat=False, prompt=prompt, max_tokens=48)
        assert (out["text"], out["finish_reason"], out["usage"]) == (text, finish, _usage(ids, tokens))
        _check_specdraft(out, tokens)
    # OpenAI's default max_tokens for completions: 16
    r = client.completions.create(model=name, prompt=text_prompt)
    assert r.usage.completion_tokens <= 16 and r.choices[0].text == reference(
        generation_runtime, generation_runtime.tokenizer.encode(text_prompt), 16)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_completions_are_the_targets_greedy_text(client, generation_runtime, name, stream):
    from drafter_lib.common.chat import encode_chat

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "Another?"}]}]
    as_text = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Another?"} for m in messages]
    ids = encode_chat(generation_runtime.tokenizer, as_text)
    text, tokens, finish = reference(generation_runtime, ids, 40)
    out = _complete(client, name, stream, chat=True, messages=messages, max_tokens=40)
    assert (out["text"], out["finish_reason"], out["usage"]) == (text, finish, _usage(ids, tokens))
    _check_specdraft(out, tokens)
    # without a bound, up to the end of the context (or a stop token); max_completion_tokens is the newer name
    short = _complete(client, name, stream, chat=True, messages=messages[:2], max_completion_tokens=5)
    assert short["usage"]["completion_tokens"] <= 5
    if not stream:  # (the same code path either way; a whole context's plain decoding is the slow part)
        whole = _complete(client, name, stream, chat=True, messages=messages[:2])
        ids = encode_chat(generation_runtime.tokenizer, messages[:2])
        assert whole["text"] == reference(generation_runtime, ids, CONTEXT - len(ids))[0]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_cut_the_text_and_count_the_tokens_up_to_them(client, generation_runtime, name, stream):
    prompt = "Stop somewhere"
    ids = generation_runtime.tokenizer.encode(prompt)
    text, tokens, _ = reference(generation_runtime, ids, 60)
    stop, i = stop_string_in(text, start=len(text) // 3)
    needed = next(n for n in range(1, len(tokens) + 1) if stop in decoded(generation_runtime.tokenizer, tokens[:n]))
    for given in (stop, ["\x01never", stop]):
        out = _complete(client, name, stream, chat=False, prompt=prompt, max_tokens=60, stop=given)
        assert (out["text"], out["finish_reason"]) == (text[:i], "stop")
        assert out["usage"] == _usage(ids, tokens[:needed])


# ------------------------------------------------------------------ log-probabilities


def _plain_logprobs(runtime, ids, max_tokens: int, top: int) -> list:
    """Plain decoding's (no drafter: one token per target pass) TokenLogprob entries."""
    from drafter_lib.decoding.text_generation import TextGeneration

    gen = TextGeneration(runtime, ids, max_tokens, None, top_logprobs=top)
    return [e for d in gen for e in d.logprobs]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_are_plain_decodings_for_every_token(client, generation_runtime, name, stream):
    """logprobs=True, top_logprobs=2 through the openai client: a log-probability for every token of the answer,
    equal (exactly, as JSON carries a float) to plain decoding's though the answer was drafted."""
    from drafter_lib.common.chat import encode_chat

    messages = [{"role": "user", "content": "Name a colour."}]
    ids = encode_chat(generation_runtime.tokenizer, messages)
    text, tokens, finish = reference(generation_runtime, ids, 40)
    expected = [{"token": e.text, "logprob": e.logprob, "bytes": list(e.bytes),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in e.top]}
                for e in _plain_logprobs(generation_runtime, ids, 40, 2)]
    kw = dict(model=name, messages=messages, max_tokens=40, logprobs=True, top_logprobs=2)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        content = [lp.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                   for lp in c.choices[0].logprobs.content]
        out, usage, extra = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
            chunks[-1].usage, _extra(chunks[-2])
    else:
        r = client.chat.completions.create(**kw)
        content = [lp.model_dump() for lp in r.choices[0].logprobs.content]
        out, usage, extra = r.choices[0].message.content, r.usage, _extra(r)
    assert out == text and usage.completion_tokens == len(tokens)
    assert len(content) == len(tokens) - (finish == "stop")  # every token but an end-of-turn one
    assert content == expected
    assert extra["specdraft"]["target_steps"] < len(tokens)  # drafted: several tokens a target pass
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_in_the_legacy_shape_are_plain_decodings(server, generation_runtime, name, stream):
    tok = generation_runtime.tokenizer
    ids = tok.encode("def main():")
    plain = _plain_logprobs(generation_runtime, ids, 32, 3)
    body = {"model": name, "prompt": "def main():", "max_tokens": 32, "logprobs": 3, "stream": stream}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        if stream:
            chunks = [json.loads(ln.removeprefix("data: ")) for ln in _stream_lines(http, body)[:-1]]
            parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
            got = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
            text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got, text = r.json()["choices"][0]["logprobs"], r.json()["choices"][0]["text"]
    assert text == reference(generation_runtime, ids, 32)[0]
    assert got == {"tokens": [e.text for e in plain], "token_logprobs": [e.logprob for e in plain],
                   "top_logprobs": [{t: v for t, _, v in e.top} for e in plain],
                   "text_offset": [e.offset for e in plain]}


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_logprobs_out_of_range_are_a_400(server, name, path, extra, param):
    body = {"model": name, "max_tokens": 2, **extra, **(
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ what is refused, in OpenAI's error shape


def _refused(call, status: int, param: str | None, *words):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    err = e.value
    assert err.status_code == status, err
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["param"] == param, err.body
    for w in words:
        assert w in err.body["message"], (w, err.body)
    return err


@pytest.mark.parametrize("kw, param", [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"),
                                       ({"n": 2}, "n"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
                                       ({"logit_bias": {"5": 3}}, "logit_bias")])
def test_sampling_is_refused_naming_the_field(client, name, kw, param):
    _refused(lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, **kw),
             400, param, "only greedy decoding is served", param)


def test_greedy_values_of_sampling_fields_are_served(client, generation_runtime, name):
    r = client.completions.create(model=name, prompt="x", max_tokens=3, temperature=0, top_p=1, n=1, seed=7,
                                  presence_penalty=0, frequency_penalty=0, logit_bias={}, user="me")
    text, tokens, finish = reference(generation_runtime, generation_runtime.tokenizer.encode("x"), 3)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, finish, len(tokens))
    _refused(lambda: client.completions.create(model=name, prompt="x", max_tokens=3, best_of=2), 400, "best_of",
             "only greedy decoding is served")
    _refused(lambda: client.completions.create(model=name, prompt="x", max_tokens=3, echo=True), 400, "echo")


def test_bad_requests_get_a_4xx_naming_the_problem(client, name):
    chat, complete = client.chat.completions.create, client.completions.create
    hi = [{"role": "user", "content": "hi"}]
    err = _refused(lambda: chat(model="gpt-4o", messages=hi), 404, "model", "gpt-4o", name)
    assert err.body["code"] == "model_not_found" and isinstance(err, openai.NotFoundError)
    _refused(lambda: chat(model=name, messages=[]), 400, "messages", "at least one message")
    _refused(lambda: chat(model=name, messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role")
    _refused(lambda: chat(model=name, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content")
    _refused(lambda: chat(model=name, messages=[{"role": "user"}]), 400, "messages[0].content", "required")
    _refused(lambda: complete(model=name, prompt="x" * (CONTEXT + 5)), 400, "prompt", f"context is {CONTEXT}")
    _refused(lambda: complete(model=name, prompt="x" * 200, max_tokens=100), 400, "max_tokens",
             "at most 56 new tokens")
    _refused(lambda: chat(model=name, messages=hi, max_completion_tokens=10_000), 400, "max_completion_tokens")
    _refused(lambda: complete(model=name, prompt="x", max_tokens="16"), 400, "max_tokens", "integer")
    _refused(lambda: complete(model=name, prompt="x", max_tokens=0), 400, "max_tokens")
    _refused(lambda: complete(model=name, prompt="x", stop=["a", "b", "c", "d", "e"]), 400, "stop", "up to 4")
    _refused(lambda: complete(model=name, prompt=[1, 10_000]), 400, "prompt", "vocabulary")
    _refused(lambda: complete(model=name, prompt=["a", "b"]), 400, "prompt", "batch of 2")
    _refused(lambda: complete(model=name, prompt=""), 400, "prompt", "empty")
    _refused(lambda: complete(model=name, prompt="x", stream=False, stream_options={"include_usage": True}), 400,
             "stream_options")


def test_malformed_bodies_get_a_400_in_openai_shape(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for body in (b'{"model": "x", "prompt": ', b"", b"[1, 2]"):
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_keys_apply_to_the_v1_endpoints(server, name):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as wrong:
        for call in (wrong.models.list, lambda: wrong.completions.create(model=name, prompt="x", max_tokens=2)):
            err = _refused(call, 401, None, "API key")
            assert isinstance(err, openai.AuthenticationError) and err.body["code"] == "invalid_api_key"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json={}).status_code == 401
        assert http.get("/health").status_code == 200


# ------------------------------------------------------------------ read as OpenAI reads requests


def _post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        return http.post(path, json=body)


def test_requests_parse_as_openai_parses_them(server, generation_runtime, name):
    """null meaning the default, a message's name, the developer role as the system one, an assistant turn without
    content, a text response_format, tools offered with no call, unknown fields: all served, the answer the
    target's own greedy text of the prompt they stand for."""
    from drafter_lib.common.chat import encode_chat

    tok = generation_runtime.tokenizer
    messages = [{"role": "developer", "content": "Be terse.", "name": "ops"},
                {"role": "user", "content": "Hi", "name": "ann", "weight": 1},
                {"role": "assistant", "content": None, "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "Again?", "cache_control": {}}]}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": name, "messages": messages, "max_tokens": 12, "stream": None, "stream_options": None,
            "temperature": None, "top_p": None, "n": None, "stop": None, "seed": None, "user": None, "logprobs": None,
            "response_format": {"type": "text"}, "tools": [tool], "tool_choice": "none",
            "parallel_tool_calls": False, "metadata": {"k": "v"}, "store": False, "frobnicate": 1}
    as_template = [{"role": "system", "content": "Be terse.", "name": "ops"},
                   {"role": "user", "content": "Hi", "name": "ann"}, {"role": "assistant", "content": ""},
                   {"role": "user", "content": "Again?"}]
    text, tokens, finish = reference(generation_runtime, encode_chat(tok, as_template), 12)
    for _ in range(2):
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish)
        assert r.json()["usage"]["completion_tokens"] == len(tokens)
    for extra in ({"tools": [], "tool_choice": None}, {"tool_choice": "auto"},
                  {"functions": [], "function_call": None}):
        r = _post(server, "/v1/chat/completions", {"model": name, "messages": messages[1:2], "max_tokens": 2,
                                                   **extra})
        assert r.status_code == 200, (extra, r.text)
    # a completion: null max_tokens is OpenAI's default of 16, null stream a whole answer
    r = _post(server, "/v1/completions", {"model": name, "prompt": "Once", "max_tokens": None, "stream": None,
                                          "echo": None, "suffix": None, "best_of": None, "frobnicate": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(
        generation_runtime, tok.encode("Once"), 16)[0], r.text
    log = server.log()
    warned = [ln for ln in log.splitlines() if "ignoring the request field" in ln]
    for field in ("'frobnicate'", "'metadata'", "'store'", "'parallel_tool_calls'", "'messages[].weight'",
                  "'messages[].content[].cache_control'"):
        assert sum(field in ln for ln in warned) == 1, (field, warned)  # once per name, however often sent
    assert not any("'logprobs'" in ln or "'stream'" in ln for ln in warned)  # known fields are not "unknown"


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_object"}}, "response_format", ["only text answers"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["json_schema"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", ["tool calls are not served"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tools", ["none"]),
    ({"tool_choice": "required"}, "tool_choice", ["tool calls are not served"]),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", []),
    ({"functions": [{"name": "f"}]}, "functions", []),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[1].type", ["only text is served", "image_url"]),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", ["required"]),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", ["required"]),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls",
     ["tool calls"]),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].role", ["developer"]),
    ({"n": 2}, "n", ["only greedy decoding"]),
    ({"temperature": 0.5}, "temperature", ["only greedy decoding"]),
    ({"stream": "yes"}, "stream", ["boolean"]),
    ({"model": None}, "model", ["required"]),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, name, extra, param, words):
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err)


# ------------------------------------------------------------------ errors on every /v1 path and method


def test_every_v1_path_and_method_answers_in_openai_shape_and_every_failure_is_counted(server, name):
    errors = "specdraft:http_errors_total"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        before = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in http.get("/metrics").text.splitlines()
                  if ln.startswith(errors)}

        def added(endpoint: str, status: int) -> float:
            series = f'{errors}{{endpoint="{endpoint}",status="{status}"}}'
            return _metric(http, series) - before.get(series, 0.0)

        for method, path, status in [("GET", "/v1/nope", 404), ("POST", "/v1/chat/completion", 404),
                                     ("GET", "/v1", 404), ("GET", "/v1/chat/completions", 405),
                                     ("PUT", "/v1/completions", 405), ("DELETE", "/v1/models", 405)]:
            r = http.request(method, path)
            assert r.status_code == status, (method, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert "POST /v1/chat/completions" in err["message"] and method in err["message"], err
        assert http.get("/v1/chat/completions").headers["allow"] == "POST"
        assert http.get("/nope").json() == {"detail": "Not Found"}  # outside /v1, FastAPI's own shape
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.post("/v1/completions", json={"model": name, "prompt": "x", "n": 2}).status_code == 400
        assert http.post("/draft", json={"tokens": "x"}).status_code == 422
        assert added("other", 404) == 4 and added("/v1/chat/completions", 405) == 2  # (the Allow check: 2)
        assert added("/v1/completions", 405) == 1 and added("/v1/models", 405) == 1
        assert added("/v1/models", 401) == 1 and added("/v1/completions", 400) == 1 and added("/draft", 422) == 1
        assert added("/health", 200) == 0  # answers below 400 are not failures


# ------------------------------------------------------------------ the rest of the server


def _metric(http, line_start: str) -> float:
    lines = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith(line_start)]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_metrics_count_generations_and_tokens_and_draft_still_serves(server, client, name, generation_dirs):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        before = {k: _metric(http, k) for k in ("specdraft:generations_total", "specdraft:generation_tokens_total",
                                                "specdraft:generation_target_steps_total",
                                                "specdraft:prompt_tokens_total")}
        r = client.completions.create(model=name, prompt="Count me", max_tokens=12)
        after = {k: _metric(http, k) for k in before}
        assert after["specdraft:generations_total"] == before["specdraft:generations_total"] + 1
        assert after["specdraft:generation_tokens_total"] - before["specdraft:generation_tokens_total"] == \
            r.usage.completion_tokens
        assert after["specdraft:prompt_tokens_total"] - before["specdraft:prompt_tokens_total"] == \
            r.usage.prompt_tokens
        assert after["specdraft:generation_target_steps_total"] - before[
            "specdraft:generation_target_steps_total"] == _extra(r)["specdraft"]["target_steps"]
        refused = 'specdraft:openai_requests_total{reason="",status="400"}'
        before_400 = _metric(http, refused)
        assert http.post("/v1/completions", json={"model": name, "prompt": "x", "n": 3}).status_code == 400
        assert _metric(http, refused) == before_400 + 1
        assert _metric(http, "specdraft:generations_running") == 0
        draft = http.post("/draft", json={"tokens": [1, 2, 3]})  # the drafter's own endpoint, unchanged
        assert draft.status_code == 200 and len(draft.json()["draft"]) == 16
        info = http.get("/info").json()
        assert info["target"]["name"] == name and info["target"]["context_length"] == CONTEXT
        assert info["server"]["target"] == name
        assert str(generation_dirs[0].parent) not in json.dumps(info)  # no machine path


# ------------------------------------------------------------------ the queue bound and the drain


def _stream_lines(http, body):
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return [ln for ln in r.iter_lines() if ln]


@pytest.mark.slow
def test_queue_bound_gives_503_and_a_drain_finishes_the_generations(generation_dirs, generation_runtime, name,
                                                                    tmp_path):
    """GENERATION_MAX_QUEUE=1, GENERATION_MAX_RUNNING=1 and the target held at its first pass (a gate file): one
    generation runs, one waits (longer than /draft's REQUEST_TIMEOUT_S, which does not bound it), the next is
    refused at once with Retry-After; SIGTERM refuses new ones, lets both finish and then exits 0."""
    target_dir, drafter_dir = generation_dirs
    gate = tmp_path / "gate"
    srv = ServerProcess(drafter_dir, tmp_path / "server.log", code=GATED_SERVER, TARGET=target_dir,
                        API_KEY=KEY, GENERATION_MAX_QUEUE=1, GENERATION_MAX_RUNNING=1, REQUEST_TIMEOUT_S=1,
                        SHUTDOWN_TIMEOUT_S=60, TEST_TARGET_GATE=gate)
    try:
        srv.wait_ready()
        gate.touch()
        results = {}
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as http:
            def run(key, body):
                results[key] = _stream_lines(http, body) if body.get("stream") else http.post(
                    "/v1/completions", json=body)

            def wait_for(metric, value):
                deadline = time.monotonic() + 30
                while _metric(http, metric) != value:
                    assert time.monotonic() < deadline, (metric, srv.log())
                    time.sleep(0.02)

            first = threading.Thread(target=run, args=("first", {"model": name, "prompt": "First", "max_tokens": 24,
                                                                 "stream": True}))
            first.start()
            wait_for("specdraft:generations_running", 1)
            second = threading.Thread(target=run, args=("second", {"model": name, "prompt": "Second",
                                                                   "max_tokens": 8}))
            second.start()
            wait_for("specdraft:generations_waiting", 1)
            full = http.post("/v1/completions", json={"model": name, "prompt": "Third", "max_tokens": 4})
            assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
            error = full.json()["error"]
            assert error["code"] == "queue_full" and "GENERATION_MAX_QUEUE=1" in error["message"]
            assert _metric(http, 'specdraft:openai_requests_total{reason="queue_full",status="503"}') == 1
            time.sleep(1.5)  # the second waits past REQUEST_TIMEOUT_S=1: a /draft bound, not a generation's

            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (late := http.post("/v1/completions", json={"model": name, "prompt": "Late"})).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert late.json()["error"]["code"] == "draining" and late.headers["connection"] == "close"
            gate.unlink()
            first.join(60)
            second.join(60)
        events = [ln.removeprefix("data: ") for ln in results["first"]]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference(
            generation_runtime, generation_runtime.tokenizer.encode("First"), 24)[0]
        assert results["second"].status_code == 200
        assert results["second"].json()["choices"][0]["text"] == reference(
            generation_runtime, generation_runtime.tokenizer.encode("Second"), 8)[0]
        assert srv.proc.wait(timeout=60) == 0, srv.log()
    finally:
        gate.unlink(missing_ok=True)
        srv.stop()


# ------------------------------------------------------------------ a client that hangs up


PREFILL_CHUNK = 16  # the gated server's GENERATION_PREFILL_CHUNK


@pytest.fixture(scope="module")
def gated_server(generation_dirs, tmp_path_factory):
    """A server whose target passes wait at its gate file (GATED_SERVER), logging them and the /draft batches, with
    prompts read in chunks of PREFILL_CHUNK tokens, one generation at a time, a small default answer bound and a
    short wait for a generation to start."""
    target_dir, drafter_dir = generation_dirs
    tmp = tmp_path_factory.mktemp("gated")
    gate, log = tmp / "gate", tmp / "engine.log"
    srv = ServerProcess(drafter_dir, tmp / "server.log", code=GATED_SERVER, TARGET=target_dir, API_KEY=KEY,
                        TEST_TARGET_GATE=gate, TEST_ENGINE_LOG=log, GENERATION_PREFILL_CHUNK=PREFILL_CHUNK,
                        GENERATION_MAX_RUNNING=1, GENERATION_DEFAULT_MAX_TOKENS=7, GENERATION_TIMEOUT_S=2)
    with srv:
        srv.gate, srv.engine_log = gate, log
        yield srv
    gate.unlink(missing_ok=True)


def _wait_for(http, metric: str, value: float, srv) -> None:
    deadline = time.monotonic() + 60
    while _metric(http, metric) != value:
        assert time.monotonic() < deadline, (metric, _metric(http, metric), srv.log())
        time.sleep(0.02)


def _engine_log(srv) -> list[str]:
    return srv.engine_log.read_text().splitlines() if srv.engine_log.exists() else []


def _passes(lines: list[str]) -> int:
    return sum(line.startswith("target ") for line in lines)


def _hold_after(srv, passes: int) -> int:
    """Let `passes` more target passes start, then hold the next one; returns the log's length now."""
    lines = _engine_log(srv)
    srv.gate.write_text(str(_passes(lines) + passes))
    return len(lines)


def _wait_until_held(srv, since: int, passes: int) -> None:
    """Until the log shows `passes` passes since line `since`, then one waiting at the gate."""
    deadline = time.monotonic() + 60
    while not ((new := _engine_log(srv)[since:]) and new[-1] == "held" and _passes(new) == passes):
        assert time.monotonic() < deadline, (new, srv.log())
        time.sleep(0.02)


@pytest.mark.parametrize("phase", ["prefill", "decoding"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_hangs_up_stops_its_generation_within_one_target_pass(gated_server, generation_runtime,
                                                                           name, stream, phase):
    """The target is held at a pass of the generation (the first chunk of its long prompt, or its first step after
    the prompt's chunks) while the client (a raw socket) hangs up on a request for the whole context; released,
    that pass ends the generation: no other pass runs, and the next request is answered at once."""
    from drafter_lib.common.chat import encode_chat

    srv = gated_server
    steps, chunks, abandoned = "specdraft:generation_target_steps_total", \
        "specdraft:generation_prefill_passes_total", 'specdraft:generations_total{finish_reason="abandoned"}'
    messages = [{"role": "user", "content": "Talk at length. " * 8}]
    prompt = len(encode_chat(generation_runtime.tokenizer, messages))
    prefill = len(range(PREFILL_CHUNK, prompt, PREFILL_CHUNK))  # the prompt's passes before the first step
    assert prefill >= 6
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        before = {m: _metric(http, m) for m in (steps, chunks, abandoned)}
        body = json.dumps({"model": name, "messages": messages, "max_tokens": CONTEXT - prompt,
                           "stream": stream}).encode()
        allowed = 0 if phase == "prefill" else prefill
        since = _hold_after(srv, allowed)
        try:
            conn = socket.create_connection(("127.0.0.1", srv.port))
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            _wait_until_held(srv, since, allowed)
            conn.close()
            time.sleep(1.0)  # the server reads the hang-up while the pass is held
        finally:
            srv.gate.unlink(missing_ok=True)
        _wait_for(http, abandoned, before[abandoned] + 1, srv)
        assert _passes(_engine_log(srv)[since:]) == allowed + 1  # the pass held at the hang-up, and no other
        if phase == "prefill":  # within one chunk of the prompt, none of its answer
            assert (_metric(http, chunks) - before[chunks], _metric(http, steps) - before[steps]) == (1, 0)
        else:
            assert (_metric(http, chunks) - before[chunks], _metric(http, steps) - before[steps]) == (prefill, 1)
        assert _metric(http, "specdraft:generations_running") == 0
        t0 = time.perf_counter()
        r = http.post("/v1/completions", json={"model": name, "prompt": "Next", "max_tokens": 8})
        assert r.status_code == 200 and time.perf_counter() - t0 < 3.0
        assert r.json()["choices"][0]["text"] == reference(generation_runtime,
                                                           generation_runtime.tokenizer.encode("Next"), 8)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_draft_is_answered_between_the_chunks_of_a_long_prompt(gated_server, generation_runtime, name, stream):
    """A /draft request that comes while a long prompt's first chunk is held runs right after that chunk, while
    the prompt's next chunk is still held: a long prompt holds the drafts up for one chunk, not for the whole
    prompt. The answer is the target's plain greedy one all the same."""
    srv = gated_server
    prompt = "A long prompt, read a chunk at a time. " * 5
    ids = generation_runtime.tokenizer.encode(prompt)
    prefill = len(range(PREFILL_CHUNK, len(ids), PREFILL_CHUNK))
    assert prefill >= 6
    results = {}
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        before = _metric(http, "specdraft:generation_prefill_passes_total")
        body = {"model": name, "prompt": prompt, "max_tokens": 8, "stream": stream}
        since = _hold_after(srv, 0)
        try:
            generation = threading.Thread(target=lambda: results.setdefault("answer", _stream_lines(http, body) if
                                                                            stream else http.post("/v1/completions",
                                                                                                  json=body)))
            generation.start()
            _wait_until_held(srv, since, 0)  # the first chunk waits at the gate
            draft = threading.Thread(target=lambda: results.setdefault("draft", http.post(
                "/draft", json={"tokens": [1, 2, 3], "num_draft_tokens": 4})))
            draft.start()
            _wait_for(http, "specdraft:num_requests_running", 1, srv)  # its batch is queued on the engine thread
            _hold_after(srv, 1)  # the first chunk runs; the second waits
            draft.join(60)
            assert results["draft"].status_code == 200 and len(results["draft"].json()["draft"]) == 4
            log = [line for line in _engine_log(srv)[since:] if line != "held"]
            assert log == [f"target {PREFILL_CHUNK}", "draft batch"], log  # the prompt not yet read
            assert generation.is_alive() and _metric(http, "specdraft:generations_running") == 1
        finally:
            srv.gate.unlink(missing_ok=True)
        generation.join(60)
        assert _metric(http, "specdraft:generation_prefill_passes_total") - before == prefill
    want = reference(generation_runtime, ids, 8)[0]
    if stream:
        chunks = [json.loads(e.removeprefix("data: ")) for e in results["answer"][:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
    else:
        assert results["answer"].json()["choices"][0]["text"] == want


def test_a_chat_answer_without_max_tokens_gets_the_servers_default_bound(gated_server, generation_runtime, name):
    from drafter_lib.common.chat import encode_chat

    messages = [{"role": "user", "content": "Say a lot."}]
    text, tokens, finish = reference(generation_runtime, encode_chat(generation_runtime.tokenizer, messages), 7)
    r = _post(gated_server, "/v1/chat/completions", {"model": name, "messages": messages})
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"],
            r.json()["usage"]["completion_tokens"]) == (text, finish, len(tokens))
    assert len(tokens) == 7 or finish == "stop"
    r = _post(gated_server, "/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 9})
    assert r.json()["usage"]["completion_tokens"] == len(reference(
        generation_runtime, encode_chat(generation_runtime.tokenizer, messages), 9)[1])  # asked for: served


@pytest.mark.slow
def test_a_drain_past_its_bound_ends_the_generations_with_a_final_event(generation_dirs, name, tmp_path):
    """SHUTDOWN_TIMEOUT_S=1 and the target held: the streamed generation gets a shutting_down error event and
    [DONE], the one queued behind it a 503, both before uvicorn's own graceful timeout would cut them; exit 0."""
    target_dir, drafter_dir = generation_dirs
    gate = tmp_path / "gate"
    srv = ServerProcess(drafter_dir, tmp_path / "server.log", code=GATED_SERVER, TARGET=target_dir, API_KEY=KEY,
                        SHUTDOWN_TIMEOUT_S=1, GENERATION_MAX_RUNNING=1, TEST_TARGET_GATE=gate)
    results = {}
    try:
        srv.wait_ready()
        gate.touch()
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
            def run(key, body):
                if body.get("stream"):
                    results[key] = _stream_lines(http, body)
                else:
                    results[key] = http.post("/v1/completions", json=body)
                results[key + "_s"] = time.monotonic()

            streamed = threading.Thread(target=run, args=("streamed", {"model": name, "prompt": "Long",
                                                                       "max_tokens": 200, "stream": True}))
            streamed.start()
            _wait_for(http, "specdraft:generations_running", 1, srv)
            queued = threading.Thread(target=run, args=("queued", {"model": name, "prompt": "Behind",
                                                                   "max_tokens": 4}))
            queued.start()
            _wait_for(http, "specdraft:generations_waiting", 1, srv)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            streamed.join(30)
            queued.join(30)
        gate.unlink()
        assert srv.proc.wait(timeout=60) == 0, srv.log()
    finally:
        gate.unlink(missing_ok=True)
        srv.stop()
    events = [ln.removeprefix("data: ") for ln in results["streamed"]]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events
    assert results["queued"].status_code == 503 and results["queued"].json()["error"]["code"] == "shutting_down"
    assert results["streamed_s"] - t0 < 4 and results["queued_s"] - t0 < 4  # the bound, not uvicorn's 5 s more


# ------------------------------------------------------------------ the settings


@pytest.mark.parametrize("env, target", [({"TARGET": "smollm2-135m-instruct"}, "smollm2-135m-instruct"),
                                         ({"TARGET_DIR": "/srv/models/my-target"}, "/srv/models/my-target"),
                                         ({"TARGET": " "}, None), ({}, None)])
def test_target_setting(monkeypatch, env, target):
    from drafter_lib.serve.settings import Settings

    for var in ("TARGET", "TARGET_DIR", "TARGET_NUMERICS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    settings = Settings.from_env()
    assert settings.target == target and settings.target_numerics == "auto"
    assert settings.public()["target"] == target  # no such folder here: shown as given (a folder: its name only)


def test_target_numerics_setting_is_the_runtimes(monkeypatch, generation_dirs):
    from pydantic import ValidationError

    from drafter_lib.decoding.runtime import NUMERICS
    from drafter_lib.serve.settings import TARGET_NUMERICS, Settings, describe_errors

    assert TARGET_NUMERICS == NUMERICS
    monkeypatch.setenv("TARGET_NUMERICS", "FP32")
    monkeypatch.setenv("TARGET", str(generation_dirs[0]))
    settings = Settings.from_env()
    assert settings.target_numerics == "fp32" and settings.public()["target"] == generation_dirs[0].name
    monkeypatch.setenv("TARGET_NUMERICS", "int4")
    with pytest.raises(ValidationError) as e:
        Settings.from_env()
    assert describe_errors(e.value) == [
        "TARGET_NUMERICS='int4': Input should be 'auto', 'gguf', 'w8a8', 'w4a8' or 'fp32'"]


def test_a_generation_not_started_within_generation_timeout_s_gets_a_503(gated_server, name):
    srv = gated_server
    results = {}
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        srv.gate.touch()
        try:
            first = threading.Thread(target=lambda: results.setdefault("first", http.post(
                "/v1/completions", json={"model": name, "prompt": "First", "max_tokens": 4})))
            first.start()
            _wait_for(http, "specdraft:generations_running", 1, srv)
            t0 = time.perf_counter()
            late = http.post("/v1/completions", json={"model": name, "prompt": "Second", "max_tokens": 4})
            waited = time.perf_counter() - t0
        finally:
            srv.gate.unlink(missing_ok=True)
        first.join(60)
    assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1, late.text
    error = late.json()["error"]
    assert error["code"] == "timeout" and "GENERATION_TIMEOUT_S=2" in error["message"] and 2 <= waited < 10
    assert results["first"].status_code == 200


def test_generation_settings(monkeypatch):
    from pydantic import ValidationError

    from drafter_lib.serve.settings import Settings, describe_errors

    for var in ("GENERATION_DEFAULT_MAX_TOKENS", "GENERATION_MAX_QUEUE", "GENERATION_TIMEOUT_S",
                "GENERATION_MAX_RUNNING", "GENERATION_PREFILL_CHUNK"):
        monkeypatch.delenv(var, raising=False)
    defaults = Settings.from_env()
    assert (defaults.generation_default_max_tokens, defaults.generation_max_queue, defaults.generation_timeout_s,
            defaults.generation_max_running, defaults.generation_prefill_chunk) == (2048, 16, 300.0, 4, 128)
    for var, bad in (("GENERATION_MAX_QUEUE", "0"), ("GENERATION_TIMEOUT_S", "0"), ("GENERATION_MAX_RUNNING", "0"),
                     ("GENERATION_MAX_RUNNING", "65"), ("GENERATION_PREFILL_CHUNK", "0")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValidationError) as e:
            Settings.from_env()
        assert describe_errors(e.value)[0].startswith(f"{var}={bad!r}: ")
        monkeypatch.delenv(var)
    monkeypatch.setenv("GENERATION_DEFAULT_MAX_TOKENS", "300")
    assert Settings.from_env().public()["generation_default_max_tokens"] == 300
    for bad in ("0", "many"):
        monkeypatch.setenv("GENERATION_DEFAULT_MAX_TOKENS", bad)
        with pytest.raises(ValidationError) as e:
            Settings.from_env()
        assert describe_errors(e.value)[0].startswith(f"GENERATION_DEFAULT_MAX_TOKENS={bad!r}: ")


@pytest.mark.parametrize("drafter, k", [("prompt-lookup", 4), ("none", 0)])
def test_generations_drafted_by_prompt_lookup_or_nothing_are_the_targets_greedy_text(generation_dirs,
                                                                                      generation_runtime, drafter, k,
                                                                                      tmp_path):
    from drafter_lib.common.chat import encode_chat

    target_dir, drafter_dir = generation_dirs
    messages = [{"role": "user", "content": "Say it twice: a b c d, a b c d"}]
    ids = encode_chat(generation_runtime.tokenizer, messages)
    text, tokens, finish = reference(generation_runtime, ids, 64)
    with ServerProcess(drafter_dir, tmp_path / "server.log", TARGET=target_dir, GENERATION_DRAFTER=drafter) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            info = http.get("/info").json()["target"]
            assert (info["drafter"], info["draft_tokens"], info["min_confidence"]) == (drafter, k, None)
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            out = _complete(client, target_dir.name, False, chat=True, messages=messages, max_tokens=64)
    assert (out["text"], out["finish_reason"], out["usage"]) == (text, finish, _usage(ids, tokens))
    _check_specdraft(out, tokens)
    assert (out["specdraft"]["draft_tokens"] > 0) == (drafter == "prompt-lookup")  # the lookup drafted


def test_generation_drafter_settings(monkeypatch):
    from pydantic import ValidationError

    from drafter_lib.decoding import text_generation
    from drafter_lib.serve.settings import GENERATION_DRAFTERS, PROMPT_LOOKUP_TOKENS, Settings, describe_errors

    assert (GENERATION_DRAFTERS, PROMPT_LOOKUP_TOKENS) == (text_generation.GENERATION_DRAFTERS,
                                                           text_generation.PROMPT_LOOKUP_TOKENS)
    for var in ("GENERATION_DRAFTER", "GENERATION_DRAFT_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    assert (Settings.from_env().generation_drafter, Settings.from_env().draft_tokens) == ("model", 16)
    monkeypatch.setenv("GENERATION_DRAFTER", " Prompt-Lookup")
    assert Settings.from_env().draft_tokens == 4
    monkeypatch.setenv("GENERATION_DRAFT_TOKENS", "2")
    assert Settings.from_env().draft_tokens == 2
    monkeypatch.setenv("GENERATION_DRAFTER", "eagle")
    monkeypatch.setenv("GENERATION_DRAFT_TOKENS", "0")
    with pytest.raises(ValidationError) as e:
        Settings.from_env()
    assert describe_errors(e.value) == [
        "GENERATION_DRAFTER='eagle': Input should be 'model', 'prompt-lookup' or 'none'",
        "GENERATION_DRAFT_TOKENS='0': Input should be greater than or equal to 1"]
