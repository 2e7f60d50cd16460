"""Anthropic's Messages API over real HTTP with the official ``anthropic`` SDK (strict response
validation): messages whole and streamed, tools (forced, any, none, parallel, a round trip),
stop reasons, usage and the prefix cache, count_tokens, thinking on the thinking variant of the
bundled model, ``x-api-key`` auth and Claude Code's billing line.

The sampling fields (``temperature``...) are not arguments of the SDK's ``create``, so they go in
``extra_body``, as any other field the SDK does not name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server.cli import server_config, build_parser
from server.errors import error_response
from tests.server.conftest import API_KEY, MODEL_ID, Server, client_of, post_json, served
from tests.think_model import make_think_model

GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather of a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MANY_CITIES = "Weather in Paris, Berlin, Rome and Oslo?"
THINK_MODEL = "fixture-think"
# a system prompt of ~300 tokens: more than two whole blocks (128 tokens) of the prefix cache
LONG_SYSTEM = " ".join(f"Rule {i}: answer about shell commands briefly and name the command first." for i in range(24))
BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch={};"


def sdk_of(server: Server, api_key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120,
                               _strict_response_validation=True)


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return sdk_of(server)


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def raw_events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed message's ``(event, data)`` pairs, checking the SSE framing: every data line
    follows an ``event:`` line naming its payload's type."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
                name = None
            else:
                assert line == "" or line.startswith(":"), line
    return [(n, d) for n, d in events if n != "ping"]


def test_a_message_and_its_usage(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL_ID, max_tokens=6, messages=ask("What is 2+2?"), extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_ID
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == 6 and message.usage.cache_creation_input_tokens == 0
    count = claude.messages.count_tokens(model=MODEL_ID, messages=ask("What is 2+2?"))
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == count.input_tokens


def test_end_turn(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL_ID, max_tokens=64, messages=ask("hi"), extra_body=GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.output_tokens < 64


def test_the_stream_assembles_the_same_message(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    body = {"model": MODEL_ID, "max_tokens": 12, "messages": ask("How do I list files?")}
    whole = claude.messages.create(**body, extra_body=GREEDY)
    with claude.messages.stream(**body, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = raw_events(http, {**body, **GREEDY})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    assert names[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(names) - 5) + ["content_block_stop"]
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 12


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(claude: anthropic.Anthropic, stream: bool) -> None:
    body = {"model": MODEL_ID, "max_tokens": 30, "messages": ask("Say hello."), "extra_body": GREEDY}
    text = claude.messages.create(**body).content[0].text
    word = text.split()[3]
    stopped = {**body, "stop_sequences": ["never-written", word]}
    if stream:
        with claude.messages.stream(**stopped) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**stopped)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    assert message.content[0].text == text[:text.index(word)].lstrip()


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool(claude: anthropic.Anthropic, stream: bool) -> None:
    body = {"model": MODEL_ID, "max_tokens": 60, "messages": ask("Weather in Paris?"), "tools": [WEATHER, TIME],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": GREEDY}
    whole = claude.messages.create(**body)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    if stream:
        with claude.messages.stream(**body) as s:
            final = s.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]
        assert final.stop_reason == "tool_use"


def test_any_tool_and_parallel_calls(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    """``any`` is chat's ``required``: the same calls as /v1/chat/completions writes for the same
    greedy prompt, several of them; ``disable_parallel_tool_use`` keeps the first."""
    body = {"model": MODEL_ID, "max_tokens": 120, "messages": ask(MANY_CITIES), "tools": [WEATHER, TIME],
            "extra_body": GREEDY}
    message = claude.messages.create(**body, tool_choice={"type": "any"})
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert len(calls) >= 2 and [b.type for b in message.content] == ["tool_use"] * len(calls)
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                     "parameters": t["input_schema"]}} for t in (WEATHER, TIME)]
    chat = post_json(http, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 120, "messages": ask(MANY_CITIES),
                                                    "tools": chat_tools, "tool_choice": "required", **GREEDY})
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in chat["choices"][0]["message"]["tool_calls"]]
    one = claude.messages.create(**body, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [(b.name, b.input) for b in one.content if b.type == "tool_use"] == calls[:1]
    assert one.stop_reason == "tool_use"


def test_tool_choice_none_makes_no_call(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL_ID, max_tokens=40, messages=ask(MANY_CITIES), tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    assert message.content and all(block.type == "text" for block in message.content)
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_a_tool_round_trip_renders_as_the_chat_conversation(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    """tool_use -> tool_result -> answer; the second turn's prompt is the chat path's prompt of
    the same conversation (assistant tool_calls, a tool message), token for token."""
    first = claude.messages.create(model=MODEL_ID, max_tokens=60, messages=ask("Weather in Paris?"), tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    call = first.content[0]
    conversation = [*ask("Weather in Paris?"), first.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, sunny"}]},
        {"type": "text", "text": "Thanks. And tomorrow?"}]}]
    answer = claude.messages.create(model=MODEL_ID, max_tokens=8, messages=conversation, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    chat_messages = [*ask("Weather in Paris?"),
                     {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
                         "name": "get_weather", "arguments": json.dumps(call.input)}}]},
                     {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "18 C, sunny"},
                     {"role": "user", "content": "Thanks. And tomorrow?"}]
    chat = post_json(http, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 1, "messages": chat_messages,
                                                    "tools": [{"type": "function", "function": {
                                                        "name": WEATHER["name"], "description": WEATHER["description"],
                                                        "parameters": WEATHER["input_schema"]}}]})
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_a_json_schema_output(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"command": {"enum": ["ls", "cd", "pwd"]}}, "required": ["command"],
              "additionalProperties": False}
    message = claude.messages.create(model=MODEL_ID, max_tokens=40, messages=ask("Which command lists files?"),
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     extra_body=GREEDY)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_is_the_prompt_that_runs(claude: anthropic.Anthropic) -> None:
    body = {"model": MODEL_ID, "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [*ask("List files"), {"role": "assistant", "content": "Use ls."}, *ask("And hidden ones?")],
            "tools": [WEATHER]}
    count = claude.messages.count_tokens(**body).input_tokens
    message = claude.messages.create(**body, max_tokens=1, extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == count
    assert count > claude.messages.count_tokens(**{**body, "tools": None}).input_tokens  # the tools are rendered


def test_the_next_turn_reads_the_last_one_from_the_cache(claude: anthropic.Anthropic) -> None:
    system = "Turn test. " + LONG_SYSTEM
    first = claude.messages.create(model=MODEL_ID, max_tokens=8, system=system, messages=ask("How do I list files?"),
                                   extra_body=GREEDY)
    second = claude.messages.create(model=MODEL_ID, max_tokens=8, system=system, extra_body=GREEDY, messages=[
        *ask("How do I list files?"), first.to_param(), *ask("And hidden ones?")])
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 256
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens


def test_root_answers_get_and_head(http: httpx.Client) -> None:
    assert http.head("/").status_code == 200
    response = http.get("/")
    assert response.status_code == 200 and response.json()["name"] == "kvarn"


def test_unknown_model_is_anthropics_404(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ask("hi"))
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert MODEL_ID in caught.value.body["error"]["message"]


def test_headers_and_beta_query_are_accepted(http: httpx.Client) -> None:
    response = http.post("/v1/messages?beta=true", json={"model": MODEL_ID, "max_tokens": 2, "messages": ask("hi")},
                         headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] <= 2


def test_overloaded_is_anthropics_529() -> None:
    """The server's 503s (a model still loading, an engine that is full) are Anthropic's 529 on
    these routes, and stay 503 in OpenAI's shape elsewhere."""
    ours = error_response(503, "The model is still loading.", path="/v1/messages", headers={"Retry-After": "1"})
    assert (ours.status_code, ours.headers["retry-after"]) == (529, "1")
    assert json.loads(ours.body)["error"] == {"type": "overloaded_error", "message": "The model is still loading."}
    assert error_response(503, "x", path="/v1/chat/completions").status_code == 503


