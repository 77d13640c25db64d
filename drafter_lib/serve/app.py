"""The drafter's HTTP app (FastAPI) and the uvicorn server that drains it on SIGTERM. `server.py` is the entry.

The app listens at once: one DraftEngine loads on its own worker thread while /health answers 503 "starting" (and
/draft 503 with Retry-After), logging each step (loading, each measured kernel choice, ready). The published schema
carries the model's vocabulary and context, read from the model dir's config.json. The worker thread owns the engine;
concurrent requests are micro-batched (batching.py). The engine keeps nothing
between requests except its prefix KV cache, whose bytes are bounded (MAX_CACHE_MB). A request without
`min_confidence` gets exactly `num_draft_tokens` tokens, unless the operator set a server-wide default
(DEFAULT_MIN_CONFIDENCE: a number, or "recommended" for the model dir's `draft_min_confidence`); a request's own
`min_confidence` stops its draft early; `return_probs` adds `probs` to its answer. Requests with different
thresholds share a batch. A request with `tree` gets a draft tree (`DraftEngine.draft_tree_result`; its depth bound
defaults to `num_draft_tokens`), queued like the others and run alone; its answer adds `tree` and its `draft` is the
tree's first chain.

Overload: at most MAX_QUEUE requests wait for a batch; the next ones get 503 with Retry-After at once, and a
request not answered within REQUEST_TIMEOUT_S gets 503 too. Shutdown: SIGTERM (or SIGINT) starts a drain:
requests already in flight are finished, new ones get 503 (Connection: close) and /health says "draining";
once nothing is in flight, or after SHUTDOWN_TIMEOUT_S (then a generation still running or queued ends with a
final shutting_down error, streamed or not), the server stops and the process exits 0. A second
signal stops at once. A model that fails to load stops the server with exit status 1.

With a target (TARGET: a target spec or a Hugging Face folder), the target loads on the same thread after the
drafter, and the app also serves OpenAI's /v1/models, /v1/completions and /v1/chat/completions (openai_api.py):
the target's greedy answers, drafted by the drafter, a few generations taking turns on the engine thread between the
/draft batches (GENERATION_MAX_RUNNING, long prompts in chunks of GENERATION_PREFILL_CHUNK), under the same
bounds of their own (GENERATION_MAX_QUEUE, GENERATION_TIMEOUT_S) and the server's (the drain, API keys). Without
one the server is the drafter alone.

Settings, authentication and the loopback rule: settings.py. Request ids and logs: logs.py. An unexpected error
answers 500 with a generic message and the request id; the details go to the log.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from drafter_lib.common.checks import check_token_ids
from drafter_lib.common.files import to_jsonable
from drafter_lib.serve.auth import BearerAuth
from drafter_lib.serve.batching import EngineThread, MicroBatcher, Overloaded
from drafter_lib.serve.generations import GenerationRunner
from drafter_lib.serve.json_errors import error_body, is_openai_path, send_json_error
from drafter_lib.serve.logs import RequestIds, configure_logging
from drafter_lib.serve.metrics import Metrics
from drafter_lib.serve.openai_api import add_openai_routes
from drafter_lib.serve.schema import (
    DEFAULT_DRAFT_TOKENS,
    DraftResponse,
    Health,
    Limits,
    Timing,
    TreeAnswer,
    describe,
    error_responses,
    openapi_document,
    request_model,
)
from drafter_lib.serve.settings import Settings

log = logging.getLogger("specdraft.serve")


@dataclass
class ServeState:
    """What the routes and the draining server share."""
    engine: object = None  # the DraftEngine, once loaded
    run_batch: object = None  # its draft_batch (with heap trimming)
    run_tree: object = None  # its draft_tree_result (with heap trimming)
    load_s: float | None = None
    load_error: str | None = None  # loading failed: the server stops
    draining: bool = False
    inflight: int = 0  # POST /draft and /v1 requests inside the handler
    metrics: Metrics = field(default_factory=Metrics)
    runtime: object = None  # the target's TargetRuntime, when the server has one (TARGET)
    generation_drafter: object = None  # what drafts the target's generations (GENERATION_DRAFTER), None: nothing
    drafting: str = "model"  # GENERATION_DRAFTER
    draft_tokens: int = 16  # k of the target's generations (Settings.draft_tokens)
    generations: object = None  # the GenerationRunner of the /v1 endpoints, when the server has a target

    def ready(self, engine, load_s: float, runtime=None) -> None:
        """The drafter (and the target, if any) the routes use from now on."""
        if runtime is not None:
            from drafter_lib.decoding.text_generation import generation_drafter

            self.generation_drafter = generation_drafter(self.drafting, runtime, engine)
            self.runtime = runtime
        self.run_batch, self.load_s = _trimming(engine), load_s
        self.run_tree = _trimming(engine, tree=True)
        self.engine = engine  # last: a route that sees it finds run_batch set

    @property
    def busy(self) -> bool:
        """Requests in a handler, or generations queued or running: what a drain waits for."""
        return self.inflight > 0 or (self.generations is not None and not self.generations.idle)

    @property
    def status(self) -> str:
        """What /health says: ok, starting, failed (to load) or draining."""
        return ("draining" if self.draining else "failed" if self.load_error else
                "starting" if self.engine is None else "ok")


# ---------------------------------------------------------------- body size limit (ASGI middleware)

class BodySizeLimit:
    """Rejects request bodies over `max_bytes` with 413: by Content-Length up front, and by counting the bytes
    actually received (chunked uploads or a lying header), before the route ever parses anything."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await _send_error(send, 400, f"invalid Content-Length header: {declared[:32]!r}", scope)
            if n > self.max_bytes:
                return await _send_error(send, 413, f"request body of {n} bytes exceeds the limit of "
                                                    f"{self.max_bytes} bytes", scope)
        chunks, size = [], 0  # read the whole (bounded) body here, then replay it to the app
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                         scope)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for disconnect like the real channel would

        return await self.app(scope, replay, send)


