"""The grammar that forces tool calls in the model's own format (``tool_choice`` required or named).

Only formats whose call is one JSON object ``{"name": ..., "arguments": {...}}`` between the
markers are forced (mlx-lm's ``json_tools`` parser: Hermes, Qwen2.5 and the bundled model):

    <tool_call>\\n{"name": "get_weather", "arguments": <valid under the tool's schema>}\\n</tool_call>

with the name first, as the chat templates write it back into the history (so the next turn's
prompt repeats the generated tokens), and ``", "`` / ``": "`` separators (``tojson``'s). After
the last call the grammar accepts only EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.chat_output import ChatFormat
from engine.constraints import ConstraintError, GrammarSpec, tagged_json_lark

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
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters or _NO_PARAMETERS},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return GrammarSpec.lark(tagged_json_lark(schema, begin=chat_format.tool_call_start + "\n",
                                             end="\n" + (chat_format.tool_call_end or ""), separator="\n",
                                             max_count=max_calls or MAX_FORCED_CALLS))
