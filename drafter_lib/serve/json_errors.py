"""The JSON error answer `{"error": message}` sent straight from ASGI middleware (body bound, keys, request ids),
before or around the routes; the routes build the same shape with FastAPI's JSONResponse (app.py `_error`)."""
from __future__ import annotations

import json


async def send_json_error(send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
