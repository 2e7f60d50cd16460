"""Schemathesis hooks for bench/schemathesis.sh (``SCHEMATHESIS_HOOKS``): generated bodies, kept to
what the run can afford, never turned from invalid to valid or back.

- ``model``: a generated model is any string, and a model the server does not serve is a 404
  before anything else is looked at, so without this no generated completion gets past it. A
  string ``model`` becomes the served id (``KVARN_MODEL_ID``); any other value stays.
- the cost of one request: a valid ``max_tokens`` / ``max_completion_tokens`` in (16, 4096] becomes
  16 (larger ones stay: they test the context check), none at all becomes ``max_tokens: 16`` on a
  body that is otherwise as generated (the default is the rest of the 4,096-token context), and a
  valid ``n`` / ``best_of`` in (2, 128] becomes 2 (larger ones stay: they test the choices bound).
  Without this one fuzzed request can decode 128 x 4,000 tokens on 2 CPU cores.
"""

import os

import schemathesis

MODEL_ID = os.environ.get("KVARN_MODEL_ID", "fixture-chat-29m-q8")
MAX_TOKENS = 16
MAX_CHOICES = 2


def _valid_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str):
        body["model"] = MODEL_ID
    for key in ("max_tokens", "max_completion_tokens"):
        if _valid_int(body.get(key)) and MAX_TOKENS < body[key] <= 4096:
            body[key] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    for key in ("n", "best_of"):
        if _valid_int(body.get(key)) and MAX_CHOICES < body[key] <= 128:
            body[key] = MAX_CHOICES
    return body