async def _send_error(send, status: int, message: str, scope) -> None:
    # the rest of the body is unread: close the connection
    await send_json_error(send, status, message, ((b"connection", b"close"),), path=scope.get("path", ""))


# ---------------------------------------------------------------- app

def _error(status: int, message: str, detail: list | None = None, headers: dict | None = None) -> JSONResponse:
    content = {"error": message}
    if detail is not None:
        content["detail"] = detail
    return JSONResponse(status_code=status, content=content, headers=headers)


def load_engine(settings: Settings):
    from drafter_lib.engine.draft_engine import DraftEngine  # imported here so importing the app module stays cheap

    kw = dict(max_cache_bytes=int(settings.max_cache_mb * 2 ** 20), max_batch_tokens=settings.max_batch_tokens,
              min_confidence=settings.default_min_confidence)
    if settings.engine_dtype:
        kw["dtype"] = settings.engine_dtype
    engine = DraftEngine.from_dir(settings.model_dir, **kw)
    _release_freed_memory()
    return engine


def _release_freed_memory(collect: bool = True) -> None:
    """Hand freed heap pages back to the OS. Loading restores every weight to fp32 before holding it smaller, and
    glibc keeps those pages (measured: RSS 510 MiB after loading the shipped model, 334 MiB after malloc_trim);
    evicted cache entries leave holes in the engine thread's heap the same way."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _trimming(engine, tree: bool = False):
    """engine.draft_batch (or, with `tree`, engine.draft_tree_result), followed by a malloc_trim whenever the call
    evicted cache entries: measured on the shipped model under a flood of distinct 2k-token contexts, RSS rose
    527 MiB above its warm level with a 256 MiB cache bound without it."""
    def run(*args, **options):
        if tree and not hasattr(engine, "draft_tree_result"):
            raise ValueError("tree: this drafter does not draft trees")
        before = engine.cache_info()["evictions"] if hasattr(engine, "cache_info") else None
        out = (engine.draft_tree_result if tree else engine.draft_batch)(*args, **options)
        if before is not None and engine.cache_info()["evictions"] != before:
            _release_freed_memory(collect=False)
        return out

    return run


def limits_of_dir(model_dir: str | Path) -> Limits:
    """The request limits of a packed model dir, from its config.json alone (the engine loads later)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
        return Limits(int(config["vocab_size"]), int(config["max_position_embeddings"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"MODEL_DIR {Path(model_dir).name!r} holds no readable packed drafter config "
                         f"({type(e).__name__}: {e}); set MODEL_DIR or publish a model with notebooks/04_pack") from e


def load_target(settings: Settings):
    """The TargetRuntime of TARGET, with TARGET_NUMERICS."""
    from drafter_lib.decoding.runtime import load_target_runtime

    runtime = load_target_runtime(settings.target, numerics=settings.target_numerics)
    runtime.name = settings.target_name  # the served model name: no machine path
    _release_freed_memory()
    return runtime


def _load_into(state: ServeState, settings: Settings, engine=None) -> None:
    """On the engine thread: load the drafter (unless given) and the target (if TARGET is set), then make them the
    ones the routes use (or record why not)."""
    t0 = time.perf_counter()
    what = "the drafter"
    try:
        if engine is None:
            log.info("loading the drafter from %s (weight formats are timed once per machine, then cached)",
                     Path(settings.model_dir).name)
            engine = load_engine(settings)
        runtime = None
        if settings.target is not None:
            what = "the target"
            log.info("loading the target %s (%s)", settings.target_name, settings.target_numerics)
            runtime = load_target(settings)
        state.ready(engine, time.perf_counter() - t0, runtime)
    except Exception as e:  # noqa: BLE001 - the server reports it and stops
        state.load_error = f"{type(e).__name__}: {e}"
        log.exception("loading %s failed; stopping", what)
        return
    log.info("ready in %.1f s: %s weights, %d-token vocabulary, context %d%s", state.load_s,
             getattr(engine, "dtype", "?"), engine.vocab_size, engine.max_context,
             f"; target {state.runtime.name}, context {state.runtime.context_length}" if state.runtime else "")


def create_app(settings: Settings | None = None, engine=None, runtime=None) -> FastAPI:
    """The FastAPI app over `engine` (e.g. an fp baseline), or over MODEL_DIR's drafter, which starts loading on
    the engine thread now; the app answers at once (503 "starting" until the drafter is ready). With a target
    (`runtime`, a TargetRuntime, or TARGET, loaded on the engine thread after the drafter) it also serves the
    OpenAI-compatible endpoints (openai_api.py)."""
    settings = settings or Settings.from_env()
    thread = EngineThread()  # loads the engine and runs every batch on it: one OpenMP team (batching.py)
    state = ServeState(drafting=settings.generation_drafter, draft_tokens=settings.draft_tokens)
    if engine is not None:
        limits = Limits(int(engine.vocab_size), int(engine.max_context))
        if runtime is not None or settings.target is None:
            state.ready(engine, 0.0, runtime)
        else:
            thread.submit(_load_into, state, settings, engine)
    else:
        limits = limits_of_dir(settings.model_dir)
        thread.submit(_load_into, state, settings)
    request_cls = request_model(limits)
    batcher = MicroBatcher(lambda requests, k, **options: state.run_batch(requests, k, **options),
                           window_s=settings.batch_window_ms / 1e3, max_batch=settings.max_batch,
                           max_queue=settings.max_queue, request_timeout_s=settings.request_timeout_s,
                           executor=thread, run_tree=lambda tokens, **options: state.run_tree(tokens, **options))
    state.metrics.bind(batcher, lambda: state.engine, lambda: state.draining)
    started = time.time()
    if runtime is not None or settings.target is not None:
        # the engine thread's background lane: a draft batch waits for at most the one generation pass running
        state.generations = GenerationRunner(batcher.call_in_background, settings.generation_max_queue,
                                             settings.generation_timeout_s,
                                             lambda gen, reason: state.metrics.observe_generation(reason, gen.stats),
                                             settings.generation_max_running)
        state.metrics.bind_generations(state.generations)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            if state.generations is not None:
                await state.generations.stop()
            await batcher.stop(wait=state.engine is not None)  # a load in progress is not waited for

    app = FastAPI(title="specdraft drafter", version="0.2.0", lifespan=lifespan,
                  description="Greedy draft tokens for speculative decoding from a packed small drafter.")
    app.state.serve = state
    # the last added runs first: request id, then the key, then the body bound
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, keys=settings.api_keys())
    app.add_middleware(RequestIds, on_response=state.metrics.observe_http)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException):
        """An unknown path (404) or a wrong method (405): under /v1 in OpenAI's error shape, elsewhere FastAPI's."""
        path = request.url.path
        if not is_openai_path(path):
            return await http_exception_handler(request, exc)
        served = ", ".join(f"{m} {r.path}" for r in app.routes if is_openai_path(getattr(r, "path", ""))
                           for m in sorted(set(getattr(r, "methods", None) or ()) - {"HEAD"})) or \
            "nothing: the /v1 endpoints need a target (TARGET)"
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {path}): this server serves {served}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {path}: this server serves {served}"
        else:
            message = str(exc.detail)
        return JSONResponse(status_code=exc.status_code, content=error_body(exc.status_code, message, path),
                            headers=exc.headers)

    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, limits, request_cls)
        return app.openapi_schema

    app.openapi = openapi
    if state.generations is not None:
        add_openai_routes(app, state, state.generations, settings.target_name if runtime is None else runtime.name,
                          int(started), state.draft_tokens, settings.generation_default_max_tokens,
                          settings.generation_prefill_chunk)

    def unavailable(exc: Overloaded, t0: float) -> JSONResponse:
        state.metrics.observe(503, time.perf_counter() - t0, exc.reason)
        headers = {"Retry-After": str(exc.retry_after_s)}
        if exc.reason in ("draining", "shutting_down"):
            headers["Connection"] = "close"
        return _error(503, str(exc), headers=headers)

    def answer(status: int, message: str, t0: float, detail: list | None = None) -> JSONResponse:
        state.metrics.observe(status, time.perf_counter() - t0)
        return _error(status, message, detail)

    # exclude_unset: `probs` appears only in answers to requests that asked for it
    @app.post("/draft", response_model=DraftResponse, response_model_exclude_unset=True,
              responses=error_responses(400, 413, 422, 503))
    async def draft(request: Request):
        """Greedy draft of `num_draft_tokens` tokens continuing `tokens` (fewer once the drafter's probability of
        its next token falls below `min_confidence`), or with `tree` a draft tree (`tree` in the answer, `draft` its
        first chain)."""
        # The body is parsed here rather than by FastAPI so that every failure gets one clear message (and a
        # client that forgets the JSON content-type still works); the schema is published in the OpenAPI doc.
        t0 = time.perf_counter()
        if state.draining:
            return unavailable(Overloaded("draining", "server is shutting down", 1), t0)
        if state.engine is None:
            return unavailable(Overloaded("starting", "the drafter is still loading", 1), t0)
        state.inflight += 1
        try:
            body = await request.body()
            if not body.strip():
                return answer(400, 'empty request body: expected JSON {"tokens": [int, ...], '
                                   '"num_draft_tokens": int}', t0)
            try:
                req = request_cls.model_validate_json(body)
            except ValidationError as exc:
                errs = exc.errors(include_url=False)
                if errs and errs[0].get("type") == "json_invalid":
                    return answer(400, f"malformed JSON body: {(errs[0].get('ctx') or {}).get('error', 'invalid')}",
                                  t0)
                detail = [{"loc": list(e.get("loc", ())), "type": e.get("type"), "msg": e.get("msg")} for e in errs]
                return answer(422, "; ".join(describe(e, limits) for e in errs[:5]), t0, detail)
            tokens, k = req.tokens, req.num_draft_tokens
            try:
                check_token_ids(tokens, limits.vocab_size)
            except ValueError as exc:
                return answer(422, f"{exc} (vocab_size={limits.vocab_size}, valid ids are "
                                   f"0..{limits.vocab_size - 1})", t0)
            try:
                if req.tree is not None:
                    tree = req.tree
                    res = await batcher.submit_tree(tokens, budget=tree.budget, branch=tree.branch,
                                                    max_depth=k if tree.max_depth is None else tree.max_depth)
                else:
                    options = {"return_probs": True} if req.return_probs else {}
                    if req.min_confidence is not None:
                        options["min_confidence"] = req.min_confidence
                    res = await batcher.submit(tokens, k, **options)
            except Overloaded as exc:
                return unavailable(exc, t0)
            except ValueError as exc:  # the engine's own input checks (ours above should have caught it first)
                return answer(422, str(exc), t0)
            total = time.perf_counter() - t0
            state.metrics.observe(200, total)
            state.metrics.observe_draft(res.queue_ms / 1e3, len(res.draft), res.cached_prefix_len)
            extra = {"probs": res.probs} if req.return_probs else {}
            if res.tree is not None:
                state.metrics.observe_tree(len(res.tree))
                extra["tree"] = TreeAnswer(tokens=list(res.tree.tokens), parents=list(res.tree.parents),
                                           probs=list(res.tree.probs))
            return DraftResponse(
                draft=res.draft, num_draft_tokens=k, context_len=len(tokens), batch_size=res.batch_size,
                cached_prefix_len=res.cached_prefix_len, batch_cached_tokens=res.batch_cached_tokens,
                timing=Timing(queue_ms=round(res.queue_ms, 3), compute_ms=round(res.compute_ms, 3),
                              total_ms=round(total * 1e3, 3)), **extra)
        finally:
            state.inflight -= 1

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "headers": error_responses(503)[
        503]["headers"], "description": "Starting, failed to load, or shutting down: not in rotation."}})
    async def health():
        up, status = round(time.time() - started, 3), state.status
        if status != "ok":
            return JSONResponse(status_code=503, content={"status": status, "uptime_s": up},
                                headers={"Retry-After": "1"})
        return {"status": "ok", "uptime_s": up}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus metrics (prometheus_client): requests by status, latency, queue time, batch sizes, draft
        lengths, prefix-cache hits, queue depth, resident memory."""
        body, content_type = state.metrics.exposition()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/info")
    async def info():
        """Model config, quantization, manifest hash and copy policy, plus server settings and metrics (no keys, no
        machine paths)."""
        eng = state.engine
        if eng is None:
            return _error(503, "the drafter failed to load" if state.load_error else "the drafter is still loading",
                          headers={"Retry-After": "1"})
        try:  # on the engine's own thread: info() may walk what the worker mutates
            engine_info = await batcher.call_in_worker(eng.info)
        except Exception as e:  # noqa: BLE001 - metadata must not take the server down
            log.error("engine info failed", exc_info=e)
            engine_info = {"error": f"{type(e).__name__}"}
        engine_info.pop("path", None)  # where this machine keeps the model
        return {
            "model": to_jsonable(engine_info),
            "vocab_size": limits.vocab_size,
            "max_context": limits.max_context,
            "server": {
                **settings.public(),
                "engine_dtype": getattr(eng, "dtype", settings.engine_dtype),
                "default_draft_tokens": DEFAULT_DRAFT_TOKENS,
                "default_min_confidence": getattr(eng, "min_confidence", None),
                "max_draft_tokens": limits.max_draft,
                "max_context_tokens": limits.max_tokens,
                "load_s": round(state.load_s, 3),
                "batching": dict(batcher.stats),
                "metrics": to_jsonable(state.metrics.snapshot()),
            },
            **({} if state.runtime is None else {"target": target_info(state)}),
            # Evidence for "no network at serve time": hub clients never even get imported.
            "offline": {
                "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
                "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE"),
                "imported": {m: m in sys.modules for m in ("huggingface_hub", "transformers", "requests")},
            },
        }

    state.metrics.bind_endpoints(getattr(r, "path", None) for r in app.routes)
    return app


def target_info(state: ServeState) -> dict:
    """/info's `target` block: the model the /v1 endpoints serve and how its drafts are asked for."""
    rt = state.runtime
    drafter = state.generation_drafter
    return {"name": rt.name, "numerics": rt.numerics, "context_length": rt.context_length,
            "vocab_size": rt.target.vocab_size, "drafter": state.drafting,
            "draft_tokens": state.draft_tokens if drafter is not None else 0,
            "min_confidence": drafter.options.get("min_confidence") if drafter is not None else None}


