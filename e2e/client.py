"""One request to the server, streamed over SSE or not, timed and checked: ``Call`` in, ``Outcome`` out.

A transport error or a stream cut before ``[DONE]`` is a *dropped* connection; a stream the
client itself leaves after ``abort_after`` text chunks is *aborted* on purpose and is not a failure.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from e2e import checks

logger = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(frozen=True)
class Call:
    """What to send: ``endpoint`` is "chat" or "completion"; ``abort_after`` (streams only) is how
    many text chunks to read before disconnecting."""

    label: str
    endpoint: str
    body: dict[str, Any]
    abort_after: int | None = None

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


@dataclass
class Outcome:
    """What came back, and whether it was right."""

    label: str
    reasons: list[str] = field(default_factory=list)
    status: int | None = None
    dropped: bool = False
    aborted: bool = False
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a plain chat answer's logprobs.content

    @property
    def ok(self) -> bool:
        return not self.reasons

    def fail(self, reason: str) -> Outcome:
        self.reasons.append(reason)
        return self

    def take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]


def make_client(base_url: str, api_key: str | None, timeout: float, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout, pool=timeout))


async def send(client: httpx.AsyncClient, call: Call, model: str, before_abort: Hook | None = None) -> Outcome:
    """Send ``call``; never raises for a server or transport fault (those land in the outcome).
    ``before_abort`` is awaited just before an aborting stream disconnects."""
    outcome = Outcome(call.label)
    start = time.monotonic()
    try:
        if call.streamed:
            await _send_stream(client, call, model, outcome, start, before_abort)
        else:
            await _send_plain(client, call, model, outcome)
    except httpx.TimeoutException as exc:
        outcome.fail(f"timed out after {time.monotonic() - start:.1f}s ({type(exc).__name__})")
    except httpx.TransportError as exc:
        outcome.dropped = True
        outcome.fail(f"dropped connection: {type(exc).__name__}: {exc}")
    outcome.latency = time.monotonic() - start
    if not outcome.ok:
        logger.warning("%s failed: %s", call.label, "; ".join(outcome.reasons))
    return outcome


async def _send_plain(client: httpx.AsyncClient, call: Call, model: str, outcome: Outcome) -> None:
    response = await client.post(PATHS[call.endpoint], json=call.body)
    outcome.status = response.status_code
    if response.status_code != 200:
        outcome.fail(f"status {response.status_code}: {response.text[:200]}")
        return
    try:
        payload = response.json()
    except ValueError:
        outcome.fail(f"body is not JSON: {response.text[:200]}")
        return
    reasons, outcome.text, outcome.finish_reason = checks.full(call.endpoint, payload, model,
                                                               call.body.get("max_tokens"))
    outcome.reasons += reasons
    outcome.take_usage(payload.get("usage") if isinstance(payload, dict) else None)
    try:
        outcome.logprobs = list(payload["choices"][0]["logprobs"]["content"] or [])
    except (KeyError, IndexError, TypeError):
        pass


async def _send_stream(client: httpx.AsyncClient, call: Call, model: str, outcome: Outcome, start: float,
                       before_abort: Hook | None) -> None:
    async with client.stream("POST", PATHS[call.endpoint], json=call.body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            outcome.fail(f"status {response.status_code}: {response.text[:200]}")
            return
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            outcome.fail(f"content-type {response.headers.get('content-type')!r} is not text/event-stream")
        lines = response.aiter_lines()  # held here: a dropped line iterator closes the connection early
        events, done = await _read_events(lines, call, outcome, start)
        if outcome.aborted and before_abort is not None:
            await before_abort()
    if outcome.aborted:
        outcome.reasons += [f"chunk {i} before the abort is an error or not an object: {str(e)[:160]}"
                            for i, e in enumerate(events) if not isinstance(e, dict) or "error" in e]
        return
    if not done:
        outcome.dropped = True
    reasons, outcome.text, outcome.finish_reason, usage = checks.stream(
        call.endpoint, events, done, model, call.body.get("max_tokens"), call.include_usage)
    outcome.reasons += reasons
    outcome.take_usage(usage)
    if not call.include_usage:
        outcome.completion_tokens = _text_chunks(call.endpoint, events)


async def _read_events(lines: AsyncIterator[str], call: Call, outcome: Outcome,
                       start: float) -> tuple[list[Any], bool]:
    """Parse ``data:`` lines to the end (anything after ``[DONE]`` lands in ``events`` as a string,
    which the checks refuse), or until ``abort_after`` text chunks were read."""
    events: list[Any] = []
    pieces, done = 0, False
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators and ': ping' comments
        data = line[5:].strip()
        if done or data == "[DONE]":
            events += [f"data after [DONE]: {data[:80]}"] if done else []
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            events.append(data)
        if _text_chunks(call.endpoint, events[-1:]):
            pieces += 1
            if outcome.ttft is None:
                outcome.ttft = time.monotonic() - start
            if call.abort_after is not None and pieces >= call.abort_after:
                outcome.aborted = True
                outcome.completion_tokens = pieces
                return events, False
    return events, done


def _text_chunks(endpoint: str, events: list[Any]) -> int:
    count = 0
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
            count += bool(text)
    return count


async def get_json(client: httpx.AsyncClient, path: str) -> tuple[int, Any]:
    response = await client.get(path)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text
