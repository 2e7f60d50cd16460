"""The bundled model's tools template, and the split of chat text into content, reasoning and tool
calls with mlx-lm's markers and parsers (``engine/chat_format.py``)."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.chat_format import ChatFormat, OutputParser, ParsedCall, chat_format_of
from engine.loader import BUNDLED_MODEL_DIR
from tests.think_model import THINK_END_ID, THINK_START_ID, make_think_model

DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    return load_tokenizer(make_think_model(tmp_path_factory.mktemp("think") / "model"))


def render(tokenizer, messages, tools=None, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def chatml(turns: list[tuple[str, str]], generation: bool = True) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + \
        ("<|im_start|>assistant\n" if generation else "")


PLAIN = [
    ([{"role": "user", "content": "hi"}], [("system", DEFAULT_SYSTEM), ("user", "hi")]),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": ""}], [("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "")]),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "later"}, {"role": "assistant", "content": ""}],
     [("system", DEFAULT_SYSTEM), ("user", "a"), ("system", "later"), ("assistant", "")]),
]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("messages,turns", PLAIN)
def test_plain_chats_render_exactly_as_before_tools(tokenizer, messages, turns, generation):
    """The tools template is the old ChatML one for conversations without tools (prompts, and so
    prefix-cache blocks and the existing tests' expectations, are unchanged)."""
    assert render(tokenizer, messages, add_generation_prompt=generation) == chatml(turns, generation)


def test_mlx_lm_infers_the_json_tools_parser_for_the_bundled_model(tokenizer):
    assert chat_format_of(tokenizer) == ChatFormat("json_tools", "<tool_call>", "</tool_call>", None, None)


def test_tool_turns_render_as_qwen25_does(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    assert render(tokenizer, messages, TOOLS) == (
        "<|im_start|>system\n" + DEFAULT_SYSTEM + TOOLS_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n" + CALL + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_an_agent_turn_extends_the_previous_prompt_token_for_token(tokenizer):
    """Each turn of an agent loop renders the earlier turns as before, so its prompt extends the
    previous prompt plus the reply: the prefix cache serves all of it."""
    history = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Weather in Paris?"}]
    replies = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    before = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(history + replies, tools=TOOLS, add_generation_prompt=True)
    assert after[:len(before)] == before
    reply_ids = tokenizer.encode(CALL, add_special_tokens=False)
    assert after[len(before):len(before) + len(reply_ids)] == reply_ids  # the call as the model would write it


def split(tokenizer, text: str, step: int, **options):
    parser = OutputParser(tokenizer, tools=None, parse_tools=options.get("parse_tools", True),
                          reasoning=options.get("reasoning", True), prompt_ids=options.get("prompt_ids", [1]))
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    return ("".join(p.content for p in pieces), "".join(p.reasoning for p in pieces),
            [c for p in pieces for c in p.calls])


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_calls_are_read_whole_however_the_text_arrives(tokenizer, step):
    other = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    content, reasoning, calls = split(tokenizer, f"Let me check.\n{CALL}\n{other}\n", step)
    assert (content, reasoning) == ("Let me check.", "")
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("now", "{}")]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_text_that_is_not_a_call_comes_back_as_content(tokenizer, step):
    text = "a <tool_call>\nnot json\n</tool_call> b <tool_call>{\"name\": \"x\""
    assert split(tokenizer, text, step) == (text, "", [])
    assert split(tokenizer, f"{CALL}\n<tool_call>", step)[0] == "\n<tool_call>"  # cut off after a marker


def test_without_parsing_calls_stay_in_the_content(tokenizer):
    assert split(tokenizer, CALL, 3, parse_tools=False) == (CALL, "", [])


def test_content_keeps_its_whitespace_when_no_call_is_made(tokenizer):
    assert split(tokenizer, "Hello\n world \n\n", 1) == ("Hello\n world \n\n", "", [])


def test_think_markers_are_mlx_lms(think_tokenizer):
    assert chat_format_of(think_tokenizer) == ChatFormat(None, None, None, "<think>", "</think>")
    assert think_tokenizer.think_start_tokens == (THINK_START_ID,)
    assert think_tokenizer.think_end_tokens == (THINK_END_ID,)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_is_split_out(think_tokenizer, step):
    text = "<think>\nFirst, plan.\n</think>\n\nThe answer."
    assert split(think_tokenizer, text, step) == ("\n\nThe answer.", "\nFirst, plan.\n", [])
    assert split(think_tokenizer, text, step, reasoning=False) == (text, "", [])


def test_a_prompt_that_opens_a_think_block_starts_in_reasoning(think_tokenizer):
    prompt = think_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt[-2:] == [THINK_START_ID, think_tokenizer.encode("\n", add_special_tokens=False)[0]]
    assert split(think_tokenizer, "plan</think>answer", 2, prompt_ids=prompt) == ("answer", "plan", [])
    closed = prompt + [THINK_END_ID]  # a prompt whose think block is closed again starts in content
    assert split(think_tokenizer, "plan</think>answer", 2, prompt_ids=closed) == ("plan</think>answer", "", [])
