"""The server's two ASGI middlewares, in front of every route (outermost first): who may ask
(``SecurityMiddleware``) and how much they may send (``BodyLimitMiddleware``). Their refusals
are JSON in OpenAI's error shape, Anthropic's on the Messages API's paths
(server/anthropic_errors.py).

``SecurityMiddleware``: auth, the DNS-rebinding guard and the Origin check, in this order:
1. On a loopback bind, a request whose ``Host`` header names anything but a loopback name (or an
   ``--allowed-host``) is refused: a web page that rebinds its own domain to 127.0.0.1 cannot
   reach the server.
2. A state-changing request (any method but GET and HEAD, CORS preflights included) that carries
   an ``Origin`` other than the server's own and not in ``--allowed-origins`` is refused: a web
   page elsewhere cannot make the browser POST to the server (a form POST needs no preflight).
   Clients that are not browsers send no ``Origin`` and are not concerned.
3. With an API key, ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/docs``, ``/redoc`` and ``/openapi.json`` need
   ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header); CORS preflights
   from allowed origins pass (browsers never send credentials with them), and Starlette's CORS
   middleware behind this one answers them.

``BodyLimitMiddleware``: no request body beyond ``--max-request-bytes`` is ever read in full. A
request whose ``Content-Length`` is over the limit is refused before any of its body is read, and
the bytes of every body are counted as they arrive (chunked bodies too), so a body that grows
past the limit is refused at that chunk; either way the answer is a 413. Once a request that
sent a large body is done, malloc's free pages go back to the OS (JSON parsing and tokenizing a
large body leave them in its arenas).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException

from engine.memory import trim_host_memory

from server.anthropic_errors import anthropic_error_body, is_messages_path
from server.config import ServerConfig, is_loopback
from server.errors import error_body

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_SAFE_METHODS = ("GET", "HEAD")
_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origin_authority(origin: str) -> str | None:
    """``host:port`` of an ``Origin`` header (the scheme's default port written out), or None
    for ``null`` and anything that is not an http(s) origin."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port or _DEFAULT_PORTS[parts.scheme]}"


def _host_authority(host_header: str, scheme: str) -> str:
    host = host_header.strip().lower()
    has_port = host.rsplit("]", 1)[-1].count(":") == 1 if host.startswith("[") else host.count(":") == 1
    return host if has_port else f"{host}:{_DEFAULT_PORTS.get(scheme, '80')}"


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1: host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SecurityMiddleware:
    """Refuses a request by its ``Host``, its ``Origin`` and its API key (module docstring)."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.api_key = config.api_key
        self.check_host = is_loopback(config.host)
        self.allowed = {*_LOOPBACK_NAMES, *(h.lower() for h in config.allowed_hosts)}
        self.any_origin = "*" in config.allowed_origins
        self.origins = {o.strip().lower().rstrip("/") for o in config.allowed_origins}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.check_host and _host_name(headers.get("host", "")) not in self.allowed:
            await _reply(send, 403, _error(path, 403, "Host header not allowed: the server is bound to loopback and "
                                                      "only answers loopback host names.", "host_not_allowed"))
            return
        origin = headers.get("origin")
        allowed_origin = origin is not None and self._is_allowed_origin(origin)
        method = scope.get("method", "GET")
        if origin is not None and method not in _SAFE_METHODS and not allowed_origin \
                and _origin_authority(origin) != _host_authority(headers.get("host", ""), scope.get("scheme", "http")):
            await _reply(send, 403, _error(path, 403, "Cross-origin request refused: this Origin is not the server's "
                                                      "own and not in kvarn serve --allowed-origins.",
                                           "origin_not_allowed"))
            return
        preflight = method == "OPTIONS" and allowed_origin and "access-control-request-method" in headers
        if self.api_key and not preflight and path.startswith(_KEYED_PREFIXES) and not self._has_key(headers):
            cors = {"access-control-allow-origin": origin, "vary": "Origin"} if allowed_origin and origin else {}
            await _reply(send, 401, _error(path, 401, "Incorrect or missing API key. Send it as 'Authorization: "
                                                      "Bearer <key>' or 'x-api-key: <key>'.", "invalid_api_key"),
                         {"www-authenticate": "Bearer", **cors})
            return
        await self.app(scope, receive, send)

    def _has_key(self, headers: dict[str, str]) -> bool:
        """Whether the request carries the API key, as a bearer token or in ``x-api-key``."""
        key = (self.api_key or "").encode()
        scheme, _, given = headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)
        header = "x-api-key" in headers and hmac.compare_digest(headers["x-api-key"].strip().encode(), key)
        return bearer or header

    def _is_allowed_origin(self, origin: str) -> bool:
        return self.any_origin or origin.strip().lower().rstrip("/") in self.origins


TRIM_AFTER_BYTES = 2**20  # a request with a body this large gives malloc's free pages back when done


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body passes the limit. An ``HTTPException`` so that FastAPI's
    body reader re-raises it as is (it turns other errors into a 400); the app's handler for
    ``HTTPException`` answers it in OpenAI's shape."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"The request body is larger than this server accepts ({limit:,} bytes; kvarn serve --max-request-bytes)."


class BodyLimitMiddleware:
    """ASGI middleware enforcing ``max_bytes`` on every HTTP request body."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope.get("headers", ()))
        if declared is not None and declared > self.max_bytes:
            await _reply_too_large(send, self.max_bytes, scope.get("path", ""))  # not one byte of the body is read
            return
        received = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:  # read outside a route (a route's own handler answers it there)
            if started:
                raise
            await _reply_too_large(send, self.max_bytes, scope.get("path", ""))
        finally:
            if received >= TRIM_AFTER_BYTES:
                await asyncio.to_thread(trim_host_memory)


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses it first
    return None


async def _reply_too_large(send: Any, limit: int, path: str) -> None:
    await _reply(send, 413, _error(path, 413, too_large_message(limit), BodyTooLarge.code), {"connection": "close"})


def _error(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """A refusal's body: Anthropic's shape on the Messages API's paths, OpenAI's elsewhere."""
    return anthropic_error_body(status, message) if is_messages_path(path) else error_body(status, message, code=code)


async def _reply(send: Any, status: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
