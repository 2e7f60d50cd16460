"""The ASGI stack: the app factory and the middlewares in front of every route, outermost first:
the in-flight count a graceful drain waits for (``CountInFlight``, ``DrainingServer``), who may ask
(``SecurityMiddleware``: Host, Origin, API key), CORS for ``--allowed-origins`` (when any), and how
much they may send (``BodyLimitMiddleware``). The lifespan starts the engine thread and returns at
once (``/health`` says 503 until the model is loaded); prompt building (chat template, tokenizer)
runs on ``app.state.prepare``, a small thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI
from sse_starlette.sse import AppStatus
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from engine import EngineClient
from engine.memory import trim_host_memory
from server.anthropic_errors import anthropic_error_body, is_messages_path
from server.chat import router as chat_router
from server.config import ServerConfig, is_loopback
from server.errors import error_body, install_error_handlers
from server.metrics import Metrics
from server.openapi import install_openapi
from server.messages import router as messages_router
from server.responses_api import router as responses_router
from server.routes import router
from server.tokenize import router as tokenize_router

logger = logging.getLogger("kvarn")

PREPARE_THREADS = 4  # prompts rendered and tokenized at once, beside the engine thread


def create_app(config: ServerConfig, client: EngineClient | None = None) -> FastAPI:
    """An app serving ``config``; pass ``client`` to share an engine (it is then not shut down)."""
    config.validate()
    owned = client is None
    engine_client = client or EngineClient(config.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvarn-prepare")
        if owned:
            engine_client.start()
        try:
            yield
        finally:
            app.state.prepare.shutdown(wait=False, cancel_futures=True)
            if owned:
                engine_client.shutdown()

    app = FastAPI(title="kvarn", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible LLM server on MLX with the KVarN quantized KV cache. Errors "
                              "are OpenAI's `{\"error\": {message, type, param, code}}`; invalid requests are 400s.")
    app.state.client = engine_client
    app.state.config = config
    app.state.metrics = Metrics(engine_client.stats,
                                lambda: engine_client.info.model_id if engine_client.info else None)
    app.state.in_flight = InFlight()  # what a drain waits for (DrainingServer)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(chat_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)  # the SDK sends headers of its own (x-stainless-*)
    app.add_middleware(SecurityMiddleware, config=config)
    app.add_middleware(CountInFlight, counter=app.state.in_flight)
    return app


# ---- the in-flight count and the graceful drain ----
DEFAULT_DRAIN_TIMEOUT_S = 30.0
_AFTER_FAIL_S = 5.0  # after failing what was left, how long its clients get to read the error
_UNCOUNTED = ("/health", "/metrics")


class InFlight:
    """How many HTTP requests are being answered; ``idle`` is set at zero."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()


class CountInFlight:
    """ASGI middleware keeping ``counter`` (an ``InFlight``) up to date: it counts the HTTP requests
    being answered (a streamed response counts until its last byte is sent); /health and /metrics
    are not counted."""

    def __init__(self, app: Any, counter: InFlight) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNCOUNTED:
            await self.app(scope, receive, send)
            return
        counter = self.counter
        counter.count += 1
        counter.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            counter.count -= 1
            if counter.count == 0:
                counter.idle.set()


def find_in_flight(app: Any) -> InFlight | None:
    return getattr(app.state, "in_flight", None)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM/SIGINT drain ``app`` before it shuts down: a replica stops
    taking requests and finishes the ones it has.

        signal -> draining: /health answers 503 {"status": "draining"} (routers stop sending), new
                  requests get 503 + Retry-After in their API's error shape (``EngineClient.draining``)
               -> in-flight HTTP requests finish (streams included), up to ``drain_timeout`` seconds
               -> whatever is left ends with a clean error (``EngineClient.fail_all``)
               -> uvicorn shuts down: the lifespan stops the engine, which writes the prefix cache's
                  queued disk blocks and closes the KV events publisher; the process exits 0

    Uvicorn's own signal handling would stop at once and let sse-starlette end every open stream,
    so this server takes SIGTERM and SIGINT itself; a second signal forces the exit."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout
        self._drain: asyncio.Task | None = None
        AppStatus.disable_automatic_graceful_drain()  # streams end when they are done, not at the signal

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain is not None:  # a second signal: stop now
            logger.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            AppStatus.should_exit = True
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining (up to %.0f s for %d requests in flight)", signal.Signals(sig).name,
                    self.drain_timeout, self._count())
        self._drain = asyncio.get_running_loop().create_task(self.drain())

    def _count(self) -> int:
        in_flight = find_in_flight(self.app)
        return in_flight.count if in_flight is not None else 0

    async def drain(self) -> None:
        client = self.app.state.client
        client.draining = True
        in_flight = find_in_flight(self.app)
        if in_flight is not None and not await _wait(in_flight.idle, self.drain_timeout):
            logger.warning("drain timeout: ending %d requests still in flight", in_flight.count)
            client.fail_all("The server shut down before this request finished (its drain timeout passed); "
                            "retry it.")
            await _wait(in_flight.idle, _AFTER_FAIL_S)
        logger.info("drained: shutting down")
        AppStatus.should_exit = True
        self.should_exit = True


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


# ---- who may ask and how much they may send (refusals in OpenAI's error shape, Anthropic's on the
# Messages API's paths: server/anthropic_errors.py) ----
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
    """Refuses a request by its ``Host``, its ``Origin`` and its API key: auth, the DNS-rebinding
    guard and the Origin check, in this order:

    1. On a loopback bind, a request whose ``Host`` header names anything but a loopback name (or an
       ``--allowed-host``) is refused: a web page that rebinds its own domain to 127.0.0.1 cannot
       reach the server.
    2. A state-changing request (any method but GET and HEAD, CORS preflights included) that carries
       an ``Origin`` other than the server's own and not in ``--allowed-origins`` is refused: a web
       page elsewhere cannot make the browser POST to the server (a form POST needs no preflight).
       Clients that are not browsers send no ``Origin`` and are not concerned.
    3. With an API key, ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/docs``, ``/redoc`` and
       ``/openapi.json`` need ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's
       header); CORS preflights from allowed origins pass (browsers never send credentials with
       them), and Starlette's CORS middleware behind this one answers them."""

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
    """ASGI middleware enforcing ``max_bytes`` on every HTTP request body: none is ever read in
    full past it. A request whose ``Content-Length`` is over the limit is refused before any of its
    body is read, and the bytes of every body are counted as they arrive (chunked bodies too), so
    a body that grows past the limit is refused at that chunk; either way the answer is a 413.
    Once a request that sent a large body is done, malloc's free pages go back to the OS (JSON
    parsing and tokenizing a large body leave them in its arenas)."""

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
