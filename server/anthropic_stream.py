"""A chat job's steps as Anthropic's message: content blocks, stop reason and usage, streamed as
Anthropic's events or collected whole. One ``MessageBuilder`` makes both, so a streamed message
that the SDK assembles equals the non-streamed one of the same (greedy) request.

    message_start                                  (the message, content [], usage so far)
    content_block_start  thinking | text | tool_use  per block, in the order the model wrote them
    content_block_delta  thinking_delta | text_delta | input_json_delta (| signature_delta last)
    content_block_stop
    message_delta                                  (stop_reason, stop_sequence, usage)
    message_stop

A block opens at its first text that is not whitespace (the blank lines a model writes between
its thinking and its answer open no block). A thinking block's ``signature`` is the SHA-256 of
its text: opaque to clients, and the server reads thinking back as plain text whatever it says.
Usage: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those read from it, and ``cache_creation_input_tokens`` is always 0
(every prompt's blocks are cached without being asked; nothing is billed for writing them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from engine import FinishReason
from server.anthropic_errors import new_id
from server.chat import ChatStep

logger = logging.getLogger(__name__)


class MessageBuilder:
    """Builds one message from the steps of its job. ``feed`` each step (the first also gives
    ``start``'s event), then ``finish``; each returns the stream events it adds, and
    ``message()`` is the whole message so far. ``text_of`` turns generated token ids into text
    (EngineClient.text_of), to tell which stop sequence ended the message."""

    def __init__(self, model: str, stop_sequences: Sequence[str], text_of: Callable[[list[int]], str],
                 show_thinking: bool = True) -> None:
        self.id = new_id("msg_")
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self.show_thinking = show_thinking
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._text_of = text_of
        self._open: str | None = None  # the type of the block still receiving text
        self._thinking = ""  # the open thinking block's whole text (shown or not)
        self._raw: list[str] = []  # the engine's text, before the output parser split it
        self._token_ids: list[int] = []
        self._last: ChatStep | None = None

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage()}

    def usage(self) -> dict[str, Any]:
        step = self._last
        prompt, cached = (step.prompt_tokens, step.cached_tokens) if step is not None else (0, 0)
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "output_tokens": step.output_tokens if step is not None else 0, "service_tier": "standard"}

    def start(self) -> dict[str, Any]:
        """``message_start``: the message with no content yet."""
        return {"type": "message_start", "message": {**self.message(), "content": []}}

    def feed(self, step: ChatStep) -> list[dict[str, Any]]:
        """The events of what ``step`` adds: reasoning, then content, then whole tool calls."""
        self._last = step
        self._raw.append(step.output.text)
        self._token_ids.extend(step.output.token_ids)
        events = self._text("thinking", step.parsed.reasoning) + self._text("text", step.parsed.content)
        for call in step.calls:
            events += self._tool_use(call)
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The events that end the message, once the last step was fed: the open block's end,
        ``message_delta`` with the stop reason and the usage, ``message_stop``."""
        events = self._close()
        self.stop_reason, self.stop_sequence = self._stop()
        usage = self.usage()
        usage.pop("service_tier")
        events.append({"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                          "stop_sequence": self.stop_sequence}, "usage": usage})
        events.append({"type": "message_stop"})
        return events

    def _text(self, kind: str, text: str | None) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._open != kind:
            text = text.lstrip()
            if not text:
                return []
            events = self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.content.append(block)
            self._open = kind
            events.append({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)})
        block = self.content[-1]
        if kind == "thinking":
            self._thinking += text
            if not self.show_thinking:
                return events
        block[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The open block's end (a thinking block's signature first)."""
        if self._open is None:
            return []
        index, events = len(self.content) - 1, []
        if self._open == "thinking":
            signature = hashlib.sha256(self._thinking.encode("utf-8", "surrogatepass")).hexdigest()
            self.content[index]["signature"] = signature
            self._thinking = ""
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": signature}})
        self._open = None
        events.append({"type": "content_block_stop", "index": index})
        return events

    def _tool_use(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call as one ``tool_use`` block: its input in one ``input_json_delta``."""
        events = self._close()
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": tool_input(name, arguments)}
        self.content.append(block)
        index = len(self.content) - 1
        events.append({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
        events.append({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"],
                                                                                       ensure_ascii=False)}})
        events.append({"type": "content_block_stop", "index": index})
        return events

    def _stop(self) -> tuple[str, str | None]:
        """Anthropic's ``stop_reason`` (and the stop sequence matched, for ``stop_sequence``)."""
        step = self._last
        reason = step.reason if step is not None else None
        if reason is FinishReason.LENGTH:
            return "max_tokens", None
        if reason is FinishReason.STOP and any(block["type"] == "tool_use" for block in self.content):
            return "tool_use", None
        if reason is FinishReason.STOP and self.stop_sequences:
            matched = self._matched_stop()
            if matched is not None:
                return "stop_sequence", matched
        return "end_turn", None

    def _matched_stop(self) -> str | None:
        """The stop sequence the generated tokens go on with past the text the engine gave out
        (the engine cuts its text where a stop sequence starts); None when EOS ended it."""
        rest = self._text_of(self._token_ids)[len("".join(self._raw)):]
        return next((stop for stop in self.stop_sequences if rest.startswith(stop)), None)


def tool_input(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as ``tool_use.input``, which must be an object: text that
    is a JSON object encoded once more is decoded again; anything else is an empty input."""
    try:
        value = json.loads(arguments)
        if isinstance(value, str):
            value = json.loads(value)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    logger.warning("the call of %r has arguments that are not a JSON object: %.200s", name, arguments)
    return {}
