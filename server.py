"""HTTP drafter service: POST /draft returns greedy draft tokens from the packed drafter in MODEL_DIR.

Run `./serve.sh` (offline env) or `python server.py`. Settings come from the environment:
HOST (127.0.0.1), PORT (8000), MODEL_DIR (model/), MAX_BODY_BYTES (2 MiB), BATCH_WINDOW_MS (20), MAX_BATCH (32),
ENGINE_DTYPE (the engine's default weight dtype), LOG_LEVEL (info).

One DraftEngine is loaded at startup and owned by one worker thread; concurrent requests are micro-batched
(drafter_lib/batching.py) so they share forward passes. The engine keeps nothing between requests except its
prefix KV cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from drafter_lib.batching import MicroBatcher

ROOT = Path(__file__).resolve().parent
DEFAULT_DRAFT_TOKENS = 16
MAX_DRAFT_TOKENS = 64  # a draft longer than this is almost never accepted in full; bounds the work per request


@dataclass
class Settings:
    model_dir: str = str(ROOT / "model")
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 * 1024 * 1024  # ~250k token ids written as JSON; far above any model's context
    batch_window_ms: float = 20.0  # max wait for stragglers (see drafter_lib/batching.py); 0 = never wait
    max_batch: int = 32
    log_level: str = "info"
    engine_dtype: str | None = None  # DraftEngine weight dtype ("float16", "float32", ...); None = its default

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        d = cls()
        return cls(
            model_dir=env.get("MODEL_DIR", d.model_dir),
            host=env.get("HOST", d.host),
            port=int(env.get("PORT", d.port)),
            max_body_bytes=int(env.get("MAX_BODY_BYTES", d.max_body_bytes)),
            batch_window_ms=float(env.get("BATCH_WINDOW_MS", d.batch_window_ms)),
            max_batch=int(env.get("MAX_BATCH", d.max_batch)),
            log_level=env.get("LOG_LEVEL", d.log_level),
            engine_dtype=env.get("ENGINE_DTYPE") or None,
        )


# ---------------------------------------------------------------- request / response schemas

TokenId = Annotated[StrictInt, Field(ge=0)]  # strict: no floats, strings or booleans sneaking in as ids


class DraftRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: Annotated[list[TokenId], Field(min_length=1, description="Context token ids (prompt + accepted).")]
    num_draft_tokens: StrictInt = Field(DEFAULT_DRAFT_TOKENS, ge=1, le=MAX_DRAFT_TOKENS,
                                        description="How many tokens to draft.")


class Timing(BaseModel):
    queue_ms: float
    compute_ms: float
    total_ms: float


class DraftResponse(BaseModel):
    draft: list[int]
    num_draft_tokens: int
    context_len: int
    batch_size: int = Field(description="Requests that shared this forward pass.")
    cached_prefix_len: int | None = Field(None, description="Context tokens served from the prefix KV cache "
                                                            "(known when the request ran in a batch of one).")
    batch_cached_tokens: int | None = Field(None, description="Context tokens served from the prefix cache "
                                                              "across the whole batch.")
    timing: Timing


class ErrorResponse(BaseModel):
    error: str
    detail: list[dict[str, Any]] | None = None


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
        # Read the whole (bounded) body here, then replay it to the app.
        chunks, size = [], 0
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

def _error(status: int, message: str, detail: list | None = None) -> JSONResponse:
    content = {"error": message}
    if detail is not None:
        content["detail"] = detail
    return JSONResponse(status_code=status, content=content)


def _describe(err: dict) -> str:
    """One pydantic error as `tokens[3]: Input should be a valid integer (got true)`."""
    loc = [p for p in err.get("loc", ()) if p != "body"]
    where = ""
    for p in loc:
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else str(p))
    msg = err.get("msg", "invalid value")
    if err.get("type") in ("model_type", "model_attributes_type"):
        msg = "expected a JSON object {\"tokens\": [...], \"num_draft_tokens\": ...}"
    elif err.get("type") == "extra_forbidden":
        msg = "unknown field (allowed: tokens, num_draft_tokens)"
    elif err.get("type") == "missing":
        msg = "field required"
    got = ""
    if "input" in err and err.get("type") not in ("missing", "json_invalid", "model_type", "model_attributes_type"):
        got = f" (got {json.dumps(err['input'], default=str)[:60]})"
    return f"{where or 'body'}: {msg}{got}"


def _jsonable(obj):
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        if hasattr(obj, "__dataclass_fields__"):
            return _jsonable(asdict(obj))
        return str(obj)


def _with_cache_stats(eng):
    """draft_batch that also reports how many context tokens came from the engine's prefix cache. The engine
    counts reused tokens per batch, so the count is per request only for a batch of one."""

    def run(token_lists, k):
        stats = getattr(eng, "stats", None)
        before = stats.get("reused_tokens") if isinstance(stats, dict) else None
        drafts = eng.draft_batch(token_lists, k)
        if before is None:
            return drafts
        reused = eng.stats["reused_tokens"] - before
        per_request = reused if len(token_lists) == 1 else None
        return [(d, {"cached_prefix_len": per_request, "batch_cached_tokens": reused}) for d in drafts]

    return run


def load_engine(model_dir: str, dtype: str | None = None):
    from drafter_lib.engine import DraftEngine  # imported here so `import server` stays cheap

    return DraftEngine(model_dir) if dtype is None else DraftEngine(model_dir, dtype=dtype)


def create_app(settings: Settings | None = None, engine=None) -> FastAPI:
    """The FastAPI app. `engine` may be passed in (e.g. an fp baseline); otherwise MODEL_DIR is loaded at startup."""
    settings = settings or Settings.from_env()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.perf_counter()
        eng = engine if engine is not None else load_engine(settings.model_dir, settings.engine_dtype)
        batcher = MicroBatcher(_with_cache_stats(eng), window_s=settings.batch_window_ms / 1e3,
                               max_batch=settings.max_batch)
        await batcher.start()
        state.update(engine=eng, batcher=batcher, load_s=time.perf_counter() - t0, started=time.time())
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="specdraft drafter", version="0.1.0", lifespan=lifespan,
                  description="Greedy draft tokens for speculative decoding from a packed small drafter.")
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    errors = {400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}
    # The body is parsed here rather than by FastAPI so that every failure gets one clear message (and a client
    # that forgets the JSON content-type still works); the schema is still published in the OpenAPI docs.
    body_doc = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": DraftRequest.model_json_schema()}}}}

    @app.post("/draft", response_model=DraftResponse, responses=errors, openapi_extra=body_doc)
    async def draft(request: Request):
        """Greedy draft of `num_draft_tokens` tokens continuing `tokens`."""
        t0 = time.perf_counter()
        body = await request.body()
        if not body.strip():
            return _error(400, 'empty request body: expected JSON {"tokens": [int, ...], "num_draft_tokens": int}')
        try:
            req = DraftRequest.model_validate_json(body)
        except ValidationError as exc:
            errs = exc.errors(include_url=False)
            if errs and errs[0].get("type") == "json_invalid":
                return _error(400, f"malformed JSON body: {(errs[0].get('ctx') or {}).get('error', 'invalid')}")
            detail = [{"loc": list(e.get("loc", ())), "type": e.get("type"), "msg": e.get("msg")} for e in errs]
            return _error(422, "; ".join(_describe(e) for e in errs[:5]), detail)
        eng = state["engine"]
        tokens, k = req.tokens, req.num_draft_tokens
        vocab = int(eng.vocab_size)
        top = max(tokens)
        if top >= vocab:
            i = tokens.index(top)
            return _error(422, f"tokens[{i}]: token id {top} is out of range for the vocabulary "
                               f"(vocab_size={vocab}, valid ids are 0..{vocab - 1})")
        max_ctx = int(eng.max_context)
        if len(tokens) + k > max_ctx:
            return _error(422, f"tokens: context of {len(tokens)} tokens + {k} draft tokens exceeds the model's "
                               f"maximum context of {max_ctx} tokens")
        try:
            res = await state["batcher"].submit(tokens, k)
        except ValueError as exc:  # the engine's own input checks (ours above should have caught it first)
            return _error(422, str(exc))
        return DraftResponse(
            draft=res.draft, num_draft_tokens=k, context_len=len(tokens), batch_size=res.batch_size,
            cached_prefix_len=res.extra.get("cached_prefix_len"),
            batch_cached_tokens=res.extra.get("batch_cached_tokens"),
            timing=Timing(queue_ms=round(res.queue_ms, 3), compute_ms=round(res.compute_ms, 3),
                          total_ms=round((time.perf_counter() - t0) * 1e3, 3)),
        )

    @app.get("/health")
    async def health():
        return {"status": "ok", "uptime_s": round(time.time() - state["started"], 3)}

    @app.get("/info")
    async def info():
        """Model config, quantization, manifest hash and copy policy, plus server settings."""
        eng = state["engine"]
        try:  # on the engine's own thread: info() walks the cache the worker mutates
            engine_info = await state["batcher"].call_in_worker(eng.info)
        except Exception as e:  # noqa: BLE001 - metadata must not take the server down
            engine_info = {"error": f"{type(e).__name__}: {e}"}
        return {
            "model": _jsonable(engine_info),
            "vocab_size": int(eng.vocab_size),
            "max_context": int(eng.max_context),
            "server": {
                "model_dir": settings.model_dir,
                "engine_dtype": getattr(eng, "dtype", settings.engine_dtype),
                "default_draft_tokens": DEFAULT_DRAFT_TOKENS,
                "max_draft_tokens": MAX_DRAFT_TOKENS,
                "max_body_bytes": settings.max_body_bytes,
                "batch_window_ms": settings.batch_window_ms,
                "max_batch": settings.max_batch,
                "load_s": round(state["load_s"], 3),
                "batching": dict(state["batcher"].stats),
            },
            # Evidence for "no network at serve time": hub clients never even get imported.
            "offline": {
                "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
                "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE"),
                "imported": {m: m in sys.modules for m in ("huggingface_hub", "transformers", "requests")},
            },
        }

    return app


app = create_app()


def main() -> None:
    import uvicorn

    s = Settings.from_env()
    if not (Path(s.model_dir) / "config.json").is_file():
        sys.exit(f"MODEL_DIR {s.model_dir!r} holds no packed drafter (no config.json); set MODEL_DIR or publish "
                 f"a model with notebooks/04_pack")
    uvicorn.run(app, host=s.host, port=s.port, log_level=s.log_level, workers=1)


if __name__ == "__main__":
    main()
