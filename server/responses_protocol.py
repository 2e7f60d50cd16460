"""Request bodies of OpenAI's Responses API as pydantic models (``POST /v1/responses``).

Strict as ``server/protocol.py``: unknown fields are refused, values of the wrong JSON type are
never coerced, a top-level ``null`` is "not given". Every field of the reference is here, with
its meaning, as a documented no-op, or refused with a clear 400 (``refuse_unsupported``):

| field | here |
|---|---|
| ``input``, ``instructions``, ``tools`` (functions), ``tool_choice`` (``allowed_tools`` too), ``parallel_tool_calls``, ``text.format``, ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``, ``stream``, ``store``, ``previous_response_id``, ``metadata``, ``user``, ``truncation``, ``include``, ``reasoning`` | as OpenAI (``server/responses_input.py``) |
| ``text.verbosity``, ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options`` (not ``prewarm``), ``service_tier``, ``max_tool_calls``, ``access_programs``, ``image``, ``stream_options.include_obfuscation``, ``reasoning.summary`` | accepted and echoed, no effect: one local prefix cache serves every request, no built-in tools run, no obfuscation is added |
| ``background``, ``background_options``, ``conversation``, ``prompt``, ``moderation``, ``context_management``, built-in tools | 400 |
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from server.errors import APIError
from server.protocol import MAX_TOP_LOGPROBS, checked_body
from server.protocol_messages import MAX_FUNCTION_NAME_CHARS

Status = Literal["in_progress", "completed", "incomplete"]
# a declared web search is accepted and not offered to the model (Codex CLI declares one by default);
# other hosted tools are refused by name, and so is a tool_choice that forces any of them
WEB_SEARCH_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11")
BUILTIN_TOOLS = ("file_search", "computer", "computer_use_preview", "computer_use", "mcp", "code_interpreter", "image_generation", "local_shell", "shell", "custom", "tool_search", "apply_patch", "programmatic_tool_calling")
BUILTIN_ITEMS = ("item_reference", "file_search_call", "computer_call", "computer_call_output", "web_search_call",
                 "tool_search_call", "tool_search_output", "additional_tools", "image_generation_call",
                 "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call",
                 "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools",
                 "mcp_approval_request", "mcp_approval_response", "mcp_call", "custom_tool_call",
                 "custom_tool_call_output", "compaction", "program", "program_output")
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
def _json_kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "list[]" if isinstance(value, list) else "object[]"


def text_or(other: Any, tag: str = "list[]") -> Any:
    """``str | other``, validated by the JSON type sent, so an error names the branch the client
    meant (a plain union reports its string branch first)."""
    return Annotated[Annotated[str, Tag("str")] | Annotated[other, Tag(tag)],
                     Discriminator(_json_kind, custom_error_type="invalid_type",
                                   custom_error_message="Input should be a string or " +
                                   ("an array" if tag == "list[]" else "an object"))]


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=MAX_FUNCTION_NAME_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Refused(BaseModel):
    """A known kind of part, item, tool or choice this server cannot serve: refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    what: ClassVar[str] = "value"
    why: ClassVar[str] = "this server does not provide it."

    @model_validator(mode="after")
    def _refuse(self) -> _Refused:
        raise PydanticCustomError("unsupported", f"{self.what} of type '{{kind}}' is not supported: {self.why}",
                                  {"kind": getattr(self, "type", "?")})


class UnsupportedPart(_Refused):
    type: Literal["input_image", "input_file", "input_audio"]
    what: ClassVar[str] = "content part"
    why: ClassVar[str] = "this server runs a text-only model; send text parts (input_text)."


class UnsupportedItem(_Refused):
    type: Literal[BUILTIN_ITEMS]  # type: ignore[valid-type]
    what: ClassVar[str] = "input item"
    why: ClassVar[str] = "this server runs no built-in tools; send messages, function calls and their outputs."


class UnsupportedTool(_Refused):
    type: Literal[BUILTIN_TOOLS]  # type: ignore[valid-type]
    what: ClassVar[str] = "tool"
    why: ClassVar[str] = "this server runs no such tool; declare your own tools as type 'function'."


class UnsupportedChoice(_Refused):
    type: Literal[BUILTIN_TOOLS + WEB_SEARCH_TOOLS]  # type: ignore[valid-type]
    what: ClassVar[str] = "tool_choice"
    why: ClassVar[str] = "this server runs no built-in tools; choose 'none', 'auto', 'required', a function or allowed_tools."


# --- input items ---
class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # accepted: the prefix cache needs no breakpoints


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | OutputText | Refusal | UnsupportedPart, Field(discriminator="type")]
OutputPart = Annotated[InputText | UnsupportedPart, Field(discriminator="type")]


