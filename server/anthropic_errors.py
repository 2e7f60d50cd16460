"""Errors in Anthropic's shape for the Messages API routes (``/v1/messages``, ``/v1/messages/...``).

``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`` with Anthropic's
statuses: a refusal the rest of the server answers with 503 (the model still loading, an engine
that is full) is a 529 ``overloaded_error`` here, as Anthropic answers when it is overloaded; any
other 4xx keeps its status as an ``invalid_request_error``, any other 5xx is an ``api_error``.
The app's exception handlers, the security checks and the body limit all answer through here on
these paths, so a client of the Messages API never sees OpenAI's shape.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

MESSAGES_PATH = "/v1/messages"
OVERLOADED = 529
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   OVERLOADED: "overloaded_error"}
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_CHARS = 24


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages API's routes (or below them)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def new_id(prefix: str) -> str:
    """An id like Anthropic's: ``prefix`` and 24 letters or digits (``msg_``, ``toolu_``, ``req_``)."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_CHARS))


def anthropic_status(status: int) -> int:
    """The status Anthropic answers where the server would answer ``status`` (503 is 529)."""
    return OVERLOADED if status == 503 else status


def anthropic_error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an (already mapped) ``status``."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """The body of an error with the (already mapped) ``status``; ``message`` must be encodable."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message},
            "request_id": new_id("req_")}
