"""The OpenAI-compatible endpoints, served when the server has a target (TARGET): GET /v1/models,
POST /v1/completions and POST /v1/chat/completions, streamed (server-sent events) or whole.

The target answers greedily with the drafter proposing its next tokens (decoding/text_generation.py), so the text is
the target's own greedy answer and only the speed depends on the drafter. Everything that touches the target or its
tokenizer runs on the engine thread: the prompt's tokenization here, the generation itself in generations.py, one
target pass per call (a step, or a GENERATION_PREFILL_CHUNK-token chunk of a long prompt), up to
GENERATION_MAX_RUNNING generations taking turns, each on a KV cache of its own. Requests and answers:
openai_schema.py. The bounds: GENERATION_MAX_QUEUE generations wait (then 503 with Retry-After), one not started
within GENERATION_TIMEOUT_S gets 503, a drain (SIGTERM) lets the running and queued ones finish and refuses new
ones, and API keys apply as to every endpoint. A chat request without `max_tokens` gets
GENERATION_DEFAULT_MAX_TOKENS at most. A client that hangs up, streamed or not, stops its generation after the
target pass running then (the connection is watched, not only written to).
"""
from __future__ import annotations

import asyncio
import functools
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from drafter_lib.serve.batching import Overloaded
from drafter_lib.serve.generations import GenerationRunner
from drafter_lib.serve.openai_schema import (
    Answer,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    models_list,
    parse_request,
    sse,
    unknown_fields,
)

log = logging.getLogger("specdraft.serve")
CLIENT_CLOSED = 499  # the status logged and counted for an answer whose client hung up first (nginx's)


def overloaded(exc: Overloaded) -> ApiError:
    """The 503 of a refused generation, with Retry-After (and Connection: close while shutting down)."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    if exc.reason in ("draining", "shutting_down"):
        headers["Connection"] = "close"
    return ApiError(503, str(exc), code=exc.reason, headers=headers)


async def hang_up(request: Request, stream) -> None:
    """Abandon `stream`'s generation as soon as the client disconnects (the body has been read: what the
    connection says next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abandon()


def add_openai_routes(app: FastAPI, state, runner: GenerationRunner, model_name: str, created: int,
                      draft_tokens: int, default_max_tokens: int | None = None, prefill_chunk: int | None = None
                      ) -> None:
    """The /v1 routes over `state` (app.ServeState: its `runtime`, `generation_drafter`, draining, in-flight count
    and metrics); `draft_tokens`: k, the most tokens drafted per target step; `default_max_tokens`: the bound of a
    chat answer that asks for none (None: the rest of the context); `prefill_chunk`: the prompt tokens a generation
    reads per pass before its first step (None: all in its first step)."""
    from drafter_lib.decoding.text_generation import (  # imported here so importing the app stays cheap
        GenerationInputError,
        TextGeneration,
        chat_prompt_ids,
        completion_prompt_ids,
    )

    ignored: set[str] = set()  # unknown request fields already logged

    def log_unknown(request) -> None:
        for name in unknown_fields(request):
            if name not in ignored:
                ignored.add(name)
                log.warning("ignoring the request field %r: this server does not read it (logged once per name)",
                            name)

    def check_ready() -> None:
        if state.draining:
            raise overloaded(Overloaded("draining", "server is shutting down", 1))
        if state.engine is None:
            raise overloaded(Overloaded("starting", "the drafter and the target are still loading", 1))

    def prepared(request, chat: bool):
        """On the engine thread: the request's prompt as token ids and its generation."""
        runtime = state.runtime
        try:
            if chat:
                ids = chat_prompt_ids(runtime, [m.as_template_input() for m in request.messages])
                max_tokens = request.answer_tokens
                if max_tokens is None and default_max_tokens is not None:  # (no room at all: the prompt's 400)
                    max_tokens = max(1, min(default_max_tokens, runtime.context_length - len(ids)))
            else:
                ids = completion_prompt_ids(runtime, request.single_prompt())
                max_tokens = request.max_tokens
            # a KV cache of its own: the runner lets several generations take turns
            return TextGeneration(runtime, ids, max_tokens, state.generation_drafter, draft_tokens, request.stop,
                                  request.top_logprobs_asked, prefill_chunk=prefill_chunk, own_cache=True)
        except GenerationInputError as e:
            param = e.param
            if chat and param == "prompt":
                param = "messages"
            elif chat and param == "max_tokens" and request.max_completion_tokens is not None:
                param = "max_completion_tokens"
            raise ApiError(400, str(e), param) from None

    async def generate(request: Request, chat: bool):
        state.inflight += 1  # a drain waits for this request, then for its generation (ServeState.busy)
        try:
            check_ready()
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, await request.body())
            log_unknown(req)
            if req.model != model_name:
                raise ApiError(404, f"The model `{req.model}` does not exist: this server serves `{model_name}` "
                                    "(GET /v1/models)", "model", "model_not_found")
            try:
                generation, stream = await runner.start(functools.partial(prepared, req, chat))
            except Overloaded as exc:
                raise overloaded(exc) from None
            answer = Answer(model_name, chat)
            watcher = asyncio.create_task(hang_up(request, stream))
            if req.stream:
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                state.metrics.observe_openai(200)  # the answer begins now; an error after this goes into the stream
                return StreamingResponse(events(stream, generation, answer, include_usage, watcher),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                deltas = [delta async for delta in stream]
            except Overloaded as exc:
                raise overloaded(exc) from None
            finally:
                watcher.cancel()
            if stream.abandoned:  # nobody is left to read the answer
                state.metrics.observe_openai(CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            state.metrics.observe_openai(200)
            logprobs = None if req.top_logprobs_asked is None else [e for d in deltas for e in d.logprobs]
            return JSONResponse(answer.whole("".join(d.text for d in deltas), generation.finish_reason,
                                             generation.stats, logprobs))
        except ApiError as e:
            state.metrics.observe_openai(e.status, e.code if e.status == 503 else None)
            return e.response()
        finally:
            state.inflight -= 1

    @app.get("/v1/models")
    async def models():
        """The one model served: the target."""
        return models_list(model_name, created)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI's text completion of `prompt` (a string or token ids), greedy; `stream` for server-sent events."""
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI's chat completion of `messages` (through the target's chat template), greedy; `stream` for
        server-sent events."""
        return await generate(request, chat=True)


async def events(stream, generation, answer: Answer, include_usage: bool, watcher: asyncio.Task | None = None):
    """The stream's server-sent events: the text as it is accepted, then the finish reason and the acceptance
    figures, the usage if asked, and `[DONE]`. An error after the answer has begun becomes an error event. A
    client that goes away stops the generation after its current step (`watcher`: the task that notices it)."""
    try:
        if (first := answer.first_chunk()) is not None:
            yield sse(first)
        async for delta in stream:
            if delta.text or delta.logprobs:
                yield sse(answer.text_chunk(delta.text, delta.logprobs))
        yield sse(answer.last_chunk(generation.finish_reason, generation.stats))
        if include_usage:
            yield sse(answer.usage_chunk(generation.stats))
    except Overloaded as exc:
        yield sse(overloaded(exc).body())
    except Exception:  # noqa: BLE001 - the answer has begun: the error goes into the stream, the details to the log
        log.exception("generation failed")
        yield sse(ApiError(500, "internal error during the generation; the server log has the details").body())
    finally:
        if watcher is not None:
            watcher.cancel()
        stream.abandon()  # nothing left to stop once it has ended
    yield sse("[DONE]")
