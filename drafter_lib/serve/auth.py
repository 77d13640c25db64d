"""Bearer-key authentication: with keys configured, every endpoint but /health needs `Authorization: Bearer <key>`.

Keys are compared in constant time (`hmac.compare_digest`, against every key, so the time does not tell which
key nearly matched), and never logged. A missing or wrong key gets 401 with `WWW-Authenticate: Bearer`.
"""
from __future__ import annotations

import hmac

from drafter_lib.serve.json_errors import send_json_error

OPEN_PATHS = ("/health",)  # a load balancer's probe needs no key


class BearerAuth:
    """ASGI middleware; `keys` empty = no authentication (the settings then allow loopback only)."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, key = given.partition(b" ")
        ok = False
        for k in self.keys:  # no early exit: every key is compared
            ok |= hmac.compare_digest(key.strip(), k)
        return scheme.lower() == b"bearer" and ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope.get("path") in OPEN_PATHS \
                or self.allowed(scope.get("headers") or []):
            return await self.app(scope, receive, send)
        await send_json_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                              ((b"www-authenticate", b"Bearer"),), path=scope.get("path", ""))
