"""One chat choice's text in OpenAI's shapes: ``content``, ``reasoning_content`` and ``tool_calls``,
whole (``message``) or streamed (``delta``).

The split itself is the engine's ``OutputParser`` (mlx-lm's markers and tool parsers). A call
is streamed as OpenAI does, so the SDK's stream helpers assemble it: first its index, id, type
and name (arguments ""), then its arguments; the parser reads a call whole, so both arrive once
the call's end marker has been generated.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import EngineClient, FinishReason, OutputParser, ParsedCall, ParsedDelta
from server.tools import ToolPlan

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_CHARS = 24


def new_call_id() -> str:
    """An id like OpenAI's (``call_`` and 24 letters or digits)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_CHARS))


@dataclass(frozen=True)
class ChoiceFormat:
    """How a request's chat choices are split: ``make_parser`` gives each choice its own parser
    (None: the whole text is content, as before tools); ``max_calls`` caps the calls reported
    (``parallel_tool_calls: false``: the first)."""

    make_parser: Callable[[], OutputParser] | None = None
    max_calls: int | None = None
    reads_calls: bool = False

    def start(self) -> ChoiceText:
        return ChoiceText(self.make_parser() if self.make_parser is not None else None, self.max_calls)

    def role_delta(self) -> dict[str, Any]:
        """A stream's first delta: content "" (as vLLM), or null where the answer may be calls
        alone (as OpenAI starts its tool-call streams), so the SDK assembles what the
        non-streamed message says."""
        return {"role": "assistant", "content": None if self.reads_calls else ""}


def choice_format(client: EngineClient, prompt_ids: list[int], plan: ToolPlan, reasoning: bool) -> ChoiceFormat:
    """How to split a chat request's choices: tool calls when ``plan`` reads them, reasoning when
    ``reasoning`` is on and the model has think markers; else no split at all."""
    chat_format = client.info.chat_format if client.info is not None else None
    if chat_format is None or not (plan.parse or (reasoning and chat_format.has_thinking)):
        return ChoiceFormat()

    def make_parser() -> OutputParser:
        return client.output_parser(prompt_ids, tools=plan.tools, parse_tools=plan.parse, reasoning=reasoning)

    return ChoiceFormat(make_parser, plan.max_calls, plan.parse)


@dataclass
class ChoiceText:
    """The running split of one choice. ``calls`` are the tool calls reported so far, with ids."""

    parser: OutputParser | None
    max_calls: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, finished: bool, truncated: bool = False) -> ParsedDelta:
        """What ``text`` adds (and, at the end, what the parser still held), calls past
        ``max_calls`` left out; ``truncated``: the choice ended at ``max_tokens``, so a call it
        was still writing is dropped, never shown as content."""
        if self.parser is None:
            return ParsedDelta(content=text)
        parsed = self.parser.feed(text)
        if finished:
            parsed.extend(self.parser.finish(truncated))
        room = None if self.max_calls is None else max(self.max_calls - len(self.calls), 0)
        parsed.calls = parsed.calls[:room]
        self.calls.extend(_entry(call) for call in parsed.calls)
        return parsed

    def finish_name(self, reason: FinishReason | None, name: str | None) -> str | None:
        """OpenAI's ``finish_reason``: "tool_calls" when the choice stopped after making calls."""
        return "tool_calls" if reason is FinishReason.STOP and self.calls else name

    def message(self, parsed: ParsedDelta) -> dict[str, Any]:
        """The non-streamed ``message`` of a choice whose whole text gave ``parsed``."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content if parsed.content or not self.calls else None,
                                   "refusal": None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def deltas(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        """The stream deltas of ``parsed`` (one of ``feed``'s results): text first, then two
        per call (header, arguments), indexed across the whole choice."""
        out: list[dict[str, Any]] = []
        text = {key: value for key, value in (("reasoning_content", parsed.reasoning),
                                              ("content", parsed.content)) if value}
        if text:
            out.append(text)
        first = len(self.calls) - len(parsed.calls)
        for index, entry in enumerate(self.calls[first:], start=first):
            header = {"index": index, "id": entry["id"], "type": "function",
                      "function": {"name": entry["function"]["name"], "arguments": ""}}
            out.append({"tool_calls": [header]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": entry["function"]["arguments"]}}]})
        return out


def _entry(call: ParsedCall) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
