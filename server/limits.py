"""Request-size limits: no request body beyond ``--max-request-bytes`` is ever read in full.

``BodyLimitMiddleware`` refuses a request whose ``Content-Length`` is over the limit before any
of its body is read, and counts the bytes of every body as they arrive (chunked bodies too), so
a body that grows past the limit is refused at that chunk. Either way the answer is a 413 in
OpenAI's error shape (Anthropic's on the Messages API's paths). Once a request that sent a large
body is done, malloc's free pages go back to the OS (JSON parsing and tokenizing a large body leave them in its arenas). ``check_text_bound`` refuses a prompt whose text cannot fit the context
before it is tokenized (tokenizing runs off the event loop, but still costs a core).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from starlette.exceptions import HTTPException

from engine.memory import trim_host_memory

from server.anthropic_errors import anthropic_error_body, is_messages_path
from server.errors import APIError, error_body
from server.protocol import ChatCompletionRequest, CompletionRequest


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
    message = too_large_message(limit)
    body = anthropic_error_body(413, message) if is_messages_path(path) else \
        error_body(413, message, code=BodyTooLarge.code)
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def check_text_bound(num_chars: int, context_length: int, max_token_chars: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt of ``num_chars`` characters that cannot fit in
    ``context_length`` tokens: no token of the vocabulary covers more than ``max_token_chars``
    characters, so such a text has more than ``context_length`` tokens. A bound, not an estimate:
    it never refuses a prompt that would fit (tokenizers whose normalizer deletes characters
    aside); the exact check after tokenizing still runs."""
    if max_token_chars > 0 and num_chars > context_length * max_token_chars:
        raise APIError(400, f"This model's maximum context length is {context_length} tokens, and the prompt's "
                            f"{num_chars:,} characters are more than that many tokens of this vocabulary can hold "
                            f"(at most {max_token_chars} characters a token). Please reduce the length of the prompt.",
                       param=param, code="context_length_exceeded")


def prompt_text_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of a request's text that every chat template renders (system, developer, user
    and tool turns: a template may drop or shorten an assistant's earlier reasoning); for a list
    of prompts, the longest. Under-counting only weakens the bound, never makes it wrong."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) for m in body.messages if m.role != "assistant")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    return max((len(p) for p in prompts if isinstance(p, str)), default=0)
