"""OpenAI's Responses API over real HTTP with the official SDK (strict validation): string and item
input, instructions, the stream's events and its assembled response, structured outputs, function
calls (forced, streamed, a round trip), ``max_output_tokens``, ``previous_response_id`` served by
the prefix cache, the store (``store: false``, GET, DELETE, input items, a restart), truncation,
log-probabilities and reasoning items on the thinking variant of the bundled model.

Each answer is checked against ``/v1/chat/completions`` on the same conversation: one chat path
runs both, so the greedy text and the prompt's token count are the same."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_ID, Server, post_json, served
from tests.think_model import make_think_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "search", "description": "Search the documentation", "parameters": SEARCH,
          "strict": None}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
G = 128  # the prefix cache's block


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-store")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, store_dir: Path) -> Iterator[Server]:
    with served(tmp_path_factory, "responses", "--responses-store-dir", str(store_dir)) as server:
        yield server


def sdk_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", _strict_response_validation=True,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(srv: Server) -> openai.OpenAI:
    return sdk_of(srv)


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.base_url, timeout=120) as client:
        yield client


def create(sdk: openai.OpenAI, **fields: Any) -> Any:
    return sdk.responses.create(**{"model": MODEL_ID, "temperature": 0, "max_output_tokens": 24, **fields})


def chat(http: httpx.Client, messages: list[dict[str, Any]], max_tokens: int = 24, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **fields}
    return post_json(http, "/v1/chat/completions", body)


def same_as_chat(response: Any, completion: dict[str, Any]) -> None:
    """The response says what the chat completion of the same conversation says."""
    choice = completion["choices"][0]
    assert response.output_text == (choice["message"]["content"] or "")
    assert response.usage.input_tokens == completion["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == completion["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status == ("incomplete" if choice["finish_reason"] == "length" else "completed")


def test_a_string_input_is_one_user_turn(sdk: openai.OpenAI, http: httpx.Client) -> None:
    response = create(sdk, input="hi", max_output_tokens=40)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_ID
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant" and message.status == "completed"
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    assert response.incomplete_details is None and response.error is None and response.store is True
    assert (response.temperature, response.max_output_tokens, response.tools, response.tool_choice) == (0, 40, [], "auto")
    same_as_chat(response, chat(http, [{"role": "user", "content": "hi"}], 40))


def test_items_and_instructions_are_the_chat_conversation(sdk: openai.OpenAI, http: httpx.Client) -> None:
    items = [{"role": "developer", "content": "Answer in one line."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": "How do I list files?"}]
    response = create(sdk, input=items, instructions="You are terse.", metadata={"run": "a"})
    assert response.instructions == "You are terse." and response.metadata == {"run": "a"}
    same_as_chat(response, chat(http, [{"role": "system", "content": "You are terse."},
                                       {"role": "system", "content": "Answer in one line."},
                                       {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "How do I list files?"}]))


def comparable(response: Any) -> dict[str, Any]:
    """A response without what differs from one run to the next (ids, times) and without what the
    SDK's stream helper adds (``parsed``)."""
    body = response.model_dump(exclude={"id", "created_at", "completed_at"})
    for item in body["output"]:
        item.pop("id")
        item.pop("parsed_arguments", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return body


def test_the_stream_is_the_responses_events_in_order(sdk: openai.OpenAI) -> None:
    fields = {"model": MODEL_ID, "input": "hi", "instructions": "You are terse.", "temperature": 0,
              "max_output_tokens": 40}
    with sdk.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    message = final.output[0]
    assert all(e.item_id == message.id for e in events if e.type == "response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert events[-1].response.id == final.id == events[0].response.id
    assert comparable(final) == comparable(sdk.responses.create(**fields))


def test_parse_gives_a_validated_object(sdk: openai.OpenAI) -> None:
    class Weather(BaseModel):
        city: str
        degrees: int

    response = sdk.responses.parse(model=MODEL_ID, input="Weather in Paris?", text_format=Weather, temperature=0,
                                   max_output_tokens=60)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Weather)
    assert Weather.model_validate_json(response.output_text) == response.output_parsed
    assert response.text.format.type == "json_schema" and response.text.format.name == "Weather"


def check_call(item: Any, name: str) -> None:
    assert item.type == "function_call" and item.name == name and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_") and len(item.call_id) == 29
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", [{"type": "function", "name": "search"}, "required",
                                    {"type": "allowed_tools", "mode": "required",
                                     "tools": [{"type": "function", "name": "search"}]}])
def test_a_forced_call_is_valid_under_its_schema(sdk: openai.OpenAI, choice: Any) -> None:
    response = create(sdk, input="Find the docs about rain gear.", tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=False, max_output_tokens=80)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    check_call(calls[0], calls[0].name if choice == "required" else "search")
    assert response.status == "completed" and response.parallel_tool_calls is False


def test_a_function_call_round_trip(sdk: openai.OpenAI, http: httpx.Client) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = create(sdk, input=[question], tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=80)
    call = first.output[-1]
    check_call(call, "get_weather")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny."}
    second = create(sdk, input=[question, *[item.model_dump(exclude_none=True) for item in first.output], result],
                    tools=TOOLS)
    assert all(item.type == "message" for item in second.output)
    same_as_chat(second, chat(http, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny."}],
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
               for t in TOOLS]))


def test_a_namespace_offers_its_functions(sdk: openai.OpenAI) -> None:
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [TOOLS[0]]}
    response = create(sdk, input="What is the weather in Paris?", tools=[namespace, TOOLS[1]],
                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                      extra_body={"client_metadata": {"session_id": "s1"}})
    call = response.output[-1]
    check_call(call, "get_weather")
    assert call.namespace == "weather" and response.tools[0].type == "namespace"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C", "namespace": "weather"}
    follow = create(sdk, input=[call.model_dump(exclude_none=True), result], previous_response_id=response.id,
                    tools=[namespace], max_output_tokens=4)
    items = sdk.responses.input_items.list(follow.id, order="asc").data
    assert [(i.type, getattr(i, "namespace", None)) for i in items[-2:]] == [("function_call", "weather"),
                                                                              ("function_call_output", "weather")]


def test_a_declared_web_search_is_not_offered_to_the_model(sdk: openai.OpenAI) -> None:
    """Codex CLI declares a hosted web search by default: the request is served with the model
    shown only the function tools (the same prompt, token for token, as without the search)."""
    plain = create(sdk, input="What is the weather in Paris?", tools=TOOLS, max_output_tokens=8)
    declared = create(sdk, input="What is the weather in Paris?", max_output_tokens=8,
                      tools=[*TOOLS, {"type": "web_search", "search_context_size": "low"}])
    assert declared.status in ("completed", "incomplete")
    assert declared.usage.input_tokens == plain.usage.input_tokens
    assert [t.type for t in declared.tools] == ["function", "function", "web_search"]


