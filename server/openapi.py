"""The OpenAPI document (``/openapi.json``, ``/docs``), made to say what the server does.

FastAPI's own document says 422 for validation errors (the server answers 400, in OpenAI's
shape), lists no other error status and has empty response schemas for routes that build their
bodies by hand. ``install_openapi`` replaces it with one that has, per route: the response
models below (documentation only: the routes keep building their bodies), every error status
the route can answer with the error shape as its schema (Anthropic's, with its 529 for 503, on the
Messages API's routes), ``text/event-stream`` beside JSON for the streaming routes and
``text/plain`` for ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, RootModel
from pydantic.json_schema import models_json_schema

from server.anthropic_errors import is_messages_path


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # the document lists what is always there; more may come


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error of every route: OpenAI's error shape."""

    error: ErrorDetail


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    context_length: int
    kv_cache: dict[str, Any]


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(_Open):
    role: str
    content: str | None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Health(_Open):
    """``ok`` once the model is loaded (with the engine's counters), else ``loading``."""

    status: str


class CacheReset(_Open):
    object: str


class ResponseObject(_Open):
    """OpenAI's ``response``: ``status`` completed, incomplete (``incomplete_details``) or failed;
    ``output`` items are reasoning, message and function_call items, in the model's order."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseDeleted(_Open):
    id: str
    object: str
    deleted: bool


class ResponseItemList(_Open):
    """A page of a stored response's input items (``after``, ``limit``, ``order``)."""

    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages API's routes: Anthropic's error shape."""

    type: str
    error: AnthropicErrorDetail
    request_id: str


class AnthropicUsage(_Open):
    input_tokens: int  # prompt tokens not read from the prefix cache
    cache_creation_input_tokens: int
    cache_read_input_tokens: int  # prompt tokens read from the prefix cache
    output_tokens: int


class AnthropicMessage(_Open):
    """``POST /v1/messages``: content blocks ``thinking``, ``text`` and ``tool_use``."""

    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int


class Tokenized(BaseModel):
    """``POST /tokenize`` (vLLM's): the ids the chat or completions route would run."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(BaseModel):
    prompt: str


class RenderedRequest(_Open):
    """vLLM's ``GenerateRequest``: a request rendered to token ids and sampling parameters, not run."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    model: str | None
    stream: bool
    cache_salt: str | None


class RenderedRequests(RootModel[list[RenderedRequest]]):
    """``POST /v1/completions/render``: one rendered request per prompt."""


_MODELS = (ErrorResponse, ModelList, ModelCard, ChatCompletion, Completion, Health, CacheReset, ResponseObject,
           ResponseDeleted, ResponseItemList, AnthropicErrorResponse, AnthropicMessage, TokenCount, Tokenized,
           Detokenized, RenderedRequest, RenderedRequests)
_WHY = {400: "Invalid request (validation errors included)", 401: "Missing or wrong API key (with --api-key)",
        403: "Host or Origin not allowed", 404: "No such model, or no such stored response", 413: "Request body over --max-request-bytes",
        415: "The body is not JSON (Content-Type)", 429: "The waiting queue is full (Retry-After)",
        500: "Generation failed inside the engine", 503: "The model is loading or failed to load",
        529: "Overloaded: the model is loading or the engine is full (Anthropic's 503)"}
_KEYED = (401,)
_ANY = (403, 413)
_GENERATE = (400, 404, 415, 429, 500, 503)
# OpenAPI before 3.2 (no itemSchema) has a text/event-stream `schema` describe one event, as tools read it
_STREAM = {"type": "object", "required": ["data"],
           "description": "One server-sent event: `data` is a chunk's JSON; the last event's is `[DONE]`",
           "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                          "retry": {"type": "integer"}}}
# the Responses API's stream: named events (`event` is the payload's `type`), no [DONE]
_RESPONSE_STREAM = {"type": "object", "required": ["event", "data"],
                    "description": "One server-sent event: `event` is its type (response.created, "
                                   "response.output_text.delta, ..., response.completed / response.incomplete / "
                                   "response.failed, error) and `data` its JSON, with `type` and `sequence_number`",
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
# the Messages API's stream: named events (`event` is the payload's `type`), no [DONE]
_MESSAGE_STREAM = {"type": "object", "required": ["event", "data"],
                   "description": "One server-sent event: `event` is its type (message_start, content_block_start, "
                                  "content_block_delta, content_block_stop, message_delta, message_stop, ping, "
                                  "error) and `data` its JSON, whose `type` is the same",
                   "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
_ANTHROPIC_GENERATE = (400, 404, 415, 429, 500, 529)
# path -> method -> (200's model name or None, extra media types of the 200, error statuses)
_ROUTES: dict[str, dict[str, tuple[str | None, dict[str, Any], tuple[int, ...]]]] = {
    "/v1/chat/completions": {"post": ("ChatCompletion", {"text/event-stream": {"schema": _STREAM}},
                                      _KEYED + _ANY + _GENERATE)},
    "/v1/completions": {"post": ("Completion", {"text/event-stream": {"schema": _STREAM}}, _KEYED + _ANY + _GENERATE)},
    "/v1/models": {"get": ("ModelList", {}, _KEYED + _ANY + (503,))},
    "/v1/models/{model_id}": {"get": ("ModelCard", {}, _KEYED + _ANY + (404, 503))},
    "/v1/cache/stats": {"get": (None, {}, _KEYED + _ANY + (503,))},
    "/v1/cache/reset": {"post": ("CacheReset", {}, _KEYED + _ANY + (503,))},
    "/health": {"get": ("Health", {}, _ANY)},
    "/v1/responses": {"post": ("ResponseObject", {"text/event-stream": {"schema": _RESPONSE_STREAM}},
                               _KEYED + _ANY + _GENERATE)},
    "/v1/responses/{response_id}": {"get": ("ResponseObject", {}, _KEYED + _ANY + (404,)),
                                    "delete": ("ResponseDeleted", {}, _KEYED + _ANY + (404,))},
    "/v1/responses/{response_id}/input_items": {"get": ("ResponseItemList", {}, _KEYED + _ANY + (400, 404))},
    "/v1/messages": {"post": ("AnthropicMessage", {"text/event-stream": {"schema": _MESSAGE_STREAM}},
                              _KEYED + _ANY + _ANTHROPIC_GENERATE)},
    "/v1/messages/count_tokens": {"post": ("TokenCount", {}, _KEYED + _ANY + (400, 404, 415, 529))},
    "/tokenize": {"post": ("Tokenized", {}, _KEYED + _ANY + (400, 404, 415, 503))},
    "/detokenize": {"post": ("Detokenized", {}, _KEYED + _ANY + (400, 404, 415, 503))},
    "/v1/chat/completions/render": {"post": ("RenderedRequest", {}, _KEYED + _ANY + (400, 404, 415, 503))},
    "/v1/completions/render": {"post": ("RenderedRequests", {}, _KEYED + _ANY + (400, 404, 415, 503))},
}


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, defs = models_json_schema([(m, "serialization") for m in _MODELS], ref_template="#/components/schemas/{model}")
    components.update(defs.get("$defs", {}))
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            model, extra, errors = _ROUTES.get(path, {}).get(method, (None, {}, _ANY))
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if model is not None:
                ok["content"] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}, **extra}
            elif path == "/metrics":
                ok["content"] = {"text/plain": {"schema": {"type": "string"},
                                                "example": "# HELP kvarn_requests_total ..."}}
            elif "content" in ok and ok["content"].get("application/json", {}).get("schema") == {}:
                ok["content"]["application/json"]["schema"] = {"type": "object"}
            error_model = "AnthropicErrorResponse" if is_messages_path(path) else "ErrorResponse"
            for status in sorted((*errors, 503) if path == "/health" else errors):
                responses[str(status)] = {"description": _WHY[status], "content": {
                    "application/json": {"schema": _health_503() if path == "/health" and status == 503
                                         else {"$ref": f"#/components/schemas/{error_model}"}}}}
    return schema


def _health_503() -> dict[str, Any]:
    """``/health``'s 503: ``{"status": "loading"}`` while the model loads, an error after a failed load."""
    return {"anyOf": [{"$ref": "#/components/schemas/Health"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
