"""Sampling controls with exact, observable effects: stop strings (streamed and not), seeds,
presence/frequency penalties, logit_bias, top_k/top_p."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.server.conftest import MODEL_ID, chat_body, post_json, stream_json

PROMPT = "How do I list files in Linux?"


def _content(response: dict[str, Any]) -> str:
    return response["choices"][0]["message"]["content"]


def _streamed_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def baseline(http: httpx.Client) -> dict[str, Any]:
    """The greedy reply to PROMPT, 40 tokens, with its tokens (from logprobs)."""
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2))
    tokens = [e["token"] for e in response["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 40 and "".join(tokens) == _content(response)
    return {"text": _content(response), "tokens": tokens, "entries": response["choices"][0]["logprobs"]["content"]}


def _stop_across_a_boundary(tokens: list[str], text: str) -> tuple[str, int, int]:
    """A stop string made of the end of token k and the start of token k+1, whose first
    occurrence in ``text`` is that very spot: (stop, where it starts, k)."""
    offset = 0
    for k, (left, right) in enumerate(zip(tokens, tokens[1:])):
        offset += len(left)
        if k >= 4 and len(left.strip()) >= 2 and len(right.strip()) >= 2:
            stop = left[-2:] + right[:2]
            if text.find(stop) == offset - 2:
                return stop, offset - 2, k
    raise AssertionError(f"no usable token boundary in {tokens}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_string_across_token_boundary(http: httpx.Client, baseline: dict[str, Any], stream: bool) -> None:
    stop, start, k = _stop_across_a_boundary(baseline["tokens"], baseline["text"])
    expected = baseline["text"][:start]
    body = chat_body(PROMPT, max_tokens=40, ignore_eos=True, stop=[stop])
    if not stream:
        response = post_json(http, "/v1/chat/completions", body)
        text, finish, usage = _content(response), response["choices"][0]["finish_reason"], response["usage"]
    else:
        chunks = stream_json(http, "/v1/chat/completions",
                             {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert not any(stop in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
        text, finish, usage = _streamed_text(chunks), chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]
    assert text == expected
    assert stop not in text
    assert finish == "stop"
    # the stop string is complete with token k+1: tokens 0..k+1 were generated, no more
    assert usage["completion_tokens"] == k + 2


def test_earliest_of_several_stop_strings_wins(http: httpx.Client, baseline: dict[str, Any]) -> None:
    stop, start, _ = _stop_across_a_boundary(baseline["tokens"], baseline["text"])
    later = baseline["text"][start + 10: start + 14]
    assert later and baseline["text"].find(later) > start
    response = post_json(http, "/v1/chat/completions", chat_body(PROMPT, max_tokens=40, ignore_eos=True,
                                                                 stop=[later, stop]))
    assert _content(response) == baseline["text"][:start]
    assert response["choices"][0]["finish_reason"] == "stop"


def test_stop_string_on_completions(http: httpx.Client) -> None:
    body = {"model": MODEL_ID, "prompt": "To create a table in PostgreSQL,", "temperature": 0, "max_tokens": 24,
            "ignore_eos": True}
    text = post_json(http, "/v1/completions", body)["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    assert cut > 0
    response = post_json(http, "/v1/completions", {**body, "stop": stop})
    assert response["choices"][0]["text"] == text[:cut]
    assert response["choices"][0]["finish_reason"] == "stop"
    chunks = stream_json(http, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seed_reproducibility(http: httpx.Client) -> None:
    body = chat_body(PROMPT, temperature=1.0, max_tokens=40, ignore_eos=True)
    first = _content(post_json(http, "/v1/chat/completions", {**body, "seed": 1234}))
    again = _content(post_json(http, "/v1/chat/completions", {**body, "seed": 1234}))
    other = _content(post_json(http, "/v1/chat/completions", {**body, "seed": 4321}))
    streamed = _streamed_text(stream_json(http, "/v1/chat/completions", {**body, "seed": 1234, "stream": True}))
    assert first == again == streamed
    assert other != first


def test_top_k_1_and_tiny_top_p_are_greedy(http: httpx.Client, baseline: dict[str, Any]) -> None:
    body = chat_body(PROMPT, temperature=1.0, max_tokens=40, ignore_eos=True, seed=7)
    assert _content(post_json(http, "/v1/chat/completions", {**body, "top_k": 1})) == baseline["text"]
    assert _content(post_json(http, "/v1/chat/completions", {**body, "top_p": 1e-6})) == baseline["text"]


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_positive_penalty_changes_text_only_after_a_repeat(http: httpx.Client, baseline: dict[str, Any],
                                                           penalty: str) -> None:
    """Penalties only lower tokens already generated, so under greedy the reply is the baseline's
    up to the first token the baseline repeats; a strong penalty must change it after that."""
    tokens = baseline["tokens"]
    first_repeat = next(i for i, t in enumerate(tokens) if t in tokens[:i])
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=40, ignore_eos=True, **{penalty: 2.0}))
    text = _content(response)
    prefix = "".join(tokens[:first_repeat])
    assert text.startswith(prefix)
    assert text != baseline["text"]


def test_negative_frequency_penalty_encourages_repeats(http: httpx.Client, baseline: dict[str, Any]) -> None:
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=40, ignore_eos=True, frequency_penalty=-2.0,
                                   logprobs=True))
    tokens = [e["token"] for e in response["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 40
    assert max(Counter(tokens).values()) > max(Counter(baseline["tokens"]).values())


def test_logit_bias_plus_100_forces_a_token(http: httpx.Client, tokenizer: Tokenizer) -> None:
    (token_id,) = tokenizer.encode("?", add_special_tokens=False).ids
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=6, logit_bias={str(token_id): 100}))
    assert _content(response) == "?" * 6
    assert response["usage"]["completion_tokens"] == 6
    assert response["choices"][0]["finish_reason"] == "length"
    completion = post_json(http, "/v1/completions", {"model": MODEL_ID, "prompt": "SELECT", "max_tokens": 4,
                                                     "temperature": 0, "logit_bias": {str(token_id): 100}})
    assert completion["choices"][0]["text"] == "?" * 4


def test_logit_bias_minus_100_bans_the_greedy_token(http: httpx.Client, tokenizer: Tokenizer,
                                                    baseline: dict[str, Any]) -> None:
    first = baseline["entries"][0]
    (banned,) = tokenizer.encode(first["token"], add_special_tokens=False).ids
    runner_up = first["top_logprobs"][1]["token"]
    response = post_json(http, "/v1/chat/completions",
                         chat_body(PROMPT, max_tokens=3, logit_bias={str(banned): -100}, logprobs=True))
    entries = response["choices"][0]["logprobs"]["content"]
    assert entries[0]["token"] == runner_up
    # logprobs are the model's own, before the bias: the same as in the unbiased baseline
    assert entries[0]["logprob"] == first["top_logprobs"][1]["logprob"]
