"""Structured outputs through real HTTP with the official ``openai`` SDK (strict response
validation): ``response_format`` json_schema / json_object / text and vLLM's ``guided_*``
fields, streamed and not, at temperature 0 and 1; invalid schemas and fields are 400s in
OpenAI's shape before any token; a client leaving mid-stream frees its constrained row."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_ID, Server, chat_body, metric, stream_json, wait_idle
from tests.server.schemas import INVALID_SCHEMAS, SCHEMAS

TEMPERATURES = (0.0, 1.0)
MAX_TOKENS = 256


def _schema_format(name: str, schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def _ask(sdk: openai.OpenAI, name: str, temperature: float) -> Any:
    return sdk.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": f"Reply with JSON for: {name.replace('_', ' ')}."}],
        max_tokens=MAX_TOKENS, temperature=temperature, seed=7, response_format=_schema_format(name, SCHEMAS[name]))


@pytest.fixture(scope="module")
def schema_replies(sdk: openai.OpenAI) -> dict[tuple[str, float], Any]:
    """Every schema at every temperature, sent at once (the engine runs them as one batch)."""
    jobs = [(name, t) for name in SCHEMAS for t in TEMPERATURES]
    with ThreadPoolExecutor(16) as pool:
        return dict(zip(jobs, pool.map(lambda job: _ask(sdk, *job), jobs)))


def test_there_are_at_least_twenty_schemas() -> None:
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(schema_replies: dict, name: str, temperature: float) -> None:
    reply = schema_replies[(name, temperature)]
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert reply.usage.completion_tokens < MAX_TOKENS


def test_the_sdk_parse_helper_gets_a_parsed_model(sdk: openai.OpenAI) -> None:
    class Command(BaseModel):
        command: Literal["ls", "cd", "pwd"]
        recursive: bool
        depth: int

    completion = sdk.chat.completions.parse(model=MODEL_ID, messages=[{"role": "user", "content": "List files"}],
                                            max_tokens=64, temperature=0, response_format=Command)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Command) and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_json_object_output_parses(sdk: openai.OpenAI, temperature: float) -> None:
    """Any JSON object: nothing bounds its size, and at temperature 1 this 29M model sometimes
    nests or lists on until max_tokens (seen in about 1 of 6 choices), so a choice ends either
    with a complete object (``stop``) or at max_tokens (``length``); greedy ends."""
    reply = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "A JSON object."}],
                                        max_tokens=MAX_TOKENS, temperature=temperature, seed=3, n=4,
                                        response_format={"type": "json_object"})
    stopped = [c for c in reply.choices if c.finish_reason == "stop"]
    for choice in stopped:
        assert isinstance(json.loads(choice.message.content), dict)
    assert len(stopped) == 4 if temperature == 0 else len(stopped) >= 2
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)


def test_n_choices_each_validate(sdk: openai.OpenAI) -> None:
    schema = SCHEMAS["tool_like"]
    reply = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Pick a command."}],
                                        max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=4,
                                        response_format=_schema_format("cmd", schema))
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_text_is_free_text(sdk: openai.OpenAI) -> None:
    free = sdk.chat.completions.create(**chat_body("What does ls do?"), response_format={"type": "text"})
    plain = sdk.chat.completions.create(**chat_body("What does ls do?"))
    assert free.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_streamed_json_schema_output_validates(sdk: openai.OpenAI, temperature: float) -> None:
    schema = SCHEMAS["nested_object"]
    stream = sdk.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "A user as JSON."}], max_tokens=MAX_TOKENS,
        temperature=temperature, seed=1, stream=True, stream_options={"include_usage": True},
        response_format=_schema_format("user", schema))
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # really streamed
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].usage.completion_tokens > 3


def test_completions_take_response_format_and_guided_fields(sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(model=MODEL_ID, prompt="A config:", max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].text), dict)
    choice = sdk.completions.create(model=MODEL_ID, prompt="Favourite colour:", max_tokens=16, temperature=1,
                                    seed=2, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue") and choice.choices[0].finish_reason == "stop"
    date = sdk.completions.create(model=MODEL_ID, prompt="Today is", max_tokens=32, temperature=1, seed=2,
                                  extra_body={"guided_regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert len(date.choices[0].text) == 11 and date.choices[0].text[5] == "-"


def test_chat_takes_guided_json_and_guided_grammar(sdk: openai.OpenAI) -> None:
    schema = SCHEMAS["flat_object"]
    reply = sdk.chat.completions.create(**chat_body("A person.", max_tokens=MAX_TOKENS),
                                        extra_body={"guided_json": json.dumps(schema)})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    grammar = 'start: "ls " flag " " path\nflag: "-l" | "-a"\npath: /[a-z\\/]{1,12}/\n'
    reply = sdk.chat.completions.create(**chat_body("A command.", max_tokens=32),
                                        extra_body={"guided_grammar": grammar})
    text = reply.choices[0].message.content
    assert text.startswith(("ls -l ", "ls -a ")) and reply.choices[0].finish_reason == "stop", text


def _refused(http: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """POST ``body`` expecting a 400 in OpenAI's shape (never a stream), and no token generated."""
    tokens = metric(http, "kvarn_generation_tokens_total")
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert metric(http, "kvarn_generation_tokens_total") == tokens
    return error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(INVALID_SCHEMAS))
