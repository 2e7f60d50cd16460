"""A Messages API body as the one chat request underneath every chat-shaped API (server/chat.py).

    system (string or text blocks)        -> one system message (text blocks joined by a blank line)
    user: text ... tool_result ... text    -> user message, tool message(s), user message, in order
    assistant: thinking, text, tool_use... -> one assistant message: reasoning_content, content, tool_calls
    tools / tool_choice / thinking / ...   -> function tools, "auto"/"required"/named/"none", enable_thinking

Every turn renders from its blocks alone, the same way on every request, so a conversation's next
turn extends the prompt of the last one and the prefix cache serves all of it again. Claude Code's
``x-anthropic-billing-header:`` line, which changes every conversation, is dropped from the first
system block unless the server keeps it (``kvarn serve --keep-billing-header``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError

from server.anthropic import (CountTokensRequest, Message, MessagesRequest, RedactedThinkingBlock, TextBlock,
                              ThinkingBlock, ToolChoiceAny, ToolChoiceAuto, ToolChoiceNone, ToolChoiceTool,
                              ToolResultBlock, ToolUseBlock)
from server.errors import APIError
from server.protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one turn
TOOL_ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reads as a failure to the model


def drop_billing_header(text: str) -> str:
    """``text`` without its lines that start with Claude Code's billing header."""
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER_PREFIX))


def system_text(system: str | list[TextBlock] | None, keep_billing_header: bool) -> str:
    """The system prompt's text; without the billing line of its first block unless
    ``keep_billing_header`` (a first block that held only that line is dropped whole)."""
    texts = [system] if isinstance(system, str) else [block.text for block in system or ()]
    if texts and not keep_billing_header:
        first = drop_billing_header(texts[0])
        texts = ([first] if first.strip() or first == texts[0] else []) + texts[1:]
    return BLOCK_SEPARATOR.join(texts)


def chat_request(body: MessagesRequest | CountTokensRequest, keep_billing_header: bool) -> ChatCompletionRequest:
    """The chat request that runs ``body`` (400s in the Messages API's terms for what the chat
    request cannot hold)."""
    if body.messages[-1].role == "assistant":
        raise APIError(400, "The last message is an assistant turn: this server does not continue a partial "
                            "assistant answer (prefill). End the conversation with a user turn.", param="messages")
    system = system_text(body.system, keep_billing_header)
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(body.messages)
    data: dict[str, Any] = {"model": body.model, "messages": messages}
    data.update(_tools(body))
    if body.thinking is not None:
        data["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if body.output_config is not None and body.output_config.format is not None:
        data["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    if isinstance(body, MessagesRequest):  # a count runs nothing: no sampling, no max_tokens to check
        data.update({key: value for key, value in (
            ("max_tokens", body.max_tokens), ("stop", body.stop_sequences), ("temperature", body.temperature),
            ("top_p", body.top_p), ("top_k", body.top_k)) if value is not None})
        if body.metadata is not None and body.metadata.user_id is not None:
            logger.debug("messages request of user %r", body.metadata.user_id)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:  # a limit of the chat request that the Messages body does not state
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise APIError(400, f"Invalid request: {where}: {first.get('msg', 'invalid value')}") from exc


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as chat messages; each ``tool_result`` names the tool whose ``tool_use``
    it answers (when an earlier turn holds it)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_use id -> tool name
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(index, message.content, names))
        else:
            out.extend(_user(index, message.role, message.content, names))
    return out


def _misplaced(index: int, block_index: int, kind: str, role: str) -> APIError:
    where = "an assistant turn" if kind in ("tool_use", "thinking", "redacted_thinking") else "a user turn"
    return APIError(400, f"messages.{index}.content.{block_index}: a '{kind}' block belongs in {where}, not in a "
                         f"'{role}' turn.", param=f"messages.{index}.content.{block_index}")


def _assistant(index: int, blocks: list[Any], names: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block_index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):  # encrypted elsewhere: nothing to show the model
            raise _misplaced(index, block_index, block.type, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(index: int, role: str, blocks: list[Any], names: dict[str, str]) -> list[dict[str, Any]]:
    """A user (or system) turn's blocks in order: runs of text as one message each, every
    ``tool_result`` as a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block_index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if texts:
                out.append({"role": role, "content": BLOCK_SEPARATOR.join(texts)})
                texts = []
            tool = {"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": (TOOL_ERROR_PREFIX if block.is_error else "") + block.text()}
            if block.tool_use_id in names:
                tool["name"] = names[block.tool_use_id]
            out.append(tool)
        else:
            raise _misplaced(index, block_index, block.type, role)
    if texts:
        out.append({"role": role, "content": BLOCK_SEPARATOR.join(texts)})
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request: ``auto`` and
    ``none`` without tools say nothing (Anthropic takes them), ``any`` is ``required``."""
    fields: dict[str, Any] = {}
    if body.tools:  # an empty list is no tools, as Anthropic reads it
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {}),
            **({"strict": tool.strict} if tool.strict is not None else {})}} for tool in body.tools]
    choice = body.tool_choice
    if choice is None or (not body.tools and isinstance(choice, (ToolChoiceAuto, ToolChoiceNone))):
        return fields
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else choice.type
    if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields
