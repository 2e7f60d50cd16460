"""A recording reverse proxy in front of ``kvarn serve``, for benchmarks of API clients that are
not ours (agent CLIs) as well as of the SDKs.

Every request is forwarded unchanged and its answer streamed back unchanged; on the side the
proxy keeps one ``Exchange`` per request: route, status, time to the first generated event,
the usage the answer reported (normalised across Chat Completions, Anthropic Messages and
Responses), and for a refused request its body and the error text, so a report can say exactly
what a client sent and what kvarn answered.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "accept-encoding"}
_MAX_KEPT_BODY = 400_000  # characters of a failed request's body kept for the report


@dataclass
class Usage:
    """Prompt tokens, those served from the prefix cache, and output tokens of one answer."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None


@dataclass
class Exchange:
    """One request through the proxy. ``ttft_s`` is the time from the request to the first event
    carrying generated text or tool arguments (streams only); ``error`` is the error body of a
    refused request or the error event of a stream; ``request_body`` is kept only for those."""

    method: str
    path: str
    started: float
    status: int | None = None
    ttft_s: float | None = None
    duration_s: float | None = None
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
    request_body: str | None = None
    user_agent: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def usage_of(payload: dict[str, Any]) -> Usage | None:
    """The usage an answer or a stream event carries, in any of the three APIs' shapes (Anthropic
    counts cached prompt tokens apart from ``input_tokens``; the others inside the prompt)."""
    for holder in (payload, payload.get("message"), payload.get("response")):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict):
            return _normalise(usage)
    return None


def _normalise(usage: dict[str, Any]) -> Usage:
    if "prompt_tokens" in usage:  # Chat Completions
        details = usage.get("prompt_tokens_details") or {}
        return Usage(usage["prompt_tokens"], details.get("cached_tokens"), usage.get("completion_tokens"))
    if "input_tokens_details" in usage:  # Responses
        return Usage(usage.get("input_tokens"), (usage["input_tokens_details"] or {}).get("cached_tokens"),
                     usage.get("output_tokens"))
    read = usage.get("cache_read_input_tokens") or 0  # Messages
    written = usage.get("cache_creation_input_tokens") or 0
    prompt = usage.get("input_tokens")
    return Usage(None if prompt is None else prompt + read + written, read, usage.get("output_tokens"))


def is_generated(event: dict[str, Any]) -> bool:
    """Whether a stream event carries generated text, reasoning or tool-call arguments."""
    kind = str(event.get("type", ""))
    if kind.endswith(".delta") or kind == "content_block_delta":
        return True
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


class _Recorder:
    """Reads an answer's bytes as they pass: SSE events or one JSON body."""

    def __init__(self, exchange: Exchange, is_stream: bool) -> None:
        self.exchange, self.is_stream = exchange, is_stream
        self.request_body = b""  # kept for the report when the answer is an error
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        if not self.is_stream:
            return
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.strip())

    def close(self) -> None:
        if self.is_stream:
            self._line(self._buffer.strip())
            return
        text = self._buffer.decode(errors="replace")
        if self.exchange.status is not None and self.exchange.status >= 400:
            self.exchange.error = text[:4000]
            return
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return
        if isinstance(payload, dict):
            self.exchange.usage = usage_of(payload) or self.exchange.usage

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        try:
            event = json.loads(line[5:])
        except json.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        if self.exchange.ttft_s is None and is_generated(event):
            self.exchange.ttft_s = time.monotonic() - self.exchange.started
        if event.get("type") in ("error", "response.failed") or event.get("error"):
            self.exchange.error = json.dumps(event)[:4000]
        usage = usage_of(event)
        if usage is not None:  # a later event's usage completes an earlier one's
            old = self.exchange.usage
            self.exchange.usage = Usage(*(n if n is not None else o for n, o in
                                          zip(asdict(usage).values(), asdict(old).values())))


class RecordingProxy:
    """Forwards everything to ``upstream``; ``exchanges`` grows by one per request."""

    def __init__(self, upstream: str, port: int) -> None:
        self.upstream, self.port = upstream, port
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/{path:path}", self._forward,
                                           methods=["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS"])])

    def since(self, start: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[start:])

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        exchange = Exchange(request.method, path, time.monotonic(), user_agent=request.headers.get("user-agent", ""))
        with self._lock:
            self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(None, connect=10))
        try:
            upstream = await client.send(client.build_request(request.method, path, headers=headers, content=body),
                                         stream=True)
        except httpx.TransportError as exc:  # kvarn died or refused the connection: the client sees a 502
            await client.aclose()
            exchange.status, exchange.error = 502, f"upstream unreachable: {exc!r}"
            exchange.request_body = body.decode(errors="replace")[:_MAX_KEPT_BODY]
            return StreamingResponse(iter([exchange.error.encode()]), status_code=502)
        exchange.status = upstream.status_code
        recorder = _Recorder(exchange, upstream.headers.get("content-type", "").startswith("text/event-stream"))
        recorder.request_body = body
        answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                          and k.lower() != "content-encoding"}
        return StreamingResponse(self._relay(upstream, client, recorder), status_code=upstream.status_code,
                                 headers=answer_headers)

    @staticmethod
    async def _relay(upstream: httpx.Response, client: httpx.AsyncClient, recorder: _Recorder) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                recorder.feed(chunk)
                yield chunk
        finally:
            recorder.close()
            exchange = recorder.exchange
            exchange.duration_s = time.monotonic() - exchange.started
            if exchange.error is not None or (exchange.status or 0) >= 400:
                exchange.request_body = recorder.request_body.decode(errors="replace")[:_MAX_KEPT_BODY]
            await upstream.aclose()
            await client.aclose()


@contextmanager
def recording_proxy(upstream: str, port: int) -> Iterator[RecordingProxy]:
    """A ``RecordingProxy`` to ``upstream`` on 127.0.0.1:``port`` for the length of the block."""
    proxy = RecordingProxy(upstream, port)
    server = uvicorn.Server(uvicorn.Config(proxy.app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the recording proxy did not start on port {port}")
        time.sleep(0.05)
    try:
        yield proxy
    finally:
        server.should_exit = True
        thread.join(10)
