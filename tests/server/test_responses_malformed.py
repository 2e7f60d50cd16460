"""Hundreds of malformed Responses API requests, field by field, each answered with a 4xx in OpenAI's
error shape through real HTTP: never a 5xx, a traceback or a hang, and the server answers normally
afterwards. The bodies carry ``max_output_tokens: 1`` and none of them is valid, so no case
generates at all (``test_the_base_is_valid`` shows the base itself is)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_ID, Server, wait_idle
from tests.server.test_malformed import (BOOL, DEEP_LIST, NOT_JSON, NOT_JSON_TYPES, STRING, SURROGATE, Case, _deep_schema,
                                         encode, numbers, wrong_types)

PATH = "/v1/responses"
FUNCTION = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "input": "hi", "max_output_tokens": 1, **fields}


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def calls(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "x"}, *items]


FIELDS: dict[str, dict[str, Any]] = {
    "model": {**STRING, "null": None, "empty": "", "unknown-model": "gpt-4o"},
    "input": {
        **wrong_types("str", "list"), "null": None, "empty-list": [], "list-of-str": ["hi"], "list-of-int": [7],
        "unknown-item-type": [{"type": "bogus"}], "missing-role": [{"content": "x"}],
        "unknown-role": [{"role": "wizard", "content": "x"}], "tool-role": [{"role": "tool", "content": "x"}],
        "content-int": user(7), "content-object": user({"text": "x"}), "content-null": user(None),
        "image-part": user([{"type": "input_image", "image_url": "https://example.com/a.png"}]),
        "file-part": user([{"type": "input_file", "file_id": "file-1"}]),
        "audio-part": user([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]),
        "unknown-part": user([{"type": "video", "url": "x"}]), "part-without-text": user([{"type": "input_text"}]),
        "part-text-int": user([{"type": "input_text", "text": 7}]),
        "part-unknown-field": user([{"type": "input_text", "text": "x", "y": 1}]),
        "message-unknown-field": [{"role": "user", "content": "x", "extra": 1}],
        "message-bad-status": [{"type": "message", "role": "user", "content": "x", "status": "done"}],
        "message-bad-phase": [{"role": "assistant", "content": "x", "phase": "middle"}],
        "call-without-call-id": calls({"type": "function_call", "name": "f", "arguments": "{}"}),
        "call-without-arguments": calls({"type": "function_call", "call_id": "c", "name": "f"}),
        "call-arguments-not-json": calls({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}),
        "call-arguments-object": calls({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}),
        "output-without-output": calls({"type": "function_call_output", "call_id": "c"}),
        "output-without-call-id": calls({"type": "function_call_output", "output": "1"}),
        "output-int": calls({"type": "function_call_output", "call_id": "c", "output": 7}),
        "output-image": calls({"type": "function_call_output", "call_id": "c",
                               "output": [{"type": "input_image", "image_url": "x"}]}),
        "reasoning-bad-summary": calls({"type": "reasoning", "summary": [{"type": "text", "text": "x"}]}),
        "reasoning-content-str": calls({"type": "reasoning", "summary": [], "content": "x"}),
        "item-reference": [{"type": "item_reference", "id": "msg_1"}],
        "web-search-call": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}],
        "local-shell-call": [{"type": "local_shell_call", "id": "ls_1", "call_id": "c", "status": "completed",
                              "action": {"type": "exec", "command": ["ls"], "env": {}}}],
        "surrogate": SURROGATE, "surrogate-in-part": user([{"type": "input_text", "text": SURROGATE}]),
        "surrogate-role": [{"role": SURROGATE, "content": "x"}], "deep-content": user(DEEP_LIST),
        "5000-items": user("hi there") * 5000, "4-million-characters": "a" * 4_000_000, "deep-list": DEEP_LIST},
    "instructions": STRING,
    "tools": {
        **wrong_types("list"), "list-of-int": [7], "empty-tool": [{}], "no-name": [{"type": "function"}],
        "bad-name": [{**FUNCTION, "name": "bad name"}], "65-char-name": [{**FUNCTION, "name": "f" * 65}],
        "parameters-string": [{**FUNCTION, "parameters": "x"}],
        "parameters-not-object": [{**FUNCTION, "parameters": {"type": "string"}}],
        "parameters-bad-schema": [{**FUNCTION, "parameters": {"type": "object", "properties": {"a": {"type": "x"}}}}],
        "deep-parameters": [{**FUNCTION, "parameters": _deep_schema(200)}],
        "duplicate-names": [FUNCTION, FUNCTION], "unknown-field": [{**FUNCTION, "extra": 1}],
        "chat-shaped": [{"type": "function", "function": {"name": "f"}}],
        "defer-loading": [{**FUNCTION, "defer_loading": True}],
        "programmatic-caller": [{**FUNCTION, "allowed_callers": ["programmatic"]}],
        "surrogate-description": [{**FUNCTION, "description": SURROGATE}],
        **{f"builtin-{kind}": [{"type": kind}] for kind in ("file_search", "computer_use_preview", "code_interpreter",
                                                             "image_generation", "mcp", "local_shell", "custom",
                                                             "shell", "apply_patch")},
        "namespace-empty": [{"type": "namespace", "name": "n", "tools": []}],
        "namespace-builtin": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}],
        "namespace-duplicate": [FUNCTION, {"type": "namespace", "name": "n", "tools": [FUNCTION]}],
        "unknown-type": [{"type": "teleport"}], "deep-list": DEEP_LIST},
    "tool_choice": {
        **wrong_types("str", "object"), "unknown-string": "sometimes", "empty-object": {},
        "function-without-name": {"type": "function"}, "chat-shaped": {"type": "function", "function": {"name": "f"}},
        "required-without-tools": "required", "named-without-tools": {"type": "function", "name": "get_weather"},
        "builtin": {"type": "web_search_preview"}, "web-search": {"type": "web_search"}, "mcp": {"type": "mcp", "server_label": "x"},
        "allowed-without-tools": {"type": "allowed_tools", "mode": "auto", "tools": []},
        "allowed-bad-mode": {"type": "allowed_tools", "mode": "none", "tools": [{"type": "function", "name": "f"}]},
        "surrogate": {"type": "function", "name": SURROGATE}},
    "parallel_tool_calls": BOOL,
    "text": {**wrong_types("object"), "format-string": {"format": "json"}, "format-unknown": {"format": {"type": "xml"}},
             "schema-without-name": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
             "schema-without-schema": {"format": {"type": "json_schema", "name": "x"}},
             "bad-name": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}},
             "schema-a-list": {"format": {"type": "json_schema", "name": "x", "schema": [1]}},
             "bad-schema": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
             "chat-shaped": {"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
             "unknown-field": {"format": {"type": "text"}, "extra": 1}, "verbosity": {"verbosity": "loud"}},
    "reasoning": {**wrong_types("object"), "effort": {"effort": "extreme"}, "summary": {"summary": "long"},
                  "mode": {"mode": "pro"}, "context": {"context": "some_turns"}, "unknown-field": {"budget": 10}},
    "max_output_tokens": {**wrong_types("int"), **numbers(0, 5000, integer=True)},
    "temperature": {**wrong_types("int", "float"), **numbers(-0.1, 2.01, integer=False)},
    "top_p": {**wrong_types("int", "float"), **numbers(0, 1.01, integer=False)},
    "top_logprobs": {**wrong_types("int"), **numbers(-1, 21, integer=True)},
    "stream": BOOL,
    "store": BOOL,
    "previous_response_id": {**wrong_types("str"), "unknown": "resp_" + "0" * 48, "traversal": "resp_../../x",
                             "not-an-id": "chatcmpl-1", "surrogate": SURROGATE},
    "metadata": {**wrong_types("object"), "17-pairs": {f"k{i}": "v" for i in range(17)}, "65-char-key": {"k" * 65: "v"},
                 "513-char-value": {"k": "v" * 513}, "int-value": {"k": 1}, "null-value": {"k": None}},
    "user": STRING,
    "safety_identifier": {**STRING, "129-chars": "s" * 129},
    "prompt_cache_key": STRING,
    "prompt_cache_retention": {**wrong_types(), "unknown": "forever"},
    "prompt_cache_options": {**wrong_types("object"), "prewarm": {"prewarm": True}, "ttl": {"ttl": "1y"}},
    "service_tier": {**wrong_types(), "unknown": "gold"},
    "truncation": {**wrong_types(), "unknown": "middle"},
    "include": {**wrong_types("list"), "unknown": ["everything"], "string": "reasoning.encrypted_content"},
    "background": {"true": True, **wrong_types("bool")},
    "background_options": {"object": {"completion_window": "2h"}},
    "conversation": {"id": "conv_1", "object": {"id": "conv_1"}},
    "prompt": {"object": {"id": "pmpt_1"}},
    "moderation": {"object": {"model": "omni-moderation-latest"}},
    "context_management": {"compaction": [{"type": "compaction"}]},
    "max_tool_calls": {**wrong_types("int"), "zero": 0},
    "client_metadata": {**wrong_types("object"), "int-value": {"k": 1}},
}
UNKNOWN_FIELDS = ("frobnicate", "messages", "max_tokens", "seed", "top_k", "n", "stop", "response_format",
                  "logprobs", "cache_salt")
STRUCTURE = {
    "missing-model": {"input": "hi"}, "missing-input": {"model": MODEL_ID}, "empty-object": {},
    "stream-options-without-stream": base(stream_options={"include_obfuscation": False}),
    "stream-options-unknown-field": base(stream=True, stream_options={"include_usage": True}),
    "forced-call-with-json-schema": base(tools=[FUNCTION], tool_choice="required",
                                         text={"format": {"type": "json_object"}}),
    "named-unknown-function": base(tools=[FUNCTION], tool_choice={"type": "function", "name": "other"}),
    "allowed-unknown-function": base(tools=[FUNCTION], tool_choice={"type": "allowed_tools", "mode": "auto",
                                                                    "tools": [{"type": "function", "name": "other"}]}),
    "streamed-unknown-model": base(stream=True, model="gpt-4o"),
    "streamed-surrogate": base(stream=True, input=SURROGATE),
    "streamed-unknown-previous": base(stream=True, previous_response_id="resp_" + "1" * 48),
    "context-exceeded": base(input="word " * 5000),
    "context-exceeded-streamed": base(input="word " * 5000, stream=True),
}
MISSING_ID = "resp_" + "f" * 48
ROUTES = [("GET", f"/v1/responses/{MISSING_ID}"), ("DELETE", f"/v1/responses/{MISSING_ID}"),
          ("GET", "/v1/responses/not-an-id"), ("DELETE", "/v1/responses/..%2F..%2Fetc"),
          ("GET", f"/v1/responses/{MISSING_ID}/input_items"), ("GET", "/v1/responses"), ("PUT", PATH), ("PATCH", PATH),
          ("GET", "/v1/responses/" + "%ED%A0%80"), ("POST", f"/v1/responses/{MISSING_ID}")]


def build_cases() -> list[Case]:
    cases = [Case(f"{key}.{name}", PATH, encode({**base(), key: value}))
             for key, values in FIELDS.items() for name, value in values.items()]
    cases += [Case(f"unknown.{key}", PATH, encode(base(**{key: 1}))) for key in UNKNOWN_FIELDS]
    cases += [Case(f"structure.{name}", PATH, encode(body)) for name, body in STRUCTURE.items()]
    cases += [Case(f"not-json.{name}", PATH, raw) for name, raw in NOT_JSON.items()]
    cases += [Case(f"not-object.{name}", PATH, raw) for name, raw in
              {"null": b"null", "array": b"[]", "string": b'"hi"', "number": b"42", "body-in-array": encode([base()])}.items()]
    cases += [Case(f"content-type.{kind.split(';')[0]}", PATH, encode(base()), kind) for kind in NOT_JSON_TYPES]
    cases += [Case(f"route.{method}{route}", route, b"", None, method) for method, route in ROUTES]
    return cases


CASES = build_cases()
INPUT_ITEMS_QUERIES = ("limit=0", "limit=101", "limit=x", "order=sideways", "after=msg_unknown")


def test_the_base_is_valid(http: httpx.Client) -> None:
    response = http.post(PATH, content=encode(base()), headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 1


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 300
    assert len({c.id for c in CASES}) == len(CASES)


def check_error(response: httpx.Response) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert "Traceback" not in response.text and "pydantic" not in error["message"]
    return error


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request_is_a_4xx_in_openai_shape(http: httpx.Client, case: Case) -> None:
    headers = {"content-type": case.content_type} if case.content_type else {}
    check_error(http.request(case.method, case.path, content=case.body or None, headers=headers))


@pytest.mark.parametrize("query", INPUT_ITEMS_QUERIES)
def test_malformed_input_items_queries(http: httpx.Client, query: str) -> None:
    stored = http.post(PATH, json=base()).json()["id"]
    check_error(http.get(f"/v1/responses/{stored}/input_items?{query}"))


@pytest.mark.parametrize(("body", "param"), [
    (base(input=user([{"type": "input_image", "image_url": "x"}])), "input_image"),
    (base(tools=[{"type": "code_interpreter", "container": {"type": "auto"}}]), "code_interpreter"),
    (base(tools=[FUNCTION, {"type": "web_search"}], tool_choice={"type": "web_search"}), "web_search"),
    (base(background=True), "background"),
    (base(conversation="conv_1"), "conversation"), (base(prompt={"id": "pmpt_1"}), "prompt"),
    (base(previous_response_id="resp_" + "2" * 48), "previous_response_id")])
def test_refusals_name_what_is_refused(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = check_error(http.post(PATH, json=body))
    assert param in error["message"] or error["param"] == param


def test_serves_normally_after_the_table(http: httpx.Client, server: Server) -> None:
    wait_idle(http, 10)
    response = http.post(PATH, json=base(max_output_tokens=3, input="How do I list files?"))
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 3
    assert "Traceback" not in server.log() and "Exception in ASGI application" not in server.log()