# ---------------------------------------------------------------- serving with a drain on SIGTERM

def serve(app: FastAPI, settings: Settings) -> None:
    """Run `app` under uvicorn until SIGTERM/SIGINT, then drain (see the module doc); returns normally, or exits 1
    when the drafter failed to load."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        deadline = None

        def handle_exit(self, sig, frame):
            # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the process would
            # die by the signal instead of exiting 0.
            st: ServeState = app.state.serve
            if st.draining:  # a second signal: stop now
                self.should_exit = self.force_exit = True
                return
            st.draining = True
            self.deadline = time.monotonic() + settings.drain_s

        async def on_tick(self, counter: int) -> bool:
            st: ServeState = app.state.serve
            if st.load_error or (st.draining and (not st.busy or time.monotonic() > self.deadline)):
                if st.generations is not None and not st.generations.closed:
                    # past the bound: stop the generations here, while their connections are still served, so
                    # that each stream's final event (shutting_down, then [DONE]) reaches its client before
                    # uvicorn's own graceful timeout would cut it
                    await st.generations.stop()
                self.should_exit = True
            return await super().on_tick(counter)

    configure_logging(settings.log_level, settings.log_format)
    # log_config=None: uvicorn's loggers go through ours (request ids, LOG_FORMAT); access lines come from logs.py
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            workers=1, timeout_graceful_shutdown=5, log_config=None, access_log=False)
    DrainingServer(config).run()
    if app.state.serve.load_error:
        sys.exit(1)


__all__ = ["Settings", "create_app", "serve", "load_engine", "BodySizeLimit", "ServeState"]
