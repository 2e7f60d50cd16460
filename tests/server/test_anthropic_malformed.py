"""Malformed Messages API requests, generated field by field, each answered with a 4xx in
Anthropic's error shape through real HTTP (``{"type": "error", "error": {"type", "message"}}``);
never a 5xx, a traceback or a hang, and the server serves a good request afterwards.

Every case breaks a valid body (``max_tokens: 1``) in one place: values of the wrong JSON type,
numbers out of range, huge and not numbers, lone surrogates, deep nesting, unknown and missing
fields, content blocks this server does not take (images, documents, server tools' blocks) or in
the wrong turn, bad tools and tool choices, thinking budgets, fields of Anthropic's API for what
this server does not run (containers, MCP servers, compaction...), bodies that are not JSON or
not objects, content types that are not JSON, other methods, and a body over the size limit.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_ID, Server, wait_idle
from tests.server.test_malformed import (DEEP_LIST, HUGE, INF, NAN, NOT_JSON, NOT_JSON_TYPES, NOT_OBJECT, STRING,
                                         SURROGATE, encode, numbers, wrong_types)

MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
TYPE_BY_STATUS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                  413: "request_too_large", 415: "invalid_request_error"}
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    method: str = "POST"


def base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **fields}


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


TEXT = {"type": "text", "text": "hi"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}
BOOL = {**wrong_types("bool"), "string-true": "true", "one": 1}

FIELDS: dict[str, dict[str, Any]] = {
    "model": {**STRING, "null": None, "empty": "", "unknown-model": "claude-sonnet-4-5", "huge-number": HUGE},
    "max_tokens": {**wrong_types("int", "float"), **numbers(0, 5000, integer=True), "null": None, "minus-one": -1},
    "temperature": {**wrong_types("int", "float"), **numbers(-0.1, 1.01, integer=False)},
    "top_p": {**wrong_types("int", "float"), **numbers(0, 1.01, integer=False)},
    "top_k": {**wrong_types("int"), **numbers(-1, 2**31, integer=True)},
    "stream": BOOL,
    "stop_sequences": {**wrong_types("list"), "a-string": "stop", "empty-string": [""], "list-of-int": [1],
                       "17-strings": [f"s{i}" for i in range(17)], "nested": [["a"]], "surrogate": [SURROGATE],
                       "deep-list": DEEP_LIST},
    "system": {**wrong_types("str", "list"), "list-of-str": ["be brief"], "image-block": [IMAGE],
               "block-without-text": [{"type": "text"}], "text-int": [{"type": "text", "text": 7}],
               "block-unknown-field": [{**TEXT, "x": 1}], "bad-cache-control": [{**TEXT, "cache_control": {
                   "type": "persistent"}}], "bad-ttl": [{**TEXT, "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
               "surrogate": SURROGATE, "surrogate-block": [{"type": "text", "text": SURROGATE}]},
    "messages": {**wrong_types("list"), "empty": [], "list-of-str": ["hi"], "role-tool": [{"role": "tool", "content": "x"}],
                 "role-developer": [{"role": "developer", "content": "x"}], "surrogate-role": [{"role": SURROGATE,
                                                                                              "content": "x"}],
                 "missing-role": [{"content": "x"}], "missing-content": [{"role": "user"}],
                 "content-int": [{"role": "user", "content": 7}], "content-object": [{"role": "user", "content": TEXT}],
                 "content-empty-list": [{"role": "user", "content": []}], "image-block": [user(TEXT, IMAGE)],
                 "document-block": [user({"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                         "data": "x"}})],
                 "search-result-block": [user({"type": "search_result", "source": "x", "title": "t", "content": []})],
                 "server-tool-use-block": [user(TEXT), assistant({"type": "server_tool_use", "id": "srvtoolu_1",
                                                                  "name": "web_search", "input": {}}), user(TEXT)],
                 "unknown-block": [user({"type": "foo"})], "block-without-type": [user({"text": "hi"})],
                 "block-not-object": [user("hi")], "text-int": [user({"type": "text", "text": 7})],
                 "tool-use-in-user-turn": [user(USE)], "tool-result-in-assistant-turn": [user(TEXT), assistant(RESULT),
                                                                                          user(TEXT)],
                 "thinking-in-user-turn": [user({"type": "thinking", "thinking": "x", "signature": "s"})],
                 "tool-use-without-id": [user(TEXT), assistant({k: v for k, v in USE.items() if k != "id"}), user(TEXT)],
                 "tool-use-input-string": [user(TEXT), assistant({**USE, "input": "{}"}), user(TEXT)],
                 "tool-use-input-list": [user(TEXT), assistant({**USE, "input": [1]}), user(TEXT)],
                 "tool-result-without-id": [user(TEXT), assistant(USE), user({"type": "tool_result", "content": "x"})],
                 "tool-result-content-int": [user(TEXT), assistant(USE), user({**RESULT, "content": 7})],
                 "tool-result-image": [user(TEXT), assistant(USE), user({**RESULT, "content": [IMAGE]})],
                 "tool-result-is-error-string": [user(TEXT), assistant(USE), user({**RESULT, "is_error": "yes"})],
                 "thinking-without-signature": [user(TEXT), assistant({"type": "thinking", "thinking": "x"}), user(TEXT)],
                 "redacted-without-data": [user(TEXT), assistant({"type": "redacted_thinking"}), user(TEXT)],
                 "prefill": [user(TEXT), {"role": "assistant", "content": "The answer is"}],
                 "message-unknown-field": [{"role": "user", "content": "x", "name": "me"}],
                 "block-unknown-field": [user({**TEXT, "x": 1})], "surrogate-text": [user({"type": "text",
                                                                                          "text": SURROGATE})],
                 "surrogate-tool-input-key": [user(TEXT), assistant({**USE, "input": {SURROGATE: 1}}), user(TEXT)],
                 "5000-messages": [{"role": "user", "content": "hi there"}] * 5000,
                 "4-million-characters": [{"role": "user", "content": "a" * 4_000_000}],
                 "deep-content": [{"role": "user", "content": DEEP_LIST}], "deep-list": DEEP_LIST},
    "tools": {**wrong_types("list"), "list-of-int": [7], "empty-tool": [{}], "no-schema": [{"name": "f"}],
              "no-name": [{"input_schema": {"type": "object"}}], "bad-name": [{**TOOL, "name": "bad name"}],
              "65-char-name": [{**TOOL, "name": "f" * 65}], "schema-string": [{**TOOL, "input_schema": "x"}],
              "schema-not-object": [{**TOOL, "input_schema": {"type": "string"}}],
              "schema-invalid": [{**TOOL, "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}],
              "web-search": [{"type": "web_search_20250305", "name": "web_search"}],
              "bash": [{"type": "bash_20250124", "name": "bash"}],
              "text-editor": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}],
              "openai-shape": [{"type": "function", "function": {"name": "f"}}], "duplicate-names": [TOOL, TOOL],
              "unknown-field": [{**TOOL, "parameters": {}}], "bad-cache-control": [{**TOOL, "cache_control": {"type": 1}}],
              "surrogate-name": [{**TOOL, "name": SURROGATE}], "deep-list": DEEP_LIST},
    "tool_choice": {**wrong_types("object"), "string-auto": "auto", "empty": {}, "required": {"type": "required"},
                    "tool-without-name": {"type": "tool"}, "tool-without-tools": {"type": "tool", "name": "get_weather"},
                    "any-without-tools": {"type": "any"},
                    "unknown-field": {"type": "auto", "x": 1}, "parallel-string": {"type": "any",
                                                                                  "disable_parallel_tool_use": "yes"},
                    "none-with-parallel": {"type": "none", "disable_parallel_tool_use": True}},
    "thinking": {**wrong_types("object"), "empty": {}, "enabled-without-budget": {"type": "enabled"},
                 "budget-1023": {"type": "enabled", "budget_tokens": 1023},
                 "budget-not-below-max-tokens": {"type": "enabled", "budget_tokens": 2048},
                 "budget-string": {"type": "enabled", "budget_tokens": "2048"}, "type-on": {"type": "on"},
                 "display-bad": {"type": "adaptive", "display": "full"},
                 "unknown-field": {"type": "disabled", "budget_tokens": 2048}},
    "metadata": {**wrong_types("object"), "user-id-int": {"user_id": 7}, "unknown-field": {"session": "x"},
                 "surrogate-user-id": {"user_id": SURROGATE}},
    "service_tier": {**STRING, "priority": "priority"},
    "speed": {**STRING, "warp": "warp"},
    "inference_geo": wrong_types("str"),
    "output_config": {**wrong_types("object"), "effort-extreme": {"effort": "extreme"},
                      "format-json-object": {"format": {"type": "json_object"}},
                      "format-without-schema": {"format": {"type": "json_schema"}},
                      "format-bad-schema": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
                      "unknown-field": {"verbosity": "low"}},
    "cache_control": {**wrong_types("object"), "bad-type": {"type": "persistent"}},
    "container": {"id": "container_1", "object": {"id": "c", "skills": []}},
    "mcp_servers": {**wrong_types("list"), "one": [{"type": "url", "url": "https://mcp.example", "name": "x"}]},
    "compaction": {"object": {"type": "auto"}},
    "thread": {"create": {"type": "create"}},
    "fallbacks": {"default": "default"},
    "billing_policy": {"user-profile": {"type": "billing_policy", "bill_to": "user_profile"}},
    "context_management": wrong_types("object"),
    "diagnostics": {**wrong_types("object"), "unknown-field": {"previous": "msg_1"}},
}
UNKNOWN = {"frobnicate": True, "n": 2, "seed": 1, "user_profile_id": "up_1", "betas": ["x"], "messages_": [],
           SURROGATE: 1, "": 1}
STRUCTURE = {"tool-not-in-tools": base(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
             "tool-result-image-block": base(messages=[user(TEXT), assistant(USE), user({**RESULT, "content": [IMAGE]})]),
             "system-block-image": base(system=[TEXT, IMAGE]),
             "json-output-with-forced-tool": base(tools=[TOOL], tool_choice={"type": "any"}, output_config={
                 "format": {"type": "json_schema", "schema": {"type": "object"}}})}
COUNT_CASES = {"missing-model": {k: v for k, v in base().items() if k != "model"},
               "missing-messages": {"model": MODEL_ID}, "empty-messages": {"model": MODEL_ID, "messages": []},
               "image": {"model": MODEL_ID, "messages": [user(IMAGE)]}, "unknown-model": {**base(), "model": "x"},
               "server-tool": {**base(), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
               "unknown-field": {**base(), "frobnicate": 1}, "container": {**base(), "container": "c"},
               "max-tokens-zero": {**base(), "max_tokens": 0}}


def build_cases() -> list[Case]:
    cases = []
    for key, values in FIELDS.items():
        for name, value in values.items():
            cases.append(Case(f"{key}.{name}", MESSAGES, encode({**base(), key: value})))
    for key, value in UNKNOWN.items():
        cases.append(Case(f"unknown-field.{key.encode('unicode_escape').decode() or 'empty'}", MESSAGES,
                          encode({**base(), key: value})))
    for key in ("model", "max_tokens", "messages"):
        cases.append(Case(f"missing.{key}", MESSAGES, encode({k: v for k, v in base().items() if k != key})))
    for name, key, value in (("surrogate-model", "model", SURROGATE), ("surrogate-stop", "stop_sequences", [SURROGATE]),
                             ("unknown-model", "model", "unknown"), ("image", "messages", [user(IMAGE)]),
                             ("infinite-temperature", "temperature", INF), ("nan-top-k", "top_k", NAN)):
        cases.append(Case(f"streamed.{name}", MESSAGES, encode({**base(stream=True), key: value})))
    for name, body in STRUCTURE.items():
        cases.append(Case(f"structure.{name}", MESSAGES, encode(body)))
    for name, body in COUNT_CASES.items():
        cases.append(Case(f"count.{name}", COUNT, encode(body)))
    for path in (MESSAGES, COUNT):
        kind = "count" if path == COUNT else "messages"
        cases += [Case(f"{kind}.not-json.{name}", path, raw) for name, raw in NOT_JSON.items()]
        cases += [Case(f"{kind}.not-object.{name}", path, raw) for name, raw in NOT_OBJECT.items()]
        cases += [Case(f"{kind}.content-type.{t.split(';')[0]}", path, encode(base()), t) for t in NOT_JSON_TYPES]
        cases += [Case(f"{kind}.method.{m}", path, encode(base()), method=m) for m in ("GET", "PUT", "DELETE")]
        cases.append(Case(f"{kind}.no-content-type", path, encode(base()), None))
    cases.append(Case("route.unknown", "/v1/messages/batches", b"", method="GET"))
    return cases


CASES = build_cases()


def test_the_base_is_valid(http: httpx.Client) -> None:
    for path in (MESSAGES, COUNT):
        response = http.post(path, content=encode(base()), headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request_is_a_4xx_in_anthropic_shape(http: httpx.Client, case: Case) -> None:
    headers = {"content-type": case.content_type} if case.content_type else {}
    response = http.request(case.method, case.path, content=case.body or None, headers=headers)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["request_id"].startswith("req_")
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == TYPE_BY_STATUS[response.status_code]
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text and "pydantic" not in body["error"]["message"]


def test_a_body_over_the_limit_is_anthropics_413(server: Server) -> None:
    """Refused on its Content-Length, before one byte of it is read."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {MESSAGES} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {17 * 2**20}\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    body = json.loads(payload)
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert "max-request-bytes" in body["error"]["message"]


def test_serves_normally_after_the_table(http: httpx.Client, server: Server) -> None:
    wait_idle(http, 10)
    response = http.post(MESSAGES, json={**base(), "max_tokens": 3})
    assert response.status_code == 200 and response.json()["content"][0]["type"] == "text"
    assert "Traceback" not in server.log() and "Exception in ASGI application" not in server.log()
