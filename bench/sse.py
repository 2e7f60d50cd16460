"""The data messages of an OpenAI-style SSE stream (shared by the HTTP benchmarks)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


async def sse_messages(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Each ``data:`` line's JSON, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
