"""The JSON error answers: `{"error": message}` on the drafter's own endpoints, and OpenAI's
`{"error": {"message", "type", "param", "code"}}` under /v1 (every path and method, an unknown one included), whose
clients read that shape. The middleware (body bound, keys, request ids) sends them straight from ASGI, before or
around the routes; the routes build the same shapes with FastAPI's JSONResponse (app.py `_error`,
openai_schema.ApiError), and app.py's handler of routing errors (404, 405) too."""
from __future__ import annotations

import json

OPENAI_PREFIX = "/v1"
# OpenAI's error type and code for the statuses the middleware sends
_OPENAI_KINDS = {401: ("invalid_request_error", "invalid_api_key"), 413: ("invalid_request_error", "request_too_large")}


def openai_error(message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def is_openai_path(path: str) -> bool:
    """Whether a request path is under /v1, where errors take OpenAI's shape."""
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def error_body(status: int, message: str, path: str = "") -> dict:
    """The error answer's body for a request to `path`."""
    if not is_openai_path(path):
        return {"error": message}
    kind, code = _OPENAI_KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return openai_error(message, kind, None, code)


async def send_json_error(send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = (),
                          path: str = "") -> None:
    body = json.dumps(error_body(status, message, path)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