def test_invalid_schemas_are_400s_before_any_token(http: httpx.Client, case: str, stream: bool) -> None:
    schema, words = INVALID_SCHEMAS[case]
    error = _refused(http, chat_body(response_format=_schema_format("bad", schema), stream=stream))
    assert error["param"] == "response_format" and error["code"] == "invalid_schema"
    assert words in error["message"]
    error = _refused(http, {"model": MODEL_ID, "prompt": "x", "guided_json": schema, "stream": stream},
                     "/v1/completions")
    assert error["param"] == "guided_json" and words in error["message"]


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "bogus": 1}},
     "response_format.json_schema.bogus"),
    ({"type": "json_object", "extra": True}, "response_format.extra"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
])
def test_malformed_response_formats_are_400s(http: httpx.Client, response_format: dict, param: str) -> None:
    assert _refused(http, chat_body(response_format=response_format))["param"] == param


def test_malformed_guided_fields_are_400s(http: httpx.Client) -> None:
    error = _refused(http, chat_body(response_format={"type": "json_object"}, guided_regex="[0-9]+"))
    assert error["param"] == "guided_regex" and "Only one" in error["message"]
    assert _refused(http, chat_body(guided_json="{not json"))["param"] == "guided_json"
    assert _refused(http, chat_body(guided_regex="(unclosed"))["code"] == "invalid_grammar"
    assert _refused(http, chat_body(guided_grammar="start: undefined_rule"))["param"] == "guided_grammar"
    assert _refused(http, chat_body(guided_choice=[]))["param"] == "guided_choice"
    assert _refused(http, chat_body(guided_decoding_backend="xgrammar"))["param"] == "guided_decoding_backend"


def test_a_disconnect_mid_constrained_stream_frees_the_row(http: httpx.Client, server: Server) -> None:
    wait_idle(http)
    body = chat_body("Letters.", max_tokens=3000, stream=True, temperature=1.0, guided_regex="[a-z ]{4000}")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection at once
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                    if seen == 4:  # the role chunk and three with letters
                        break
            assert http.get("/health").json()["running"] == 1
    closed = time.monotonic()
    health = wait_idle(http, 10.0)
    assert health["running"] == 0 and health["waiting"] == 0 and health["kv_bytes"] == 0
    assert time.monotonic() - closed < 10.0


def test_streamed_constrained_chunks_are_ordinary_chunks(http: httpx.Client) -> None:
    chunks = stream_json(http, "/v1/chat/completions", chat_body(
        "A colour.", max_tokens=16, stream=True, response_format=_schema_format("c", SCHEMAS["string_enum"])))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert json.loads(text)["color"] in ("red", "green", "blue")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
