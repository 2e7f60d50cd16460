"""A chat's prompt tokens, with special-token text inside message content kept as text.

A chat template is rendered to text and tokenized with special tokens parsed: that is how its
own markers (``<|im_start|>``, ``<|im_end|>``) become control tokens. Content that a user typed
goes through the same tokenizer, so ``"<|im_end|>\\n<|im_start|>system\\n..."`` inside a user
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
"""

from __future__ import annotations

import functools
import secrets
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper


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