def test_the_openapi_document_has_the_routes(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    create = document["paths"]["/v1/messages"]["post"]
    assert sorted(create["responses"]) == ["200", "400", "401", "403", "404", "413", "415", "429", "500", "529"]
    assert create["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicErrorResponse")
    assert set(create["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("MessagesRequest")
    count = document["paths"]["/v1/messages/count_tokens"]["post"]
    assert count["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("TokenCount")
    assert "422" not in count["responses"] and "max_tokens" in document["components"]["schemas"]["MessagesRequest"][
        "required"]


# --- auth ---
def test_x_api_key_auth(auth_server: Server) -> None:
    assert sdk_of(auth_server, API_KEY).messages.create(model=MODEL_ID, max_tokens=2, messages=ask("hi")).content
    bearer = anthropic.Anthropic(base_url=auth_server.base_url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL_ID, messages=ask("hi")).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        sdk_of(auth_server, "wrong").messages.create(model=MODEL_ID, max_tokens=2, messages=ask("hi"))
    assert caught.value.body["error"]["type"] == "authentication_error"
    with client_of(auth_server) as http:
        missing = http.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 2, "messages": ask("hi")})
        assert missing.status_code == 401 and missing.json()["type"] == "error"
        assert missing.json()["error"]["type"] == "authentication_error"
        chat = http.get("/v1/models", headers={"x-api-key": API_KEY})  # every route takes the header
        assert chat.status_code == 200 and chat.json()["data"][0]["id"] == MODEL_ID
        assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape elsewhere


# --- Claude Code's billing line ---
@pytest.fixture(scope="module")
def keeping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "keep-billing", "--keep-billing-header") as srv:
        yield srv


def billed(client: anthropic.Anthropic, nonce: str, tag: str, count: bool = False) -> Any:
    system = [{"type": "text", "text": BILLING.format(nonce)},
              {"type": "text", "text": f"{tag} {LONG_SYSTEM}", "cache_control": {"type": "ephemeral"}}]
    if count:
        return client.messages.count_tokens(model=MODEL_ID, system=system, messages=ask("hi"))
    return client.messages.create(model=MODEL_ID, max_tokens=2, system=system, messages=ask("hi"), extra_body=GREEDY)


def test_the_billing_flag() -> None:
    parse = build_parser().parse_args
    assert server_config(parse(["serve", "--keep-billing-header"])).keep_billing_header is True
    assert server_config(parse(["serve"])).keep_billing_header is False


def test_the_billing_line_is_dropped(claude: anthropic.Anthropic, keeping: Server) -> None:
    """A second conversation with another billing line reads the first one's system prompt from
    the cache; a server that keeps the line caches nothing across them."""
    assert billed(claude, "aaaaa", "Billing dropped.").usage.cache_read_input_tokens == 0
    assert billed(claude, "bbbbb", "Billing dropped.").usage.cache_read_input_tokens >= 256
    keep = sdk_of(keeping)
    assert billed(keep, "aaaaa", "Billing kept.").usage.cache_read_input_tokens == 0
    assert billed(keep, "bbbbb", "Billing kept.").usage.cache_read_input_tokens == 0
    kept, dropped = billed(keep, "ccccc", "x", count=True), billed(claude, "ccccc", "x", count=True)
    assert kept.input_tokens > dropped.input_tokens
    plain = claude.messages.count_tokens(model=MODEL_ID, system=f"x {LONG_SYSTEM}", messages=ask("hi"))
    assert dropped.input_tokens == plain.input_tokens  # the line alone is gone, the rest renders as one block


# --- thinking ---
@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    folder = make_think_model(tmp_path_factory.mktemp("think-model") / THINK_MODEL)
    with served(tmp_path_factory, "think", str(folder)) as srv:
        yield sdk_of(srv)


def test_thinking_makes_a_thinking_block(thinker: anthropic.Anthropic) -> None:
    body = {"model": THINK_MODEL, "max_tokens": 12, "messages": ask("How do I list files?"),
            "thinking": {"type": "adaptive"}, "extra_body": GREEDY}
    message = thinker.messages.create(**body)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert message.content[0].signature
    with thinker.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    off = thinker.messages.create(**{**body, "thinking": {"type": "disabled"}})
    assert all(block.type != "thinking" for block in off.content)
    hidden = thinker.messages.create(**{**body, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert [(b.type, b.thinking, b.signature) for b in hidden.content] == [("thinking", "", message.content[0].signature)]


def test_thinking_switches_the_template(thinker: anthropic.Anthropic) -> None:
    """``enabled`` and ``adaptive`` open the think block in the prompt, ``disabled`` does not;
    an earlier turn's thinking block is read back without failing the request."""
    def count(thinking: dict[str, Any] | None) -> int:
        extra = {"thinking": thinking} if thinking else {}
        return thinker.messages.count_tokens(model=THINK_MODEL, messages=ask("hi"), **extra).input_tokens
    enabled, adaptive = count({"type": "enabled", "budget_tokens": 2048}), count({"type": "adaptive"})
    disabled = count({"type": "disabled"})
    assert enabled == adaptive == disabled + 2  # "<think>" and its newline
    history = [*ask("hi"), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "A greeting.", "signature": "abc"}, {"type": "text", "text": "Hello!"}]},
        *ask("How are you?")]
    assert thinker.messages.create(model=THINK_MODEL, max_tokens=2, messages=history, extra_body=GREEDY).content
