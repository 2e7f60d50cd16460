"""The request fields of OpenAI's Chat Completions reference that real clients send, over real HTTP
with the ``openai`` SDK: the no-ops change nothing, ``reasoning_effort`` and
``chat_template_kwargs`` switch a thinking model's think block (on the thinking variant of the
bundled model), ``allowed_tools`` narrows the calls, and each capability this server lacks is a
400 that names it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_ID, Server, client_of, post_json, served, stream_json
from tests.think_model import make_think_model

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "How do I list files in Linux?"}]
NO_OPS: dict[str, Any] = {
    "store": True, "metadata": {"team": "search", "run": "42"}, "service_tier": "auto", "reasoning_effort": "low",
    "user": "user-1", "safety_identifier": "hash-of-user-1", "prompt_cache_key": "agent-7", "verbosity": "low",
    "modalities": ["text"], "prediction": {"type": "content", "content": "Use the ls command."},
    "prompt_cache_retention": "24h",
}


def greedy(sdk: openai.OpenAI, **fields: Any) -> Any:
    return sdk.chat.completions.create(model=MODEL_ID, messages=fields.pop("messages", ASK), temperature=0,
                                       max_tokens=fields.pop("max_tokens", 12), **fields)


def test_every_field_clients_send_is_accepted_and_changes_nothing(sdk: openai.OpenAI) -> None:
    plain = greedy(sdk)
    reply = greedy(sdk, **NO_OPS, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                              "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    assert reply.choices[0].finish_reason == plain.choices[0].finish_reason == "length"


ROUTER_SWITCHES = {"skip_special_tokens": True, "continue_final_message": False, "separate_reasoning": True,
                   "stream_reasoning": True, "include_reasoning": True, "return_hidden_states": False,
                   "no_stop_trim": False}


def test_the_switches_vllm_router_forwards_are_taken_at_their_defaults(sdk: openai.OpenAI, http: httpx.Client) -> None:
    """vllm-router re-sends every chat request with vLLM's and SGLang's output switches: at the
    behaviour this server has they change nothing; another value is a 400 naming the switch."""
    plain = greedy(sdk)
    reply = greedy(sdk, extra_body=ROUTER_SWITCHES)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 2}
    for field, value in ROUTER_SWITCHES.items():
        if field == "no_stop_trim":  # both values mean something (tests/server/test_tokenize.py)
            continue
        response = http.post(CHAT, json={**body, field: not value})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field


def test_a_stream_takes_include_obfuscation_and_carries_no_obfuscation_field(sdk: openai.OpenAI,
                                                                             http: httpx.Client) -> None:
    plain = greedy(sdk)
    chunks = list(greedy(sdk, stream=True, stream_options={"include_usage": True, "include_obfuscation": True},
                         **NO_OPS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert all("obfuscation" not in c.model_fields_set for c in chunks)
    chunks = stream_json(http, "/v1/completions", {"model": MODEL_ID, "prompt": "ls", "max_tokens": 3, "stream": True,
                                                   "user": "u", "stream_options": {"include_usage": True,
                                                                                   "include_obfuscation": False}})
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and all("obfuscation" not in c for c in chunks)


def test_message_fields_clients_send_back_are_taken(sdk: openai.OpenAI) -> None:
    """``name``, a refusal (field and part), ``audio: null``, text parts with cache breakpoints."""
    messages = [{"role": "system", "content": "Be brief.", "name": "policy"},
                {"role": "user", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": {
                    "mode": "explicit", "ttl": "30m"}}], "name": "ann"},
                {"role": "assistant", "content": [{"type": "text", "text": "No."}, {"type": "refusal",
                                                                                   "refusal": "I can't."}],
                 "refusal": "I can't.", "audio": None},
                {"role": "user", "content": "How do I list files?"}]
    reply = greedy(sdk, messages=messages)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def allowed(mode: str, *names: str) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": n}} for n in names]}}


def test_allowed_tools_required_calls_only_the_listed_tools(sdk: openai.OpenAI) -> None:
    for name in ("get_weather", "get_time"):
        reply = greedy(sdk, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME],
                       tool_choice=allowed("required", name), parallel_tool_calls=False, max_tokens=60)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == [name]
        json.loads(choice.message.tool_calls[0].function.arguments)


def test_allowed_tools_auto_renders_only_the_listed_tools(sdk: openai.OpenAI) -> None:
    both = greedy(sdk, tools=[WEATHER, TIME], max_tokens=1)
    one = greedy(sdk, tools=[WEATHER, TIME], tool_choice=allowed("auto", "get_time"), max_tokens=1)
    alone = greedy(sdk, tools=[TIME], max_tokens=1)
    assert one.usage.prompt_tokens == alone.usage.prompt_tokens < both.usage.prompt_tokens


TOOL = WEATHER
UNSUPPORTED = [
    ("modalities-audio", {"modalities": ["text", "audio"]}, "modalities", "unsupported_value", "Audio output"),
    ("audio", {"audio": {"format": "wav", "voice": "alloy"}}, "audio", "unsupported_value", "Audio output"),
    ("web-search", {"web_search_options": {"search_context_size": "low"}}, "web_search_options", "unsupported_value",
     "Web search"),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, "moderation", "unsupported_value",
     "Moderation"),
    ("functions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions", "unsupported_value",
     "send the functions as 'tools'"),
    ("function-call", {"function_call": {"name": "f"}}, "function_call", "unsupported_value", "'tools'"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/cat.png"}}]}]}, "messages.0.content", "invalid_value", "Image input"),
    ("audio-part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hear"}, {
        "type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, "messages.0.content",
     "invalid_value", "Audio input"),
    ("file-part", {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]},
     "messages.0.content", "invalid_value", "File input"),
    ("custom-tool", {"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0]", "unsupported_value",
     "Custom tools"),
    ("custom-tool-choice", {"tools": [TOOL], "tool_choice": {"type": "custom", "custom": {"name": "grep"}}},
     "tool_choice", "unsupported_value", "custom tools"),
    ("custom-allowed-tool", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "custom", "custom": {"name": "grep"}}]}}},
     "tool_choice.allowed_tools.tools[0]", "unsupported_value", "custom tools"),
    ("unknown-allowed-tool", {"tools": [TOOL], "tool_choice": allowed("required", "nope")},
     "tool_choice.allowed_tools.tools[0]", "invalid_value", "no function named 'nope'"),
    ("function-role", {"messages": [*ASK, {"role": "function", "name": "f", "content": "1"}]}, "messages[1].role",
     "unsupported_value", "'tool' message"),
    ("assistant-function-call", {"messages": [*ASK, {"role": "assistant", "function_call": {
        "name": "f", "arguments": "{}"}}]}, "messages[1].function_call", "unsupported_value", "'tool_calls'"),
    ("assistant-audio", {"messages": [*ASK, {"role": "assistant", "audio": {"id": "audio_1"}}]}, "messages[1].audio",
     "unsupported_value", "Audio answers"),
    ("custom-call", {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {
        "name": "grep", "input": "x"}}]}]}, "messages[1].tool_calls[0]", "unsupported_value", "Custom tool calls"),
    ("refusal-part-in-user", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "messages[0].content[0]", "invalid_value", "only allowed in assistant messages"),
]


@pytest.mark.parametrize("fields, param, code, words", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_each_missing_capability_is_a_400_that_names_it(http: httpx.Client, fields, param, code, words) -> None:
    body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 2, **fields}
    response = http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert words in error["message"]


# --- the thinking switch, on the thinking variant of the bundled model ---
THINK = "fixture-think"


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_think_model(tmp_path_factory.mktemp("think-model") / THINK)
    with served(tmp_path_factory, "think-fields", str(model), "--log-level", "debug") as srv:
        yield srv


@pytest.fixture(scope="module")
def think(think_server: Server) -> Iterator[httpx.Client]:
    with client_of(think_server) as client:
        yield client


def think_chat(think: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(think, CHAT, {"model": THINK, "messages": ASK, "max_tokens": 8, "temperature": 0,
                                   "ignore_eos": True, **fields})


@pytest.mark.parametrize("off", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}},
                                 {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}],
                         ids=["effort-none", "template-kwargs", "kwargs-over-effort"])
def test_thinking_off_renders_no_open_think_block(think: httpx.Client, off: dict[str, Any]) -> None:
    on = think_chat(think, reasoning_effort="high")
    reply = think_chat(think, **off)
    assert on["choices"][0]["message"]["reasoning_content"]
    message = reply["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    # the generation prompt ends before "<think>\n": the open block is what thinking on adds
    assert reply["usage"]["prompt_tokens"] < on["usage"]["prompt_tokens"]


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "chat_template"])
def test_a_reserved_template_argument_is_a_400(think: httpx.Client, key: str) -> None:
    response = think.post(CHAT, json={"model": THINK, "messages": ASK, "max_tokens": 2,
                                      "chat_template_kwargs": {key: None if key != "messages" else []}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("chat_template_kwargs", "invalid_value") and f"'{key}'" in error["message"]


def test_who_asked_is_in_the_debug_log_line(think: httpx.Client, think_server: Server) -> None:
    think_chat(think, user="user-77", safety_identifier="sid-77", metadata={"trace": "t-77"})
    assert "user=user-77 safety_identifier=sid-77 metadata={'trace': 't-77'}" in think_server.log()


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "kvarn-capped", "--default-max-tokens", "5") as srv:
        yield srv


def test_default_max_tokens_caps_requests_that_set_none(capped: Server) -> None:
    """``--default-max-tokens``: a chat-shaped request without a cap (agent CLIs send none) stops
    there; one that sets its own cap keeps it, on each API."""
    with client_of(capped) as http:
        ask = {"model": MODEL_ID, "messages": ASK, "temperature": 0, "ignore_eos": True}
        free = post_json(http, CHAT, ask)
        assert free["usage"]["completion_tokens"] == 5 and free["choices"][0]["finish_reason"] == "length"
        own = post_json(http, CHAT, {**ask, "max_tokens": 9})
        assert own["usage"]["completion_tokens"] == 9
        response = post_json(http, "/v1/responses", {"model": MODEL_ID, "input": "How do I list files?",
                                                      "temperature": 0, "store": False})
        assert response["usage"]["output_tokens"] <= 5
        assert response["status"] == "completed" or response["incomplete_details"] == {"reason": "max_output_tokens"}
