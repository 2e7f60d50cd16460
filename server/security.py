"""Auth and the DNS-rebinding guard, as one ASGI middleware in front of every route.

On a loopback bind, a request whose ``Host`` header names anything but a loopback name (or an
``--allowed-host``) is refused: a web page that rebinds its own domain to 127.0.0.1 cannot
reach the server. With an API key, ``/v1/*`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from server.config import ServerConfig, is_loopback
from server.errors import error_body

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1: host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SecurityMiddleware:
    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.api_key = config.api_key
        self.check_host = is_loopback(config.host)
        self.allowed = {*_LOOPBACK_NAMES, *(h.lower() for h in config.allowed_hosts)}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.check_host and _host_name(headers.get("host", "")) not in self.allowed:
            await _reply(send, 403, error_body(403, "Host header not allowed: the server is bound to loopback "
                                                    "and only answers loopback host names.", code="host_not_allowed"))
            return
        if self.api_key and scope.get("path", "").startswith("/v1"):
            token = headers.get("authorization", "")
            scheme, _, given = token.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
                await _reply(send, 401, error_body(401, "Incorrect or missing API key. Send it as "
                                                        "'Authorization: Bearer <key>'.", code="invalid_api_key"),
                             {"www-authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


async def _reply(send: Any, status: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
