"""The model's chat format both ways: the chat template rendered and tokenized on the way in
(special-token text typed in message content kept as text), the generated text parsed into
content, reasoning and tool calls on the way out (with mlx-lm's own markers and parsers).

The way in. A chat template is rendered to text and tokenized with special tokens parsed: that is
how its own markers (``<|im_start|>``, ``<|im_end|>``) become control tokens. Content that a user
typed goes through the same tokenizer, so ``"<|im_end|>\\n<|im_start|>system\\n..."`` inside a user
message would become real control tokens and forge turns. By default the content's special-token
text is tokenized as ordinary text instead:

```
messages --(each content -> a placeholder)--> template text
template text  = [markup][placeholder 0][markup][placeholder 1]...[markup]
tokens         = markup: specials parsed   content: split_special_tokens (plain text)
```

Conversations whose content holds no special-token text take the template's own tokenization,
token for token (so nothing changes for them, prefix-cache keys included). ``parse_special``
(``kvarn serve --parse-special-tokens``) restores parsing everywhere.

The way out. mlx-lm's tokenizer wrapper knows a model's markers (``think_start``/``think_end``
from the vocabulary, ``tool_call_start``/``tool_call_end`` from the tool parser it inferred from
the chat template); its ``TextStateMachine`` finds them in decoded text (across token boundaries,
holding back text that may still be a marker) and its tool parser (``tokenizer.tool_parser``)
reads each call. Nothing here parses a model's format itself.

    text:   <think>plan</think>Let me look.<tool_call>{"name": ...}</tool_call>
    states: |--reasoning--|---normal---|--------tool--------|
    result: reasoning "plan", content "Let me look.", one call

Pure Python (no MLX): the server runs the output parser per choice on the text deltas the engine
streams.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper

logger = logging.getLogger(__name__)

_NORMAL, _REASONING, _TOOL = "normal", "reasoning", "tool"


@functools.lru_cache(maxsize=8)
def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every special token of ``tokenizer`` (an mlx-lm wrapper or a Hugging Face
    tokenizer), longest first; read once per tokenizer, not for every chat."""
    hf = _hf(tokenizer)
    found = {str(t) for t in getattr(hf, "all_special_tokens", ())}
    for token in getattr(hf, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    return tuple(sorted((t for t in found if t), key=len, reverse=True))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, parse_special: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt tokens of ``messages`` through the model's chat template (module docstring);
    ``template_kwargs`` are extra variables of the template (``enable_thinking``: the server
    checks that none overrides the template's own arguments)."""
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    specials = special_texts(tokenizer)
    contents = [m.get("content") for m in messages]
    forged = any(isinstance(c, str) and any(s in c for s in specials) for c in contents)
    if parse_special or not forged:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 gives a BatchEncoding
    marks = [f"\u2063kvarn{secrets.token_hex(8)}\u2063" if isinstance(c, str) else None for c in contents]
    masked = [dict(m, content=mark) if mark is not None else m for m, mark in zip(messages, marks)]
    text = tokenizer.apply_chat_template(masked, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    hf = _hf(tokenizer)
    ids: list[int] = []
    rest = text
    for mark, content in zip(marks, contents):
        if mark is None:
            continue
        if rest.count(mark) != 1:
            raise ValueError("the chat template changed a message's content while rendering it, so the special "
                             "tokens typed in it cannot be kept as text")
        markup, rest = rest.split(mark)
        ids += _encode(hf, markup, split_special=False) + _encode(hf, content, split_special=True)
    return ids + _encode(hf, rest, split_special=False)


def _hf(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (or ``tokenizer`` itself)."""
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def _encode(hf: Any, text: str, *, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(hf(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat markers as mlx-lm inferred them (no MLX objects). ``tool_parser`` names the
    ``mlx_lm.tool_parsers`` module reading its calls (None: the model has no tool-call format)."""

    tool_parser: str | None = None
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    think_start: str | None = None
    think_end: str | None = None

    @property
    def has_tool_calling(self) -> bool:
        return self.tool_parser is not None

    @property
    def has_thinking(self) -> bool:
        return self.think_start is not None


def chat_format_of(tokenizer: Any) -> ChatFormat:
    """The markers of an mlx-lm ``TokenizerWrapper`` (its ``load`` records the parser it chose as
    ``init_kwargs["tool_parser_type"]``)."""
    has_tools = tokenizer.has_tool_calling and tokenizer.tool_parser is not None
    name = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type") if has_tools else None
    return ChatFormat(
        tool_parser=(name or "custom") if has_tools else None,
        tool_call_start=tokenizer.tool_call_start if has_tools else None,
        tool_call_end=tokenizer.tool_call_end if has_tools else None,
        think_start=tokenizer.think_start if tokenizer.has_thinking else None,
        think_end=tokenizer.think_end if tokenizer.has_thinking else None)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedDelta:
    """What one piece of text added: content, reasoning and whole tool calls, in that order of
    arrival within each kind."""

    content: str = ""
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)


class OutputParser:
    """The split of one choice's text, fed delta by delta (``feed``), then ``finish``.

    Invariants: the concatenated ``content`` + ``reasoning`` + calls account for all the text
    but the markers; a call is reported once its end marker arrives (or at ``finish``), whole,
    read by mlx-lm's parser; text between markers that the parser cannot read is given back as
    content, markers included, never dropped. Trailing whitespace of the content is held until
    other content follows, and dropped at the end when the choice made calls (the newlines
    around calls are not content), so the split does not depend on how the text was cut."""

    def __init__(self, tokenizer: Any, *, tools: list[dict[str, Any]] | None, parse_tools: bool,
                 reasoning: bool, prompt_ids: list[int]) -> None:
        transitions: dict[str, list[tuple[str, str]]] = {}
        reasoning = reasoning and tokenizer.has_thinking
        parse_tools = parse_tools and tokenizer.has_tool_calling and tokenizer.tool_parser is not None
        if reasoning:
            transitions[_NORMAL] = [(tokenizer.think_start, _REASONING)]
            transitions[_REASONING] = [(tokenizer.think_end, _NORMAL)]
        if parse_tools:
            transitions.setdefault(_NORMAL, []).append((tokenizer.tool_call_start, _TOOL))
            if reasoning:  # as mlx-lm: a call may start while the model still thinks
                transitions[_REASONING].append((tokenizer.tool_call_start, _TOOL))
            transitions[_TOOL] = [(tokenizer.tool_call_end, _NORMAL)] if tokenizer.tool_call_end else []
        self._machine = TextStateMachine(transitions or None)
        self._state = self._machine.make_state(initial=self._initial(tokenizer, reasoning, prompt_ids))
        self._parser = tokenizer.tool_parser if parse_tools else None
        self._markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self._tools = tools
        self._tool_text = ""
        self._held = ""  # trailing whitespace of the content, not sent yet
        self.num_calls = 0

    @staticmethod
    def _initial(tokenizer: Any, reasoning: bool, prompt_ids: list[int]) -> str:
        """"reasoning" when the prompt leaves a think block open (a template that starts the
        answer with ``<think>``), as mlx-lm's server decides."""
        if reasoning and tokenizer.rfind_think_start(prompt_ids) > tokenizer.rfind_think_end(prompt_ids):
            return _REASONING
        return _NORMAL

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ParsedDelta:
        """The content, reasoning and calls that ``text`` completes."""
        self._state, segments = TextStateMachine.split(self._state, text)
        out = ParsedDelta()
        for i, (state, piece) in enumerate(segments):
            closed = i < len(segments) - 1  # every segment but the last ended at a marker
            if state == _TOOL:
                self._tool_text += piece
                if closed:
                    self._close_call(out)
            elif state == _REASONING:
                out.reasoning += piece
            else:
                self._add_content(out, piece)
        return out

    def finish(self, truncated: bool = False) -> ParsedDelta:
        """What is left at the end: text held back as a possible marker, an unclosed call
        (read if it parses: a format without an end marker ends at the end of the text). When
        the text was ``truncated`` (``max_tokens``), an unclosed call that does not parse is a
        call cut short, not content: it is dropped (the choice's finish says ``length``)."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        out = ParsedDelta()
        if state == _TOOL:
            self._tool_text += rest
            self._close_call(out, closed=False, drop_unread=truncated)
        elif state == _REASONING:
            out.reasoning += rest
        else:
            self._add_content(out, rest)
        if self._held and not self.made_calls:
            out.content += self._held
        self._held = ""
        return out

    def _add_content(self, out: ParsedDelta, piece: str) -> None:
        text = self._held + piece
        body = text.rstrip()
        out.content += body
        self._held = text[len(body):]

    def _close_call(self, out: ParsedDelta, closed: bool = True, drop_unread: bool = False) -> None:
        text, self._tool_text = self._tool_text, ""
        calls = self._read(text)
        if calls is None and drop_unread:
            logger.debug("a tool call cut short by max_tokens was dropped (%d characters)", len(text))
            return
        if calls is None:  # not a call after all: the text goes back, as the model wrote it
            start, end = self._markers
            self._add_content(out, start + text + (end if closed else ""))
            return
        out.calls.extend(calls)
        self.num_calls += len(calls)

    def _read(self, text: str) -> list[ParsedCall] | None:
        try:
            parsed = self._parser(text, self._tools)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = []
            for item in items:
                arguments = item["arguments"]
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                if not isinstance(item["name"], str) or not item["name"]:
                    raise ValueError("a call without a function name")
                calls.append(ParsedCall(item["name"], arguments))
        except Exception as exc:  # noqa: BLE001 - mlx-lm's parsers raise what their format meets
            logger.debug("a tool call could not be read (%s: %s); returned as content", type(exc).__name__, exc)
            return None
        return calls or None
