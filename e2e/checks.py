"""Shape checks of OpenAI responses: each function returns a list of reasons (empty when all is well)."""

from __future__ import annotations

from typing import Any

FINISH_OK = ("stop", "length")
_OBJECTS = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
            ("completion", False): "text_completion", ("completion", True): "text_completion"}


def error_shape(status: int, body: Any) -> list[str]:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on a 4xx."""
    reasons = [] if 400 <= status < 500 else [f"status {status} is not a 4xx"]
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return reasons + [f"body is not an error object: {str(body)[:120]}"]
    missing = [k for k in ("message", "type", "param", "code") if k not in error]
    if missing:
        reasons.append(f"error object lacks {missing}")
    if not isinstance(error.get("message"), str) or not error.get("message"):
        reasons.append("error.message is not a non-empty string")
    if not isinstance(error.get("type"), str):
        reasons.append("error.type is not a string")
    for key in ("param", "code"):
        if key in error and error[key] is not None and not isinstance(error[key], str):
            reasons.append(f"error.{key} is neither a string nor null")
    return reasons


def usage(value: Any, max_tokens: int | None, finish: str | None) -> list[str]:
    """prompt + completion == total, completion within max_tokens, and 'length' means it was reached."""
    if not isinstance(value, dict):
        return ["usage missing"]
    p, c, t = (value.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if not all(isinstance(x, int) for x in (p, c, t)):
        return [f"usage fields are not integers: {value}"]
    reasons = []
    if p + c != t:
        reasons.append(f"usage total {t} != prompt {p} + completion {c}")
    if p < 1 or c < 0:
        reasons.append(f"usage counts out of range: prompt {p}, completion {c}")
    if max_tokens is not None and c > max_tokens:
        reasons.append(f"completion_tokens {c} > max_tokens {max_tokens}")
    if finish == "length" and max_tokens is not None and c != max_tokens:
        reasons.append(f"finish_reason 'length' with {c} of max_tokens {max_tokens} tokens")
    details = value.get("prompt_tokens_details")
    if details is not None:
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(cached, int) or not 0 <= cached < max(p, 1):
            reasons.append(f"prompt_tokens_details.cached_tokens {cached!r} is not in [0, prompt_tokens {p})")
    return reasons


def _header(endpoint: str, streamed: bool, payload: dict[str, Any], model: str) -> list[str]:
    reasons = []
    if payload.get("object") != _OBJECTS[(endpoint, streamed)]:
        reasons.append(f"object {payload.get('object')!r} != {_OBJECTS[(endpoint, streamed)]!r}")
    if payload.get("model") != model:
        reasons.append(f"model {payload.get('model')!r} != {model!r}")
    if not isinstance(payload.get("id"), str) or not payload.get("id"):
        reasons.append("id missing")
    return reasons


def full(endpoint: str, payload: Any, model: str, max_tokens: int | None) -> tuple[list[str], str, str | None]:
    """A non-streamed body: (reasons, text, finish_reason)."""
    if not isinstance(payload, dict):
        return [f"body is not a JSON object: {str(payload)[:120]}"], "", None
    reasons = _header(endpoint, False, payload, model)
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return reasons + [f"expected one choice, got {str(choices)[:120]}"], "", None
    choice = choices[0]
    if endpoint == "chat":
        message = choice.get("message") or {}
        text = message.get("content")
        if message.get("role") != "assistant":
            reasons.append(f"message.role {message.get('role')!r} != 'assistant'")
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        reasons.append("choice has no text")
        text = ""
    finish = choice.get("finish_reason")
    if finish not in FINISH_OK:
        reasons.append(f"finish_reason {finish!r} not in {FINISH_OK}")
    return reasons + usage(payload.get("usage"), max_tokens, finish), text, finish


def _chunk_text(endpoint: str, choice: dict[str, Any]) -> str:
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def stream(endpoint: str, events: list[Any], done: bool, model: str, max_tokens: int | None,
           include_usage: bool) -> tuple[list[str], str, str | None, dict[str, Any] | None]:
    """A whole SSE stream (JSON chunks, then ``[DONE]``): (reasons, text, finish_reason, usage)."""
    reasons = [] if done else ["stream ended without [DONE]"]
    text, finish, usage_seen, ids, pieces = "", None, None, set(), 0
    for i, event in enumerate(events):
        if not isinstance(event, dict) or "error" in event:
            reasons.append(f"chunk {i} is an error or not an object: {str(event)[:160]}")
            continue
        ids.add(event.get("id"))
        reasons += [f"chunk {i}: {r}" for r in _header(endpoint, True, event, model)]
        if event.get("usage") is not None:
            usage_seen = event["usage"]
            if event.get("choices") != [] or i != len(events) - 1:
                reasons.append("the usage chunk must be last and have no choices")
            continue
        choice = (event.get("choices") or [{}])[0]
        if finish is not None:
            reasons.append(f"chunk {i} arrived after finish_reason {finish!r}")
        piece = _chunk_text(endpoint, choice)
        text, pieces = text + piece, pieces + bool(piece)
        finish = choice.get("finish_reason") or finish
    reasons += _stream_tail(endpoint, events, ids, finish, usage_seen, include_usage, max_tokens, pieces)
    return reasons, text, finish, usage_seen


def _stream_tail(endpoint: str, events: list[Any], ids: set[Any], finish: str | None, usage_seen: Any,
                 include_usage: bool, max_tokens: int | None, pieces: int) -> list[str]:
    reasons = []
    if len(ids) > 1:
        reasons.append(f"chunks carry {len(ids)} different ids")
    if finish not in FINISH_OK:
        reasons.append(f"finish_reason {finish!r} not in {FINISH_OK}")
    if endpoint == "chat" and events and isinstance(events[0], dict):
        delta = ((events[0].get("choices") or [{}])[0]).get("delta") or {}
        if delta.get("role") != "assistant":
            reasons.append("the first chat chunk does not carry role 'assistant'")
    if include_usage:
        reasons += usage(usage_seen, max_tokens, finish)
        if isinstance(usage_seen, dict) and isinstance(usage_seen.get("completion_tokens"), int) \
                and pieces > usage_seen["completion_tokens"]:
            reasons.append(f"{pieces} text chunks but only {usage_seen['completion_tokens']} completion tokens")
    elif usage_seen is not None:
        reasons.append("usage chunk sent without stream_options.include_usage")
    return reasons
