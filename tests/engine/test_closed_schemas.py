"""Closed object schemas (``engine.constraints.closed_schema``): an object schema that lists
``properties`` and says nothing of ``additionalProperties`` takes no other key, wherever it sits,
unless closing it would refuse keys the schema allows; then what llguidance makes of it on the
bundled model's tokenizer (no extra key, no repeated key)."""

from __future__ import annotations

import copy
import json

import pytest

from engine.chat_format import ChatFormat
from engine.constraints import ConstraintCompiler, GrammarSpec, closed_schema
from engine.tool_grammar import tool_call_grammar

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
CLOSED = {**OBJ, "additionalProperties": False}


@pytest.mark.parametrize("schema, closed", [
    (OBJ, CLOSED),
    ({"properties": {"a": {}}}, {"properties": {"a": {}}, "additionalProperties": False}),
    ({"type": "object", "properties": {"o": OBJ}},
     {"type": "object", "properties": {"o": CLOSED}, "additionalProperties": False}),
    ({"type": "array", "items": OBJ}, {"type": "array", "items": CLOSED}),
    ({"type": "array", "prefixItems": [OBJ, {"type": "string"}]},
     {"type": "array", "prefixItems": [CLOSED, {"type": "string"}]}),
    ({"type": "array", "items": [OBJ]}, {"type": "array", "items": [CLOSED]}),
    ({"anyOf": [OBJ, {"type": "null"}]}, {"anyOf": [CLOSED, {"type": "null"}]}),
    ({"oneOf": [OBJ, {"type": "string"}]}, {"oneOf": [CLOSED, {"type": "string"}]}),
    ({"$defs": {"A": OBJ}, "$ref": "#/$defs/A"}, {"$defs": {"A": CLOSED}, "$ref": "#/$defs/A"}),
    ({"definitions": {"A": OBJ}}, {"definitions": {"A": CLOSED}}),
    ({"type": "object", "additionalProperties": OBJ},
     {"type": "object", "additionalProperties": CLOSED}),
    ({"not": OBJ}, {"not": CLOSED}),
    ({"type": "array", "contains": OBJ}, {"type": "array", "contains": CLOSED}),
    ({"type": "object", "patternProperties": {"^x": OBJ}},
     {"type": "object", "patternProperties": {"^x": CLOSED}}),
    ({"allOf": [OBJ]}, {"allOf": [CLOSED]}),  # one branch: nothing else brings keys
])
def test_each_keyword_is_walked(schema, closed):
    assert closed_schema(schema) == closed


def test_then_else_and_dependent_schemas_keep_their_own_keys_open_but_close_what_they_nest():
    schema = {"type": "object", "properties": {"kind": {"type": "string"}},
              "if": {"properties": {"kind": {"const": "a"}}},
              "then": {"properties": {"x": OBJ}}, "else": {"properties": {"y": {}}},
              "dependentSchemas": {"kind": {"properties": {"z": OBJ}}}}
    out = closed_schema(schema)
    assert "additionalProperties" not in out  # its keys may come from then / else / dependentSchemas
    assert out["if"] == schema["if"]  # a condition, left as it is
    assert out["then"] == {"properties": {"x": CLOSED}}
    assert out["else"] == {"properties": {"y": {}}}
    assert out["dependentSchemas"] == {"kind": {"properties": {"z": CLOSED}}}


def test_the_branches_of_a_multi_branch_all_of_stay_open():
    a = {"type": "object", "properties": {"a": {"type": "integer"}}}
    b = {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {}}}}}
    out = closed_schema({"allOf": [a, b]})
    assert out["allOf"][0] == a
    assert out["allOf"][1] == {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {}},
                                                                          "additionalProperties": False}}}


