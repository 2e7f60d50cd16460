"""The messages of an OpenAI Chat Completions request and what they carry, as pydantic models:
content parts, tool calls, tool definitions and tool choices, and the response format (the
request bodies built from them are ``server/protocol.py``'s). Strict as the bodies: unknown
fields are refused, values of the wrong JSON type are refused too, never coerced."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheBreakpoint(_Strict):
    """OpenAI's explicit prompt-cache breakpoint on a content part: accepted, no effect (the
    prefix cache here is content-addressed: every block of a prompt is cached)."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class RefusalPart(_Strict):
    """An earlier assistant turn's refusal, sent back in the conversation (read as its text)."""

    type: Literal["refusal"]
    refusal: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high", "original"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class InputAudio(_Strict):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class FileData(_Strict):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Strict):
    type: Literal["file"]
    file: FileData
    prompt_cache_breakpoint: CacheBreakpoint | None = None


# image, audio and file parts are read so that their refusal names them (server/chat.py:
# check_unsupported): the served models take text only
ContentPart = Annotated[TextPart | RefusalPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]


MAX_FUNCTION_NAME_CHARS = 64


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class CustomCallInput(_Strict):
    name: str
    input: str


class ToolCall(_Strict):
    """A call an earlier assistant message made (sent back in the conversation): a function's,
    or a custom tool's (``type: "custom"``, read so that its refusal names it: only function tools
    are served)."""

    id: str
    type: Literal["function", "custom"]
    function: FunctionCall | None = None
    custom: CustomCallInput | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> ToolCall:
        _check_kind(self, ("function", "custom"))
        return self


def _check_kind(entry: BaseModel, kinds: tuple[str, ...]) -> None:
    """An entry whose ``type`` names which of its ``kinds`` fields it carries: that one, alone."""
    kind = getattr(entry, "type")
    if getattr(entry, kind) is None:
        raise ValueError(f"'{kind}' is required with type '{kind}'")
    other = next((k for k in kinds if k != kind and getattr(entry, k) is not None), None)
    if other is not None:
        raise ValueError(f"'{other}' is not allowed with type '{kind}'")


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=MAX_FUNCTION_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object (checked in server/tools.py)
    strict: bool | None = None


class GrammarFormat(_Strict):
    definition: str
    syntax: Literal["lark", "regex"]


class CustomFormat(_Strict):
    type: Literal["text", "grammar"]
    grammar: GrammarFormat | None = None


class CustomDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=MAX_FUNCTION_NAME_CHARS)]
    description: str | None = None
    format: CustomFormat | None = None


class ToolDefinition(_Strict):
    """A function tool, or OpenAI's custom tool (``type: "custom"``, free-text input: read so that
    its refusal names it, server/tools.py)."""

    type: Literal["function", "custom"]
    function: FunctionDefinition | None = None
    custom: CustomDefinition | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> ToolDefinition:
        _check_kind(self, ("function", "custom"))
        return self


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class NamedCustomToolChoice(_Strict):
    type: Literal["custom"]
    custom: FunctionName


class AllowedTools(_Strict):
    """``mode`` ``auto`` or ``required``, over ``tools`` (a subset of the request's, by name)."""

    mode: Literal["auto", "required"]
    tools: Annotated[list[Annotated[NamedToolChoice | NamedCustomToolChoice, Field(discriminator="type")]],
                     Field(min_length=1)]


class AllowedToolChoice(_Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class LegacyFunction(_Strict):
    """An entry of the deprecated ``functions`` list (refused with a pointer to ``tools``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class AssistantAudio(_Strict):
    id: str


class ChatMessage(_Strict):
    # "function": the deprecated function-result turn, refused with a pointer to "tool"
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # what the SDK sends back when a client appends a response's message to the conversation
    refusal: str | None = None
    reasoning_content: str | None = None
    audio: AssistantAudio | None = None  # an earlier audio answer: none is ever made here (a 400)
    function_call: FunctionCall | None = None  # the deprecated form of tool_calls (a 400)

    def text(self) -> str:
        """The turn's text: its string, or its text and refusal parts joined (other parts have no
        text: requests with them are refused before a prompt is built)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else part.refusal
                       for part in self.content if isinstance(part, (TextPart, RefusalPart)))


def _schema_required(schema: dict[str, Any]) -> None:
    """The JSON schema says what server/tools.py does: ``schema`` is required (a JSON object)."""
    schema["required"] = sorted({*schema.get("required", ()), "schema"})
    schema["properties"]["schema"] = {"type": "object", "additionalProperties": True, "title": "Schema"}


class JsonSchema(_Strict):
    """OpenAI's ``response_format.json_schema``. The schema is enforced whatever ``strict`` says
    (server/tools.py); ``description`` is accepted and not shown to the model."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_schema_required)

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=MAX_FUNCTION_NAME_CHARS)]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


def _format_variants(schema: dict[str, Any]) -> None:
    """The JSON schema says what ``ResponseFormat._check_schema`` does: ``json_schema`` is required
    with type ``json_schema`` and allowed (other than ``null``) only with it."""
    schema_ref = next(option for option in schema["properties"]["json_schema"]["anyOf"] if "$ref" in option)
    schema["oneOf"] = [
        {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
        {"properties": {"type": {"const": "json_schema"}, "json_schema": dict(schema_ref)},
         "required": ["type", "json_schema"]},
    ]


class ResponseFormat(_Strict):
    """``text`` (free), ``json_object`` (one JSON object) or ``json_schema`` (with ``json_schema``)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_format_variants)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and allowed only with it")
        return self
