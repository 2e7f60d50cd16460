"""Log-probabilities on both endpoints: shapes, ordering, consistency with the text."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_ID, chat_body, post_json, stream_json

PROMPT = "How do I list files in Linux?"
RAW_PROMPT = "The ls command"


def _check_entry(entry: dict[str, Any], top_n: int) -> None:
    assert entry["logprob"] <= 0.0
    assert entry["bytes"] == list(entry["token"].encode("utf-8"))
    top = entry["top_logprobs"]
    assert len(top) == top_n
    values = [t["logprob"] for t in top]
    assert values == sorted(values, reverse=True)
    assert all(v <= 0.0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
    assert all(t["bytes"] == list(t["token"].encode("utf-8")) for t in top)
    for t in top:
        if t["token"] == entry["token"]:
            assert t["logprob"] == entry["logprob"]


@pytest.fixture(scope="module")
def greedy(http: httpx.Client) -> dict[str, Any]:
    return post_json(http, "/v1/chat/completions",
                     chat_body(PROMPT, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3))


def test_chat_logprobs_greedy(greedy: dict[str, Any]) -> None:
    choice = greedy["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert len(entries) == greedy["usage"]["completion_tokens"] == 12
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        _check_entry(entry, 3)
        # greedy: the chosen token is the most likely one
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]


def test_chat_logprobs_streamed_equal_non_streamed(http: httpx.Client, greedy: dict[str, Any]) -> None:
    chunks = stream_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3,
                                   stream=True))
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == greedy["choices"][0]["logprobs"]["content"]
    for c in chunks[1:]:
        assert "".join(e["token"] for e in c["choices"][0]["logprobs"]["content"]) == \
            c["choices"][0]["delta"].get("content", "")


def test_chat_logprobs_sampled(http: httpx.Client) -> None:
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True,
                                   logprobs=True, top_logprobs=5))
    entries = response["choices"][0]["logprobs"]["content"]
    assert len(entries) == 20
    assert "".join(e["token"] for e in entries) == response["choices"][0]["message"]["content"]
    for entry in entries:
        _check_entry(entry, 5)
        # a sampled token is never likelier than the top one
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"]


def test_chat_logprobs_without_top(http: httpx.Client, greedy: dict[str, Any]) -> None:
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=12, ignore_eos=True, logprobs=True))
    entries = response["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in entries] == [[]] * 12
    expected = greedy["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in entries] == [(e["token"], e["logprob"]) for e in expected]


def test_chat_logprobs_sdk_strict(sdk: openai.OpenAI, greedy: dict[str, Any]) -> None:
    r = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                    temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    assert [e.model_dump() for e in r.choices[0].logprobs.content] == greedy["choices"][0]["logprobs"]["content"]


def test_completions_logprobs(http: httpx.Client, sdk: openai.OpenAI) -> None:
    body = {"model": MODEL_ID, "prompt": RAW_PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    response = post_json(http, "/v1/completions", body)
    lp = response["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = response["usage"]["completion_tokens"]
    assert n == 10
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0.0
        assert len(top) == 2
        assert all(v <= 0.0 for v in top.values())
        assert top[token] == logprob == max(top.values())  # greedy: the top-1 token
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    chunks = stream_json(http, "/v1/completions", {**body, "stream": True})
    streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in lp}
    assert {k: v for k, v in streamed.items() if k != "text_offset"} == \
        {k: v for k, v in lp.items() if k != "text_offset"}  # text_offset: see the next test

    r = sdk.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.model_dump() == lp


def test_completions_text_is_the_concatenation_of_its_tokens(http: httpx.Client) -> None:
    body = {"model": MODEL_ID, "prompt": RAW_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    response = post_json(http, "/v1/completions", body)
    choice = response["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert tokens[0].startswith(" ")  # what this test is about: a first token with a leading space
    assert choice["text"] == "".join(tokens)
    for token, offset in zip(tokens, choice["logprobs"]["text_offset"]):
        assert choice["text"][offset: offset + len(token)] == token
    chunks = stream_json(http, "/v1/completions", {**body, "stream": True})
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == \
        choice["logprobs"]["text_offset"]
    echoed = post_json(http, "/v1/completions", {**body, "echo": True, "logprobs": None})
    assert echoed["choices"][0]["text"] == RAW_PROMPT + "".join(tokens)
