"""Hundreds of malformed requests, generated field by field, each answered with a 4xx in OpenAI's
error shape through real HTTP; never a 5xx, never a traceback.

For every field of both endpoints (and of the objects nested in them): values of every wrong JSON
type, numbers out of range, huge (10**30, 1e400 read as inf) and not numbers (NaN, Infinity), a
lone surrogate in every string, deep nesting, empty and oversized arrays, unknown and missing
fields; then bodies that are not JSON or not objects, and content types that are not JSON. The
bodies carry ``max_tokens: 1`` (what is not malformed generates one token at most), and none of
them is valid, so no case generates at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_ID, Server, chat_body, wait_idle

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SURROGATE = "bad \ud800 text"  # sent as the JSON escape \ud800, which Python decodes to a lone surrogate


class Raw(str):
    """JSON text put into a body as is (NaN, 1e400, nesting deeper than Python's json can write)."""


NAN, INF, NEG_INF, HUGE_FLOAT = Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400")
DEEP_LIST = Raw("[" * 100_000 + "]" * 100_000)
HUGE, NEG_HUGE = 10**30, -(10**30)


def _deep_schema(depth: int) -> Raw:
    """A JSON schema nested ``depth`` objects deep whose innermost type does not exist."""
    return Raw('{"type": "object", "properties": {"a": ' * depth + '{"type": "nonsense"}' + "}}" * depth)


def encode(body: Any) -> bytes:
    """``body`` as JSON text, with ``Raw`` parts spliced in and surrogates as ``\\ud800`` escapes."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(str(value))
            return f"__raw_{len(raws) - 1}__"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body))  # ensure_ascii: a lone surrogate is written as its escape
    for i, raw in enumerate(raws):
        text = text.replace(f'"__raw_{i}__"', raw)
    return text.encode()


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


# --- the valid bases each case breaks in one place ---
def chat_base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


def completion_base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1, **fields}


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

WRONG_TYPES = {"str": "x", "int": 7, "float": 1.5, "bool": True, "list": [1], "object": {"a": 1}}


def wrong_types(*accepted: str) -> dict[str, Any]:
    """A value of every JSON type the field does not take (``null`` is "not given" for optional fields)."""
    return {f"wrong-type-{k}": v for k, v in WRONG_TYPES.items() if k not in accepted}


def numbers(low: Any, high: Any, *, integer: bool) -> dict[str, Any]:
    """Out of range, huge, and not numbers at all, for a field within [low, high]."""
    values: dict[str, Any] = {"below-range": low, "above-range": high, "huge": HUGE, "negative-huge": NEG_HUGE,
                              "inf-literal": HUGE_FLOAT, "nan": NAN, "infinity": INF, "negative-infinity": NEG_INF,
                              "numeric-string": "1", "deep-list": DEEP_LIST}
    if integer:
        values["fractional"] = 1.5
    return values


BOOL = {**wrong_types("bool"), "string-true": "true", "one": 1, "zero": 0, "deep-list": DEEP_LIST}
STRING = {**wrong_types("str"), "surrogate": SURROGATE, "deep-list": DEEP_LIST}

# field -> bad values, shared by both endpoints
COMMON: dict[str, dict[str, Any]] = {
    "model": {**STRING, "null": None, "empty": "", "unknown-model": "gpt-4o", "huge-number": HUGE},
    "max_tokens": {**wrong_types("int", "float"), **numbers(0, 5000, integer=True), "minus-one": -1},
    "temperature": {**wrong_types("int", "float"), **numbers(-0.1, 2.01, integer=False)},
    "top_p": {**wrong_types("int", "float"), **numbers(0, 1.01, integer=False)},
    "top_k": {**wrong_types("int"), **numbers(-2, 2**63, integer=True)},
    "min_p": {**wrong_types("int", "float"), **numbers(-0.1, 1.1, integer=False)},
    "n": {**wrong_types("int"), **numbers(0, 17, integer=True)},
    "stream": BOOL,
    "ignore_eos": BOOL,
    "stream_options": {**wrong_types("object"), "without-stream": {"include_usage": True}},
    "stop": {**wrong_types("str", "list"), "empty-string": "", "list-with-empty": [""], "list-of-int": [1],
             "17-strings": [f"s{i}" for i in range(17)], "nested-list": [["a"]], "surrogate": SURROGATE,
             "surrogate-in-list": ["ok", SURROGATE], "deep-list": DEEP_LIST},
    "seed": {**wrong_types("int"), **numbers(-(2**63) - 1, 2**63, integer=True)},
    "presence_penalty": {**wrong_types("int", "float"), **numbers(-2.1, 2.1, integer=False)},
    "frequency_penalty": {**wrong_types("int", "float"), **numbers(-2.1, 2.1, integer=False)},
    "logit_bias": {**wrong_types("object"), "word-key": {"hello": 1}, "fraction-key": {"1.5": 1}, "empty-key": {"": 1},
                   "5000-digit-key": {"9" * 5000: 1}, "negative-id": {"-1": 1}, "id-past-vocab": {"8192": 1},
                   "above-100": {"1": 101}, "below-minus-100": {"1": -101}, "string-value": {"1": "x"},
                   "nan-value": {"1": NAN}, "inf-value": {"1": INF}, "list-value": {"1": [1]},
                   "surrogate-key": {SURROGATE: 1}, "superscript-digit-key": {"²": 1}},
    "user": STRING,
    "cache_salt": {**STRING, "257-chars": "s" * 257},
    "guided_json": {**wrong_types("object", "str"), "not-json-text": "{not json", "bad-type": {"type": "nonsense"},
                    "bad-properties": {"type": "object", "properties": "x"}, "unsupported-not": {"not": {}},
                    "surrogate": {"type": "string", "enum": [SURROGATE]}, "deep": _deep_schema(200),
                    "deep-list": DEEP_LIST},
    "guided_regex": {**STRING, "unclosed-group": "(", "unclosed-class": "[a-"},
    "guided_choice": {**wrong_types("list"), "empty": [], "list-of-int": [1], "surrogate": ["a", SURROGATE],
                      "deep-list": DEEP_LIST},
    "guided_grammar": {**STRING, "not-a-grammar": "start: ::= (("},
}

CHAT_ONLY: dict[str, dict[str, Any]] = {
    "messages": {**wrong_types("list"), "empty": [], "list-of-str": ["hi"], "list-of-int": [7],
                 "unknown-role": [{"role": "wizard", "content": "x"}], "missing-role": [{"content": "x"}],
                 "content-int": [{"role": "user", "content": 7}],
                 "content-object": [{"role": "user", "content": {"text": "x"}}],
                 "image-part": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 "audio-part": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
                     "data": "UklGRg==", "format": "wav"}}]}],
                 "file-part": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}],
                 "refusal-part-in-user": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
                 "image-part-bad-detail": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                     "url": "x", "detail": "extreme"}}]}],
                 "function-role": [{"role": "user", "content": "x"}, {"role": "function", "name": "f", "content": "1"}],
                 "assistant-function-call": [{"role": "user", "content": "x"}, {"role": "assistant", "function_call": {
                     "name": "f", "arguments": "{}"}}],
                 "assistant-audio": [{"role": "user", "content": "x"}, {"role": "assistant", "audio": {"id": "audio_1"}}],
                 "assistant-audio-int": [{"role": "user", "content": "x"}, {"role": "assistant", "audio": 7}],
                 "custom-tool-call": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                     {"id": "call_1", "type": "custom", "custom": {"name": "f", "input": "x"}}]}],
                 "breakpoint-bad-mode": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                        "prompt_cache_breakpoint": {"mode": "auto"}}]}],
                 "part-without-text": [{"role": "user", "content": [{"type": "text"}]}],
                 "part-text-int": [{"role": "user", "content": [{"type": "text", "text": 7}]}],
                 "part-unknown-field": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}],
                 "message-unknown-field": [{"role": "user", "content": "x", "extra": 1}],
                 "name-int": [{"role": "user", "content": "x", "name": 7}],
                 "tool-without-call-id": [{"role": "user", "content": "x"}, {"role": "tool", "content": "18 C"}],
                 "call-arguments-not-json": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
                 "call-type-wrong": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                     {"id": "call_1", "type": "magic", "function": {"name": "f", "arguments": "{}"}}]}],
                 "call-without-id": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                     {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
                 "surrogate-content": [{"role": "user", "content": SURROGATE}],
                 "surrogate-in-part": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
                 "surrogate-name": [{"role": "user", "content": "x", "name": SURROGATE}],
                 "surrogate-role": [{"role": SURROGATE, "content": "x"}],
                 "surrogate-system": [{"role": "system", "content": SURROGATE}, {"role": "user", "content": "x"}],
                 "surrogate-tool-call-id": [{"role": "user", "content": "x"},
                                            {"role": "tool", "content": "y", "tool_call_id": SURROGATE}],
                 "surrogate-reasoning": [{"role": "assistant", "content": "x", "reasoning_content": SURROGATE}],
                 "deep-content": [{"role": "user", "content": DEEP_LIST}],
                 "5000-messages": [{"role": "user", "content": "hi there"}] * 5000,
                 "4-million-characters": [{"role": "user", "content": "a" * 4_000_000}],
                 "deep-list": DEEP_LIST},
    "max_completion_tokens": {**wrong_types("int", "float"), **numbers(0, 5000, integer=True)},
    "logprobs": BOOL,
    "top_logprobs": {**wrong_types("int"), **numbers(-1, 21, integer=True)},
    "parallel_tool_calls": BOOL,
    "response_format": {**wrong_types("object"), "string-json": "json", "empty": {}, "unknown-type": {"type": "xml"},
                        "schema-missing": {"type": "json_schema"},
                        "schema-with-text": {"type": "text", "json_schema": {"name": "x", "schema": {}}},
                        "bad-name": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
                        "65-char-name": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": {}}},
                        "no-schema": {"type": "json_schema", "json_schema": {"name": "x"}},
                        "bad-schema": {"type": "json_schema", "json_schema": {"name": "x",
                                                                              "schema": {"type": "nonsense"}}},
                        "unsupported-schema": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                      "schema": {"not": {}}}},
                        "schema-a-list": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
                        "strict-open-object": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                            "schema": {"type": "object", "additionalProperties": True}}},
                        "strict-nested-open": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                            "schema": {"type": "array", "items": {"additionalProperties": {}}}}},
                        "unknown-field": {"type": "json_object", "extra": 1},
                        "json-schema-unknown-field": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": {}, "y": 1}},
                        "surrogate-name": {"type": "json_schema", "json_schema": {"name": SURROGATE, "schema": {}}},
                        "surrogate-schema-key": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object", "properties": {SURROGATE: {}}}}},
                        "deep-schema": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(200)}},
                        "deep-list": DEEP_LIST},
    "tools": {**wrong_types("list"), "list-of-int": [7], "empty-tool": [{}], "no-function": [{"type": "function"}],
              "custom-tool": [{"type": "custom", "custom": {"name": "f"}}],
              "custom-tool-bad-syntax": [{"type": "custom", "custom": {"name": "f", "format": {
                  "type": "grammar", "grammar": {"definition": "start: x", "syntax": "peg"}}}}],
              "strict-open-object": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                  "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}}}],
              "strict-open-nested": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                  "type": "object", "properties": {"a": {"type": "object", "unevaluatedProperties": True}}}}}],
              "type-wrong": [{"type": "x", "function": {"name": "f"}}],
              "bad-name": [{"type": "function", "function": {"name": "bad name"}}],
              "65-char-name": [{"type": "function", "function": {"name": "f" * 65}}],
              "parameters-string": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
              "parameters-not-object": [{"type": "function", "function": {"name": "f",
                                                                          "parameters": {"type": "string"}}}],
              "parameters-bad-schema": [{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
              "duplicate-names": [TOOL, TOOL],
              "function-unknown-field": [{"type": "function", "function": {"name": "f", "extra": 1}}],
              "tool-unknown-field": [{**TOOL, "extra": 1}],
              "surrogate-name": [{"type": "function", "function": {"name": SURROGATE}}],
              "surrogate-description": [{"type": "function", "function": {"name": "f", "description": SURROGATE}}],
              "deep-parameters": [{"type": "function", "function": {"name": "f", "parameters": _deep_schema(200)}}],
              "deep-list": DEEP_LIST},
    "store": BOOL,
    "metadata": {**wrong_types("object"), "int-value": {"a": 1}, "17-pairs": {f"k{i}": "v" for i in range(17)},
                 "65-char-key": {"k" * 65: "v"}, "513-char-value": {"k": "v" * 513}, "surrogate-value": {"k": SURROGATE}},
    "service_tier": {**STRING, "unknown-tier": "platinum"},
    "reasoning_effort": {**STRING, "unknown-effort": "extreme"},
    "chat_template_kwargs": {**wrong_types("object"), "reserved-key": {"tools": []},
                             "reserved-messages": {"messages": []}},
    "safety_identifier": {**STRING, "129-chars": "s" * 129},
    "prompt_cache_key": STRING,
    "prompt_cache_retention": {**STRING, "unknown-retention": "forever"},
    "prompt_cache_options": {**wrong_types("object"), "bad-mode": {"mode": "sometimes"}, "bad-ttl": {"ttl": "1y"},
                             "unknown-field": {"mode": "implicit", "x": 1}},
    "verbosity": {**STRING, "unknown-verbosity": "chatty"},
    "modalities": {**wrong_types("list"), "audio": ["text", "audio"], "image": ["image"], "list-of-int": [1]},
    "audio": {**wrong_types("object"), "given": {"format": "wav", "voice": "alloy"}, "bad-format": {
        "format": "midi", "voice": "alloy"}, "no-voice": {"format": "wav"}},
    "web_search_options": {**wrong_types("object"), "given": {}, "with-size": {"search_context_size": "low"},
                           "bad-size": {"search_context_size": "huge"}},
    "prediction": {**wrong_types("object"), "no-content": {"type": "content"}, "bad-type": {"type": "x", "content": "a"},
                   "content-int": {"type": "content", "content": 7}},
    "moderation": {**wrong_types("object"), "given": {"model": "omni-moderation-latest"}},
    "functions": {**wrong_types("list"), "given": [{"name": "f", "parameters": {"type": "object"}}], "empty": [],
                  "no-name": [{"parameters": {}}]},
    "function_call": {**wrong_types("str", "object"), "auto": "auto", "named": {"name": "f"},
                      "unknown-string": "sometimes"},
    "tool_choice": {**wrong_types("str", "object"), "unknown-string": "sometimes", "empty-object": {},
                    "no-function": {"type": "function"}, "required-without-tools": "required",
                    "named-without-tools": {"type": "function", "function": {"name": "get_weather"}},
                    "surrogate": {"type": "function", "function": {"name": SURROGATE}},
                    "unknown-field": {"type": "function", "function": {"name": "get_weather"}, "x": 1},
                    "custom": {"type": "custom", "custom": {"name": "get_weather"}},
                    "allowed-tools-empty": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
                    "allowed-tools-bad-mode": {"type": "allowed_tools", "allowed_tools": {
                        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}},
                    "allowed-tools-without-tools": {"type": "allowed_tools", "allowed_tools": {
                        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}},
}

COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {**wrong_types("str", "list"), "null": None, "empty-string": "", "empty-list": [], "empty-inner": [[]],
               "negative-id": [-1], "id-past-vocab": [8192], "huge-id": [HUGE], "fractional-id": [1.5],
               "mixed-list": ["a", 1], "list-of-bool": [True], "list-of-object": [{"a": 1}],
               "surrogate": SURROGATE, "surrogate-in-list": [SURROGATE], "5000-tokens": [100] * 5000,
               "4-million-characters": "a" * 4_000_000, "nan-id": [NAN], "deep-list": DEEP_LIST},
    "echo": BOOL,
    "logprobs": {**wrong_types("int"), **numbers(-1, 21, integer=True)},
    "suffix": {**STRING, "given": "and so on"},
    "best_of": {**wrong_types("int"), **numbers(0, 2, integer=True)},
    "response_format": {**wrong_types("object"), "unknown-type": {"type": "xml"}, "schema-missing": {"type": "json_schema"}},
}

# objects nested in the bodies, each with an unknown field and a missing required one
NESTED_UNKNOWN = {
    "root-chat": (CHAT, chat_base(frobnicate=True)),
    "root-completion": (COMPLETIONS, completion_base(frobnicate=True)),
    "root-functions": (CHAT, chat_base(functions=[{"name": "f"}])),
    "root-surrogate-key": (CHAT, chat_base(**{SURROGATE: 1})),
    "root-empty-key": (COMPLETIONS, completion_base(**{"": 1})),
    "stream-options": (CHAT, chat_base(stream=True, stream_options={"include_usage": True, "x": 1})),
    "stream-options-completion": (COMPLETIONS, completion_base(stream=True, stream_options={"y": True})),
    "stream-options-obfuscation-string": (CHAT, chat_base(stream=True, stream_options={"include_obfuscation": "no"})),
    "stream-options-obfuscation-completion": (COMPLETIONS, completion_base(stream=True,
                                                                           stream_options={"include_obfuscation": 0})),
    "prediction-part-unknown-field": (CHAT, chat_base(prediction={"type": "content", "content": [
        {"type": "text", "text": "x", "y": 1}]})),
    "allowed-tools-unknown-field": (CHAT, chat_base(tools=[TOOL], tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}], "x": 1}})),
    "tool-choice-function": (CHAT, chat_base(tools=[TOOL], tool_choice={"type": "function",
                                                                         "function": {"name": "get_weather", "z": 1}})),
    "tool-call-function": (CHAT, chat_base(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "w": 1}}]}])),
}
MISSING = {
    "chat-model": (CHAT, {k: v for k, v in chat_base().items() if k != "model"}),
    "chat-messages": (CHAT, {k: v for k, v in chat_base().items() if k != "messages"}),
    "completion-model": (COMPLETIONS, {k: v for k, v in completion_base().items() if k != "model"}),
    "completion-prompt": (COMPLETIONS, {k: v for k, v in completion_base().items() if k != "prompt"}),
    "empty-object-chat": (CHAT, {}),
    "empty-object-completion": (COMPLETIONS, {}),
    "tool-function-name": (CHAT, chat_base(tools=[{"type": "function", "function": {"parameters": {}}}])),
    "tool-choice-name": (CHAT, chat_base(tools=[TOOL], tool_choice={"type": "function", "function": {}})),
    "json-schema-name": (CHAT, chat_base(response_format={"type": "json_schema", "json_schema": {"schema": {}}})),
    "call-arguments": (CHAT, chat_base(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}])),
    "two-constraints": (CHAT, chat_base(guided_regex="a+", guided_choice=["a"])),
    "format-and-guided": (COMPLETIONS, completion_base(response_format={"type": "json_object"}, guided_regex="a")),
    "top-logprobs-without-logprobs": (CHAT, chat_base(top_logprobs=2)),
}
NOT_JSON = {
    "unclosed-object": b"{", "missing-value": b'{"model": }', "trailing-comma": b'{"model": "x",}',
    "single-quotes": b"{'model': 'x'}", "trailing-garbage": b"{} x", "bare-word": b"nul", "unclosed-array": b"[",
    "invalid-utf8": b'{"model": "\xff\xfe"}', "utf8-bom": b'\xef\xbb\xbf{"model": "x"}', "only-whitespace": b"   ",
    "empty": b"", "5000-digit-number": b'{"model": "x", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    "deep-array": ("[" * 100_000 + "]" * 100_000).encode(), "deep-object": ('{"a":' * 50_000 + "1" + "}" * 50_000).encode(),
    "nul-byte": b'{"model": "x\x00"}', "control-char": b'{"model": "\x01"}', "lone-low-surrogate": b'"\\udc00"',
}
NOT_OBJECT = {"null": b"null", "array": b"[]", "array-of-body": encode([chat_base()]), "string": b'"hi"', "number": b"42",
              "true": b"true", "nan": b"NaN", "infinity": b"-Infinity"}
NOT_JSON_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/xml", "text/html", "application/octet-stream", "application/jsonx", "image/png")


def _set(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**base, key: value}


def build_cases() -> list[Case]:
    cases: list[Case] = []
    for path, base, fields in ((CHAT, chat_base(), {**COMMON, **CHAT_ONLY}),
                               (COMPLETIONS, completion_base(), {**COMMON, **COMPLETION_ONLY})):
        kind = "chat" if path == CHAT else "completion"
        for key, values in fields.items():
            for name, value in values.items():
                cases.append(Case(f"{kind}.{key}.{name}", path, encode(_set(base, key, value))))
        for key, value in (("model", SURROGATE), ("stop", [SURROGATE]), ("model", "unknown")):
            streamed = _set({**base, "stream": True}, key, value)
            cases.append(Case(f"{kind}.streamed.{key}.{'surrogate' if value != 'unknown' else value}", path,
                              encode(streamed)))
        for name, raw in NOT_JSON.items():
            cases.append(Case(f"{kind}.not-json.{name}", path, raw))
        for name, raw in NOT_OBJECT.items():
            cases.append(Case(f"{kind}.not-object.{name}", path, raw))
        valid = encode(base)
        for content_type in NOT_JSON_TYPES:
            cases.append(Case(f"{kind}.content-type.{content_type.split(';')[0]}", path, valid, content_type))
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            cases.append(Case(f"{kind}.method.{method}", path, valid, method=method))
    cases.append(Case("completion.streamed.prompt.surrogate", COMPLETIONS,
                      encode(completion_base(stream=True, prompt=SURROGATE))))
    for name, (path, body) in {**NESTED_UNKNOWN, **MISSING}.items():
        cases.append(Case(f"structure.{name}", path, encode(body)))
    for route in ("/v1/models", "/v1/models/" + MODEL_ID, "/v1/cache/stats", "/health", "/metrics"):
        cases.append(Case(f"method.POST{route}", route, b"{}", method="POST"))
    for route in ("/v1/chat", "/v1/completion", "/v2/chat/completions", "/v1/embeddings", "/v1/models/nope",
                  "/v1/models/" + "%ED%A0%80"):
        cases.append(Case(f"route{route}", route, b"", method="GET"))
    return cases


CASES = build_cases()


def test_the_bases_are_valid(http: httpx.Client) -> None:
    """Each case breaks a valid body in one place (no content type at all is a case of its own)."""
    for path, base in ((CHAT, chat_base()), (COMPLETIONS, completion_base())):
        response = http.post(path, content=encode(base), headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
    no_type = http.post(CHAT, content=encode(chat_base()))
    assert no_type.status_code == 415 and no_type.json()["error"]["message"].startswith("No Content-Type")


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 500
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request_is_a_4xx_in_openai_shape(http: httpx.Client, case: Case) -> None:
    headers = {**({"content-type": case.content_type} if case.content_type else {}), **case.headers}
    response = http.request(case.method, case.path, content=case.body or None, headers=headers)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    assert "Traceback" not in response.text and "pydantic" not in error["message"]


def test_serves_normally_after_the_table(http: httpx.Client, server: Server) -> None:
    wait_idle(http, 10)
    response = http.post(CHAT, json=chat_body("hi", max_tokens=3, ignore_eos=True))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log() and "Exception in ASGI application" not in server.log()
