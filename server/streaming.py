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

from engine import EngineClient, FinishReason, RequestOutput, RequestRejected
from server.errors import APIError, ClientDisconnected, error_body
from server.metrics import Metrics
from server.responses import Collected, Job, chat_chunk, chat_logprobs, chunk, completion_logprobs, finish_name, \
    full_response, usage_chunk

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1


def _observe(job: Job, metrics: Metrics, finish: FinishReason | None, num_tokens: int, cached_tokens: int) -> None:
    metrics.requests.labels(job.kind, finish_name(finish) or "disconnect").inc()
    metrics.generation_tokens.inc(num_tokens)
    metrics.cached_prompt_tokens.inc(cached_tokens)
    metrics.latency.observe(time.monotonic() - job.arrival)


def _generate(job: Job, client: EngineClient) -> AsyncIterator[RequestOutput]:
    return client.generate(job.prompt_ids, job.params, job.request_id, n=job.n, admission=job.admission,
                           cache_salt=job.cache_salt, snapshot_at=job.snapshot_at)


async def stream_events(job: Job, client: EngineClient, metrics: Metrics) -> AsyncIterator[dict[str, str]]:
    """SSE events: chunks (each of one choice, told apart by ``index``), an optional usage chunk
    once every choice has finished, then ``[DONE]``."""
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    offsets = [len(job.echo_text)] * job.n
    tokens = [0] * job.n
    cached = 0  # the prompt's tokens served from the prefix cache (the same on every output)
    finishes: list[FinishReason | None] = [None] * job.n
    splits = [job.choice_format.start() for _ in range(job.n)] if job.kind == "chat" else []
    try:
        for index in range(job.n):
            if job.kind == "chat":
                yield _event(chat_chunk(job, job.choice_format.role_delta(), None, None, index=index))
            elif job.echo_text:
                yield _event(chunk(job, job.echo_text, None, None, index=index))
        async for output in _generate(job, client):
            i = output.index
            if sum(tokens) == 0 and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            tokens[i], finishes[i] = output.num_output_tokens, output.finish_reason
            cached = max(cached, output.num_cached_tokens)
            if output.error is not None:
                yield _event(error_body(500, output.error, code="generation_failed"))
                break
            logprobs = None
            if job.params.logprobs and output.logprobs:
                logprobs = (chat_logprobs(output.logprobs, client.decode_token) if job.kind == "chat"
                            else completion_logprobs(output.logprobs, client.decode_token, offsets[i]))
            offsets[i] += len(output.text)
            finish = finish_name(output.finish_reason)
            if splits:
                split = splits[i]
                deltas = split.deltas(split.feed(output.text, output.finished)) or \
                    ([{}] if logprobs or output.finished else [])
                finish = split.finish_name(output.finish_reason, finish)
                for k, delta in enumerate(deltas):  # logprobs with the first, the finish with the last
                    yield _event(chat_chunk(job, delta, finish if k == len(deltas) - 1 else None,
                                            logprobs if k == 0 else None, index=i))
            elif output.text or logprobs or output.finished:
                yield _event(chunk(job, output.text, finish, logprobs, index=i))
        else:
            if job.include_usage:
                yield _event(usage_chunk(job, len(job.prompt_ids), sum(tokens), cached))
        yield {"data": "[DONE]"}
    except RequestRejected as exc:  # only without a front-door admission (the routes always take one)
        metrics.rejected.labels(str(exc.status)).inc()
        yield _event(error_body(exc.status, exc.message, code=exc.code))
    finally:
        _observe(job, metrics, _overall(finishes), sum(tokens), cached)


def _overall(finishes: list[FinishReason | None]) -> FinishReason | None:
    """A request's finish for the metrics: choice 0's once every choice has finished, else None
    (the client left first)."""
    return finishes[0] if all(f is not None for f in finishes) else None


def _event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def collect(job: Job, client: EngineClient, metrics: Metrics, request: Request) -> dict[str, Any]:
    """The whole response, or nothing if the client left first (the request is then aborted)."""
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    choices = [Collected() for _ in range(job.n)]

    async def run() -> None:
        first = True
        async for output in _generate(job, client):
            if first and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
                first = False
            choices[output.index].add(output)

    try:
        await until_disconnect(request, run())
    except RequestRejected as exc:
        metrics.rejected.labels(str(exc.status)).inc()
        raise APIError(exc.status, exc.message, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None) from exc
    finally:
        lasts = [c.last for c in choices if c.last is not None]
        _observe(job, metrics, _overall([c.last.finish_reason if c.last else None for c in choices]),
                 sum(last.num_output_tokens for last in lasts),
                 max((last.num_cached_tokens for last in lasts), default=0))
    errors = [c.last.error for c in choices if c.last is not None and c.last.error is not None]
    if errors:
        raise APIError(500, errors[0], code="generation_failed")
    return full_response(job, choices, client.decode_token)


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
