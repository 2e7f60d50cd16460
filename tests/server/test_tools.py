"""Tool calling over real HTTP with the official SDK (strict validation): forced and required calls
whose arguments validate against the tools' schemas, streamed and not (the SDK's stream helper
assembles them), auto-parsed parallel calls, ``tool_choice: none``, a round trip whose second
turn reuses the first turn's blocks, and malformed tools as 400s."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.server.conftest import MODEL_DIR, MODEL_ID, stream_json

G = 128  # prefix-cache block
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the documentation",
                                           "parameters": SEARCH, "strict": True}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "search", "arguments": {"query": "rain gear"}}\n</tool_call>')
TWO_CALLS_GRAMMAR = f"start: {json.dumps(TWO_CALLS)}\n"  # the model must write exactly this


def create(sdk: openai.OpenAI, **fields: Any) -> Any:
    body = {"model": MODEL_ID, "messages": QUESTION, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **fields}
    return sdk.chat.completions.create(**body)


def assembled(sdk: openai.OpenAI, **fields: Any) -> Any:
    """The SDK's stream helper over a streamed request: the completion it assembles from the deltas."""
    body = {"model": MODEL_ID, "messages": QUESTION, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **fields}
    with sdk.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def check_calls(message: Any, names: list[str]) -> None:
    """The calls are ``names`` in order, with OpenAI's ids, and arguments valid under their schemas."""
    assert [c.function.name for c in message.tool_calls] == names
    assert len({c.id for c in message.tool_calls}) == len(names)
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(sdk: openai.OpenAI, stream: bool) -> None:
    r = (assembled if stream else create)(sdk, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message, ["get_weather"])


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7), (1.0, 8)])
@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_one_valid_call(sdk: openai.OpenAI, stream: bool, temperature: float,
                                       seed: int | None) -> None:
    r = (assembled if stream else create)(sdk, tool_choice="required", parallel_tool_calls=False,
                                          temperature=temperature, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message, [choice.message.tool_calls[0].function.name])


