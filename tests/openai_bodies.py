"""Hypothesis strategies for fuzzing /v1/completions and /v1/chat/completions: bodies OpenAI accepts and the server
serves, written in the odd ways clients write them (null for a default, the developer role, names, text parts,
greedy values of the sampling fields, tools offered without a call, unknown fields, any text); bodies the server
must refuse with a 4xx in OpenAI's error shape (one such body with one thing wrong, or no request at all); and
garbage (such a body with a few of its fields set to any JSON value), which may go either way but never to a 5xx.

Each strategy draws (path, body); a body is a dict to send as JSON, or raw bytes. Prompts stay short (a tiny
target's context holds them and their answers) and answers at most MAX_TOKENS tokens, or the server's default
bound, which the fuzzed server sets as low."""

from __future__ import annotations

from hypothesis import strategies as st

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 8

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)  # any character JSON carries, at most 4 bytes each
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=4)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63) | st.floats(allow_nan=False,
                                                                                            allow_infinity=False)
                    | TEXT, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
# names no version of the API uses: accepted and ignored, as OpenAI and vLLM do
UNKNOWN = st.dictionaries(st.from_regex(r"x_[a-z_]{1,10}", fullmatch=True), JSON, max_size=2)
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def _maybe_null(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | values


# fields both endpoints take, each with values that ask for nothing but one greedy answer
COMMON = {
    "stop": _maybe_null(WORDS | st.lists(WORDS, max_size=4)),
    "stream": _maybe_null(st.booleans()),
    "seed": _maybe_null(st.integers(-2 ** 63, 2 ** 63 - 1)),
    "user": _maybe_null(TEXT),
    "response_format": _maybe_null(st.just({"type": "text"})),
    "temperature": _maybe_null(st.sampled_from([0, 0.0, -0.0])),
    "top_p": _maybe_null(st.sampled_from([1, 1.0])),
    "n": _maybe_null(st.just(1)),
    "presence_penalty": _maybe_null(st.sampled_from([0, 0.0])),
    "frequency_penalty": _maybe_null(st.sampled_from([0, 0.0])),
    "logit_bias": _maybe_null(st.just({})),
}


@st.composite
def _common(draw, model: str) -> dict:
    body = {"model": model, **draw(st.fixed_dictionaries({}, optional=COMMON)), **draw(UNKNOWN)}
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = draw(_maybe_null(st.fixed_dictionaries({}, optional={
            "include_usage": _maybe_null(st.booleans())})))
    return body


@st.composite
def _message(draw) -> dict:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant"]))
    part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(st.characters(codec="utf-8"), max_size=6)})
    content = draw(TEXT | st.lists(part, max_size=2)
                   | (st.none() if role == "assistant" else st.nothing()))
    extra = draw(st.fixed_dictionaries({}, optional={"name": _maybe_null(st.from_regex(r"[A-Za-z0-9_-]{1,8}",
                                                                                           fullmatch=True)),
                                                     "refusal": st.none(), "tool_calls": st.just([])}))
    return {"role": role, "content": content, **extra}


@st.composite
def chat_bodies(draw, model: str) -> tuple[str, dict]:
    body = draw(_common(model)) | {"messages": draw(st.lists(_message(), min_size=1, max_size=3))}
    body |= draw(st.fixed_dictionaries({}, optional={
        "max_tokens": _maybe_null(st.integers(1, MAX_TOKENS)),
        "max_completion_tokens": _maybe_null(st.integers(1, MAX_TOKENS)),
        "logprobs": _maybe_null(st.booleans())}))
    if body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(_maybe_null(st.integers(0, 20)))
    tools = draw(st.sampled_from(["none", "offered", "auto"]))
    if tools == "offered":  # offered, with no call possible
        body |= {"tools": [TOOL], "tool_choice": "none"}
    elif tools == "auto":
        body |= {"tool_choice": "auto"}
    return CHAT, body


