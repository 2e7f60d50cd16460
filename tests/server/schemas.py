"""JSON schemas the structured-output tests generate against: nested objects, arrays with
minItems/maxItems, enums, const, anyOf, numbers and integers with (exclusive) bounds, booleans,
nulls, additionalProperties false, required and optional fields, patterns, $defs/$ref, prefixItems.
Strings carry a maxLength (or a pattern) and numbers a multipleOf, so a 29M model at
temperature 1 ends within the test's max_tokens (digits are single tokens: an unbounded
fraction can run on); the grammar enforces every keyword listed."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 24}


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with exactly these properties (``additionalProperties: false``), all required
    unless ``required`` says otherwise."""
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_object": closed({"name": NAME, "age": integer(0, 130)}),
    "nested_object": closed({"user": closed({"id": integer(1, 9999), "name": NAME}), "active": {"type": "boolean"}}),
    "deeply_nested": closed({"a": closed({"b": closed({"c": integer(0, 9)})})}),
    "array_bounds": {"type": "array", "items": integer(0, 99), "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": closed(
        {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": integer(1, 10)})},
    "string_enum": closed({"color": {"enum": ["red", "green", "blue"]}}),
    "mixed_enum": {"enum": ["yes", "no", 1, 2.5, True, None]},
    "const": closed({"kind": {"const": "event"}, "n": integer(0, 5)}),
    "anyof_scalars": {"anyOf": [integer(0, 100), {"type": "boolean"}, {"type": "null"}]},
    "anyof_objects": {"anyOf": [closed({"circle": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}),
                                closed({"square": integer(0, 10)})]},
    "number_bounds": closed({"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
                             "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001}}),
    "exclusive_bounds": closed({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1,
                                      "multipleOf": 0.01},
                                "k": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    "integer_only": integer(-1000, 1000),
    "booleans": closed({"a": {"type": "boolean"}, "b": {"type": "boolean"}}),
    "nullable": closed({"note": {"type": ["string", "null"], "maxLength": 16},
                        "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10}}),
    "null_only": closed({"nothing": {"type": "null"}}),
    "optional_fields": closed({"title": NAME, "pages": integer(1, 999),
                               "isbn": {"type": "string", "pattern": "^[0-9]{10}$"}}, required=["title"]),
    "string_lengths": closed({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "string_pattern": closed({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                              "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}),
    "tuple_prefix_items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 8}, integer(0, 9),
                                                            {"type": "boolean"}], "items": False, "minItems": 3},
    "refs_and_defs": {"$defs": {"point": closed({"x": integer(-9, 9), "y": integer(-9, 9)})}, **closed(
        {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}})},
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": integer(0, 9)}},
    "enum_array": {"type": "array", "items": {"enum": ["ls", "cd", "pwd", "cat"]}, "minItems": 1, "maxItems": 4},
    "tool_like": closed({"command": {"enum": ["ls", "grep", "find"]},
                         "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "recursive": {"type": "boolean"}}),
    "record_map": closed({"scores": {"type": "object", "maxProperties": 3,
                                     "additionalProperties": integer(0, 100)}}),
}

# schemas the server must refuse with a 400 before any token: (schema, what the message names)
INVALID_SCHEMAS: dict[str, tuple[Any, str]] = {
    "unknown_type": ({"type": "foo"}, "foo"),
    "dangling_ref": ({"$ref": "#/$defs/missing"}, "missing"),
    "unsatisfiable_items": ({"type": "array", "minItems": 5, "maxItems": 2}, "Unsatisfiable"),
    "unsatisfiable_bounds": ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    "unsatisfiable_all_of": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
    "bad_pattern": ({"type": "string", "pattern": "[a-z"}, "regex"),
    "unsupported_not": ({"not": {"type": "string"}}, "Unimplemented keys"),
}
