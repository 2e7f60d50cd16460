"""One agent loop through each chat-shaped API with its official SDK: a fixed system prompt of
about 2k tokens and two tools; each turn appends the previous answer (its tool calls answered
with a fixed tool result) and a new user message, as an agent does.

    Chat Completions (openai)   the whole conversation every turn
    Messages (anthropic)        the whole conversation every turn
    Responses (openai)          previous_response_id plus the new items only

Each ``*_turns`` function is a generator: it runs one turn per ``next()`` and yields the
answer's text, so the caller can measure around every turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

USER_TURNS = (
    "List the Python files under src/ and tell me which one defines the HTTP routes.",
    "Now read that file and summarise what each route does, in two sentences.",
    "Suggest one test for the slowest route and write it as a pytest function.",
)
TOOL_RESULT = "src/app.py\nsrc/routes.py\nsrc/models.py"
_TOOLS = (
    ("read_file", "Read a UTF-8 text file of the workspace and return its contents.",
     {"path": {"type": "string", "description": "path relative to the workspace root"}}),
    ("run_command", "Run a shell command in the workspace and return its output.",
     {"command": {"type": "string", "description": "the command line"}}),
)
_RULES = (
    "Read the relevant files before you change anything, and keep each change as small as the task allows.",
    "Prefer the project's existing helpers and conventions over new abstractions.",
    "Run the tests that cover the code you touched, and report exactly which ones ran and their results.",
    "Never print secrets, tokens or credentials, even when a file you read contains them.",
    "When a command fails, read its output and fix the cause instead of retrying it unchanged.",
    "Explain what you did in a few plain sentences; put code in fenced blocks with the language named.",
    "Ask before deleting files, rewriting history, or running anything that reaches the network.",
    "Keep functions short and named for what they do; comments say why, not what.",
)


def system_prompt(sections: int = 24) -> str:
    """The loop's fixed system prompt: numbered guideline sections (24 make ~2k tokens of the
    bundled tokenizer; the same text every run, so runs compare)."""
    parts = ["You are a careful software engineering agent working in the user's repository. "
             "You can call tools to read files and run commands."]
    for k in range(sections):
        rules = "\n".join(f"- {_RULES[(k + j) % len(_RULES)]}" for j in range(3))
        parts.append(f"## Guideline {k + 1}: area {k + 1} of the workspace\n{rules}")
    return "\n\n".join(parts)


@dataclass(frozen=True)
class LoopConfig:
    """What every loop shares: the model id, the system prompt and the answer's token cap."""

    model: str
    system: str
    max_tokens: int = 32


def _schema(params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": params, "required": list(params)}


def chat_turns(client: openai.OpenAI, config: LoopConfig) -> Iterator[str]:
    """The loop over ``POST /v1/chat/completions``, streamed with usage."""
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": _schema(p)}}
             for n, d, p in _TOOLS]
    messages: list[dict[str, Any]] = [{"role": "system", "content": config.system}]
    for user in USER_TURNS:
        messages.append({"role": "user", "content": user})
        stream = client.chat.completions.create(model=config.model, messages=messages, tools=tools,
                                                max_tokens=config.max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        text, calls = "", {}
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
        messages.append({"role": "assistant", "content": text, **({"tool_calls": list(calls.values())} if calls
                                                                   else {})})
        messages.extend({"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in calls.values())
        yield text


def messages_turns(client: anthropic.Anthropic, config: LoopConfig) -> Iterator[str]:
    """The loop over ``POST /v1/messages``, streamed."""
    tools = [{"name": n, "description": d, "input_schema": _schema(p)} for n, d, p in _TOOLS]
    messages: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for user in USER_TURNS:
        messages.append({"role": "user", "content": [*results, {"type": "text", "text": user}]})
        with client.messages.stream(model=config.model, system=config.system, messages=messages, tools=tools,
                                    max_tokens=config.max_tokens) as stream:
            answer = stream.get_final_message()
        blocks = [block.model_dump(exclude_none=True) for block in answer.content]
        messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": TOOL_RESULT}
                   for b in blocks if b["type"] == "tool_use"]
        yield "".join(b.get("text", "") for b in blocks)


def responses_turns(client: openai.OpenAI, config: LoopConfig) -> Iterator[str]:
    """The loop over ``POST /v1/responses``, each turn chained to the last by
    ``previous_response_id`` (only the new items sent), streamed."""
    tools = [{"type": "function", "name": n, "description": d, "parameters": _schema(p)} for n, d, p in _TOOLS]
    previous: str | None = None
    pending: list[dict[str, Any]] = []
    for user in USER_TURNS:
        items = [*pending, {"role": "user", "content": user}]
        stream = client.responses.create(model=config.model, instructions=config.system, input=items, tools=tools,
                                         max_output_tokens=config.max_tokens, temperature=0, stream=True,
                                         **({"previous_response_id": previous} if previous else {}))
        final = None
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                final = event.response
            elif event.type in ("response.failed", "error"):
                raise RuntimeError(f"the stream failed: {event.model_dump_json()[:2000]}")
        if final is None:
            raise RuntimeError("the stream ended without response.completed or response.incomplete")
        previous = final.id
        pending = [{"type": "function_call_output", "call_id": item.call_id, "output": TOOL_RESULT}
                   for item in final.output if item.type == "function_call"]
        yield final.output_text


def loop_clients(base_url: str, api_key: str) -> dict[str, tuple[Any, Any]]:
    """The SDK clients of each loop, against ``base_url`` (no retries: a refusal is a result)."""
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=900)
    ant = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=900)
    return {"sdk-chat": (chat_turns, oai), "sdk-messages": (messages_turns, ant),
            "sdk-responses": (responses_turns, oai)}


