"""Running a job against the engine: streamed over SSE, or collected with a disconnect watch.

Either way, a client that goes away cancels the consumer, whose ``finally`` aborts the request
inside the engine at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from sse_starlette import EventSourceResponse

from engine import EngineClient, FinishReason, RequestOutput, RequestRejected
from server.errors import APIError, ClientDisconnected, error_body
from server.metrics import Metrics
from server.responses import Collected, Job, chat_chunk, chat_logprobs, chunk, completion_logprobs, finish_name, \
    full_response, shown_logprobs, usage_chunk

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1


def observe(job: Job, metrics: Metrics, finish: FinishReason | None, num_tokens: int, cached_tokens: int) -> None:
    metrics.requests.labels(job.kind, finish_name(finish) or "disconnect").inc()
    metrics.generation_tokens.inc(num_tokens)
    metrics.cached_prompt_tokens.inc(cached_tokens)
    metrics.latency.observe(time.monotonic() - job.arrival)


def _generate(job: Job, client: EngineClient) -> AsyncIterator[RequestOutput]:
    return client.generate(job.prompt_ids, job.params, job.engine_id, n=job.n, admission=job.admission,
                           cache_salt=job.cache_salt, snapshot_at=job.snapshot_at)


async def outputs(jobs: Sequence[Job], client: EngineClient) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Every job's outputs as they come (a list of prompts runs as one engine request each, side
    by side). Leaving early cancels them all, which aborts them inside the engine."""
    if len(jobs) == 1:
        async for output in _generate(jobs[0], client):
            yield jobs[0], output
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for output in _generate(job, client):
                queue.put_nowait((job, output))
        except Exception as exc:  # handed to the consumer (a refusal, an engine that went away)
            queue.put_nowait((job, exc))
            return
        queue.put_nowait((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        running = len(jobs)
        while running:
            job, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def admit(jobs: Sequence[Job], request: Request) -> None:
    """Admit every job at the front door, before any byte of a response goes out (so a refusal
    gets its own status); a refusal lets go of the jobs admitted before it and raises an
    ``APIError`` (429 or 503 with ``Retry-After``)."""
    client, state = request.app.state.client, request.app.state
    try:
        for job in jobs:
            job.admission = client.check_admission(len(job.prompt_ids), job.params.max_tokens, job.n)
    except RequestRejected as exc:
        for job in jobs:
            if job.admission is not None:
                job.admission.release()
        state.metrics.rejected.labels(str(exc.status)).inc()
        raise APIError(exc.status, exc.message, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None) from exc


async def respond(jobs: list[Job], stream: bool, request: Request) -> Any:
    """Admit every job (``admit``), then stream or collect."""
    await admit(jobs, request)
    client, state = request.app.state.client, request.app.state
    if stream:
        return EventSourceResponse(stream_events(jobs, client, state.metrics), ping=15)
    return await collect(jobs, client, state.metrics, request)


async def stream_events(jobs: Sequence[Job], client: EngineClient, metrics: Metrics) -> AsyncIterator[dict[str, str]]:
    """SSE events: chunks (each of one choice, told apart by ``index``), an optional usage chunk
    once every choice has finished, then ``[DONE]``. An echoed prompt comes first, or, with its
    log-probabilities, with its choice's first output (the engine scores the prompt first)."""
    job0, n = jobs[0], jobs[0].n
    metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job in jobs))
    offsets = [len(job.echo_text) for job in jobs for _ in range(n)]
    tokens = [0] * len(offsets)
    cached = [0] * len(jobs)  # each prompt's tokens served from the prefix cache (the same on every output)
    finishes: list[FinishReason | None] = [None] * len(offsets)
    splits = [job0.choice_format.start() for _ in offsets] if job0.kind == "chat" else []
    try:
        for job in jobs:
            for index in range(n):
                if job.kind == "chat":
                    yield _event(chat_chunk(job, job.choice_format.role_delta(), None, None, index=index))
                elif job.echo_text and job.params.prompt_logprobs is None:
                    yield _event(chunk(job, job.echo_text, None, None, index=job.choice_index(index)))
        async for job, output in outputs(jobs, client):
            i = job.choice_index(output.index)
            if sum(tokens) == 0 and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            tokens[i], finishes[i] = output.num_output_tokens, output.finish_reason
            cached[job.prompt_index] = max(cached[job.prompt_index], output.num_cached_tokens)
            if output.error is not None:
                yield _event(error_body(500, output.error, code="generation_failed"))
                break
            if output.prompt_logprobs is not None and job.kind == "completion":
                echo, head = job.echoed(output.prompt_logprobs)
                offsets[i] = len(echo)
                yield _event(chunk(job, echo, None, completion_logprobs(head, 0) if job.params.logprobs else None,
                                   index=i))
            entries = shown_logprobs(job.kind, output.logprobs) if job.params.logprobs else []
            logprobs = None
            if entries:
                logprobs = chat_logprobs(entries) if job.kind == "chat" else completion_logprobs(entries, offsets[i])
            offsets[i] += len(output.text)
            finish = finish_name(output.finish_reason)
            if splits:
                split = splits[i]
                deltas = split.deltas(split.feed(output.text, output.finished,
                                                    output.finish_reason is FinishReason.LENGTH)) or \
                    ([{}] if logprobs or output.finished else [])
                finish = split.finish_name(output.finish_reason, finish)
                for k, delta in enumerate(deltas):  # logprobs with the first, the finish with the last
                    yield _event(chat_chunk(job, delta, finish if k == len(deltas) - 1 else None,
                                            logprobs if k == 0 else None, index=i))
            elif output.text or logprobs or output.finished:
                yield _event(chunk(job, output.text, finish, logprobs, index=i))
        else:
            if job0.include_usage:
                yield _event(usage_chunk(job0, sum(len(job.prompt_ids) for job in jobs), sum(tokens), sum(cached)))
        yield {"data": "[DONE]"}
    except RequestRejected as exc:  # only without a front-door admission (the routes always take one)
        metrics.rejected.labels(str(exc.status)).inc()
        yield _event(error_body(exc.status, exc.message, code=exc.code))
    finally:
        observe(job0, metrics, _overall(finishes), sum(tokens), sum(cached))


