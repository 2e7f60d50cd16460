"""The body limit (server/app.py: BodyLimitMiddleware) driven as ASGI directly, without a
server: a declared length over the limit is refused before any byte is read, a body that grows
past it is refused at that chunk, a body within it reaches the route whole; refusals are 413s in
OpenAI's shape, Anthropic's on the Messages API's paths. (The security checks run against a live
server: tests/server/test_security.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from server.app import BodyLimitMiddleware

LIMIT = 1000


class Route:
    """An inner app that reads the whole body, then answers 200 with its length."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        payload = json.dumps({"length": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def run(chunks: list[bytes], *, path: str = "/v1/chat/completions",
        declared: int | None = None) -> tuple[Route, list[dict[str, Any]], int]:
    """The middleware over ``Route`` for one POST whose body arrives in ``chunks``: (the route,
    the messages sent back, how many chunks were read)."""
    route = Route()
    headers = [(b"host", b"127.0.0.1")] + ([(b"content-length", str(declared).encode())] if declared is not None else [])
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    pending = list(chunks)
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(BodyLimitMiddleware(route, LIMIT)(scope, receive, send))
    return route, sent, read


def refusal(sent: list[dict[str, Any]]) -> tuple[int, dict[str, str], dict[str, Any]]:
    start, body = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body["body"])


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read():
    route, sent, read = run([b"x" * (LIMIT + 1)], declared=LIMIT + 1)
    status, headers, body = refusal(sent)
    assert (status, read, route.bodies) == (413, 0, [])
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(json.dumps(body))
    assert body["error"]["code"] == "request_too_large" and f"{LIMIT:,} bytes" in body["error"]["message"]


def test_a_body_that_grows_past_the_limit_is_refused_at_that_chunk():
    route, sent, read = run([b"a" * 600, b"b" * 600, b"c" * 600])  # no Content-Length: counted as it arrives
    status, _, body = refusal(sent)
    assert (status, read, route.bodies) == (413, 2, [])
    assert body["error"]["code"] == "request_too_large"


def test_a_body_within_the_limit_reaches_the_route_whole():
    route, sent, read = run([b"a" * 600, b"b" * 400], declared=LIMIT)
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"]) == {"length": LIMIT}
    assert (route.bodies, read) == ([b"a" * 600 + b"b" * 400], 2)


def test_on_the_messages_api_the_refusal_is_anthropics():
    _, sent, _ = run([b"x"], path="/v1/messages", declared=LIMIT + 1)
    status, _, body = refusal(sent)
    assert status == 413 and body["type"] == "error" and body["error"]["type"] == "request_too_large"
