"""The grammar that forces tool calls in the model's own format (``tool_choice`` required or named).

Only formats whose call is one JSON object ``{"name": ..., "arguments": {...}}`` between the
markers are forced (mlx-lm's ``json_tools`` parser: Hermes, Qwen2.5 and the bundled model):

    <tool_call>\\n{"name": "get_weather", "arguments": <valid under the tool's schema>}\\n</tool_call>

with the name first, as the chat templates write it back into the history (so the next turn's
prompt repeats the generated tokens), and ``", "`` / ``": "`` separators (``tojson``'s). The
arguments' objects are closed as ``closed_schema`` says (a schema without
``additionalProperties``, as LangChain and Pydantic write them, takes no extra or repeated key,
so the call ends). After the last call the grammar accepts only EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.chat_format import ChatFormat
from engine.constraints import ConstraintError, GrammarSpec, closed_schema, tagged_json_lark

FORCED_FORMATS = ("json_tools",)
MAX_FORCED_CALLS = 16  # the most calls a `required` turn with parallel calls may make
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_grammar(chat_format: ChatFormat, tools: Sequence[tuple[str, dict[str, Any] | None]],
                      max_calls: int | None) -> GrammarSpec:
    """The grammar of 1 to ``max_calls`` (None: ``MAX_FORCED_CALLS``) calls, each of one of
    ``tools`` (name, parameters schema), in ``chat_format``'s markers. Raises ``ConstraintError``
    for a model whose call format cannot be forced."""
    if chat_format.tool_parser not in FORCED_FORMATS or not chat_format.tool_call_start:
        raise ConstraintError(f"tool_choice 'required' or a named function needs a model whose tool calls are JSON "
                              f"objects between markers (mlx-lm's {', '.join(FORCED_FORMATS)} parser); this model's "
                              f"format is {chat_format.tool_parser or 'none'}.")
    if not tools:
        raise ConstraintError("no tool to call")
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _rebased(
        parameters or _NO_PARAMETERS, "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{i}/properties/arguments")},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, (name, parameters) in enumerate(tools)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        closed = closed_schema(schema)
    except RecursionError as exc:
        raise ConstraintError("a tool's parameters schema is nested too deeply") from exc
    return GrammarSpec.lark(tagged_json_lark(closed, begin=chat_format.tool_call_start + "\n",
                                             end="\n" + (chat_format.tool_call_end or ""), separator="\n",
                                             max_count=max_calls or MAX_FORCED_CALLS))


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local ``$ref`` pointers (``#``, ``#/$defs/...``) pointing under ``root``,
    where it sits inside the call's schema (Pydantic's nested models keep their ``$defs`` in the
    parameters)."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out
