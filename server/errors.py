"""Errors in OpenAI's shape, mapped once for the whole app: ``{"error": {message, type, param, code}}``.

No handler ever returns a traceback; unexpected exceptions are logged and answered with a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.anthropic_errors import anthropic_error_body, anthropic_status, is_messages_path

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
}


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class ClientDisconnected(APIError):
    """The client went away before its response was ready. Its request is already aborted; the
    reply (499, as nginx logs it) goes nowhere, but ends the request without an error in the log."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the connection before the response was ready.",
                         code="client_disconnected")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    """The error as JSON: in Anthropic's shape and statuses when ``path`` is a Messages API route."""
    if path is not None and is_messages_path(path):
        status = anthropic_status(status)
        return JSONResponse(anthropic_error_body(status, _text(message) or ""), status_code=status, headers=headers)
    return JSONResponse(error_body(status, _text(message), _text(param), code), status_code=status, headers=headers)


def _text(value: str | None) -> str | None:
    """``value`` made encodable as UTF-8: an error that echoes what a client sent must never fail
    to encode (a lone surrogate is written as its escape)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8") if value is not None else None


_FASTAPI_BODY_ERROR = "There was an error parsing the body"
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _param_path(loc: tuple[int | str, ...], kind: str) -> list[str]:
    """The parameter an error is about: pydantic's location without the leading ``body`` and
    without the union member names pydantic inserts (``prompt.list[int]`` is ``prompt``). The
    last part of an unknown-field error is the client's own key, kept as sent."""
    parts = list(loc[1:] if loc[:1] == ("body",) else loc)
    last = [str(parts.pop())] if kind == "extra_forbidden" and parts else []
    return [str(p) for p in parts if isinstance(p, int) or (p not in _UNION_MEMBER_TAGS and "[" not in p)] + last


def _describe_validation(exc: RequestValidationError, deepest: bool = False) -> tuple[str, str | None]:
    """The message and parameter of the first error (``deepest``: of the one deepest in the body,
    which for a value that matched no member of a union is the member the client meant)."""
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = max(errors, key=lambda error: len(error.get("loc", ()))) if deepest else errors[0]
    kind = first.get("type", "")
    loc = _param_path(tuple(first.get("loc", ())), kind)
    param = ".".join(loc) or None
    if kind == "json_invalid":
        return "Invalid JSON body: the request body could not be parsed as JSON.", None
    if kind in ("missing", "model_type", "model_attributes_type", "dict_type") and not loc:  # no body or no object
        return "The request body must be a JSON object.", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "invalid_unicode":  # the body's own check (server/protocol.py: checked_body) names the field itself
        return str(first.get("msg", "invalid text")), (first.get("ctx") or {}).get("param")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"Invalid value for '{param}': {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, (bytes, bytearray)):  # a body FastAPI did not read as JSON: its content type
            kind = request.headers.get("content-type")
            given = f"Unsupported Content-Type {kind[:100]!r}" if kind else "No Content-Type"
            return error_response(415, f"{given}: this route takes a JSON body; send it with 'Content-Type: "
                                       "application/json'.", code="unsupported_media_type", path=request.url.path)
        message, param = _describe_validation(exc, deepest=is_messages_path(request.url.path))
        return error_response(400, message, param, "invalid_value" if param else "invalid_request",
                              path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "Not found: no such route."
        if exc.status_code == 400 and message == _FASTAPI_BODY_ERROR:  # json.loads raised, but not a decode error
            return error_response(400, "Invalid JSON body: the request body could not be parsed as JSON (nested too "
                                       "deeply, a number too long, or not UTF-8).", code="invalid_request",
                                  path=request.url.path)
        return error_response(exc.status_code, message, code=getattr(exc, "code", None),
                              headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", code="internal_error",
                              path=request.url.path)
