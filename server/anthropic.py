"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as pydantic models, strict as ``server/protocol.py``: unknown fields are refused, values of the
wrong JSON type are never coerced, and an optional field sent as ``null`` is not given.

What the server does with each field (server/anthropic_chat.py translates a body into the one
chat request underneath every chat-shaped API):

| field | here |
|---|---|
| ``system``, ``messages`` | text, ``tool_use``, ``tool_result`` and ``thinking`` blocks; any other block is a 400 naming it |
| ``tools``, ``tool_choice`` | custom tools as function tools; ``any`` is required, ``tool`` a named function; server tools are a 400 |
| ``thinking`` | ``enabled`` / ``adaptive`` / ``disabled`` switch the template's ``enable_thinking``; the budget is checked, not enforced |
| ``output_config.format`` | structured output under the JSON schema |
| ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` | sampling, as chat completions |
| ``cache_control`` (anywhere), ``metadata``, ``service_tier``, ``speed``, ``inference_geo``, ``diagnostics``, ``output_config.effort``, ``context_management`` | accepted, no effect: the prefix cache is automatic, and nothing is tiered, regional or edited |
| ``container``, ``mcp_servers``, ``compaction``, ``thread``, ``fallbacks``, ``fallback_credit_token``, ``billing_policy`` (other than ``self``) | a 400: this server runs no containers, MCP servers or server-side state |
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.protocol import MAX_STOP_STRINGS, invalid_text_path
from server.protocol_messages import MAX_FUNCTION_NAME_CHARS

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_TOOL_RESULT_BLOCKS = ("text",)


class _Strict(BaseModel):
    """Unknown fields refused, no coercion; an optional field sent as ``null`` is not given."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required()}
        return data


def _check_blocks(content: Any, allowed: tuple[str, ...], what: str, where: str = "") -> None:
    """A 400 naming the first block of ``content`` whose type is not in ``allowed`` (``what``
    block 3 ``where``)."""
    if not isinstance(content, list):
        return
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise PydanticCustomError(
                "unsupported_block", "{what} block {index}{where} is of type '{kind}', which this server does not "
                "take (it serves a text model: {allowed} blocks only).",
                {"what": what, "index": index, "where": where, "kind": kind[:64], "allowed": ", ".join(allowed)})


class CacheControl(_Strict):
    """A prompt-cache breakpoint: accepted, no effect (every prompt's blocks are cached)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # an earlier answer's citations: not shown to the model


class ToolUseBlock(_Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Strict):
    """A tool's result, answering the ``tool_use`` with ``tool_use_id``; ``is_error`` marks a failure."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n\n".join(block.text for block in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Strict):
    """Another server's encrypted thinking: accepted in an assistant turn, not shown to the model
    (it has no readable text)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, value: Any) -> Any:
        _check_blocks(value, _BLOCKS, "content")
        for index, block in enumerate(value if isinstance(value, list) else ()):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                _check_blocks(block.get("content"), _TOOL_RESULT_BLOCKS, "tool_result content",
                              f" (of content block {index})")
        return value


_TOOL_NAME = Field(pattern=r"^[a-zA-Z0-9_-]+$", min_length=1, max_length=MAX_FUNCTION_NAME_CHARS)


class Tool(_Strict):
    """A custom (client) tool: the model writes its calls, the client runs them."""

    name: Annotated[str, _TOOL_NAME]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the schema is enforced when a call is forced, whatever this says
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect
    format: JsonOutputFormat | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class Diagnostics(_Strict):
    previous_message_id: str | None = None


class ContextManagement(_Strict):
    """Context edits (clearing old tool results or thinking past a trigger): accepted, never
    applied: the prompt is always the conversation as sent."""

    edits: list[dict[str, Any]] | None = None


class BillingPolicy(_Strict):
    type: Literal["billing_policy"] | None = None
    bill_to: Literal["self", "user_profile"] | None = None


# fields of the reference that ask for what this server does not run: refused unless null (or empty)
_UNSUPPORTED = {
    "container": "this server runs no containers (code execution and skills are server tools of Anthropic's API)",
    "mcp_servers": "this server connects to no MCP servers; run them in the client and pass their tools in 'tools'",
    "compaction": "this server does not summarize conversations (compaction)",
    "thread": "this server holds no conversation state; send the whole conversation in 'messages'",
    "fallbacks": "this server serves one model and has no fallback models",
    "fallback_credit_token": "this server serves one model and has no fallback models",
}


class _Conversation(_Strict):
    """What both routes read: the model, the conversation and what shapes its prompt."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    context_management: ContextManagement | None = None
    billing_policy: BillingPolicy | None = None
    mcp_servers: list[Any] | None = None
    compaction: Any = None
    ignored: ClassVar[tuple[str, ...]] = ()  # fields of _UNSUPPORTED this route accepts and ignores

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        """Every string of the body, keys included, must be Unicode text (a JSON ``\\ud800``
        escape is a lone surrogate, which no tokenizer or template takes)."""
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_unicode", "Invalid value for '{param}': a string holds a lone UTF-16 "
                                      "surrogate (a \\ud800-\\udfff escape outside a pair), which is not text.",
                                      {"param": path})
        return data

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        _check_blocks(value, ("text",), "system")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "custom":
                raise PydanticCustomError(
                    "server_tool", "tools.{index} is the server tool '{kind}': this server runs no server tools "
                    "(only custom tools, which the client runs).", {"index": index, "kind": kind[:64]})
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> _Conversation:
        for name, why in _UNSUPPORTED.items():
            if name not in self.ignored and getattr(self, name, None) not in (None, []):
                raise ValueError(f"'{name}' is not supported: {why}.")
        if self.billing_policy is not None and self.billing_policy.bill_to == "user_profile":
            raise ValueError("'billing_policy' with bill_to 'user_profile' is not supported: this server bills no one.")
        return self


class _Body(_Conversation):
    """Every field of a message request but ``max_tokens``."""

    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Annotated[str, Field(max_length=64)] | None = None
    diagnostics: Diagnostics | None = None
    container: Any = None
    thread: Any = None
    fallbacks: Any = None
    fallback_credit_token: Any = None

    @field_validator("stop_sequences")
    @classmethod
    def _few_stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> _Body:
        max_tokens = getattr(self, "max_tokens", None)
        if isinstance(self.thinking, ThinkingEnabled) and max_tokens is not None \
                and self.thinking.budget_tokens >= max_tokens:
            raise ValueError(f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than max_tokens "
                             f"({max_tokens}).")
        return self


class MessagesRequest(_Body):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1)]


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the body of a message request, whose prompt is
    rendered and counted, not run; ``max_tokens`` is optional, and ``compaction`` is ignored, as
    Anthropic's count ignores it. The sampling fields are checked, and change no count."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    ignored: ClassVar[tuple[str, ...]] = ("compaction",)
