"""Tool calling on /v1/chat/completions: checking ``tools`` and ``tool_choice`` against the model,
and the conversation as the chat template takes it (assistant ``tool_calls``, ``tool`` results).

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
be open to any key (``server.structured.check_strict``). Custom tools (free-text input) are refused:
only function tools are served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from engine import ConstraintError, EngineClient, ModelInfo, SamplingParams, tool_call_grammar
from server.errors import APIError
from server.protocol import AllowedToolChoice, ChatCompletionRequest, ChatMessage, \
    NamedCustomToolChoice, NamedToolChoice, ToolDefinition
from server.structured import attach_constraint, check_strict

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
