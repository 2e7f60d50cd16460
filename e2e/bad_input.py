"""The bad_input scenario: malformed requests must each get their 4xx in OpenAI's error shape,
and the server must serve a normal request afterwards."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from e2e import checks
from e2e.client import Call, Outcome
from e2e.context import Context, chat_body
from e2e.report import ScenarioReport

logger = logging.getLogger(__name__)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class BadCase:
    """One malformed request: ``body`` is sent as JSON, ``raw`` as bytes; ``auth`` replaces the
    Authorization header (``""`` drops it; None keeps the client's)."""

    name: str
    status: int
    body: Any = None
    raw: bytes | None = None
    path: str = CHAT
    method: str = "POST"
    content_type: str = "application/json"
    auth: str | None = None


def _chat(ctx: Context, **fields: Any) -> dict[str, Any]:
    return {"model": ctx.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def _completion(ctx: Context, **fields: Any) -> dict[str, Any]:
    return {"model": ctx.model, "prompt": "Hi", "max_tokens": 4, **fields}


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def body_cases(ctx: Context) -> list[BadCase]:
    """Request bodies the API must refuse."""
    c, p = _chat(ctx), _completion(ctx)
    return [
        BadCase("invalid JSON", 400, raw=b'{"model": '),
        BadCase("empty body", 400, raw=b""),
        BadCase("JSON array body", 400, raw=b"[1, 2]"),
        BadCase("JSON sent as text/plain", 415, raw=json.dumps(c).encode(), content_type="text/plain"),
        BadCase("missing model", 400, _without(c, "model")),
        BadCase("missing messages", 400, _without(c, "messages")),
        BadCase("empty messages", 400, {**c, "messages": []}),
        BadCase("messages not a list", 400, {**c, "messages": "Hi"}),
        BadCase("unknown role", 400, {**c, "messages": [{"role": "wizard", "content": "Hi"}]}),
        BadCase("image content part", 400, {**c, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        BadCase("unknown field", 400, {**c, "frobnicate": True}),
        BadCase("unknown model", 404, {**c, "model": ctx.model + "-nope"}),
        BadCase("temperature 3", 400, {**c, "temperature": 3}),
        BadCase("top_p 0", 400, {**c, "top_p": 0}),
        BadCase("presence_penalty 5", 400, {**c, "presence_penalty": 5}),
        BadCase("max_tokens 0", 400, {**c, "max_tokens": 0}),
        BadCase("max_tokens a string", 400, {**c, "max_tokens": "many"}),
        BadCase("max_tokens over the context", 400, {**c, "max_tokens": ctx.context_length + 1}),
        BadCase("n 17 (above 16)", 400, {**c, "n": 17}),
        BadCase("stream_options without stream", 400, {**c, "stream_options": {"include_usage": True}}),
        BadCase("streamed with temperature 5", 400, {**c, "stream": True, "temperature": 5}),
        BadCase("empty stop string", 400, {**c, "stop": [""]}),
        BadCase("17 stop strings", 400, {**c, "stop": [f"s{i}" for i in range(17)]}),
        BadCase("logit_bias key not a token id", 400, {**c, "logit_bias": {"hello": 1}}),
        BadCase("top_logprobs without logprobs", 400, {**c, "top_logprobs": 2}),
        BadCase("completion: missing prompt", 400, _without(p, "prompt"), path=COMPLETIONS),
        BadCase("completion: empty prompt", 400, {**p, "prompt": ""}, path=COMPLETIONS),
        BadCase("completion: negative token id", 400, {**p, "prompt": [-1]}, path=COMPLETIONS),
        BadCase("completion: token id past the vocabulary", 400, {**p, "prompt": [10 ** 9]}, path=COMPLETIONS),
        BadCase("completion: 257 prompts", 400, {**p, "prompt": ["a"] * 257}, path=COMPLETIONS),
        BadCase("completion: prompt over the context", 400, {**p, "prompt": [100] * (ctx.context_length + 1)},
                path=COMPLETIONS),
        BadCase("completion: best_of 2", 400, {**p, "best_of": 2}, path=COMPLETIONS),
        BadCase("completion: suffix", 400, {**p, "suffix": "end"}, path=COMPLETIONS),
        BadCase("completion: logprobs 21", 400, {**p, "logprobs": 21}, path=COMPLETIONS),
        BadCase("completion: messages field", 400, {**p, "messages": [{"role": "user", "content": "Hi"}]},
                path=COMPLETIONS),
    ]


def route_cases(ctx: Context) -> list[BadCase]:
    """Wrong routes and methods, and (when the run has an API key) wrong or missing keys."""
    cases = [BadCase("unknown route", 404, _chat(ctx), path="/v1/chat/completion"),
             BadCase("GET on chat completions", 405, method="GET"),
             BadCase("POST on models", 405, {}, path="/v1/models")]
    if ctx.api_key:
        cases += [BadCase("wrong API key", 401, _chat(ctx), auth="Bearer wrong-" + ctx.api_key),
                  BadCase("missing API key", 401, _chat(ctx), auth=""),
                  BadCase("API key without Bearer", 401, _chat(ctx), auth=ctx.api_key)]
    return cases


def _request(ctx: Context, case: BadCase) -> httpx.Request:
    content = case.raw if case.raw is not None else (None if case.body is None else json.dumps(case.body).encode())
    headers = {"content-type": case.content_type} if content is not None else {}
    request = ctx.client.build_request(case.method, case.path, content=content, headers=headers)
    if case.auth is not None:
        request.headers.pop("authorization", None)
        if case.auth:
            request.headers["authorization"] = case.auth
    return request


async def send_bad(ctx: Context, case: BadCase) -> Outcome:
    outcome = Outcome(f"bad: {case.name}")
    start = time.monotonic()
    try:
        response = await ctx.client.send(_request(ctx, case))
    except httpx.TransportError as exc:
        outcome.dropped = True
        return outcome.fail(f"dropped connection: {type(exc).__name__}: {exc}")
    outcome.latency, outcome.status = time.monotonic() - start, response.status_code
    if response.status_code != case.status:
        outcome.fail(f"status {response.status_code}, expected {case.status}: {response.text[:160]}")
    try:
        payload = response.json()
    except ValueError:
        payload = response.text[:160]
    outcome.reasons += checks.error_shape(response.status_code, payload)
    return outcome


async def bad_input(ctx: Context, report: ScenarioReport) -> None:
    for case in body_cases(ctx) + route_cases(ctx):
        report.outcomes.append(await send_bad(ctx, case))
    good = await ctx.send(Call("normal request afterwards", "chat", chat_body(ctx, "Hello", 8, True)))
    report.outcomes.append(good)
    report.check("a normal request succeeds afterwards", good.ok, "; ".join(good.reasons) or "ok")
