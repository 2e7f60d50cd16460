"""A Responses request as the one chat request (``server/chat.py``), and its input as stored items.

    input (string or items) --normalize--> items with ids (what the store keeps, GET .../input_items)
    earlier conversation + items --chat_messages--> ChatCompletionRequest.messages

Items become chat messages so that a continued conversation renders its earlier turns exactly
as they rendered before (the prompt extends the earlier one, and the prefix cache serves it):

| items | chat message |
|---|---|
| ``instructions`` | a system message first |
| message (user / system / developer) | that role, its parts' text joined |
| reasoning, message (assistant), function_call... | one assistant message: ``reasoning_content``, ``content``, ``tool_calls`` |
| function_call_output | a ``tool`` message with its ``call_id`` |
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pydantic import TypeAdapter, ValidationError

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.responses_protocol import (AllowedToolsChoice, FunctionCallItem, FunctionCallOutputItem, FunctionChoice,
                                       FunctionTool, Item, MessageItem, NamespaceTool, ReasoningItem,
                                       ResponsesRequest)

ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[Item])
_EFFORT = {"max": "xhigh"}  # the chat request's efforts stop at xhigh; any effort but "none" thinks


def new_id(prefix: str) -> str:
    """An id like OpenAI's: ``prefix`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def normalize(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as whole items with ids (a string input is one user message)."""
    if isinstance(body.input, str):
        return [_message("user", [{"type": "input_text", "text": body.input}])]
    return [_normalized(index, item) for index, item in enumerate(body.input)]


def _message(role: str, content: list[dict[str, Any]], item_id: str | None = None,
             phase: str | None = None) -> dict[str, Any]:
    message = {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": "completed",
               "content": content}
    return {**message, "phase": phase} if phase else message


def _normalized(index: int, item: Any) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        if isinstance(item.content, str):
            part = {"type": "output_text", "text": item.content, "annotations": []} if item.role == "assistant" \
                else {"type": "input_text", "text": item.content}
            content = [part]
        else:
            content = [p.model_dump(exclude_none=True) for p in item.content]
        return _message(item.role, content, item.id, item.phase)
    if isinstance(item, FunctionCallItem):
        _check_arguments(index, item.arguments)
        return {"id": item.id or new_id("fc"), "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": item.status or "completed",
                **({"namespace": item.namespace} if item.namespace else {})}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
        return {"id": item.id or new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                "output": output, "status": item.status or "completed",
                **{key: value for key in ("name", "namespace") if (value := getattr(item, key))}}
    assert isinstance(item, ReasoningItem)
    return item.model_dump(exclude_none=True) | {"id": item.id or new_id("rs")}


def _check_arguments(index: int, text: str) -> None:
    try:
        json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"Invalid value for 'input[{index}].arguments': the arguments are not valid JSON "
                            f"({exc}).", param=f"input[{index}].arguments", code="invalid_value") from exc


def chat_messages(items: list[dict[str, Any]], instructions: str | None,
                  current_turn_reasoning: bool = False) -> list[dict[str, Any]]:
    """The conversation ``items`` (normalized) as chat messages, ``instructions`` first;
    ``current_turn_reasoning``: earlier turns' reasoning is left out (``reasoning.context``)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning: list[str] = []
    for item in ITEMS.validate_python(items):
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
        elif isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(_assistant(item.text(), reasoning))
            reasoning = []
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1]["role"] != "assistant" or reasoning:
                messages.append(_assistant(None, reasoning))
                reasoning = []
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if reasoning:  # an answer cut short while still thinking
        messages.append(_assistant("", reasoning))
    if current_turn_reasoning:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
        for message in messages[:last_user]:
            message.pop("reasoning_content", None)
    return messages


def _assistant(content: str | None, reasoning: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def functions(body: ResponsesRequest) -> list[FunctionTool]:
    """Every function the request offers: its function tools and those of its namespaces."""
    return [member for tool in body.tools or () if isinstance(tool, (FunctionTool, NamespaceTool))
            for member in (tool.tools if isinstance(tool, NamespaceTool) else [tool])]


def namespaces(body: ResponsesRequest) -> dict[str, str]:
    """The namespace of each function that has one, by function name."""
    return {member.name: tool.name for tool in body.tools or () if isinstance(tool, NamespaceTool)
            for member in tool.tools}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that runs ``body`` on ``messages`` (400 if the chat path refuses a value)."""
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, "user": body.user}
    tools = functions(body)
    choice = body.tool_choice
    if isinstance(choice, AllowedToolsChoice):  # only the allowed ones are shown to the model
        allowed = [t.name for t in choice.tools]
        missing = sorted(set(allowed) - {t.name for t in tools})
        if missing:
            raise APIError(400, f"Invalid value for 'tool_choice.tools': no function named '{missing[0]}' is in "
                                f"'tools'.", param="tool_choice.tools", code="invalid_value")
        tools, choice = [t for t in tools if t.name in allowed], choice.mode
    if tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)} for t in tools]
        fields["parallel_tool_calls"] = body.parallel_tool_calls
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, FunctionChoice) else choice
    elif choice not in (None, "auto", "none"):  # required or a function, but nothing to call
        raise APIError(400, "Invalid value for 'tool_choice': it requires function tools in 'tools'.",
                       param="tool_choice", code="invalid_value")
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    elif text_format is not None:
        fields["response_format"] = {"type": text_format.type}
    effort = body.reasoning.effort if body.reasoning is not None else None
    fields["reasoning_effort"] = _EFFORT.get(effort, effort) if effort is not None else None
    if body.wants_logprobs():
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        raise APIError(400, f"Invalid request: {error.get('msg', 'invalid value')}", param=None,
                       code="invalid_value") from exc


_PARAMS = (("messages", "input"), ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
           ("reasoning_effort", "reasoning.effort"), ("logprobs", "top_logprobs"))


def responses_error(exc: APIError) -> APIError:
    """A chat path's error with its ``param`` named as the Responses API names it."""
    param = exc.param
    if param is None:
        return exc
    for chat_name, name in _PARAMS:
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            param = name if chat_name == "messages" else name + param[len(chat_name):]
            break
    param = param.replace(".function.", ".") if param.startswith("tools[") else param
    exc.param = param
    return exc
