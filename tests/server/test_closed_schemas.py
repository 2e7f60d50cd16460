"""Schemas as agent frameworks send them, over real HTTP on the bundled model with the ``openai``
SDK: Pydantic's ``model_json_schema()`` (what LangChain's ``bind_tools`` and instructor send) says
nothing of ``additionalProperties``; its objects are closed, so a forced call or a structured
answer ends with valid JSON instead of growing keys until ``max_tokens``. With ``strict: true`` no
object may be open to any key."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import MAX_FORCED_CALLS
from tests.server.conftest import MODEL_ID


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="The city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"] = "celsius"
    days: int = Field(default=1, ge=1, le=14, description="How many days to forecast")


class Place(BaseModel):
    city: str
    country: str


class Trip(BaseModel):
    """A trip: where to and for how long."""

    destination: Place
    nights: int = Field(ge=1, le=30)
    note: str | None = None


WEATHER_SCHEMA = GetWeather.model_json_schema()
TRIP_SCHEMA = Trip.model_json_schema()  # a nested model: its $defs travel with it
WEATHER_TOOL = {"type": "function", "function": {"name": "GetWeather", "description": GetWeather.__doc__,
                                                 "parameters": WEATHER_SCHEMA}}
TRIP_TOOL = {"type": "function", "function": {"name": "Trip", "description": Trip.__doc__, "parameters": TRIP_SCHEMA}}
ASK = [{"role": "user", "content": "Use the tool to check the weather in Berlin."}]
ROME = [{"role": "user", "content": "Plan a trip to Rome, as JSON."}]
# enough for every call a `required` turn may make, so the turn always ends by itself
ROOM = MAX_FORCED_CALLS * 60


def test_the_schemas_say_nothing_of_additional_properties() -> None:
    for schema in (WEATHER_SCHEMA, TRIP_SCHEMA, TRIP_SCHEMA["$defs"]["Place"]):
        assert "additionalProperties" not in schema


def create(sdk: openai.OpenAI, **fields: Any) -> Any:
    return sdk.chat.completions.create(model=MODEL_ID, messages=fields.pop("messages", ASK), temperature=0, **fields)


def check_calls(calls: list[Any], schemas: dict[str, dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("tool, schema", [(WEATHER_TOOL, WEATHER_SCHEMA), (TRIP_TOOL, TRIP_SCHEMA)],
                         ids=["flat", "nested"])
def test_a_call_forced_by_name_closes_with_valid_arguments(sdk: openai.OpenAI, tool, schema) -> None:
    name = tool["function"]["name"]
    reply = create(sdk, tools=[tool], tool_choice={"type": "function", "function": {"name": name}}, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name == name
    check_calls(choice.message.tool_calls, {name: schema})
    assert reply.usage.completion_tokens < 200


def test_required_with_one_call_closes(sdk: openai.OpenAI) -> None:
    reply = create(sdk, tools=[WEATHER_TOOL, TRIP_TOOL], tool_choice="required", parallel_tool_calls=False,
                   max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {"GetWeather": WEATHER_SCHEMA, "Trip": TRIP_SCHEMA})


def test_required_with_parallel_calls_ends_with_valid_calls(sdk: openai.OpenAI) -> None:
    reply = create(sdk, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=ROOM)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert 1 <= len(choice.message.tool_calls) <= MAX_FORCED_CALLS
    check_calls(choice.message.tool_calls, {"GetWeather": WEATHER_SCHEMA})


def test_a_streamed_forced_call_assembles_into_valid_arguments(sdk: openai.OpenAI) -> None:
    stream = create(sdk, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                    max_tokens=200, stream=True)
    arguments, finish = "", None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or ():
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


@pytest.mark.parametrize("schema", [WEATHER_SCHEMA, TRIP_SCHEMA], ids=["flat", "nested"])
def test_response_format_from_a_default_pydantic_model_stops_with_valid_json(sdk: openai.OpenAI, schema) -> None:
    reply = create(sdk, messages=ROME, max_tokens=200,
                   response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_guided_json_closes_the_same_way(sdk: openai.OpenAI) -> None:
    reply = create(sdk, messages=ROME, max_tokens=200, extra_body={"guided_json": TRIP_SCHEMA})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), TRIP_SCHEMA)


def test_the_sdk_parse_helper_sends_strict_schemas_that_are_taken(sdk: openai.OpenAI) -> None:
    """``chat.completions.parse`` rewrites the model into OpenAI's strict form (``strict: true``)."""
    reply = sdk.chat.completions.parse(model=MODEL_ID, messages=ASK, temperature=0, max_tokens=200,
                                       response_format=GetWeather)
    assert reply.choices[0].finish_reason == "stop"
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, GetWeather) and 1 <= parsed.days <= 14


STRICT_OK = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 14}},
             "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("schema, words", [
    ({**STRICT_OK, "additionalProperties": True}, "In context=(), 'additionalProperties' must be false or a schema in "
                                                  "strict mode (got true)"),
    ({**STRICT_OK, "properties": {**STRICT_OK["properties"], "tags": {"type": "object", "additionalProperties": {}}}},
     "In context=('properties', 'tags'), 'additionalProperties' must be false or a schema in strict mode (got {})"),
    ({"type": "array", "items": {"$ref": "#/$defs/A"}, "$defs": {"A": {"type": "object", "unevaluatedProperties": True}}},
     "In context=('$defs', 'A'), 'unevaluatedProperties' must be false or a schema in strict mode (got true)"),
])
def test_strict_response_format_refuses_an_object_open_to_any_key(sdk: openai.OpenAI, schema, words) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        create(sdk, max_tokens=5, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "w", "schema": schema, "strict": True}})
    error = err.value.body
    assert (error["param"], error["code"]) == ("response_format", "invalid_schema")
    assert error["message"].startswith(f"Invalid schema for response_format 'w': {words}: strict output takes no key")


@pytest.mark.parametrize("strict", [True, False, None])
def test_strict_or_not_an_unspecified_object_is_closed(sdk: openai.OpenAI, strict) -> None:
    """What OpenAI's strict mode would refuse for lack of ``additionalProperties: false`` and for
    optional properties is served, closed (vLLM serves any schema whatever ``strict`` says)."""
    reply = create(sdk, messages=ROME, max_tokens=200, response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": TRIP_SCHEMA, "strict": strict}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), {**TRIP_SCHEMA, "additionalProperties": False})


def test_strict_functions_are_checked_and_a_closed_schema_is_enforced_as_given(sdk: openai.OpenAI) -> None:
    opened = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True,
                                               "parameters": {**WEATHER_SCHEMA, "additionalProperties": True}}}
    with pytest.raises(openai.BadRequestError) as err:
        create(sdk, tools=[opened], max_tokens=5)
    assert (err.value.body["param"], err.value.body["code"]) == ("tools[0].function.parameters",
                                                                 "invalid_function_parameters")
    assert err.value.body["message"].startswith("Invalid schema for function 'GetWeather': In context=(), "
                                                "'additionalProperties' must be false or a schema in strict mode")
    strict_tool = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": STRICT_OK}}
    reply = create(sdk, tools=[strict_tool], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls, {"lookup": STRICT_OK})
    lax = create(sdk, tools=[{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}],
                 tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert lax.choices[0].finish_reason == "tool_calls"
    check_calls(lax.choices[0].message.tool_calls, {"GetWeather": {**WEATHER_SCHEMA, "additionalProperties": False}})
