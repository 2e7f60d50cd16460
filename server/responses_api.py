"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A request runs as the one chat request (``server/chat.py``): its items become chat messages
(``server/responses_input.py``), ``prepare_chat`` checks and renders them, ``admit`` takes it in,
and ``chat_steps`` feeds a ``ResponseRun`` (``server/responses_stream.py``) that makes the
stream's events and the response object. With ``store`` (the default) the response and its
conversation go to the ``ResponseStore`` (``--responses-store-bytes``, ``--responses-store-dir``),
so ``previous_response_id`` continues it: the earlier turns render as before and the prefix
cache serves them.

``truncation: "auto"``: a conversation too long for the context loses its oldest turns (each up
to the next user message), never the instructions or the newest user turn, until it fits; the
stored conversation is the one the model saw.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from engine import RequestRejected
from server.chat import chat_steps, off_loop, prepare_chat, ready
from server.errors import APIError
from server.response_store import ResponseStore, is_response_id
from server.responses_input import ITEMS, chat_messages, chat_request, namespaces, new_id, normalize, responses_error
from server.responses_protocol import ResponsesRequest, refuse_unsupported
from server.responses_stream import Event, ResponseRun, response_skeleton
from server.streaming import Job, admit, until_disconnect

router = APIRouter()
Item = dict[str, Any]


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use from its config (a store directory is read then)."""
    state = request.app.state
    if getattr(state, "responses_store", None) is None:
        state.responses_store = ResponseStore(state.config.responses_store_bytes, state.config.responses_store_dir)
    return state.responses_store


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    refuse_unsupported(body)
    store = response_store(request)
    conversation = _history(store, body.previous_response_id) + normalize(body)
    job, conversation = await _prepare(body, conversation, request)
    await admit([job], request)
    run = ResponseRun(response_skeleton(body, new_id("resp"), job.model), body.wants_logprobs(), namespaces(body))

    def keep(response: dict[str, Any]) -> None:
        if body.store and response["status"] != "in_progress":
            store.put(response["id"], {"response": response, "input": conversation})

    if body.stream:
        return EventSourceResponse(_events(run, job, request, keep), ping=15)
    await until_disconnect(request, _collect(run, job, request))
    if run.response["status"] == "failed":
        raise APIError(500, run.response["error"]["message"], code="generation_failed")
    keep(run.response)
    return run.response


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> Any:
    return _stored(response_store(request), response_id)["response"]


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Any:
    if not (is_response_id(response_id) and response_store(request).delete(response_id)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc") -> Any:
    """The stored response's input as the model saw it (earlier turns included), a page at a time."""
    items: list[Item] = list(_stored(response_store(request), response_id)["input"])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"Invalid value for 'after': no input item '{after}' in this response.",
                           param="after", code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def _stored(store: ResponseStore, response_id: str) -> dict[str, Any]:
    record = store.get(response_id) if is_response_id(response_id) else None
    if record is None or not isinstance(record.get("input"), list):
        raise _not_found(response_id)
    return record


def _history(store: ResponseStore, response_id: str | None) -> list[Item]:
    """The conversation a stored response ended: its input and its output items."""
    if response_id is None:
        return []
    record = store.get(response_id) if is_response_id(response_id) else None
    items = [*record.get("input", ()), *record["response"].get("output", ())] if record is not None else None
    try:
        ITEMS.validate_python(items)
    except ValidationError:
        items = None  # no record, or one this server cannot read back
    if items is None:
        raise APIError(404, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return items


async def _prepare(body: ResponsesRequest, conversation: list[Item], request: Request) -> tuple[Job, list[Item]]:
    """The chat job of ``conversation``, shortened from the front under ``truncation: "auto"``."""
    current_turn = body.reasoning is not None and body.reasoning.context == "current_turn"
    while True:
        chat = chat_request(body, chat_messages(conversation, body.instructions, current_turn))
        try:
            return await prepare_chat(chat, request), conversation
        except APIError as exc:
            shorter = _without_oldest_turn(conversation) if body.truncation == "auto" and \
                exc.code == "context_length_exceeded" else None
            if shorter is None:
                raise responses_error(exc) from None
            conversation = shorter


def _without_oldest_turn(items: list[Item]) -> list[Item] | None:
    """``items`` from their second user message on (None: only one user turn is left)."""
    users = [i for i, item in enumerate(items) if item.get("type") == "message" and item.get("role") == "user"]
    later = [i for i in users if i > 0]
    return items[later[0]:] if later else None


async def _reasoning_tokens(run: ResponseRun, request: Request) -> int:
    if not run.reasoning_text:
        return 0
    client, _ = ready(request)
    return len(await off_loop(request, client.encode, run.reasoning_text))


async def _steps(run: ResponseRun, job: Job, request: Request) -> AsyncIterator[list[Event]]:
    """The run's events, a batch per chat step, ending with the response's last event; a failure
    of the engine ends the run as failed."""
    yield run.start()
    try:
        async for step in chat_steps(job, request):
            events = run.feed(step)
            if step.finished:
                events += run.finish(step, await _reasoning_tokens(run, request))
            yield events
    except (APIError, RequestRejected) as exc:  # GenerationFailed, or a refusal inside the engine
        yield run.fail(exc.code, exc.message)


async def _collect(run: ResponseRun, job: Job, request: Request) -> None:
    async for _ in _steps(run, job, request):
        pass


async def _events(run: ResponseRun, job: Job, request: Request,
                  keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[dict[str, str]]:
    async for events in _steps(run, job, request):
        for event in events:
            yield {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
    keep(run.response)
