"""Finding strings that are not Unicode text in a parsed JSON body.

JSON lets a client write a lone UTF-16 surrogate (``"\\ud800"``); Python's ``json`` decodes it into
a ``str`` that cannot be encoded as UTF-8, so a tokenizer, a chat template or the response
encoder (which echoes e.g. an unknown ``model``) would fail on it with a 500. Bodies are checked
once, as a whole, before any field is used.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_text_path(data: Any) -> str | None:
    """The dotted path (``messages.0.content``) of a string in ``data`` (keys included)
    holding a lone surrogate, or None when every string is text. A key that is bad is reported
    by its parent's path (the key itself cannot be echoed). Iterative: any nesting depth."""
    try:  # the common case in C: one encode of the whole body, no walk
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, RecursionError, TypeError, ValueError):
        pass
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return path or "body"
                stack.append((value, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((value, f"{path}.{i}" if path else str(i)) for i, value in enumerate(item))
    return None


def checked_body(model: type[BaseModel], data: Any) -> Any:
    """A request body before its fields are validated: every string of it, keys included, must
    be Unicode text (JSON's ``\\ud800`` escapes give lone surrogates, which no tokenizer,
    template or response encoder takes), and an optional field of ``model`` sent as ``null`` is
    not given (OpenAI's fields are nullable: ``"n": null`` is n = 1); required ones stay refused."""
    path = invalid_text_path(data)
    if path is not None:
        raise PydanticCustomError("invalid_unicode", "Invalid value for '{param}': a string holds a lone UTF-16 "
                                  "surrogate (a \\ud800-\\udfff escape outside a pair), which is not text.",
                                  {"param": path})
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in model.model_fields
                or model.model_fields[k].is_required()}
    return data
