"""Request bodies of the OpenAI API as pydantic models. Unknown fields are refused, never ignored;
values of the wrong JSON type are refused too, never coerced (``"max_tokens": "10"``, ``"stream": "yes"``)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.text_check import invalid_text_path

MAX_STOP_STRINGS = 16
_TOKEN_ID = re.compile(r"-?[0-9]+")
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and top_k as vLLM bounds them (a C long)
MAX_TOKEN_ID_DIGITS = 12  # a logit_bias key longer than this is no token id (and int() of 5,000 digits raises)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


MAX_FUNCTION_NAME_CHARS = 64


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call an earlier assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=MAX_FUNCTION_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object (checked in server/tools.py)
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # what the SDK sends back when a client appends a response's message to the conversation
    refusal: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _schema_required(schema: dict[str, Any]) -> None:
    """The JSON schema says what server/structured.py does: ``schema`` is required (a JSON object)."""
    schema["required"] = sorted({*schema.get("required", ()), "schema"})
    schema["properties"]["schema"] = {"type": "object", "additionalProperties": True, "title": "Schema"}


class JsonSchema(_Strict):
    """OpenAI's ``response_format.json_schema``. The schema is enforced whatever ``strict`` says
    (server/structured.py); ``description`` is accepted and not shown to the model."""

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


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """The JSON schema says what ``_check_body`` does: every optional field may be ``null``."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        options = prop.get("anyOf", [prop])
        if name not in required and {"type": "null"} not in options:
            outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


def _sampling_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what ``_check_stop`` and ``_check_bias`` do (non-empty stop strings, at
    most ``MAX_STOP_STRINGS``; logit_bias keys of ASCII digits), then ``_nullable_optionals``."""
    for option in schema["properties"]["stop"].get("anyOf", ()):
        if option.get("type") == "string":
            option["minLength"] = 1
        elif option.get("type") == "array":
            option["items"] = {**option.get("items", {}), "minLength": 1}
            option["maxItems"] = MAX_STOP_STRINGS
    for option in schema["properties"]["logit_bias"].get("anyOf", ()):
        if option.get("type") == "object":
            option["propertyNames"] = {"pattern": f"^-?[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"}
    _nullable_optionals(schema)


class _Sampling(_Strict):
    """Fields shared by both endpoints; ranges follow OpenAI's (top_k and min_p as in vLLM)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_sampling_schema)

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    ignore_eos: bool = False
    # vLLM's extra field: the prefix cache serves this request only blocks cached under the same
    # salt (tenants that must not share cached prefixes each send their own); "" is no salt
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's structured-output extras (server/structured.py); at most one constraint per request
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        """Every string of the body, keys included, must be Unicode text: JSON's ``\\ud800``
        escapes give lone surrogates, which no tokenizer, template or response encoder takes.
        An optional field sent as ``null`` is not given (OpenAI's fields are nullable: ``"n": null``
        is n = 1); required ones stay refused."""
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_unicode", "Invalid value for '{param}': a string holds a lone UTF-16 "
                                      "surrogate (a \\ud800-\\udfff escape outside a pair), which is not text.",
                                      {"param": path})
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required()}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not _TOKEN_ID.fullmatch(key):  # ASCII digits only: str.isdigit() accepts "²", int() does not
                raise ValueError(f"logit_bias keys must be token ids, not {key[:40]!r}")
            if len(key.lstrip("-")) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias key {key[:20]}... ({len(key)} characters) is not a token id of this "
                                 "vocabulary")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def salt(self) -> str | None:
        """The prefix cache salt handed to the engine (None: unsalted, also for "")."""
        return self.cache_salt or None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the reasoning switch of a thinking model: "none" renders the prompt with thinking off, any
    # other effort with it on (server/prepare.py: template_kwargs); no effect on other models
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's extra field: variables handed to the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo (server/prepare.py): the prompt, and with logprobs its scores, without a completion
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None  # as vLLM: structured outputs on completions too
