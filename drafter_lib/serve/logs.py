"""The server's logs: every line of a request carries its request id, as text or as one JSON object a line.

`X-Request-ID` is taken from the request when it is a sane token (at most 128 of letters, digits and `-_.:`),
else generated, returned in the answer's header, and kept in a context variable that every log record of the
request reads (`RequestIdFilter`). The access line of each request is written here (uvicorn's own access log is
off), so it carries the id too.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid

from drafter_lib.serve.json_errors import send_json_error

REQUEST_ID_HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
access_log = logging.getLogger("specdraft.access")
error_log = logging.getLogger("specdraft.serve")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id, and any `extra` fields given."""

    _STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id"}

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname.lower(),
               "logger": record.name, "message": record.getMessage(), "request_id": getattr(record, "request_id", None)}
        doc.update({k: v for k, v in vars(record).items() if k not in self._STANDARD and not k.startswith("_")})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{rid}]" if rid else ""
        return super().format(record)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Root handler on stderr for our loggers and uvicorn's (which then propagate to it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def _request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key.lower() == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if _SANE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: the request id in the context, in the answer's `X-Request-ID`, and one access log line.
    An unexpected error is logged with its details and answered 500 with a generic message and the request id.
    `on_response(path, status)` is told every answer's status (None: none was sent), whoever sent it: the routes,
    the middleware inside this one (keys, the body bound) or this one's 500."""

    def __init__(self, app, on_response=None):
        self.app = app
        self.on_response = on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = _request_id_from(scope.get("headers") or [])
        token = request_id.set(rid)
        t0, status = time.perf_counter(), {"code": None}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            error_log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if status["code"] is not None:  # the answer had begun: nothing clean left to send
                raise
            await send_json_error(send_with_id, 500, f"internal error (request id {rid}); the server log has the "
                                  "details", path=scope.get("path", ""))
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            if self.on_response is not None:
                self.on_response(scope.get("path", ""), status["code"])
            access_log.info("%s %s %s %.1f ms", scope.get("method"), scope.get("path"), status["code"], ms,
                            extra={"method": scope.get("method"), "path": scope.get("path"),
                                   "status": status["code"], "ms": round(ms, 3)})
            request_id.reset(token)
