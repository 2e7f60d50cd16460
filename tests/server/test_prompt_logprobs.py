"""Prompt log-probabilities, lists of prompts and token bytes over HTTP:
what lm-eval's ``local-completions`` and OpenAI's legacy clients send."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_ID, chat_body, post_json, stream_json

TEXT = "The ls command lists the files in a folder, sorted by name."
MULTIBYTE = "Café, naïve — 日本語 ✓ ok"


def completion(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, "/v1/completions", {"model": MODEL_ID, "temperature": 0, **fields})


def test_lm_eval_loglikelihood_request(http: httpx.Client, tokenizer) -> None:
    """lm-eval's request: token ids, echo, logprobs 1, max_tokens 1 (and 0)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    body = completion(http, prompt=[ids], echo=True, logprobs=1, max_tokens=1)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0.0 for v in lp["token_logprobs"][1:])
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert choice["text"] == TEXT + "".join(lp["tokens"][len(ids):])
    assert "".join(lp["tokens"]) == choice["text"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1
    nothing = completion(http, prompt=[ids], echo=True, logprobs=1, max_tokens=0)
    zero = nothing["choices"][0]
    assert zero["text"] == TEXT and zero["finish_reason"] == "length"
    assert nothing["usage"]["completion_tokens"] == 0
    assert zero["logprobs"]["tokens"] == lp["tokens"][: len(ids)]
    for a, b in zip(zero["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1: len(ids)]):
        assert abs(a - b) < 1e-5


def test_a_scored_token_is_what_the_prompt_cut_there_predicts(http: httpx.Client, tokenizer) -> None:
    """Prompt token k's logprob is the logprob a completion of the first k tokens gives it: cut the
    prompt before k, take the greedy next token with its logprob, and score a prompt ending in it."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    k = 7
    head = completion(http, prompt=ids[:k], max_tokens=1, logprobs=2)
    predicted = head["choices"][0]["logprobs"]["token_logprobs"][0]
    token = tokenizer.encode(head["choices"][0]["text"], add_special_tokens=False).ids
    scored = completion(http, prompt=ids[:k] + token[:1], echo=True, logprobs=2, max_tokens=0)
    assert abs(scored["choices"][0]["logprobs"]["token_logprobs"][k] - predicted) < 2e-3


def test_top_logprobs_of_prompt_tokens(http: httpx.Client) -> None:
    body = completion(http, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    lp = body["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) >= 1
        values = sorted(top.values(), reverse=True)
        assert all(v <= 0.0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-4
        assert value <= values[0] + 1e-6  # the prompt's own token is at most as likely as the best
        if token in top:
            assert abs(top[token] - value) < 1e-6


def test_prompt_logprobs_do_not_depend_on_the_prefix_cache(http: httpx.Client) -> None:
    """A prompt the prefix cache holds (a long one, sent once plainly) is scored in full."""
    long = " ".join([TEXT] * 40)
    cold = completion(http, prompt=long, echo=True, logprobs=1, max_tokens=0)
    completion(http, prompt=long, max_tokens=2)  # caches its blocks
    again = completion(http, prompt=long, echo=True, logprobs=1, max_tokens=0)
    a, b = cold["choices"][0]["logprobs"], again["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) > 256
    assert all(abs(x - y) < 1e-5 for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:]))


def test_echo_logprobs_streamed_equal_non_streamed(http: httpx.Client) -> None:
    body = {"model": MODEL_ID, "prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    whole = post_json(http, "/v1/completions", body)["choices"][0]
    chunks = stream_json(http, "/v1/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = [t for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
              for t in c["choices"][0]["logprobs"]["tokens"]]
    values = [v for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert values[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    assert all(abs(a - b) < 1e-5 for a, b in zip(values[1:], whole["logprobs"]["token_logprobs"][1:]))


def test_list_of_prompts_each_gets_its_choices(http: httpx.Client, sdk: openai.OpenAI, tokenizer) -> None:
    prompts = ["The ls command", "A folder holds"]
    body = completion(http, prompt=prompts, n=2, max_tokens=4, echo=True, temperature=0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        alone = completion(http, prompt=prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        for c in choices[2 * k: 2 * k + 2]:
            assert c["text"] == prompt + alone
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p, add_special_tokens=False).ids)
                                                 for p in prompts)
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    by_ids = sdk.completions.create(model=MODEL_ID, prompt=ids, max_tokens=4, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == [c["text"][len(p):] for c, p in zip(choices[::2], prompts)]
    streamed = stream_json(http, "/v1/completions", {"model": MODEL_ID, "prompt": prompts, "max_tokens": 4,
                                                     "temperature": 0, "stream": True})
    texts: dict[int, str] = {}
    for c in streamed:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: choices[0]["text"][len(prompts[0]):], 1: choices[2]["text"][len(prompts[1]):]}


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"max_tokens": 0, "logprobs": 1}, {"max_tokens": -1}])
def test_max_tokens_zero_needs_echo(http: httpx.Client, fields: dict[str, Any]) -> None:
    response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": TEXT, **fields})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_too_many_prompts_is_a_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": ["a"] * 257, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_echo_of_token_ids_decodes_multibyte_characters(http: httpx.Client, tokenizer) -> None:
    """Token-id prompts whose characters span tokens echo exactly; the pieces add up to the text
    and ``text_offset`` points at each piece."""
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False).ids
    assert len(ids) > len(MULTIBYTE.split())  # several characters span two tokens
    plain = completion(http, prompt=ids, echo=True, max_tokens=1)["choices"][0]["text"]
    assert plain.startswith(MULTIBYTE)
    scored = completion(http, prompt=ids, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    lp = scored["logprobs"]
    assert scored["text"] == MULTIBYTE and "".join(lp["tokens"]) == MULTIBYTE
    assert "\ufffd" not in "".join(lp["tokens"])
    assert len(lp["tokens"]) == len(ids)
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert scored["text"][offset: offset + len(token)] == token


def test_chat_logprob_bytes_are_each_tokens_own(http: httpx.Client, tokenizer) -> None:
    """A reply spelled with tokens that split UTF-8 characters: each entry's ``bytes`` are that
    token's raw bytes (not U+FFFD's), so they join to the reply's UTF-8."""
    target = "日本語 ✓"
    body = post_json(http, "/v1/chat/completions",
                     chat_body("Say it.", max_tokens=16, logprobs=True, top_logprobs=2,
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "s", "schema": {"type": "string", "enum": [target]}}}))
    choice = body["choices"][0]
    content = choice["message"]["content"]
    assert content == f'"{target}"'
    entries = choice["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.decode("utf-8") == content
    partial = [e for e in entries if not _valid_utf8(bytes(e["bytes"]))]
    assert partial, "expected tokens that split a character"
    for e in entries:
        for t in e["top_logprobs"]:
            assert t["bytes"] is None or isinstance(t["bytes"], list)


def _valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