def test_a_streamed_call_arrives_as_argument_events(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model=MODEL_ID, input="What is the weather in Paris?", tools=TOOLS, temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    check_call(final.output[0], "get_weather")
    assert events[3].delta == events[4].arguments == final.output[0].arguments
    assert events[2].item.status == "in_progress" and events[2].item.arguments == ""


def test_max_output_tokens_makes_an_incomplete_response(sdk: openai.OpenAI) -> None:
    response = create(sdk, input="How do I list files?", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"
    with sdk.responses.create(model=MODEL_ID, input="How do I list files?", max_output_tokens=5, temperature=0,
                              stream=True) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


def test_previous_response_id_continues_from_the_prefix_cache(sdk: openai.OpenAI, http: httpx.Client) -> None:
    story = f"[{uuid.uuid4().hex}] " + "The dog and the cat live in a house with a garden by the river. " * 20
    first = create(sdk, input=story, instructions="You are terse.", max_output_tokens=12)
    assert first.usage.input_tokens > 2 * G and first.usage.input_tokens_details.cached_tokens == 0
    second = create(sdk, input="And then?", instructions="You are terse.", previous_response_id=first.id,
                    max_output_tokens=12)
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // G * G >= 2 * G  # every block of the first prompt
    same_as_chat(second, chat(http, [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": story},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "And then?"}], 12))
    items = sdk.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"),
                                                      ("message", "user")]
    assert items.data[1].id == first.output[0].id


def test_an_unknown_previous_response_is_a_404(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        create(sdk, input="hi", previous_response_id="resp_" + "0" * 48)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"


def test_get_delete_and_store_false(sdk: openai.OpenAI, http: httpx.Client) -> None:
    response = create(sdk, input="hi", max_output_tokens=4)
    assert sdk.responses.retrieve(response.id) == response
    assert http.delete(f"/v1/responses/{response.id}").json() == {"id": response.id, "object": "response.deleted",
                                                                   "deleted": True}
    for method in ("GET", "DELETE"):
        answer = http.request(method, f"/v1/responses/{response.id}")
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "response_not_found"
    unstored = create(sdk, input="hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        create(sdk, input="hi", previous_response_id=unstored.id)


def test_input_items_are_pages(sdk: openai.OpenAI) -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(5)]
    response = create(sdk, input=turns, max_output_tokens=2)
    newest_first = [item.content[0].text for item in sdk.responses.input_items.list(response.id).data]
    assert newest_first == [f"turn {i}" for i in reversed(range(5))]
    page = sdk.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["turn 0", "turn 1"] and page.has_more
    assert [item.content[0].text for item in page.iter_pages().__next__().data] == ["turn 0", "turn 1"]
    rest = sdk.responses.input_items.list(response.id, order="asc", limit=10, after=page.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["turn 2", "turn 3", "turn 4"] and not rest.has_more


def test_the_disk_store_survives_a_restart(sdk: openai.OpenAI, store_dir: Path,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    response = create(sdk, input="hi", max_output_tokens=4)
    assert (store_dir / f"{response.id}.json").is_file()
    with served(tmp_path_factory, "responses-restarted", "--responses-store-dir", str(store_dir)) as again:
        restarted = sdk_of(again)
        assert restarted.responses.retrieve(response.id) == response
        follow = create(restarted, input="And?", previous_response_id=response.id, max_output_tokens=2)
        assert follow.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens


def test_truncation_auto_drops_the_oldest_turns(sdk: openai.OpenAI, http: httpx.Client) -> None:
    long_turn = {"role": "user", "content": "word " * 5000}
    turns = [long_turn, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
    refused = http.post("/v1/responses", json={"model": MODEL_ID, "input": turns, "max_output_tokens": 4})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "input"
    response = create(sdk, input=turns, truncation="auto", max_output_tokens=4)
    assert response.truncation == "auto"
    assert response.usage.input_tokens == create(sdk, input="hi", max_output_tokens=4).usage.input_tokens
    assert [i.content[0].text for i in sdk.responses.input_items.list(response.id).data] == ["hi"]


def test_logprobs_come_with_the_output_text(sdk: openai.OpenAI) -> None:
    response = create(sdk, input="hi", include=["message.output_text.logprobs"], top_logprobs=2,
                      max_output_tokens=6)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    with sdk.responses.stream(model=MODEL_ID, input="hi", include=["message.output_text.logprobs"], top_logprobs=2,
                              temperature=0, max_output_tokens=6) as stream:
        streamed = [entry for e in stream if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder = make_think_model(tmp_path_factory.mktemp("think-model") / "fixture-think")
    with served(tmp_path_factory, "responses-think", str(folder)) as server:
        yield sdk_of(server)


def test_reasoning_is_a_reasoning_item(think: openai.OpenAI) -> None:
    fields = {"model": "fixture-think", "input": "How do I list files?", "temperature": 0, "max_output_tokens": 12,
              "reasoning": {"effort": "high"}}
    response = think.responses.create(**fields)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [part.type for part in reasoning.content] == ["reasoning_text"] and reasoning.content[0].text
    chat_reply = think.chat.completions.create(model="fixture-think", temperature=0, max_tokens=12,
                                               reasoning_effort="high", messages=[{"role": "user",
                                                                                   "content": fields["input"]}])
    assert reasoning.content[0].text == chat_reply.choices[0].message.model_extra["reasoning_content"]
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    with think.responses.stream(**fields) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "response.reasoning_text.done" in kinds and kinds[-1] == "response.incomplete"
    off = think.responses.create(**{**fields, "reasoning": {"effort": "none"}})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_the_openapi_document_has_the_routes(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    create_route = document["paths"]["/v1/responses"]["post"]
    assert sorted(create_route["responses"]) == ["200", "400", "401", "403", "404", "413", "415", "429", "500", "503"]
    assert set(create_route["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    request_schema = create_route["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    assert {"model", "input", "previous_response_id", "store"} <= set(document["components"]["schemas"][request_schema]
                                                                      ["properties"])
    stored = document["paths"]["/v1/responses/{response_id}"]
    assert {method: sorted(stored[method]["responses"]) for method in ("get", "delete")} == {
        "get": ["200", "401", "403", "404", "413"], "delete": ["200", "401", "403", "404", "413"]}
    assert "404" in document["paths"]["/v1/responses/{response_id}/input_items"]["get"]["responses"]