def test_streamed_calls_arrive_as_openai_deltas(http: httpx.Client) -> None:
    """Header (index, id, type, name, arguments "") first, then the arguments; the same call
    as the non-streamed response (greedy)."""
    body = {"model": MODEL_ID, "messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 120,
            "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"][0]
    chunks = stream_json(http, "/v1/chat/completions", {**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert deltas[0] == {"role": "assistant", "content": None}  # as OpenAI starts tool-call streams
    assert calls[0] == [{"index": 0, "id": calls[0][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]
    assert calls[1] == [{"index": 0, "function": {"arguments": whole["function"]["arguments"]}}]
    assert len(calls) == 2 and not any(d.get("content") for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_the_model_writes_are_read_out(sdk: openai.OpenAI, stream: bool) -> None:
    """``auto``: the model's two calls (forced through vLLM's guided_grammar) come back as two."""
    r = (assembled if stream else create)(sdk, tool_choice="auto", extra_body={"guided_grammar": TWO_CALLS_GRAMMAR})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message, ["get_weather", "search"])
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [
        {"city": "Paris", "unit": "celsius"}, {"query": "rain gear"}]


def test_parallel_tool_calls_false_reports_the_first_call(sdk: openai.OpenAI) -> None:
    r = create(sdk, parallel_tool_calls=False, extra_body={"guided_grammar": TWO_CALLS_GRAMMAR})
    check_calls(r.choices[0].message, ["get_weather"])
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_reads_no_calls(sdk: openai.OpenAI, stream: bool) -> None:
    """The tools are still in the prompt (as vLLM), but what the model writes stays content."""
    r = (assembled if stream else create)(sdk, tool_choice="none", extra_body={"guided_grammar": TWO_CALLS_GRAMMAR})
    choice = r.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (TWO_CALLS, None, "stop")


def test_tools_are_rendered_for_tool_choice_none(sdk: openai.OpenAI) -> None:
    usage = {choice: create(sdk, tool_choice=choice, max_tokens=1).usage.prompt_tokens for choice in ("none", "auto")}
    without = sdk.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert usage["none"] == usage["auto"] > without + 100


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the vocabulary spells a token's bytes with these characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def generated_ids(tokenizer: Tokenizer, entries: list[Any]) -> list[int]:
    """The ids of the sampled tokens, from their logprob entries' bytes (the EOS has no entry)."""
    symbols = _byte_symbols()
    return [tokenizer.token_to_id("".join(symbols[b] for b in entry.bytes)) for entry in entries]


def prompt_ids(hf_tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    tools = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in TOOLS]
    ids = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_a_round_trip_reuses_the_first_turn(sdk: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """call -> tool result -> answer. The second turn's prompt repeats the first turn's prompt
    and the call, so every block of the first turn's computed tokens (the prompt and the sampled
    tokens but the last, which is never fed) that the two share in full is a hit. The call's
    text is the template's, but its tokens are the model's choice: under the grammar the small
    model writes `"city": "` as `":` + ` ` + `"` where the tokenizer writes `":` + ` "`, so the
    shared prefix, and the reuse, stop there (at temperature 0, on the bundled model)."""
    hf_tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    salt = {"cache_salt": uuid.uuid4().hex}
    messages: list[Any] = [{"role": "system", "content": "You are an agent."}, *QUESTION]
    first = create(sdk, messages=messages, tool_choice=NAMED, logprobs=True, extra_body=salt)
    call = first.choices[0].message
    check_calls(call, ["get_weather"])
    result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C, sunny. " * 8}
    second = create(sdk, messages=[*messages, call, result], max_tokens=24, extra_body=salt)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")

    first_ids = prompt_ids(hf_tokenizer, messages)
    sampled = generated_ids(tokenizer, first.choices[0].logprobs.content)  # the grammar ends the row: no EOS
    assert (len(first_ids), len(sampled)) == (first.usage.prompt_tokens, first.usage.completion_tokens)
    computed = first_ids + sampled[:-1]  # the last sampled token is never fed to the model
    again = prompt_ids(hf_tokenizer, [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": json.loads(c.function.arguments)}}
        for c in call.tool_calls]}, result])
    assert len(again) == second.usage.prompt_tokens
    shared = next((i for i, (a, b) in enumerate(zip(again, computed)) if a != b), len(computed))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    blocks = min(shared, len(again) - 1) // G * G  # whole blocks of what the first request computed
    tail = min(len(first_ids), len(again) - 1)  # KVarN: the first prompt's tail after its last whole block
    expected = tail if blocks // G == len(first_ids) // G and len(first_ids) % G else blocks
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert shared >= len(first_ids)  # the whole first prompt: every block it completed is reused
    call_text = tokenizer.decode(sampled)
    assert tokenizer.decode(again[len(first_ids):]).startswith(call_text)  # the same text, whatever its tokens


def test_forced_calls_and_response_format_do_not_mix(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        create(sdk, tool_choice="required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


def bad(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": QUESTION, "tools": TOOLS, "max_tokens": 4, **fields}


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
MALFORMED = [
    (bad(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
     "tools[0].function.parameters", "invalid_function_parameters"),
    (bad(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools[0].function.parameters", "invalid_function_parameters"),
    (bad(tools=[TOOLS[0], TOOLS[0]]), "tools", "invalid_value"),
    (bad(tools=[]), "tools", "empty_array"),
    (bad(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name", "invalid_value"),
    (bad(tool_choice={"type": "function", "function": {"name": "unknown"}}), "tool_choice", "invalid_value"),
    (bad(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    ({**bad(), "tools": None, "tool_choice": "auto"}, "tool_choice", "invalid_value"),
    (bad(messages=[*QUESTION, ASSISTANT_CALL, {"role": "tool", "content": "18 C"}]),
     "messages[2].tool_call_id", "missing_required_parameter"),
    (bad(messages=[*QUESTION, {**ASSISTANT_CALL, "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{city: Paris"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    (bad(messages=[{**QUESTION[0], "tool_calls": ASSISTANT_CALL["tool_calls"]}]), "messages[0].tool_calls",
     "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", MALFORMED)
def test_malformed_tools_are_400s_in_openais_shape(http: httpx.Client, body: dict[str, Any], param: str,
                                                   code: str) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
