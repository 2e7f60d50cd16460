"""Chat and legacy completions over HTTP: the openai SDK (strict validation), raw SSE, exact usage,
and greedy streamed text equal to non-streamed text."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.server.conftest import MODEL_DIR, MODEL_ID, Server, chat_body, chatml, post_json, stream_json

PROMPT = "How do I list files in Linux?"
BATCH_NOISE = 3e-3  # batched vs alone logprobs, KVarN k4v2 (2x the 1.4e-3 logit noise measured in the engine)
RAW_PROMPT = "The ls command"


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def count_prompt(hf_tokenizer: Any, tokenizer: Tokenizer) -> Any:
    """Prompt tokens of a conversation, computed twice without the server: transformers' rendering
    of the model's template, and the ChatML written out by hand through the tokenizers library."""

    def count(messages: list[dict[str, str]]) -> int:
        rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == chatml([{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                                   for m in messages])
        ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == tokenizer.encode(rendered, add_special_tokens=False).ids
        return len(ids)

    return count


@pytest.fixture(scope="module")
def fingerprint(http: httpx.Client) -> str:
    return "kvarn-" + http.get("/health").json()["kv_cache"]["stamp"]


# --- chat ---

def test_chat_sdk_strict_non_streamed(sdk: openai.OpenAI, count_prompt: Any, fingerprint: str) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    r = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and len(r.id) > len("chatcmpl-")
    assert r.model == MODEL_ID
    assert r.system_fingerprint == fingerprint
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    assert r.usage is not None
    assert r.usage.prompt_tokens == count_prompt(messages)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_sdk_strict_streamed_matches_non_streamed(sdk: openai.OpenAI, count_prompt: Any,
                                                       fingerprint: str) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    whole = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40, temperature=0)
    stream = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL_ID for c in chunks)
    assert all(c.system_fingerprint == fingerprint for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert finishes[:-1] == [None] * (len(finishes) - 1)
    assert text == whole.choices[0].message.content
    assert finishes[-1] == whole.choices[0].finish_reason
    assert usage_chunk.usage == whole.usage
    assert whole.usage.prompt_tokens == count_prompt(messages)


def test_chat_raw_sse_format(http: httpx.Client, fingerprint: str) -> None:
    body = chat_body(PROMPT, max_tokens=10, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=line[len("data: "):]).json() for line in lines[:-1]]
    first = chunks[0]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "system_fingerprint", "choices"}  # no usage
        assert c["id"] == first["id"] and c["created"] == first["created"]
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL_ID
        assert c["system_fingerprint"] == fingerprint
        assert len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    whole = post_json(http, "/v1/chat/completions", chat_body(PROMPT, max_tokens=10, ignore_eos=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_chat_include_usage_equals_non_streamed_usage(http: httpx.Client, count_prompt: Any) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What does ls do?"},
                {"role": "assistant", "content": "It lists the files of a directory."},
                {"role": "user", "content": "And cd?"}]
    body = {"model": MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": 9, "ignore_eos": True}
    whole = post_json(http, "/v1/chat/completions", body)
    chunks = stream_json(http, "/v1/chat/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    expected = {"prompt_tokens": count_prompt(messages), "completion_tokens": 9,
                "total_tokens": count_prompt(messages) + 9, "prompt_tokens_details": {"cached_tokens": 0}}
    assert whole["usage"] == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == \
        whole["choices"][0]["message"]["content"]


def test_chat_eos_counts_as_a_completion_token(http: httpx.Client, count_prompt: Any) -> None:
    """A reply that ends on EOS: finish "stop"; the EOS token is counted (as vLLM does) but not shown."""
    body = chat_body("hi", max_tokens=40, logprobs=True)
    whole = post_json(http, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert "<|im_end|>" not in choice["message"]["content"]
    assert whole["usage"]["completion_tokens"] == len(entries) + 1 < 40
    assert whole["usage"]["prompt_tokens"] == count_prompt(body["messages"])


def test_chat_greedy_streamed_equals_non_streamed(http: httpx.Client) -> None:
    body = chat_body("Tell me about PostgreSQL indexes.", max_tokens=40)
    whole = post_json(http, "/v1/chat/completions", body)
    chunks = stream_json(http, "/v1/chat/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_developer_role_and_content_parts_render_as_system_and_text(http: httpx.Client, count_prompt: Any) -> None:
    plain = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is grep?"}]
    fancy = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is grep?"}]}]
    a = post_json(http, "/v1/chat/completions", {"model": MODEL_ID, "messages": plain, "temperature": 0,
                                                 "max_tokens": 8})
    b = post_json(http, "/v1/chat/completions", {"model": MODEL_ID, "messages": fancy, "temperature": 0,
                                                 "max_tokens": 8})
    assert a["usage"] == b["usage"]
    assert a["usage"]["prompt_tokens"] == count_prompt(plain)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_max_completion_tokens_is_honoured(http: httpx.Client) -> None:
    whole = post_json(http, "/v1/chat/completions",
                      {**chat_body(PROMPT, ignore_eos=True), "max_tokens": None, "max_completion_tokens": 5})
    assert whole["usage"]["completion_tokens"] == 5
    assert whole["choices"][0]["finish_reason"] == "length"


# --- legacy completions ---

def test_completions_sdk_strict_non_streamed(sdk: openai.OpenAI, tokenizer: Tokenizer, fingerprint: str) -> None:
    r = sdk.completions.create(model=MODEL_ID, prompt=RAW_PROMPT, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-") and r.model == MODEL_ID and r.system_fingerprint == fingerprint
    assert len(r.choices) == 1
    assert r.choices[0].index == 0 and r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert r.choices[0].text
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.encode(RAW_PROMPT, add_special_tokens=False).ids)
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_completions_token_id_prompt_equals_text_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(RAW_PROMPT, add_special_tokens=False).ids
    body = {"model": MODEL_ID, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    by_text = post_json(http, "/v1/completions", {**body, "prompt": RAW_PROMPT})
    by_ids = post_json(http, "/v1/completions", {**body, "prompt": ids})
    by_nested = post_json(http, "/v1/completions", {**body, "prompt": [ids]})
    assert by_ids["usage"] == by_text["usage"] == by_nested["usage"] == \
        {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12,
         "prompt_tokens_details": {"cached_tokens": 0}}
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] == by_nested["choices"][0]["text"]


def test_completions_streamed_matches_non_streamed(http: httpx.Client, server: Server) -> None:
    body = {"model": MODEL_ID, "prompt": "To create a table in PostgreSQL,", "temperature": 0, "max_tokens": 30}
    whole = post_json(http, "/v1/completions", body)
    chunks = stream_json(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    *choice_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_ID for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert "".join(c["choices"][0]["text"] for c in choice_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks] == \
        [None] * (len(choice_chunks) - 1) + [whole["choices"][0]["finish_reason"]]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]

    # The SDK reads the same stream. openai-python types a completion choice's finish_reason as
    # non-nullable, though OpenAI's own stream sends null until the end (openai/openai-openapi#100),
    # so strict validation would refuse OpenAI's stream as well: this one client is not strict.
    lenient = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    sdk_chunks = list(lenient.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in sdk_chunks if c.choices) == whole["choices"][0]["text"]
    assert sdk_chunks[-1].usage is not None
    assert sdk_chunks[-1].usage.model_dump(exclude_none=True) == whole["usage"]


def test_completions_echo(http: httpx.Client, tokenizer: Tokenizer) -> None:
    body = {"model": MODEL_ID, "prompt": RAW_PROMPT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    plain = post_json(http, "/v1/completions", body)
    echoed = post_json(http, "/v1/completions", {**body, "echo": True})
    assert echoed["choices"][0]["text"] == RAW_PROMPT + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]
    chunks = stream_json(http, "/v1/completions", {**body, "echo": True, "stream": True})
    assert chunks[0]["choices"][0]["text"] == RAW_PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["choices"][0]["text"]
    ids = tokenizer.encode(RAW_PROMPT, add_special_tokens=False).ids
    by_ids = post_json(http, "/v1/completions", {**body, "prompt": ids, "echo": True})
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]


def test_completions_default_max_tokens_is_16(http: httpx.Client) -> None:
    response = post_json(http, "/v1/completions", {"model": MODEL_ID, "prompt": RAW_PROMPT, "temperature": 0,
                                                   "ignore_eos": True})
    assert response["usage"]["completion_tokens"] == 16
    assert response["choices"][0]["finish_reason"] == "length"


# --- batching ---

def test_concurrent_requests_match_solo_runs(http: httpx.Client) -> None:
    """Requests batched together give exactly what each gives alone: greedy, seeded, logprobs."""
    bodies = [chat_body(PROMPT, max_tokens=24, ignore_eos=True),
              chat_body("Tell me about PostgreSQL indexes.", temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
              chat_body("What is a Python module?", max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2)]
    solo = [post_json(http, "/v1/chat/completions", b)["choices"][0] for b in bodies]
    most_running = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal most_running
        while not done.is_set():
            most_running = max(most_running, http.get("/health").json()["running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = [r["choices"][0] for r in pool.map(lambda b: post_json(http, "/v1/chat/completions", b),
                                                          bodies)]
    finally:
        done.set()
        watcher.join()
    assert most_running >= 2  # they did share steps
    for alone, batched in zip(solo, together):
        assert batched["message"]["content"] == alone["message"]["content"]
        # the same tokens; log-probabilities equal to float tolerance (a batched decode step runs the
        # weight matmuls as one GEMM over the rows, whose summation order differs from one row alone,
        # and the served KVarN layout amplifies that where a value crosses a rounding boundary: up to
        # 1.4e-3 in logits measured in tests/engine/test_batching.py; 1.03e-4 seen here once, over the
        # 1e-4 this used to allow)
        assert (batched["logprobs"] is None) == (alone["logprobs"] is None)
        if alone["logprobs"] is not None:
            for b, a in zip(batched["logprobs"]["content"], alone["logprobs"]["content"], strict=True):
                assert b["token"] == a["token"] and b["logprob"] == pytest.approx(a["logprob"], abs=BATCH_NOISE)
                assert [t["token"] for t in b["top_logprobs"]] == [t["token"] for t in a["top_logprobs"]]
                assert [t["logprob"] for t in b["top_logprobs"]] == pytest.approx(
                    [t["logprob"] for t in a["top_logprobs"]], abs=BATCH_NOISE)
