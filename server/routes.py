"""The HTTP routes: OpenAI's legacy completions, models, the prefix cache, health and metrics (and
``/``, which names the server). Chat completions has its own router (server/chat.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine import EngineClient, EngineNotReady, ModelInfo, attention_in_force
from server.chat import check_bound, check_model, check_unsupported, completion_prompts, fingerprint, loading, \
    off_loop, ready
from server.completions import completion_jobs
from server.errors import APIError, error_response
from server.protocol import CompletionRequest
from server.streaming import respond

router = APIRouter()
_STARTED = int(time.time())


@router.get("/")
@router.head("/")
async def root(request: Request) -> JSONResponse:
    """What this server is (clients such as Claude Code probe ``HEAD /`` before their first request)."""
    return JSONResponse({"name": "kvarn", "version": request.app.version})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    client: EngineClient = request.app.state.client
    if client.load_error is not None:
        return error_response(503, f"The model failed to load: {client.load_error}", code="model_load_failed")
    if client.info is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    if client.draining:  # shutting down: routers stop sending here (server/app.py: DrainingServer)
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
    info = client.info
    return JSONResponse({"status": "ok", "model": info.model_id, "kv_cache": info.kv_cache,
                         "attention": attention_in_force(), "speculative": _speculative(info, client.stats()),
                         **client.stats()})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    _, info = ready(request)
    return {"object": "list", "data": [_model_card(info)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """One model (the SDK's ``models.retrieve``); ids may hold slashes (``org/name``)."""
    _, info = ready(request)
    if model_id != info.model_id:
        raise APIError(404, f"The model '{model_id}' does not exist. This server serves '{info.model_id}'.",
                       param="model", code="model_not_found")
    return _model_card(info)


def _model_card(info: ModelInfo) -> dict[str, Any]:
    return {"id": info.model_id, "object": "model", "created": _STARTED, "owned_by": "kvarn",
            "context_length": info.context_length, "compute_dtype": info.compute_dtype,
            "fingerprint": info.fingerprint, "kv_cache": info.kv_cache, "attention": attention_in_force(),
            "speculative": info.speculative}


def _speculative(info: ModelInfo, stats: dict[str, Any]) -> dict[str, Any] | None:
    """Speculative decoding in force, with its acceptance so far (None: off)."""
    if info.speculative is None:
        return None
    drafted, accepted = stats.get("spec_draft_tokens", 0), stats.get("spec_accepted_tokens", 0)
    return {**info.speculative, "draft_tokens": drafted, "accepted_tokens": accepted,
            "verifies": stats.get("spec_verifies", 0),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> JSONResponse:
    """The prefix cache's counters and sizes, as the engine reports them."""
    client, _ = ready(request)
    try:
        return JSONResponse(await client.cache_stats())
    except EngineNotReady as exc:
        raise loading() from exc


@router.post("/v1/cache/reset")
async def cache_reset(request: Request) -> JSONResponse:
    """Drop every cached block and snapshot, in memory and on disk; running requests go on."""
    client, _ = ready(request)
    try:
        released = await client.reset_cache()
    except EngineNotReady as exc:
        raise loading() from exc
    return JSONResponse({"object": "cache.reset", **released})


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    client, info = ready(request)
    check_model(body, info)
    check_unsupported(body)
    check_bound(body, info)
    prompts = await off_loop(request, completion_prompts, body, info, client)
    jobs = await completion_jobs(body, client, info, prompts, fingerprint(info))
    return await respond(jobs, body.stream, request)