def test_a_ref_named_by_a_multi_branch_all_of_stays_open_and_other_refs_close():
    schema = {"type": "object",
              "properties": {"both": {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
                             "one": {"$ref": "#/$defs/C"}},
              "$defs": {"A": {"type": "object", "properties": {"a": {}}},
                        "B": {"type": "object", "properties": {"b": {}}},
                        "C": {"type": "object", "properties": {"c": OBJ}}}}
    out = closed_schema(schema)
    assert out["$defs"]["A"] == schema["$defs"]["A"] and out["$defs"]["B"] == schema["$defs"]["B"]
    assert out["$defs"]["C"] == {"type": "object", "properties": {"c": CLOSED}, "additionalProperties": False}
    assert out["additionalProperties"] is False


def test_an_object_beside_an_applicator_stays_open_and_so_do_the_branches_it_is_applied_with():
    beside = {"type": "object", "properties": {"kind": {}}, "anyOf": [{"properties": {"x": {}}}, OBJ]}
    out = closed_schema(beside)
    assert "additionalProperties" not in out and out["anyOf"] == beside["anyOf"]
    for key, value in (("$ref", "#/$defs/A"), ("allOf", [{"required": ["kind"]}])):
        assert "additionalProperties" not in closed_schema({"type": "object", "properties": {"k": {}}, key: value})


@pytest.mark.parametrize("schema", [
    {"type": "object"},  # free-form: no properties listed
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {"type": "string"}}},
    {"type": "string", "enum": ["a"]},
    {"type": "object", "properties": {"a": {"const": {"properties": {"x": 1}}}}, "additionalProperties": False},
])
def test_open_schemas_are_untouched(schema):
    assert closed_schema(schema) == schema


def test_property_names_that_are_keywords_are_schemas_not_keywords():
    schema = {"type": "object", "properties": {"if": OBJ, "enum": OBJ, "properties": OBJ}}
    assert closed_schema(schema)["properties"] == {"if": CLOSED, "enum": CLOSED, "properties": CLOSED}


def test_the_input_is_not_modified():
    schema = {"type": "object", "properties": {"o": OBJ, "l": {"type": "array", "items": OBJ}},
              "$defs": {"A": OBJ}, "anyOf": [OBJ]}
    before = copy.deepcopy(schema)
    closed_schema(schema)
    assert schema == before


def test_json_schema_specs_carry_the_closed_schema():
    assert json.loads(GrammarSpec.json_schema(OBJ).source) == CLOSED
    assert GrammarSpec.json_schema(OBJ) == GrammarSpec.json_schema(CLOSED)  # one compilation for both


# --- what llguidance makes of it ---
@pytest.fixture(scope="module")
def compiler(loaded) -> ConstraintCompiler:
    return ConstraintCompiler(loaded.tokenizer, loaded.vocab_size)


def accepts(loaded, compiler, spec: GrammarSpec, text: str) -> bool:
    tokens = loaded.tokenizer.encode(text, add_special_tokens=False)
    matcher = compiler.compile(spec).new_matcher()
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


TWO = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}


@pytest.mark.parametrize("text, open_ok, closed_ok", [
    ('{"a": 1, "b": "x"}', True, True),
    ('{"b": "x"}', True, True),
    ('{"a": 1, "zz": 2}', True, False),  # an extra key: only the open schema takes it
    ('{"a": 1, "zz": 2, "zz": 3}', True, False),  # and repeats it
    ('{"a": 1, "a": 2}', False, False),  # a listed key twice: refused either way
    ('{"a": 1, "b": "x", "a": 2}', False, False),
    ('{"b": "x", "a": 1}', False, False),  # listed keys come in schema order, open or closed
])
def test_a_closed_object_takes_no_extra_and_no_repeated_key(loaded, compiler, text, open_ok, closed_ok):
    open_spec = GrammarSpec("json_schema", json.dumps(TWO))  # as before closing: the schema as sent
    assert accepts(loaded, compiler, open_spec, text) == open_ok
    assert accepts(loaded, compiler, GrammarSpec.json_schema(TWO), text) == closed_ok


HERMES = ChatFormat(tool_parser="json_tools", tool_call_start="<tool_call>", tool_call_end="</tool_call>")
NESTED = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}, "days": {"type": "integer"}},
          "required": ["where"], "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize("tools", [[("f", NESTED)], [("g", TWO), ("f", NESTED)]])
def test_forced_calls_close_the_arguments_and_resolve_their_own_defs(loaded, compiler, tools):
    spec = tool_call_grammar(HERMES, tools, max_calls=1)
    assert accepts(loaded, compiler, spec, call("f", {"where": {"city": "Oslo"}, "days": 2}))
    assert not accepts(loaded, compiler, spec, call("f", {"where": {"city": "Oslo"}, "extra": 2}))
    assert not accepts(loaded, compiler, spec, call("f", {"where": {"city": "Oslo", "zip": "1"}}))
    if len(tools) == 2:
        assert accepts(loaded, compiler, spec, call("g", {"a": 1}))
        assert not accepts(loaded, compiler, spec, call("g", {"a": 1, "c": 1}))
