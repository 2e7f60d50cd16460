"""What every scenario shares: the client, the model, the run's sizes, and small helpers
(prompts, request bodies, bounded fan-out, /health and /metrics probes)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from e2e.client import Call, Hook, Outcome, get_json, send

logger = logging.getLogger(__name__)

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree "
          "near the river bank where small boats drift slowly past green fields and stone bridges").split()
PROMPT_WORDS = {"short": 6, "medium": 80, "long": 400}


@dataclass
class Context:
    client: httpx.AsyncClient
    model: str
    context_length: int
    api_key: str | None
    concurrency: int = 8
    requests: int = 24
    max_tokens: int = 32
    seed: int = 0
    idle_timeout: float = 30.0

    def rng(self, salt: str) -> random.Random:
        return random.Random(f"{self.seed}:{salt}")

    async def send(self, call: Call, before_abort: Hook | None = None) -> Outcome:
        return await send(self.client, call, self.model, before_abort)


def prompt_text(rng: random.Random, size: str) -> str:
    """A prompt of about ``PROMPT_WORDS[size]`` words."""
    return " ".join(rng.choice(_WORDS) for _ in range(PROMPT_WORDS[size]))


def chat_body(ctx: Context, text: str, max_tokens: int, stream: bool, usage: bool = True,
              **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ctx.model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "stream": stream, **extra}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def completion_body(ctx: Context, prompt: str | list[int], max_tokens: int, stream: bool, usage: bool = True,
                    **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ctx.model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                            **extra}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def run_calls(ctx: Context, calls: Sequence[Call], limit: int | None = None) -> list[Outcome]:
    """Send every call, at most ``limit`` at once (all at once when None); results in call order."""
    gate = asyncio.Semaphore(limit or max(1, len(calls)))

    async def one(call: Call) -> Outcome:
        async with gate:
            return await ctx.send(call)

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def health(ctx: Context) -> dict[str, Any]:
    status, body = await get_json(ctx.client, "/health")
    return body if status == 200 and isinstance(body, dict) else {"status_code": status, "body": body}


async def wait_idle(ctx: Context, timeout: float | None = None) -> tuple[bool, str]:
    """Poll /health until running == 0 and waiting == 0."""
    start = time.monotonic()
    deadline = start + (ctx.idle_timeout if timeout is None else timeout)
    last: dict[str, Any] = {}
    while True:
        try:
            last = await health(ctx)
        except httpx.TransportError as exc:
            last = {"error": f"{type(exc).__name__}: {exc}"}
        if last.get("running") == 0 and last.get("waiting") == 0:
            return True, f"idle after {time.monotonic() - start:.2f}s"
        if time.monotonic() >= deadline:
            return False, f"not idle after {time.monotonic() - start:.1f}s: {last}"
        await asyncio.sleep(0.1)


async def metric_total(ctx: Context, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the Prometheus samples ``name`` whose labels include ``labels`` (0 when none)."""
    response = await ctx.client.get("/metrics")
    total = 0.0
    for line in response.text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        found = dict(p.split("=", 1) for p in label_text.rstrip("}").split(",") if "=" in p)
        if all(found.get(k, "").strip('"') == v for k, v in (labels or {}).items()):
            total += float(value)
    return total
