"""The drafter's HTTP app (FastAPI) and the uvicorn server that drains it on SIGTERM. `server.py` is the entry.

One DraftEngine is loaded before the app is built (the published schema carries its vocabulary and context) and
is owned by one worker thread; concurrent requests are micro-batched (batching.py). The engine keeps nothing
between requests except its prefix KV cache, whose bytes are bounded (MAX_CACHE_MB). A request without
`min_confidence` gets exactly `num_draft_tokens` tokens, unless the operator set a server-wide default
(DEFAULT_MIN_CONFIDENCE: a number, or "recommended" for the model dir's `draft_min_confidence`); a request's own
`min_confidence` stops its draft early; `return_probs` adds `probs` to its answer. Requests with different
thresholds share a batch.

Overload: at most MAX_QUEUE requests wait for a batch; the next ones get 503 with Retry-After at once, and a
request not answered within REQUEST_TIMEOUT_S gets 503 too. Shutdown: SIGTERM (or SIGINT) starts a drain:
requests already in flight are finished, new ones get 503 (Connection: close) and /health says "draining";
once nothing is in flight, or after SHUTDOWN_TIMEOUT_S, the server stops and the process exits 0. A second
signal stops at once.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError

from drafter_lib.common.checks import check_token_ids
from drafter_lib.common.files import to_jsonable
from drafter_lib.packed.config_keys import RECOMMENDED, check_min_confidence
from drafter_lib.serve.batching import EngineThread, MicroBatcher, Overloaded
from drafter_lib.serve.metrics import Metrics
from drafter_lib.serve.schema import (
    DEFAULT_DRAFT_TOKENS,
    DraftResponse,
    Health,
    Limits,
    Timing,
    describe,
    error_responses,
    openapi_document,
    request_model,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository (its model/ is the default MODEL_DIR)


@dataclass
class Settings:
    model_dir: str = str(ROOT / "model")
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 * 1024 * 1024  # ~250k token ids written as JSON; far above any model's context
    batch_window_ms: float = 20.0  # max wait for stragglers (see drafter_lib/batching.py); 0 = never wait
    max_batch: int = 32
    log_level: str = "info"
    engine_dtype: str | None = None  # DraftEngine dtype ("auto", "float16", "float32", ...); None = its default
    max_queue: int = 128  # requests waiting for a batch before 503
    request_timeout_s: float = 30.0  # a request not answered by then gets 503
    max_cache_mb: float = 256.0  # prefix KV cache bound
    max_batch_tokens: int = 4096  # in-flight KV slots per decode group (engine.DraftEngine)
    shutdown_timeout_s: float | None = None  # drain bound on SIGTERM; None = request_timeout_s + 5
    # threshold of requests that set no min_confidence: None = off (exactly num_draft_tokens tokens), a number in
    # [0, 1], or "recommended" (the model dir's draft_min_confidence)
    default_min_confidence: float | str | None = None

    @classmethod
    def from_env(cls) -> Settings:
        env, d = os.environ, cls()

        def get(name, cast, default):
            return cast(env[name]) if env.get(name) else default

        return cls(model_dir=get("MODEL_DIR", str, d.model_dir), host=get("HOST", str, d.host),
                   port=get("PORT", int, d.port), max_body_bytes=get("MAX_BODY_BYTES", int, d.max_body_bytes),
                   batch_window_ms=get("BATCH_WINDOW_MS", float, d.batch_window_ms),
                   max_batch=get("MAX_BATCH", int, d.max_batch), log_level=get("LOG_LEVEL", str, d.log_level),
                   engine_dtype=get("ENGINE_DTYPE", str, None), max_queue=get("MAX_QUEUE", int, d.max_queue),
                   request_timeout_s=get("REQUEST_TIMEOUT_S", float, d.request_timeout_s),
                   max_cache_mb=get("MAX_CACHE_MB", float, d.max_cache_mb),
                   max_batch_tokens=get("MAX_BATCH_TOKENS", int, d.max_batch_tokens),
                   shutdown_timeout_s=get("SHUTDOWN_TIMEOUT_S", float, None),
                   default_min_confidence=get("DEFAULT_MIN_CONFIDENCE", _threshold, None))

    @property
    def drain_s(self) -> float:
        return self.request_timeout_s + 5 if self.shutdown_timeout_s is None else self.shutdown_timeout_s


def _threshold(text: str) -> float | str:
    """DEFAULT_MIN_CONFIDENCE: "recommended", or a number in [0, 1]."""
    if text.strip().lower() == RECOMMENDED:
        return RECOMMENDED
    try:
        return check_min_confidence(float(text))
    except ValueError:
        msg = f"DEFAULT_MIN_CONFIDENCE must be a number in [0, 1] or {RECOMMENDED!r}, got {text!r}"
        raise ValueError(msg) from None


@dataclass
class ServeState:
    """What the routes and the draining server share."""
    draining: bool = False
    inflight: int = 0  # POST /draft requests inside the handler
    metrics: Metrics = field(default_factory=Metrics)


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
                return await _send_error(send, 400, f"invalid Content-Length header: {declared[:32]!r}")
            if n > self.max_bytes:
                return await _send_error(send, 413, f"request body of {n} bytes exceeds the limit of "
                                                    f"{self.max_bytes} bytes")
        chunks, size = [], 0  # read the whole (bounded) body here, then replay it to the app
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
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


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


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


def _trimming(engine):
    """engine.draft_batch, followed by a malloc_trim whenever the batch evicted cache entries: measured on the
    shipped model under a flood of distinct 2k-token contexts, RSS rose 527 MiB above its warm level with a
    256 MiB cache bound without it."""
    def run(requests, k, **options):
        before = engine.cache_info()["evictions"] if hasattr(engine, "cache_info") else None
        out = engine.draft_batch(requests, k, **options)
        if before is not None and engine.cache_info()["evictions"] != before:
            _release_freed_memory(collect=False)
        return out

    return run


def create_app(settings: Settings | None = None, engine=None) -> FastAPI:
    """The FastAPI app over `engine` (e.g. an fp baseline), or over MODEL_DIR's drafter loaded here and now."""
    settings = settings or Settings.from_env()
    t0 = time.perf_counter()
    thread = EngineThread()  # loads the engine and runs every batch on it: one OpenMP team (batching.py)
    eng = engine if engine is not None else thread.submit(load_engine, settings).result()
    load_s = time.perf_counter() - t0
    limits = Limits(int(eng.vocab_size), int(eng.max_context))
    request_cls = request_model(limits)
    state = ServeState()
    batcher = MicroBatcher(_trimming(eng), window_s=settings.batch_window_ms / 1e3, max_batch=settings.max_batch,
                           max_queue=settings.max_queue, request_timeout_s=settings.request_timeout_s,
                           executor=thread)
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="specdraft drafter", version="0.2.0", lifespan=lifespan,
                  description="Greedy draft tokens for speculative decoding from a packed small drafter.")
    app.state.serve = state
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, limits, request_cls)
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

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
        its next token falls below `min_confidence`)."""
        # The body is parsed here rather than by FastAPI so that every failure gets one clear message (and a
        # client that forgets the JSON content-type still works); the schema is published in the OpenAPI doc.
        t0 = time.perf_counter()
        if state.draining:
            return unavailable(Overloaded("draining", "server is shutting down", 1), t0)
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
            extra = {"probs": res.probs} if req.return_probs else {}
            return DraftResponse(
                draft=res.draft, num_draft_tokens=k, context_len=len(tokens), batch_size=res.batch_size,
                cached_prefix_len=res.cached_prefix_len, batch_cached_tokens=res.batch_cached_tokens,
                timing=Timing(queue_ms=round(res.queue_ms, 3), compute_ms=round(res.compute_ms, 3),
                              total_ms=round(total * 1e3, 3)), **extra)
        finally:
            state.inflight -= 1

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "headers": error_responses(503)[
        503]["headers"], "description": "Shutting down: take this server out of rotation."}})
    async def health():
        up = round(time.time() - started, 3)
        if state.draining:
            return JSONResponse(status_code=503, content={"status": "draining", "uptime_s": up},
                                headers={"Retry-After": "1"})
        return {"status": "ok", "uptime_s": up}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus text format: queue depth, rejections, batch sizes, latency quantiles, cache hit rate."""
        return PlainTextResponse(state.metrics.prometheus(batcher, eng, state.draining),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/info")
    async def info():
        """Model config, quantization, manifest hash and copy policy, plus server settings and metrics."""
        try:  # on the engine's own thread: info() may walk what the worker mutates
            engine_info = await batcher.call_in_worker(eng.info)
        except Exception as e:  # noqa: BLE001 - metadata must not take the server down
            engine_info = {"error": f"{type(e).__name__}: {e}"}
        return {
            "model": to_jsonable(engine_info),
            "vocab_size": limits.vocab_size,
            "max_context": limits.max_context,
            "server": {
                "model_dir": settings.model_dir,
                "engine_dtype": getattr(eng, "dtype", settings.engine_dtype),
                "default_draft_tokens": DEFAULT_DRAFT_TOKENS,
                "default_min_confidence": getattr(eng, "min_confidence", None),
                "max_draft_tokens": limits.max_draft,
                "max_context_tokens": limits.max_tokens,
                "max_body_bytes": settings.max_body_bytes,
                "batch_window_ms": settings.batch_window_ms,
                "max_batch": settings.max_batch,
                "max_queue": settings.max_queue,
                "request_timeout_s": settings.request_timeout_s,
                "max_cache_mb": settings.max_cache_mb,
                "shutdown_timeout_s": settings.drain_s,
                "load_s": round(load_s, 3),
                "batching": dict(batcher.stats),
                "metrics": to_jsonable(state.metrics.snapshot(batcher, eng, state.draining)),
            },
            # Evidence for "no network at serve time": hub clients never even get imported.
            "offline": {
                "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
                "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE"),
                "imported": {m: m in sys.modules for m in ("huggingface_hub", "transformers", "requests")},
            },
        }

    return app


# ---------------------------------------------------------------- serving with a drain on SIGTERM

def serve(app: FastAPI, settings: Settings) -> None:
    """Run `app` under uvicorn until SIGTERM/SIGINT, then drain (see the module doc); returns normally."""
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
            if st.draining and (st.inflight == 0 or time.monotonic() > self.deadline):
                self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            workers=1, timeout_graceful_shutdown=5)
    DrainingServer(config).run()


__all__ = ["Settings", "create_app", "serve", "load_engine", "BodySizeLimit", "ServeState"]
