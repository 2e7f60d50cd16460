"""What constrains a chat's output: ``tools`` and ``tool_choice`` on /v1/chat/completions (checked
against the model, with the conversation as the chat template takes it: assistant ``tool_calls``,
``tool`` results), and structured outputs (``response_format`` and vLLM's ``guided_*`` fields),
each enforced in the engine as the request's one grammar (``attach_constraint``).

What each ``tool_choice`` does (the tools are always rendered into the prompt, so every turn of an
agent loop starts with the same system turn, whatever it asks):

| tool_choice | the output |
|---|---|
| ``auto`` (the default with tools) | free; calls in the model's format are read out (mlx-lm's parser) |
| ``none`` | free; nothing is read as a call: the text stays in ``content`` (vLLM's behaviour) |
| ``required`` | constrained to 1 to ``MAX_FORCED_CALLS`` calls (one with ``parallel_tool_calls: false``) of the given tools, arguments valid under their schemas |
| ``{"type": "function", "function": {"name": ...}}`` | constrained to one call of that function |
| ``{"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [...]}}`` | as ``required``, over the listed tools (every tool is still rendered) |
| ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [...]}}`` | as ``auto``, with only the listed tools rendered (the model sees no other) |

Forced calls' arguments are valid under the tools' schemas, their objects closed
(``engine.constraints.closed_schema``); with ``strict: true`` no object of a function's schema may
be open to any key (``check_strict``). Custom tools (free-text input) are refused: only function
tools are served.

What each structured-output field does:

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
from dataclasses import dataclass, replace
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from engine import ConstraintError, EngineClient, EngineNotReady, GrammarSpec, ModelInfo, SamplingParams, \
    tool_call_grammar
from server.errors import APIError
from server.protocol import ChatCompletionRequest, _Sampling
from server.protocol_messages import AllowedToolChoice, ChatMessage, NamedCustomToolChoice, NamedToolChoice, \
    ToolDefinition


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tool calling. ``tools``: OpenAI's function tools as the
    template takes them (None: no tools); ``parse``: read calls out of the output; ``forced``:
    the function names the output is constrained to call (empty: unconstrained); ``max_calls``:
    the most calls reported (None: any)."""

    tools: list[dict[str, Any]] | None = None
    parse: bool = False
    forced: tuple[str, ...] = ()
    max_calls: int | None = None
    parameters: tuple[tuple[str, dict[str, Any] | None], ...] = ()  # (name, parameters schema) per tool


def plan_tools(body: ChatCompletionRequest, info: ModelInfo) -> ToolPlan:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (400s in OpenAI's shape)."""
    if not body.tools:
        if body.tools is not None:
            raise APIError(400, "Invalid 'tools': empty array. Expected an array with minimum length 1.",
                           param="tools", code="empty_array")
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, field) is not None:
                raise APIError(400, f"Invalid value for '{field}': '{field}' is only allowed when 'tools' are "
                                    f"specified.", param=field, code="invalid_value")
        return ToolPlan()
    custom = next((i for i, tool in enumerate(body.tools) if tool.type == "custom"), None)
    if custom is not None:
        raise APIError(400, f"Custom tools are not supported: this server serves function tools only; send "
                            f"tools[{custom}] as {{\"type\": \"function\", \"function\": {{...}}}}.",
                       param=f"tools[{custom}]", code="unsupported_value")
    if not info.chat_format.has_tool_calling:
        raise APIError(400, f"The model '{info.model_id}' has no tool-call format (its chat template names none "
                            f"that mlx-lm can parse), so it cannot take 'tools'.", param="tools",
                       code="unsupported_value")
    tools = body.tools
    names = [tool.function.name for tool in tools]
    parameters = tuple((tool.function.name, _checked_parameters(i, tool)) for i, tool in enumerate(tools))
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(400, f"Invalid 'tools': the function name '{duplicate}' is used twice.", param="tools",
                       code="invalid_value")
    rendered = [tool.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for tool in tools]
    choice = body.tool_choice or "auto"
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedCustomToolChoice):
        raise APIError(400, "Invalid value for 'tool_choice': custom tools are not supported; name a function.",
                       param="tool_choice", code="unsupported_value")
    if isinstance(choice, AllowedToolChoice):
        allowed = _allowed_names(choice, names)
        if choice.allowed_tools.mode == "required":
            return ToolPlan(rendered, True, allowed, None if parallel else 1, parameters)
        return ToolPlan([r for r in rendered if r["function"]["name"] in allowed], True, (), None if parallel else 1,
                        parameters)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"Invalid value for 'tool_choice': no function named '{choice.function.name}' is "
                                f"in 'tools'.", param="tool_choice", code="invalid_value")
        return ToolPlan(rendered, True, (choice.function.name,), 1, parameters)
    if choice == "required":
        return ToolPlan(rendered, True, tuple(names), None if parallel else 1, parameters)
    return ToolPlan(rendered, choice == "auto", (), None if parallel else 1, parameters)


