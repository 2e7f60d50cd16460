"""The HTTP routes: OpenAI's chat and completions, models, the prefix cache, health and metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine import EngineClient, EngineNotReady, ModelInfo, attention_in_force
from server.errors import APIError, error_response
from server.limits import check_text_bound, prompt_text_chars
from server.prepare import chat_prompt_ids, check_model, check_unsupported, completion_prompts, sampling_params, \
    system_prompt_end
from server.chat_choices import choice_format
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import Job
from server.completions import completion_jobs
from server.streaming import respond
from server.structured import structured_params
from server.tools import force_calls, plan_tools

router = APIRouter()
_STARTED = int(time.time())
T = TypeVar("T")


async def _off_loop(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the app's prompt-building threads: a chat template or a tokenizer run on a
    long text never holds up the event loop (the tokenizer releases the GIL)."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.prepare, functools.partial(fn, *args))


def _check_bound(body: ChatCompletionRequest | CompletionRequest, info: ModelInfo) -> None:
    """The cheap length bound, before a prompt is rendered or tokenized."""
    check_text_bound(prompt_text_chars(body), info.context_length, info.max_token_chars,
                     "messages" if isinstance(body, ChatCompletionRequest) else "prompt")


def _ready(request: Request) -> tuple[EngineClient, ModelInfo]:
    client: EngineClient = request.app.state.client
    if client.load_error is not None:
        raise APIError(503, f"The model failed to load: {client.load_error}", code="model_load_failed")
    if not client.ready.is_set() or client.info is None:
        raise _loading()
    return client, client.info


def _loading() -> APIError:
    return APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                    headers={"Retry-After": "1"})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    client: EngineClient = request.app.state.client
    if client.load_error is not None:
        return error_response(503, f"The model failed to load: {client.load_error}", code="model_load_failed")
    if client.info is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    info = client.info
    return JSONResponse({"status": "ok", "model": info.model_id, "kv_cache": info.kv_cache,
                         "attention": attention_in_force(), **client.stats()})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    _, info = _ready(request)
    return {"object": "list", "data": [_model_card(info)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """One model (the SDK's ``models.retrieve``); ids may hold slashes (``org/name``)."""
    _, info = _ready(request)
    if model_id != info.model_id:
        raise APIError(404, f"The model '{model_id}' does not exist. This server serves '{info.model_id}'.",
                       param="model", code="model_not_found")
    return _model_card(info)


def _model_card(info: ModelInfo) -> dict[str, Any]:
    return {"id": info.model_id, "object": "model", "created": _STARTED, "owned_by": "kvarn",
            "context_length": info.context_length, "compute_dtype": info.compute_dtype,
            "fingerprint": info.fingerprint, "kv_cache": info.kv_cache, "attention": attention_in_force()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> JSONResponse:
    """The prefix cache's counters and sizes, as the engine reports them."""
    client, _ = _ready(request)
    try:
        return JSONResponse(await client.cache_stats())
    except EngineNotReady as exc:
        raise _loading() from exc


@router.post("/v1/cache/reset")
async def cache_reset(request: Request) -> JSONResponse:
    """Drop every cached block and snapshot, in memory and on disk; running requests go on."""
    client, _ = _ready(request)
    try:
        released = await client.reset_cache()
    except EngineNotReady as exc:
        raise _loading() from exc
    return JSONResponse({"object": "cache.reset", **released})


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    client, info = _ready(request)
    check_model(body, info)
    check_unsupported(body)
    tools = plan_tools(body, info)
    _check_bound(body, info)
    prompt_ids = await _off_loop(request, chat_prompt_ids, body, client, tools.tools)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, len(prompt_ids), info, default_max_tokens=None, logprobs=body.logprobs,
                             top_logprobs=body.top_logprobs or 0, max_tokens=max_tokens)
    params = await structured_params(body, client, params)
    if tools.forced:  # required / named: the grammar makes the calls
        params = await force_calls(client, info, tools, params)
    split = choice_format(client, prompt_ids, tools, request.app.state.config.reasoning_content)
    return await _respond(Job("chat", info.model_id, prompt_ids, params, _fingerprint(info),
                              include_usage=_include_usage(body), n=body.n, cache_salt=body.salt(),
                              snapshot_at=await _off_loop(request, system_prompt_end, body, prompt_ids, client,
                                                          tools.tools),
                              choice_format=split), body.stream, request)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    client, info = _ready(request)
    check_model(body, info)
    check_unsupported(body)
    _check_bound(body, info)
    prompts = await _off_loop(request, completion_prompts, body, info, client)
    jobs = await completion_jobs(body, client, info, prompts, _fingerprint(info))
    return await respond(jobs, body.stream, request)


async def _respond(job: Job, stream: bool, request: Request) -> Any:
    return await respond([job], stream, request)


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _fingerprint(info: ModelInfo) -> str:
    return "kvarn-" + str(info.kv_cache["stamp"])
