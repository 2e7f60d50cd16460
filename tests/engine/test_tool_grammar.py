"""The grammar of forced tool calls (``engine/tool_grammar.py``) on the bundled tokenizer."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.chat_format import ChatFormat, chat_format_of
from engine.constraints import ConstraintCompiler, ConstraintError
from engine.loader import BUNDLED_MODEL_DIR
from engine.tool_grammar import tool_call_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("now", None)]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, 8192)


def accepts(compiler, tokenizer, spec, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and then may end (EOS)."""
    matcher = compiler.compile(spec).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("text,max_calls,ok", [
    (WEATHER_CALL, 1, True),
    (NOW_CALL, 1, True),
    (f"{WEATHER_CALL}\n{NOW_CALL}", 1, False),  # parallel_tool_calls false: one call
    (f"{WEATHER_CALL}\n{NOW_CALL}", None, True),
    (WEATHER_CALL.replace('"c"', '"k"'), 1, False),  # arguments outside the schema
    (WEATHER_CALL.replace('"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}',
                          '"arguments": {"city": "Paris", "unit": "c"}, "name": "get_weather"'), 1, False),  # name first
    (WEATHER_CALL.replace('", "', '","'), 1, False),  # the template's separators
    ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', 1, False),
    ("The weather is fine.", 1, False),
])
def test_forced_calls_grammar(tokenizer, compiler, text, max_calls, ok):
    spec = tool_call_grammar(chat_format_of(tokenizer), TOOLS, max_calls)
    assert accepts(compiler, tokenizer, spec, text) is ok


def test_a_named_function_alone(tokenizer, compiler):
    spec = tool_call_grammar(chat_format_of(tokenizer), TOOLS[1:], 1)
    assert accepts(compiler, tokenizer, spec, NOW_CALL)
    assert not accepts(compiler, tokenizer, spec, WEATHER_CALL)


def test_formats_other_than_json_objects_are_refused():
    with pytest.raises(ConstraintError, match="qwen3_coder"):
        tool_call_grammar(ChatFormat("qwen3_coder", "<tool_call>", "</tool_call>"), TOOLS, 1)
    with pytest.raises(ConstraintError, match="none"):
        tool_call_grammar(ChatFormat(), TOOLS, 1)