@st.composite
def completion_bodies(draw, model: str) -> tuple[str, dict]:
    ids = st.lists(st.integers(0, 258), min_size=1, max_size=24)  # the tiny target's byte vocabulary
    prompt = draw(WORDS | ids | st.lists(WORDS, min_size=1, max_size=1) | st.lists(ids, min_size=1, max_size=1))
    body = draw(_common(model)) | {"prompt": prompt}
    body |= draw(st.fixed_dictionaries({}, optional={
        "max_tokens": _maybe_null(st.integers(1, MAX_TOKENS)), "logprobs": _maybe_null(st.integers(0, 5)),
        "echo": _maybe_null(st.just(False)), "suffix": st.none(), "best_of": _maybe_null(st.just(1))}))
    return COMPLETIONS, body


def valid_bodies(model: str) -> st.SearchStrategy:
    return chat_bodies(model) | completion_bodies(model)


# field -> values it must not take, whichever endpoint (a 4xx naming it, or a 404 for the model)
WRONG_COMMON = {
    "model": [None, 7, True, ["x"], "gpt-4o"],
    "max_tokens": ["8", 1.5, True, 0, -1, 10 ** 6, {}],
    "stream": ["yes", 1, []],
    "stop": [5, [1], ["a"] * 5, "", [""], {"a": 1}],
    "temperature": [0.5, 2.5, "0", True, -1],
    "top_p": [0.5, 0, "1"],
    "n": [2, 0, "1", 1.0],
    "presence_penalty": [0.1, 3],
    "frequency_penalty": [-0.1, "0"],
    "logit_bias": [{"1": 5}, {"1": "x"}, [1]],
    "seed": ["x", 1.5],
    "user": [5, ["u"]],
    "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {}}, "text", {}],
    "stream_options": [{"include_usage": "yes"}, "on", 1],
}
WRONG = {
    CHAT: WRONG_COMMON | {
        "messages": [None, [], "hi", {"role": "user"}, [{"role": "robot", "content": "x"}], [{"content": "x"}],
                     [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "tool", "content": "x"}],
                     [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c1", "type": "function"}]}]],
        "max_completion_tokens": [0, "8", 10 ** 6],
        "logprobs": ["yes", 1],
        "top_logprobs": [21, -1, "3"],
        "tools": [[TOOL]],
        "tool_choice": ["required", {"type": "function", "function": {"name": "lookup"}}, 3],
    },
    COMPLETIONS: WRONG_COMMON | {
        "prompt": [None, "", [], [259], [-1], [1.5], [True], ["a", "b"], [[1], [2]], [[]], [""], {"a": 1}],
        "logprobs": [21, -1, True, "1"],
        "echo": [True, "no"],
        "suffix": ["x", 5],
        "best_of": [2, 0],
    },
}


@st.composite
def invalid_bodies(draw, model: str) -> tuple[str, dict]:
    """A valid body with one field made wrong (missing, where it is required)."""
    path, body = draw(valid_bodies(model))
    field = draw(st.sampled_from(sorted(WRONG[path])))
    value = draw(st.sampled_from(WRONG[path][field]))
    body = dict(body)
    if value is None and field in ("model", "messages", "prompt"):
        del body[field]  # null is the default, and these have none
    else:
        body[field] = value
    if field == "max_tokens":  # (chat: max_completion_tokens would win over it)
        body.pop("max_completion_tokens", None)
    if field == "tools":  # offered where a call could be needed
        body.pop("tool_choice", None)
    if field == "tool_choice":
        body["tools"] = [TOOL]
    return path, body


NOT_REQUESTS = st.sampled_from([b"", b"{", b'{"model": ', b"\xff\xfe", b"nan", b"[]", b"1", b'"x"', b"null",
                                b"true", b'{"model": "m", "prompt": "\\ud800"}', b"[" * 3000 + b"]" * 3000])


def not_requests() -> st.SearchStrategy:
    """Bodies that are not a request object at all (raw bytes), for either path."""
    return st.tuples(st.sampled_from([CHAT, COMPLETIONS]), NOT_REQUESTS)


@st.composite
def garbage_bodies(draw, model: str) -> tuple[str, dict]:
    """A valid body with up to three of its endpoint's fields set to any JSON value: served or refused, never a
    5xx."""
    path, body = draw(valid_bodies(model))
    return path, body | draw(st.dictionaries(st.sampled_from(sorted(WRONG[path])), JSON, min_size=1, max_size=3))