def _overall(finishes: list[FinishReason | None]) -> FinishReason | None:
    """A request's finish for the metrics: choice 0's once every choice has finished, else None
    (the client left first)."""
    return finishes[0] if all(f is not None for f in finishes) else None


def _event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def collect(jobs: Sequence[Job], client: EngineClient, metrics: Metrics, request: Request) -> dict[str, Any]:
    """The whole response, or nothing if the client left first (the request is then aborted)."""
    job0 = jobs[0]
    metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job in jobs))
    choices = [Collected() for _ in range(len(jobs) * job0.n)]

    async def run() -> None:
        first = True
        async for job, output in outputs(jobs, client):
            if first and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
                first = False
            choices[job.choice_index(output.index)].add(output)

    try:
        await until_disconnect(request, run())
    except RequestRejected as exc:
        metrics.rejected.labels(str(exc.status)).inc()
        raise APIError(exc.status, exc.message, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None) from exc
    finally:
        lasts = [c.last for c in choices if c.last is not None]
        cached = [max((c.last.num_cached_tokens for c in choices[k * job0.n:(k + 1) * job0.n] if c.last), default=0)
                  for k in range(len(jobs))]
        observe(job0, metrics, _overall([c.last.finish_reason if c.last else None for c in choices]),
                 sum(last.num_output_tokens for last in lasts), sum(cached))
    errors = [c.last.error for c in choices if c.last is not None and c.last.error is not None]
    if errors:
        raise APIError(500, errors[0], code="generation_failed")
    return full_response(jobs, choices)


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
