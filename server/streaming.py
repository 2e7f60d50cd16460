"""Running a job against the engine: streamed over SSE, or collected with a disconnect watch.

Either way, a client that goes away cancels the consumer, whose ``finally`` aborts the request
inside the engine at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from engine import EngineClient, FinishReason
from server.errors import APIError, ClientDisconnected, error_body
from server.metrics import Metrics
from server.responses import Collected, Job, chat_logprobs, chunk, completion_logprobs, finish_name, \
    full_response, usage_chunk

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1


def _observe(job: Job, metrics: Metrics, finish: FinishReason | None, num_tokens: int) -> None:
    metrics.requests.labels(job.kind, finish_name(finish) or "disconnect").inc()
    metrics.generation_tokens.inc(num_tokens)
    metrics.latency.observe(time.monotonic() - job.arrival)


async def stream_events(job: Job, client: EngineClient, metrics: Metrics) -> AsyncIterator[dict[str, str]]:
    """SSE events: chunks, an optional usage chunk, then ``[DONE]``."""
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    offset = len(job.echo_text)
    finish: FinishReason | None = None
    num_tokens = 0
    try:
        if job.kind == "chat":
            yield _event(chunk(job, None, None, None, role=True))
        elif job.echo_text:
            yield _event(chunk(job, job.echo_text, None, None))
        async for output in client.generate(job.prompt_ids, job.params, job.request_id):
            if num_tokens == 0 and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            num_tokens, finish = output.num_output_tokens, output.finish_reason
            if output.error is not None:
                yield _event(error_body(500, output.error, code="generation_failed"))
                break
            logprobs = None
            if job.params.logprobs and output.logprobs:
                logprobs = (chat_logprobs(output.logprobs, client.decode_token) if job.kind == "chat"
                            else completion_logprobs(output.logprobs, client.decode_token, offset))
            offset += len(output.text)
            if output.text or logprobs or output.finished:
                yield _event(chunk(job, output.text, finish_name(output.finish_reason), logprobs))
            if output.finished and job.include_usage:
                yield _event(usage_chunk(job, output.num_prompt_tokens, output.num_output_tokens))
        yield {"data": "[DONE]"}
    finally:
        _observe(job, metrics, finish, num_tokens)


def _event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def collect(job: Job, client: EngineClient, metrics: Metrics, request: Request) -> dict[str, Any]:
    """The whole response, or nothing if the client left first (the request is then aborted)."""
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    collected = Collected()

    async def run() -> None:
        async for output in client.generate(job.prompt_ids, job.params, job.request_id):
            if not collected.logprobs and not collected.text and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            collected.add(output)

    try:
        await until_disconnect(request, run())
    finally:
        last = collected.last
        _observe(job, metrics, last.finish_reason if last else None, last.num_output_tokens if last else 0)
    assert collected.last is not None
    if collected.last.error is not None:
        raise APIError(500, collected.last.error, code="generation_failed")
    return full_response(job, collected, client.decode_token)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``
    (never the child task's ``CancelledError``, which would reach uvicorn as a crash)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})  # let its cleanup (the engine abort) run
                raise ClientDisconnected()
        return await task
    finally:
        if not task.done():
            task.cancel()