async def force_calls(client: EngineClient, info: ModelInfo, plan: ToolPlan, params: SamplingParams) -> SamplingParams:
    """``params`` constrained to ``plan.forced``'s calls in the model's format, their arguments
    valid under the tools' schemas: a 400 if the model's format cannot be forced, a schema cannot
    be enforced, or the request already constrains its output (``response_format``, ``guided_*``)."""
    if params.constraint is not None:
        raise APIError(400, "tool_choice 'required' or a named function makes the output tool calls; it cannot be "
                            "combined with response_format or guided_* fields.", param="tool_choice",
                       code="invalid_value")
    try:
        spec = tool_call_grammar(info.chat_format, [p for p in plan.parameters if p[0] in plan.forced],
                                 plan.max_calls)
    except ConstraintError as exc:
        raise APIError(400, str(exc), param="tool_choice", code="unsupported_value") from exc
    return await attach_constraint(client, params, spec, "tools")


def _allowed_names(choice: AllowedToolChoice, names: list[str]) -> tuple[str, ...]:
    """The function names ``allowed_tools`` lists, each one of ``names`` (400s otherwise)."""
    allowed: list[str] = []
    for i, entry in enumerate(choice.allowed_tools.tools):
        param = f"tool_choice.allowed_tools.tools[{i}]"
        if isinstance(entry, NamedCustomToolChoice):
            raise APIError(400, f"Invalid value for '{param}': custom tools are not supported; list functions.",
                           param=param, code="unsupported_value")
        if entry.function.name not in names:
            raise APIError(400, f"Invalid value for '{param}': no function named '{entry.function.name}' is in "
                                f"'tools'.", param=param, code="invalid_value")
        allowed.append(entry.function.name)
    return tuple(dict.fromkeys(allowed))


def _checked_parameters(index: int, tool: ToolDefinition) -> dict[str, Any] | None:
    """A function's ``parameters``: a valid JSON Schema for an object (OpenAI's rule), or None
    (no parameters); with ``strict: true``, none of its objects open to any key."""
    name, schema = tool.function.name, tool.function.parameters
    if schema is None:
        return None
    param = f"tools[{index}].function.parameters"
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        raise APIError(400, f"Invalid schema for function '{name}': {exc.message}", param=param,
                       code="invalid_function_parameters") from exc
    except RecursionError as exc:  # jsonschema checks recursively: a schema nested deeper than Python's stack
        raise APIError(400, f"Invalid schema for function '{name}': nested too deeply.", param=param,
                       code="invalid_function_parameters") from exc
    if schema.get("type", "object") != "object":
        raise APIError(400, f"Invalid schema for function '{name}': schema must be a JSON Schema of "
                            f"'type: \"object\"', got 'type: {json.dumps(schema.get('type'))}'.", param=param,
                       code="invalid_function_parameters")
    if tool.function.strict:
        check_strict(schema, f"function '{name}'", param, "invalid_function_parameters")
    return schema


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: a developer message is a system message;
    an assistant's ``tool_calls`` carry their arguments as JSON values (templates write them
    with ``tojson``, as Hugging Face's and vLLM's do); a tool result keeps its ``tool_call_id``."""
    return [_template_message(i, m) for i, m in enumerate(body.messages)]


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": message.text()}
    if message.tool_calls:
        if message.role != "assistant":
            raise APIError(400, f"Invalid parameter: messages[{index}].tool_calls is only allowed on assistant "
                                f"messages.", param=f"messages[{index}].tool_calls", code="invalid_value")
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(index, j, call.function.arguments)}}
                             for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if message.tool_call_id is None:
            raise APIError(400, f"Missing required parameter: 'messages[{index}].tool_call_id'.",
                           param=f"messages[{index}].tool_call_id", code="missing_required_parameter")
        out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
    if message.role == "assistant" and message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content  # templates that re-render thinking read it
    return out


def _arguments(index: int, call: int, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        param = f"messages[{index}].tool_calls[{call}].function.arguments"
        raise APIError(400, f"Invalid value for '{param}': the arguments are not valid JSON ({exc}).",
                       param=param, code="invalid_value") from exc


# ---- structured outputs ----
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
