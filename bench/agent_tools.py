"""Real tool-call turns for the agent workload of bench/apc.py (``--tool-calls``).

Every request of a conversation carries the same three tools. After a user message the request
asks for one call (``tool_choice: "required"``, ``parallel_tool_calls: false``: the bundled 29M
model does not call tools on its own, so the server's grammar makes it call one, with arguments
valid under the tool's schema); after a tool result it is ``"auto"`` (the model answers in text).
The call comes back assembled from the stream's ``delta.tool_calls``, is sent back as the
assistant's ``tool_calls``, and the next tool message answers it by ``tool_call_id``: the turns
an OpenAI client runs in an agent loop. Prompt lengths are estimated with the model's own chat
template (``transformers``, no MLX), tools included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_PATH = {"type": "string", "maxLength": 48}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read lines of a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": _PATH, "start_line": {"type": "integer", "minimum": 1, "maximum": 5000}},
            "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a pattern.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "maxLength": 32}, "path": _PATH},
            "required": ["pattern"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command in the repository.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string", "maxLength": 64}},
                       "required": ["command"], "additionalProperties": False}}},
]


def request_fields(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The tool fields of the next request: a call after a user message, free after a result."""
    choice = "auto" if messages[-1]["role"] == "tool" else "required"
    return {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}


def assemble(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]] | None) -> None:
    """Add one chunk's ``delta.tool_calls`` to ``calls`` (by index), as OpenAI clients do."""
    for delta in deltas or []:
        call = calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def reply_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's reply as the next request sends it back."""
    if calls:
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    return {"role": "assistant", "content": text}


def turn_message(role: str, content: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The next message: a tool result answers the previous reply's first call (a result with
    no call to answer is sent as a user message)."""
    calls = messages[-1].get("tool_calls") if messages and messages[-1]["role"] == "assistant" else None
    if role == "tool" and calls:
        return {"role": "tool", "tool_call_id": calls[0]["id"], "content": content}
    return {"role": "user" if role == "tool" else role, "content": content}


class TemplateTokens:
    """Prompt token ids of a conversation with the tools, through the model's own template."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        rendered = [_template_message(m) for m in messages]
        ids = self.tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def chat_tokens(self, messages: list[dict[str, Any]]) -> int:
        return len(self.chat_ids(messages))


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the server hands it to the template (content "" for None, arguments parsed)."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    return out
