"""The wire format of the OpenAI-compatible endpoints: what /v1/completions and /v1/chat/completions accept, the
answers and stream chunks they send, and errors in OpenAI's shape.

Requests are read as OpenAI reads them: `null` means the default, unknown fields are accepted (the caller logs
each name once: `unknown_fields`), a message may carry a `name`, the `developer` role is the `system` one, an
assistant turn's `content` may be null, `response_format` of type text and tools that need no call are accepted.
Types stay strict (no "16" for 16), so a mistake is a 400 naming the field rather than a silent default. Decoding
is greedy only: a request that asks for anything else (temperature above 0, top_p below 1, several answers,
penalties, biases), or for what cannot be honoured (images, JSON modes, a tool call), gets a 400 that says so,
naming the field; `seed` and `user` are accepted and change nothing. `logprobs` (chat: with `top_logprobs`) are
served in OpenAI's shapes: chat's `content` list, the text completion's legacy `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`. Answers carry OpenAI's fields plus
`specdraft`: the generation's target steps, mean acceptance length (tokens per target step, plain decoding = 1.0),
draft tokens proposed and accepted.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from drafter_lib.serve.json_errors import openai_error

MAX_TOP_LOGPROBS = 20  # decoding/text_generation.py's, spelled out so that parsing a request imports no torch
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the server's default cap)
CHAT_ROLES = ("system", "developer", "user", "assistant")
TEMPLATE_ROLES = {"developer": "system"}  # OpenAI's newer name of the system role, for templates that know the old


class ApiError(Exception):
    """An answer in OpenAI's error shape: `status`, message, `type`, the request field at fault (`param`), `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return openai_error(str(self), self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=self.headers)


# ---------------------------------------------------------------------------------------------------- requests

class _Lenient(BaseModel):
    """Strict types; `null` means the field's default (a required one: missing); unknown fields kept in
    `model_extra`, for the log."""
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Lenient):
    include_usage: bool = False


class ContentPart(_Lenient):
    type: str  # only "text" is served (check_messages): a 400 names any other part
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal[CHAT_ROLES]
    content: str | list[ContentPart] | None = None  # None: an assistant turn only (check_messages)
    name: str | None = None
    tool_calls: list | None = None  # an earlier tool call: not served (check_messages)

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or ())
        message = {"role": TEMPLATE_ROLES.get(self.role, self.role), "content": content}
        if self.name is not None:  # a template with a place for it renders it; the others ignore it
            message["name"] = self.name
        return message


def check_messages(messages: list[ChatMessage]) -> None:
    """A 400 naming the first message part that cannot be served: no content outside an assistant turn, a part
    other than text (images, audio, files), an earlier tool call."""
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages[{i}].content: required (only an assistant turn may have none)",
                           f"messages[{i}].content")
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise ApiError(400, f"{where}: only text is served, got a part of type {json.dumps(part.type)}",
                               f"{where}.type")
            if part.text is None:
                raise ApiError(400, f"{where}.text: required", f"{where}.text")
        if m.tool_calls:
            raise ApiError(400, f"messages[{i}].tool_calls: tool calls are not served (the answers are text only)",
                           f"messages[{i}].tool_calls")


class ResponseFormat(_Lenient):
    type: str


class _GenerationRequest(_Lenient):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None  # greedy decoding needs none
    user: str | None = None
    response_format: ResponseFormat | None = None  # type "text" only
    # asked of a sampler; only their greedy values are served (GREEDY)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[StrictInt] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[list[list[StrictInt]], Field(min_length=1)]
    max_tokens: int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy form: how many most likely tokens
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of one is unwrapped; a bigger batch is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > 1:
                raise ApiError(400, f"one prompt per request is served, got a batch of {len(p)}", "prompt")
            p = p[0]
        return p

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many most likely tokens to list at each position; None: no log-probabilities."""
        return self.logprobs


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens; wins if both
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # tools the model may call: accepted only where no call can be needed (check_tools)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None  # the older names of the two above
    function_call: str | dict | None = None

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many most likely tokens to list at each position; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _absent_or(value):
    return lambda v: v is None or v == value


# field -> (whether a value is what greedy decoding serves, what to say)
GREEDY = {
    "temperature": (_absent_or(0), "0 or absent"),
    "top_p": (_absent_or(1), "1 or absent"),
    "n": (_absent_or(1), "1 or absent"),
    "best_of": (_absent_or(1), "1 or absent"),
    "presence_penalty": (_absent_or(0), "0 or absent"),
    "frequency_penalty": (_absent_or(0), "0 or absent"),
    "logit_bias": (lambda v: not v, "empty or absent"),
    "echo": (lambda v: v is False, "false (the prompt is not echoed)"),
    "suffix": (lambda v: v is None, "absent (no insertion)"),
}


def check_greedy(request: _GenerationRequest) -> None:
    """A 400 naming the first field that asks for more than one greedy answer."""
    for name, (served, what) in GREEDY.items():
        if name in type(request).model_fields and not served(value := getattr(request, name)):
            raise ApiError(400, f"only greedy decoding is served: {name} must be {what}, got {json.dumps(value)}",
                           name)
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")


def check_served(request: _GenerationRequest) -> None:
    """A 400 naming the field that asks for what the answers cannot be: JSON (a response_format other than text),
    a tool call (tools offered with a choice other than "none", or a call required)."""
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        raise ApiError(400, f"response_format: only text answers are served, got type {json.dumps(fmt.type)}",
                       "response_format")
    if isinstance(request, ChatCompletionRequest):
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            offered, chosen = getattr(request, tools), getattr(request, choice)
            if chosen is not None and chosen not in ("none", "auto"):
                raise ApiError(400, f"{choice}: tool calls are not served (the answers are text only), got "
                                    f"{json.dumps(chosen)[:60]}", choice)
            if offered and chosen != "none":
                raise ApiError(400, f"{tools}: tool calls are not served (the answers are text only); send "
                                    f'{choice}: "none" to offer them without a call, or no {tools}', tools)
        check_messages(request.messages)


def parse_request(model: type[_GenerationRequest], body: bytes):
    """The request from a JSON body, or an ApiError (400) naming the first field at fault."""
    if not body.strip():
        raise ApiError(400, "empty request body: expected a JSON object")
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise describe_error(exc.errors(include_url=False)[0]) from None
    check_greedy(request)
    check_served(request)
    return request


def unknown_fields(request: _GenerationRequest) -> list[str]:
    """The names of the fields this server does not read, as paths: `frobnicate`, `messages[].refusal`."""
    names = []

    def add(obj, where: str) -> None:
        if isinstance(obj, BaseModel):
            names.extend(where + name for name in obj.model_extra or {})

    add(request, "")
    add(request.stream_options, "stream_options.")
    add(request.response_format, "response_format.")
    for m in getattr(request, "messages", ()):
        add(m, "messages[].")
        for part in m.content if isinstance(m.content, list) else ():
            add(part, "messages[].content[].")
    return sorted(set(names))


# what a field that takes several forms takes, said once instead of one complaint per form
UNION_EXPECTED = {
    "prompt": "must be a string or a list of token ids",
    "stop": "must be a string or a list of up to 4 strings",
    "content": 'must be a string or a list of text parts {"type": "text", "text": "..."}',
    "tool_choice": 'must be "none", "auto", "required" or an object',
    "function_call": 'must be "none", "auto" or an object',
}


def describe_error(err: dict) -> ApiError:
    """One pydantic error as a 400 naming the field: `messages[0].role: Input should be 'system', 'developer',
    'user' or 'assistant' (got "robot")`."""
    kind = err.get("type")
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {(err.get('ctx') or {}).get('error', 'invalid')}")
    if kind in ("model_type", "model_attributes_type") and not err.get("loc"):
        return ApiError(400, "the body must be a JSON object")
    param, last, msg, loc = "", None, None, tuple(err.get("loc", ()))
    for p in loc:
        if isinstance(p, int):
            param += f"[{p}]"
        elif p in _FIELD_NAMES:
            param, last = param + (f".{p}" if param else p), p
        else:  # a union's branch (e.g. "list[int]"): the error is about the field's form
            msg = UNION_EXPECTED.get(last)
            break
    msg = msg or {"missing": "required"}.get(kind) or err.get("msg", "invalid value")
    got = "" if kind == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
    return ApiError(400, f"{param or 'body'}: {msg}{got}", param or None)


_FIELD_NAMES = {name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions,
                               ResponseFormat) for name in m.model_fields}


# ---------------------------------------------------------------------------------------------------- answers

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def acceptance(stats) -> dict:
    """The `specdraft` extension field: how the speculative loop went."""
    mal = stats.mean_acceptance_length
    return {"target_steps": stats.target_steps, "mean_acceptance_length": None if math.isnan(mal) else round(mal, 4),
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens}


class Answer:
    """The answer of one request in both forms: the whole body, or the stream's chunks. `chat` picks the chat
    completion objects, else the text completion ones."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def logprobs(self, entries: list | None) -> dict | None:
        """text_generation.TokenLogprob entries in the endpoint's shape (None: not asked for)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{"token": e.text, "logprob": _finite(e.logprob), "bytes": list(e.bytes),
                                 "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": list(b)}
                                                  for t, b, v in e.top]} for e in entries], "refusal": None}
        return {"tokens": [e.text for e in entries], "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{t: _finite(v) for t, _, v in e.top} for e in entries],
                "text_offset": [e.offset for e in entries]}

    def whole(self, text: str, finish_reason: str, stats, logprobs: list | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return self._object("chat.completion" if self.chat else "text_completion", [choice], usage=usage(stats),
                            specdraft=acceptance(stats))

    def _chunk(self, content: dict, finish_reason: str | None, logprobs: list | None = None, **extra) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion",
                            [{"index": 0, **content, "logprobs": self.logprobs(logprobs),
                              "finish_reason": finish_reason}], **extra)

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role (a text completion stream has no opening)."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}}, None) if self.chat else None

    def text_chunk(self, text: str, logprobs: list | None = None) -> dict:
        """The text of a step, and the log-probabilities of its tokens if asked (they need not align: text that
        could become a stop string waits for a later chunk)."""
        return self._chunk({"delta": {"content": text}} if self.chat else {"text": text}, None, logprobs)

    def last_chunk(self, finish_reason: str, stats) -> dict:
        return self._chunk({"delta": {}} if self.chat else {"text": ""}, finish_reason, specdraft=acceptance(stats))

    def usage_chunk(self, stats) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(stats))


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token the target rules out gets OpenAI's floor, -9999."""
    return max(logprob, -9999.0)


def sse(data: Any) -> bytes:
    """One server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def models_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "specdraft"}]}
