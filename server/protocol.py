"""Request bodies of the OpenAI API as pydantic models (their messages, tools and response
formats are ``server/protocol_messages.py``'s), and the check every body (OpenAI's and
Anthropic's) passes before its fields are validated: no string of it may hold a lone UTF-16
surrogate. Unknown fields are refused, never ignored; values of the wrong JSON type are refused
too, never coerced (``"max_tokens": "10"``, ``"stream": "yes"``)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.protocol_messages import AllowedToolChoice, AssistantAudio, ChatMessage, FunctionName, LegacyFunction, \
    NamedCustomToolChoice, NamedToolChoice, ResponseFormat, TextPart, ToolDefinition, _Strict

MAX_STOP_STRINGS = 16
_TOKEN_ID = re.compile(r"-?[0-9]+")
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and top_k as vLLM bounds them (a C long)
MAX_TOKEN_ID_DIGITS = 12  # a logit_bias key longer than this is no token id (and int() of 5,000 digits raises)


class StreamOptions(_Strict):
    include_usage: bool = False
    # OpenAI pads its chunks with an ``obfuscation`` field against length side channels; this
    # server's chunks carry none, whatever this says
    include_obfuscation: bool | None = None


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
    speculative: bool = True  # False: this request decodes without speculation (when the server speculates)
    no_stop_trim: bool = False  # SGLang's (vllm-router sends it): a matched stop string stays at the text's end
    # vLLM's and SGLang's output switches, as vllm-router adds them to every request it forwards:
    # accepted at the behaviour this server has (the values below); another value is a 400
    # (server/chat.py: check_unsupported)
    skip_special_tokens: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    return_hidden_states: bool = False
    # vLLM's extra field: the prefix cache serves this request only blocks cached under the same
    # salt (tenants that must not share cached prefixes each send their own); "" is no salt
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's structured-output extras (server/tools.py); at most one constraint per request
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        return checked_body(cls, data)

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


MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_SAFETY_IDENTIFIER_CHARS = 128


class OutputAudio(_Strict):
    """``audio``: spoken output (refused: the served models write text only)."""

    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
    voice: str | AssistantAudio


class WebSearchOptions(_Strict):
    """``web_search_options`` (refused: this server searches nothing)."""

    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: dict[str, Any] | None = None


class Prediction(_Strict):
    """A Predicted Output: text the answer is expected to repeat. Accepted, no effect: the
    answer is what it would be without it."""

    type: Literal["content"]
    content: str | list[TextPart]


class PromptCacheOptions(_Strict):
    """OpenAI's prompt-cache options: accepted, no effect (the prefix cache is content-addressed
    and keeps blocks until memory or disk is needed)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class Moderation(_Strict):
    """``moderation`` (refused: this server runs no moderation model)."""

    model: str
    policy: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    """Every field of OpenAI's Chat Completions reference, each with its meaning here (README's
    Endpoints section), plus vLLM's extras. Fields for capabilities this server lacks (audio,
    images, files, web search, moderation, custom tools, the deprecated ``functions``) are read
    so that ``server/chat.py: check_unsupported`` refuses them by name."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: (Literal["none", "auto", "required"]
                  | Annotated[NamedToolChoice | NamedCustomToolChoice | AllowedToolChoice, Field(discriminator="type")]
                  | None) = None
    parallel_tool_calls: bool | None = None
    # the reasoning switch of a thinking model: "none" renders the prompt with thinking off, any
    # other effort with it on (server/chat.py: template_kwargs); no effect on other models
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's extra field: variables handed to the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # no-ops, accepted as OpenAI defines them: this server keeps no chat completions (store), has
    # one service tier (service_tier), and its prefix cache is content-addressed (prompt_cache_*)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # hints with no effect on this server's models (verbosity) or on the answer (prediction)
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    # who asked: written to the request's debug log line (server/chat.py: check_unsupported)
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = None
    safety_identifier: Annotated[str, Field(max_length=MAX_SAFETY_IDENTIFIER_CHARS)] | None = None
    # capabilities this server lacks: refused by name (server/chat.py: check_unsupported)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: OutputAudio | None = None
    web_search_options: WebSearchOptions | None = None
    moderation: Moderation | None = None
    functions: Annotated[list[LegacyFunction], Field(min_length=1)] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs")
        long = next((key for key in value or {} if len(key) > MAX_METADATA_KEY_CHARS), None)
        if long is not None:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters; got {len(long)}")
        return value

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo (server/chat.py): the prompt, and with logprobs its scores, without a completion
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None  # as vLLM: structured outputs on completions too


# ---- strings that are not Unicode text ----
# JSON lets a client write a lone UTF-16 surrogate (``"\ud800"``); Python's ``json`` decodes it into
# a ``str`` that cannot be encoded as UTF-8, so a tokenizer, a chat template or the response encoder
# (which echoes e.g. an unknown ``model``) would fail on it with a 500. Bodies are checked once, as a
# whole, before any field is used.
_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_text_path(data: Any) -> str | None:
    """The dotted path (``messages.0.content``) of a string in ``data`` (keys included)
    holding a lone surrogate, or None when every string is text. A key that is bad is reported
    by its parent's path (the key itself cannot be echoed). Iterative: any nesting depth."""
    try:  # the common case in C: one encode of the whole body, no walk
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, RecursionError, TypeError, ValueError):
        pass
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return path or "body"
                stack.append((value, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((value, f"{path}.{i}" if path else str(i)) for i, value in enumerate(item))
    return None


def checked_body(model: type[BaseModel], data: Any) -> Any:
    """A request body before its fields are validated: every string of it, keys included, must
    be Unicode text (JSON's ``\\ud800`` escapes give lone surrogates, which no tokenizer,
    template or response encoder takes), and an optional field of ``model`` sent as ``null`` is
    not given (OpenAI's fields are nullable: ``"n": null`` is n = 1); required ones stay refused."""
    path = invalid_text_path(data)
    if path is not None:
        raise PydanticCustomError("invalid_unicode", "Invalid value for '{param}': a string holds a lone UTF-16 "
                                  "surrogate (a \\ud800-\\udfff escape outside a pair), which is not text.",
                                  {"param": path})
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in model.model_fields
                or model.model_fields[k].is_required()}
    return data
