"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the one
chat path: the body becomes a chat request (server/anthropic_chat.py), which ``prepare_chat``
checks and templates, ``admit`` lets in and ``chat_steps`` runs; ``MessageBuilder`` turns its
steps into Anthropic's message or events. Errors on these routes are in Anthropic's shape
(server/anthropic_errors.py). ``anthropic-version`` and ``anthropic-beta`` headers and the
``?beta=true`` query Claude Code sends are accepted and change nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from engine import RequestRejected
from server.anthropic import CountTokensRequest, MessagesRequest
from server.anthropic_chat import chat_request
from server.anthropic_errors import anthropic_error_body, anthropic_status
from server.anthropic_stream import MessageBuilder
from server.chat import chat_prompt_ids, chat_steps, check_bound, check_model, off_loop, prepare_chat, ready
from server.errors import APIError
from server.streaming import Job, admit, until_disconnect
from server.tools import plan_tools

logger = logging.getLogger(__name__)
router = APIRouter()
PING_S = 10  # a ping event this often while a stream has nothing else to say


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Any:
    job = await prepare_chat(chat_request(body, request.app.state.config.keep_billing_header), request)
    await admit([job], request)
    thinking = body.thinking
    builder = MessageBuilder(body.model, body.stop_sequences or (), request.app.state.client.text_of,
                             show_thinking=getattr(thinking, "display", None) != "omitted")
    if body.stream:
        return EventSourceResponse(_events(builder, job, request), ping=PING_S, ping_message_factory=_ping)
    return await until_disconnect(request, _collect(builder, job, request))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt's token count, rendered as ``/v1/messages`` would render it, with nothing run."""
    chat = chat_request(body, request.app.state.config.keep_billing_header)
    client, info = ready(request)
    check_model(chat, info)
    tools = plan_tools(chat, info)
    check_bound(chat, info)
    prompt_ids = await off_loop(request, chat_prompt_ids, chat, client, tools.tools)
    return {"input_tokens": len(prompt_ids)}


async def _collect(builder: MessageBuilder, job: Job, request: Request) -> dict[str, Any]:
    try:
        async for step in chat_steps(job, request):
            builder.feed(step)
    except RequestRejected as exc:  # only without a front-door admission (taken above)
        raise APIError(exc.status, exc.message, code=exc.code) from exc
    builder.finish()
    return builder.message()


async def _events(builder: MessageBuilder, job: Job, request: Request) -> AsyncIterator[dict[str, str]]:
    """The stream's events; a failure after it started is an ``error`` event, as Anthropic's."""
    started = False
    try:
        async for step in chat_steps(job, request):
            events = builder.feed(step)
            if not started:
                started = True
                yield _event(builder.start())
            for event in events:
                yield _event(event)
        if not started:
            yield _event(builder.start())
        for event in builder.finish():
            yield _event(event)
    except (APIError, RequestRejected) as exc:
        yield _event(anthropic_error_body(anthropic_status(exc.status), exc.message))
    except Exception:  # noqa: BLE001 - the stream has started: its error goes out as an event
        logger.exception("the message stream failed")
        yield _event(anthropic_error_body(500, "The server had an error while generating this message."))


def _event(payload: dict[str, Any]) -> dict[str, str]:
    return {"event": payload["type"], "data": json.dumps(payload, ensure_ascii=False)}


def _ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))
