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