class MessageItem(_Strict):
    """A message; ``type`` may be left out (the short form ``{"role", "content"}``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(list[Part])  # type: ignore[valid-type]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)  # type: ignore[union-attr]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Status | None = None
    namespace: str | None = None  # the namespace tool the function belongs to


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: text_or(list[OutputPart])  # type: ignore[valid-type]
    id: str | None = None
    status: Status | None = None
    name: str | None = None
    namespace: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)  # type: ignore[union-attr]


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # accepted; this server's reasoning items carry their text in clear
    status: Status | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return "unsupported" if kind in BUILTIN_ITEMS else kind
    return None


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[UnsupportedItem, Tag("unsupported")],
                 Discriminator(_item_kind, custom_error_type="invalid_item",
                               custom_error_message="Each input item must be an object with a known 'type' "
                                                    "(message, function_call, function_call_output, reasoning)")]


# --- tools and how they are chosen ---
class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    output_schema: dict[str, Any] | None = None  # accepted: describes what the caller returns
    defer_loading: Literal[False] | None = None  # true needs tool search, which this server does not run
    allowed_callers: list[Literal["direct"]] | None = None  # no programmatic tool calling here


class NamespaceTool(_Strict):
    """Function tools grouped under a name: each is offered as a function of its own, and its
    calls come back with ``namespace`` set (Codex CLI groups its agent tools this way)."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: Annotated[list[FunctionTool], Field(min_length=1)]


class WebSearchTool(BaseModel):
    """A hosted web search the client offers: this server runs none, so the model is not shown
    it and never calls it (as a model may always choose not to call a tool); its options are
    accepted as sent. Forcing it (``tool_choice``) is refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal[WEB_SEARCH_TOOLS]  # type: ignore[valid-type]


Tool = Annotated[FunctionTool | NamespaceTool | WebSearchTool | UnsupportedTool, Field(discriminator="type")]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class AllowedTool(_Strict):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(_Strict):
    """Only ``tools`` (a subset of the request's) are shown to the model and may be called."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[AllowedTool], Field(min_length=1)]


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[
    FunctionChoice | AllowedToolsChoice | UnsupportedChoice, Field(discriminator="type"), Tag("object[]")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "object[]")]


# --- text, reasoning and the options that change nothing here ---
class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: FunctionName
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect: the model is not steered by it


class ReasoningConfig(_Strict):
    """``effort`` switches a thinking model's thinking ("none": off); ``context``
    ``current_turn`` leaves earlier turns' reasoning out of the prompt."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: the reasoning text is given whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Literal["standard"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation field is ever added


class PromptCacheOptions(_Strict):
    comparison_response_id: str | None = None
    mode: Literal["implicit", "explicit"] | None = None
    prewarm: Literal[False] | None = None  # prewarming without generating is not offered
    ttl: Literal["30m", "12h"] | None = None


class AccessPrograms(_Strict):
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class ImageOptions(_Strict):
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]


class ResponsesRequest(_Strict):
    """The body of ``POST /v1/responses``."""

    model: str
    input: text_or(Annotated[list[Item], Field(min_length=1)])  # type: ignore[valid-type]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # counts built-in tool calls: none run here
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                   Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=128)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    access_programs: AccessPrograms | None = None
    client_metadata: dict[str, str] | None = None  # Codex CLI's request metadata: accepted, no effect
    image: ImageOptions | None = None
    # refused by refuse_unsupported, whatever their value
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    context_management: Any = None

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        """Text must be Unicode (no lone surrogates); a top-level ``null`` is "not given"."""
        return checked_body(cls, data)

    @model_validator(mode="after")
    def _check_fields(self) -> ResponsesRequest:
        if len(self.metadata or {}) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def wants_logprobs(self) -> bool:
        """Log-probabilities on the output text: asked by ``include`` or by ``top_logprobs`` > 0."""
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)


_REFUSED = {
    "background": "Background responses are not supported: this server answers while the request is open "
                  "(stream: true for a long response).",
    "background_options": "background_options applies to background responses, which this server does not run.",
    "conversation": "Conversations are not supported: chain responses with previous_response_id instead.",
    "prompt": "Stored prompts are not supported: send the prompt as instructions and input.",
    "moderation": "Moderation is not supported: this server runs no moderation model.",
    "context_management": "context_management (compaction) is not supported; truncation: 'auto' drops the oldest "
                          "turns instead.",
}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first field set to something this server cannot do."""
    for name, message in _REFUSED.items():
        value = getattr(body, name)
        if value is not None and value is not False and value != []:
            raise APIError(400, message, param=name, code="unsupported_parameter")
