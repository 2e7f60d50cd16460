"""Structured outputs: ``response_format`` and vLLM's ``guided_*`` fields, enforced in the engine.

| field | the output |
|---|---|
| ``response_format: {"type": "text"}`` (or none) | free |
| ``response_format: {"type": "json_object"}`` | one JSON object |
| ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` | one JSON value valid under ``schema``, its objects closed (``engine.constraints.closed_schema``); with ``strict: true`` no object may be open to any key (``strict_schema_problem``) |
| ``guided_json`` (vLLM; a schema, or its JSON text) | as ``json_schema`` |
| ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (vLLM) | a match of the regex / one of the strings / text of the lark or GBNF grammar |

Both endpoints take all of them (``response_format`` on ``/v1/completions`` as vLLM does). At most
one may constrain a request. The grammar is compiled for the served model before the request is
queued (``EngineClient.compile_constraint``, on a thread): an invalid, unsatisfiable or
unsupported one is a 400 in OpenAI's shape before any token. ``attach_constraint`` is the one way
a route puts a constraint on a request (tool calls use it too).

``strict`` (here and on a function tool) is OpenAI's Structured Outputs switch: the output
follows the schema and no object in it takes a key the schema does not describe. Every schema is
enforced whatever ``strict`` says, and objects that say nothing of ``additionalProperties`` are
closed, so ``strict: true`` adds one check: an object open to any key (``additionalProperties``
or ``unevaluatedProperties`` true or ``{}``) is a 400 naming the place. The rest of OpenAI's
strict-mode subset is served as vLLM serves it: optional properties (written or left out, as the
schema allows), typed maps, any root type, every keyword llguidance enforces.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine import ConstraintError, EngineClient, EngineNotReady, GrammarSpec, SamplingParams
from server.errors import APIError
from server.protocol import _Sampling

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_grammar(body: _Sampling) -> tuple[GrammarSpec, str] | None:
    """The grammar a request's structured-output fields ask for, with the field that asked (for
    its 400s); None for free text. Two constraining fields at once are a 400."""
    asked: list[tuple[GrammarSpec, str]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        asked.append((GrammarSpec.json_object(), "response_format"))
    elif fmt is not None and fmt.json_schema is not None:
        if fmt.json_schema.schema_ is None:
            raise APIError(400, "Missing required parameter: 'response_format.json_schema.schema'.",
                           param="response_format.json_schema.schema", code="missing_required_parameter")
        if fmt.json_schema.strict:
            check_strict(fmt.json_schema.schema_, f"response_format '{fmt.json_schema.name}'", "response_format",
                         "invalid_schema")
        asked.append((_schema_spec(fmt.json_schema.schema_, "response_format"), "response_format"))
    for field in _GUIDED:
        value = getattr(body, field)
        if value is not None:
            asked.append((_guided_spec(field, value), field))
    if len(asked) > 1:
        raise APIError(400, f"Only one structured-output constraint is allowed per request; got "
                            f"{', '.join(f for _, f in asked)}.", param=asked[1][1], code="invalid_value")
    return asked[0] if asked else None


def _guided_spec(field: str, value: object) -> GrammarSpec:
    if field == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise APIError(400, f"Invalid value for 'guided_json': not JSON ({exc}).", param=field,
                               code="invalid_schema") from exc
        return _schema_spec(value, field)
    if field == "guided_regex":
        return GrammarSpec.regex(str(value))
    if field == "guided_choice":
        return GrammarSpec.choice(list(value))  # type: ignore[call-overload]
    return GrammarSpec.grammar(str(value))


def _schema_spec(schema: object, field: str) -> GrammarSpec:
    try:
        return GrammarSpec.json_schema(schema)
    except ConstraintError as exc:
        raise APIError(400, f"Invalid schema for '{field}': {exc}", param=field, code="invalid_schema") from exc


async def attach_constraint(client: EngineClient, params: SamplingParams, spec: GrammarSpec,
                            param: str) -> SamplingParams:
    """``params`` constrained to ``spec``, compiled for the served model off the event loop;
    a grammar the engine cannot use is a 400 about ``param``."""
    try:
        constraint = await client.compile_constraint(spec)
    except ConstraintError as exc:
        code = "invalid_schema" if spec.kind == "json_schema" else "invalid_grammar"
        raise APIError(400, f"Invalid '{param}': {exc}", param=param, code=code) from exc
    except EngineNotReady as exc:
        raise APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                       headers={"Retry-After": "1"}) from exc
    return replace(params, constraint=constraint)


async def structured_params(body: _Sampling, client: EngineClient, params: SamplingParams) -> SamplingParams:
    """``params`` with the constraint the body's structured-output fields ask for (if any)."""
    asked = requested_grammar(body)
    if asked is None:
        return params
    spec, field = asked
    return await attach_constraint(client, params, spec, field)


_OPENINGS = ("additionalProperties", "unevaluatedProperties")
_STRICT_CHILDREN = ("items", "additionalProperties", "unevaluatedProperties", "not", "then", "else", "contains")
_STRICT_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_STRICT_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def check_strict(schema: Any, what: str, param: str, code: str) -> None:
    """A 400 about ``param`` when ``schema`` lets an object take keys of any name and any value,
    which strict mode rules out (``what`` names it in the message: "response_format 'x'",
    "function 'f'")."""
    try:
        problem = strict_schema_problem(schema, ())
    except RecursionError:
        problem = "the schema is nested too deeply."
    if problem is not None:
        raise APIError(400, f"Invalid schema for {what}: {problem}", param=param, code=code)


def strict_schema_problem(schema: Any, context: tuple[str, ...]) -> str | None:
    """The first object of ``schema`` open to anything (``additionalProperties`` or
    ``unevaluatedProperties`` true or ``{}``), worded as OpenAI words it (``In
    context=('properties', 'a'), ...``); None when there is none. A typed map
    (``additionalProperties: {"type": "integer"}``) is not open to anything: it is served."""
    if not isinstance(schema, dict):
        return None
    where = f"In context={context!r}, "
    opened = next((key for key in _OPENINGS if schema.get(key, False) is True or schema.get(key) == {}), None)
    if opened is not None:
        return (f"{where}'{opened}' must be false or a schema in strict mode (got {json.dumps(schema[opened])}): "
                f"strict output takes no key the schema does not describe.")
    children = [((key,), schema[key]) for key in _STRICT_CHILDREN if isinstance(schema.get(key), dict)]
    children += [((key, name), sub) for key in _STRICT_MAPS if isinstance(schema.get(key), dict)
                 for name, sub in schema[key].items()]
    children += [((key, str(i)), sub) for key in _STRICT_LISTS if isinstance(schema.get(key), list)
                 for i, sub in enumerate(schema[key])]
    for path, sub in children:
        problem = strict_schema_problem(sub, context + path)
        if problem is not None:
            return problem
    return None
