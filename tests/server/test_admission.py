"""Capacity-priced admission and ``n > 1`` over real HTTP.

- A request that can never fit the KV budget (alone) is refused with 400 ``kv_budget_exceeded``
  before any byte of a stream goes out; ``n`` multiplies the price.
- A full waiting queue refuses with 429 ``queue_full`` and ``Retry-After``.
- A budget that fits two requests keeps the others waiting (never failing), two at a time.
- ``n > 1``: n choices, the prompt counted once, greedy choices equal to the n=1 answer, seeded
  choice i equal to an n=1 request seeded seed+i, streamed choices equal to non-streamed ones.

The budgets are computed from the bundled model's shape with ``engine.pricing`` (pure Python),
and one test checks that the server's own reservation is exactly that price.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engine.loader import resolve_dtype
from engine.pricing import LayerSpec, Pricing
from kvarn.layout import KVLayout
from tests.server.conftest import MODEL_DIR, MODEL_ID, Server, chat_body, chatml, client_of, metric, post_json, \
    HealthPoller, served, stream_json, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "How do I list files in Linux?"
RAW_PROMPT = "The ls command"
PREFILL_CHUNK = 512  # kvarn serve's default --prefill-chunk-size
PAIR_MAX_TOKENS = 40  # the size of the requests that the budget server fits two of
SHORT_MAX_TOKENS = 16
HUGE_MAX_TOKENS = 4000  # prompt + this stays within the 4096 context, but never fits the budget
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# --- pricing, from the model's shape ---

def pricing(dtype_bytes: int) -> Pricing:
    """The price list the engine builds for the bundled model (KVarN k4v2, tile 128): every layer a
    plain attention layer whose cache holds ``dtype_bytes``-wide keys (the compute dtype; a float32
    compute dtype also holds the KVarN window as float32: ``KVLayout.window_dtype``)."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    layer = LayerSpec("layout", config["num_key_value_heads"], config["head_dim"], dtype_bytes)
    layout = KVLayout.kvarn("k4v2", 128).with_storage_dtype("float32" if dtype_bytes == 4 else "float16")
    return Pricing(layout, (layer,) * config["num_hidden_layers"],
                   config["num_attention_heads"], config["max_position_embeddings"], PREFILL_CHUNK)


def chat_prompt_tokens(tokenizer: Tokenizer, content: str) -> int:
    return len(tokenizer.encode(chatml([{"role": "user", "content": content}]), add_special_tokens=False).ids)


def budget_for_two(prompt_tokens: int, max_tokens: int) -> int:
    """A budget in which two requests of this size run at once but never a third: two whole
    reservations (KV + prefill transient) fit, and two KV shares plus a third reservation do not,
    at the compute dtype the server will run (``--dtype auto`` on this machine's backend: float32
    on a CPU, whose KVarN window is then float32 too)."""
    dtype_bytes = _DTYPE_BYTES[resolve_dtype("auto") or "float16"]
    r = pricing(dtype_bytes).reservation(prompt_tokens, max_tokens)
    low, high = 2 * r.total, 2 * r.kv + r.total
    assert low < high, (low, high)
    return (low + high) // 2


def wait_drained(http: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /health until nothing runs, waits, holds KV or holds a reservation."""
    wait_idle(http, timeout)
    deadline = time.monotonic() + timeout
    while True:
        health = http.get("/health").json()
        if (health["running"], health["waiting"], health["kv_bytes"], health["reserved_bytes"]) == (0, 0, 0, 0):
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"the server still held something after {timeout} s: {health}")
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int, code: str, kind: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == kind
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- servers ---

@pytest.fixture(scope="module")
def pair_prompt_tokens(tokenizer: Tokenizer) -> int:
    return chat_prompt_tokens(tokenizer, PROMPT)


@pytest.fixture(scope="module")
def budget(pair_prompt_tokens: int) -> int:
    return budget_for_two(pair_prompt_tokens, PAIR_MAX_TOKENS)


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory, budget: int) -> Iterator[Server]:
    # the prefix cache off: this budget is sized for two requests and nothing else
    with served(tmp_path_factory, "kvarn-budget", "--kv-budget-bytes", str(budget), "--no-apc") as srv:
        yield srv


@pytest.fixture(scope="module")
def bhttp(budget_server: Server) -> Iterator[httpx.Client]:
    with client_of(budget_server) as client:
        yield client


@pytest.fixture(scope="module")
def prices(bhttp: httpx.Client) -> Pricing:
    """The price list at the budget server's own compute dtype."""
    dtype = bhttp.get("/v1/models").json()["data"][0]["compute_dtype"]
    return pricing(_DTYPE_BYTES[dtype])


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "kvarn-queue", "--max-num-seqs", "1", "--max-queue", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def qhttp(queue_server: Server) -> Iterator[httpx.Client]:
    with client_of(queue_server) as client:
        yield client


@contextmanager
def decoding_stream(server: Server) -> Iterator[httpx.Response]:
    """A long streamed request that has started decoding. Its line iterator is kept open while the
    block runs (dropping it would close the connection); the stream closes when the block ends."""
    body = chat_body(PROMPT, max_tokens=2000, ignore_eos=True, stream=True)
    with client_of(server) as client, client.stream("POST", CHAT, json=body) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        for line in lines:
            if '"content": "' in line and '"content": ""' not in line:
                break  # decoding
        yield first


# --- the KV budget ---

def test_budget_is_reported_and_reservations_are_exact(bhttp: httpx.Client, budget: int, prices: Pricing,
                                                        pair_prompt_tokens: int) -> None:
    """/health and /metrics report the budget; a running request reserves exactly its KV price
    (its prefill transient released once the prompt is in), and holds no more than that."""
    health = wait_drained(bhttp)
    assert health["budget_bytes"] == budget
    assert metric(bhttp, "kvarn_kv_budget_bytes") == budget
    assert metric(bhttp, "kvarn_kv_reserved_bytes") == 0
    body = chat_body(PROMPT, max_tokens=100, ignore_eos=True, stream=True)
    with bhttp.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        seen = 0
        lines = response.iter_lines()  # kept: a dropped line iterator would close the connection
        for line in lines:
            if line.startswith("data: ") and json.loads(line[len("data: "):])["choices"][0]["delta"].get("content"):
                seen += 1
                if seen == 2:  # two text chunks: the prompt is done, decoding runs
                    break
        during = bhttp.get("/health").json()
        reserved_metric = metric(bhttp, "kvarn_kv_reserved_bytes")
    expected = prices.reservation(pair_prompt_tokens, 100).kv
    assert during["running"] == 1
    assert during["reserved_bytes"] == expected, (during, expected)
    assert reserved_metric == expected
    assert 0 < during["kv_bytes"] <= during["reserved_bytes"]
    wait_drained(bhttp)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_that_can_never_fit_is_refused_with_400(bhttp: httpx.Client, budget: int, prices: Pricing,
                                                          path: str, stream: bool) -> None:
    wait_drained(bhttp)
    rejected = metric(bhttp, "kvarn_requests_rejected_total", {"status": "400"})
    body = (chat_body(PROMPT, max_tokens=HUGE_MAX_TOKENS) if path == CHAT else
            {"model": MODEL_ID, "prompt": RAW_PROMPT, "max_tokens": HUGE_MAX_TOKENS})
    assert prices.reservation(30, HUGE_MAX_TOKENS).total > budget  # (any prompt of these would do)
    if stream:
        body = {**body, "stream": True}
        with bhttp.stream("POST", path, json=body) as response:
            response.read()
    else:
        response = bhttp.post(path, json=body)
    error = assert_openai_error(response, 400, "kv_budget_exceeded", "invalid_request_error")
    assert f"{budget:,}" in error["message"], error
    assert metric(bhttp, "kvarn_requests_rejected_total", {"status": "400"}) == rejected + 1
    health = wait_drained(bhttp, 2)
    assert health["running"] == 0 and health["waiting"] == 0
    # and it still serves a request that fits
    ok = post_json(bhttp, path, {**{k: v for k, v in body.items() if k != "stream"}, "max_tokens": 8,
                                 "ignore_eos": True, "temperature": 0})
    assert ok["usage"]["completion_tokens"] == 8
    assert ok["choices"][0]["finish_reason"] == "length"


def test_chat_without_max_tokens_reserves_a_whole_context(bhttp: httpx.Client, budget: int,
                                                         prices: Pricing) -> None:
    """Chat's default max_tokens is "up to the context", and admission prices that: under a
    budget smaller than a whole context the request is refused (400) rather than run."""
    assert prices.reservation(20, prices.context_length).total > budget
    response = bhttp.post(CHAT, json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(response, 400, "kv_budget_exceeded", "invalid_request_error")


def test_the_sdk_sees_kv_budget_exceeded(budget_server: Server) -> None:
    sdk = openai.OpenAI(base_url=budget_server.base_url + "/v1", api_key="x", _strict_response_validation=True,
                        max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}],
                                    max_tokens=HUGE_MAX_TOKENS)
    assert info.value.status_code == 400 and info.value.code == "kv_budget_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL_ID, prompt=RAW_PROMPT, max_tokens=HUGE_MAX_TOKENS, stream=True)
    assert info.value.status_code == 400 and info.value.code == "kv_budget_exceeded"


def test_n_multiplies_the_price(bhttp: httpx.Client, budget: int, prices: Pricing, tokenizer: Tokenizer) -> None:
    """Short requests: n=2 fits the budget (and runs), n=3 can never fit (400, streamed or not)."""
    wait_drained(bhttp)
    tokens = chat_prompt_tokens(tokenizer, "hi")
    assert prices.reservation(tokens, SHORT_MAX_TOKENS, 2).total <= budget
    assert prices.reservation(tokens, SHORT_MAX_TOKENS, 3).total > budget
    body = chat_body("hi", max_tokens=SHORT_MAX_TOKENS, ignore_eos=True)
    two = post_json(bhttp, CHAT, {**body, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["completion_tokens"] == 2 * SHORT_MAX_TOKENS
    assert two["usage"]["prompt_tokens"] == tokens
    assert_openai_error(bhttp.post(CHAT, json={**body, "n": 3}), 400, "kv_budget_exceeded", "invalid_request_error")
    with bhttp.stream("POST", CHAT, json={**body, "n": 3, "stream": True}) as response:
        response.read()
    assert_openai_error(response, 400, "kv_budget_exceeded", "invalid_request_error")
    wait_drained(bhttp)


def test_the_budget_queues_requests_instead_of_failing_them(budget_server: Server, bhttp: httpx.Client,
                                                            budget: int, pair_prompt_tokens: int) -> None:
    """Four requests where the budget fits two: all four succeed with exact usage, at most two run
    at once (and two do), the reservations never exceed the budget, KV held never exceeds them."""
    wait_drained(bhttp)
    rejected = {s: metric(bhttp, "kvarn_requests_rejected_total", {"status": s}) for s in ("400", "429")}
    body = chat_body(PROMPT, max_tokens=PAIR_MAX_TOKENS, ignore_eos=True)
    solo = post_json(bhttp, CHAT, body)
    assert solo["usage"]["prompt_tokens"] == pair_prompt_tokens
    results: list[httpx.Response | BaseException] = [None] * 4  # type: ignore[list-item]

    def send(i: int) -> None:
        try:
            with httpx.Client(base_url=budget_server.base_url, timeout=120) as client:
                if i % 2:
                    results[i] = client.post(CHAT, json=body)
                else:
                    with client.stream("POST", CHAT, json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
                        r.read()
                    results[i] = r
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    with HealthPoller(budget_server.base_url) as poller:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    for i, result in enumerate(results):
        assert isinstance(result, httpx.Response), (i, result)
        assert result.status_code == 200, (i, result.text)
        if i % 2:
            answer = result.json()
            assert answer["usage"] == solo["usage"]
            assert answer["choices"][0]["message"]["content"] == solo["choices"][0]["message"]["content"]
            assert answer["choices"][0]["finish_reason"] == "length"
        else:
            lines = [line for line in result.text.splitlines() if line and not line.startswith(":")]  # ":": SSE pings
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert all("error" not in c for c in chunks), chunks
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == solo["usage"]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert text == solo["choices"][0]["message"]["content"]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    samples = poller.samples
    assert samples, "the poller saw nothing"
    assert poller.max("running") == 2, f"max running {poller.max('running')}, expected exactly 2 at once"
    assert poller.max("reserved_bytes") <= budget
    assert all(s["kv_bytes"] <= s["reserved_bytes"] for s in samples), \
        [s for s in samples if s["kv_bytes"] > s["reserved_bytes"]][:3]
    assert poller.max("waiting") >= 1  # someone did wait for room
    for status, before in rejected.items():
        assert metric(bhttp, "kvarn_requests_rejected_total", {"status": status}) == before
    wait_drained(bhttp)


# --- the waiting queue ---

def test_a_full_queue_answers_429_with_retry_after(queue_server: Server, qhttp: httpx.Client) -> None:
    wait_drained(qhttp)
    rejected = metric(qhttp, "kvarn_requests_rejected_total", {"status": "429"})
    waiter: dict[str, Any] = {}

    def second() -> None:
        try:
            with httpx.Client(base_url=queue_server.base_url, timeout=120) as client:
                waiter["response"] = client.post(COMPLETIONS, json={"model": MODEL_ID, "prompt": RAW_PROMPT,
                                                                    "max_tokens": 8, "ignore_eos": True,
                                                                    "temperature": 0})
        except BaseException as exc:  # noqa: BLE001 - reported below
            waiter["error"] = exc

    long_body = chat_body(PROMPT, max_tokens=2000, ignore_eos=True, stream=True)
    thread = threading.Thread(target=second)
    with httpx.Client(base_url=queue_server.base_url, timeout=120) as client:
        with client.stream("POST", CHAT, json=long_body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped line iterator would close the connection
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break
            assert qhttp.get("/health").json()["running"] == 1
            thread.start()
            deadline = time.monotonic() + 10
            while (health := qhttp.get("/health").json())["waiting"] != 1:
                assert time.monotonic() < deadline, f"the second request never waited: {health}"
                time.sleep(0.02)
            assert health["running"] == 1
            # the queue (1) is full: a third request is refused at once, streamed or not, on either endpoint
            refused = [qhttp.post(CHAT, json=chat_body("hi", max_tokens=4))]
            with qhttp.stream("POST", COMPLETIONS, json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 4,
                                                         "stream": True}) as streamed:
                streamed.read()
            refused.append(streamed)
            for response in refused:
                assert_openai_error(response, 429, "queue_full", "rate_limit_error")
                assert int(response.headers["retry-after"]) >= 1
            sdk = openai.OpenAI(base_url=queue_server.base_url + "/v1", api_key="x",
                                _strict_response_validation=True, max_retries=0, timeout=30)
            with pytest.raises(openai.RateLimitError) as info:
                sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True)
            assert info.value.code == "queue_full"
            assert int(info.value.response.headers["retry-after"]) >= 1
            assert metric(qhttp, "kvarn_requests_rejected_total", {"status": "429"}) == rejected + 3
            still = qhttp.get("/health").json()
            assert still["running"] == 1 and still["waiting"] == 1
        # the first stream is closed (aborted): the waiting one runs and finishes
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in waiter, waiter
    response = waiter["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert response.json()["choices"][0]["finish_reason"] == "length"
    wait_drained(qhttp)
    ok = post_json(qhttp, CHAT, chat_body("hi", max_tokens=5, ignore_eos=True))
    assert ok["usage"]["completion_tokens"] == 5
    wait_drained(qhttp)
    assert metric(qhttp, "kvarn_requests_rejected_total", {"status": "429"}) == rejected + 3


BURST = 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_burst_into_a_nearly_full_queue_gets_429s_not_200s(queue_server: Server, qhttp: httpx.Client,
                                                              stream: bool) -> None:
    """One request runs (max_num_seqs 1) and the queue (max 1) is empty; BURST requests arrive at
    once. One of them may wait; every other one must get the 429 status with Retry-After, streamed
    or not, never a 200 stream that carries the refusal inside it."""
    wait_drained(qhttp)
    rejected = metric(qhttp, "kvarn_requests_rejected_total", {"status": "429"})
    disconnects = metric(qhttp, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"})
    results: list[tuple[int, dict[str, str], str] | BaseException | None] = [None] * BURST

    async def send(client: httpx.AsyncClient, i: int) -> None:
        try:
            async with client.stream("POST", CHAT, json=chat_body("hi", max_tokens=4, ignore_eos=True,
                                                                   stream=stream)) as response:
                await response.aread()
            results[i] = (response.status_code, dict(response.headers), response.text)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    async def burst() -> None:  # all at once, from one event loop
        async with httpx.AsyncClient(base_url=queue_server.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=BURST)) as client:
            await asyncio.gather(*(send(client, i) for i in range(BURST)))

    threads = [threading.Thread(target=asyncio.run, args=(burst(),))]
    with decoding_stream(queue_server):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20  # all but the one that waits are answered at once
        while sum(r is not None for r in results) < BURST - 1:
            assert time.monotonic() < deadline, results
            time.sleep(0.02)
        assert qhttp.get("/health").json()["running"] == 1
    # the first stream closes: the one that waited runs
    for t in threads:
        t.join(60)
    assert all(isinstance(r, tuple) for r in results), results
    statuses = sorted(r[0] for r in results)  # type: ignore[index]
    refused_inside_200 = [r[2][-300:] for r in results if r[0] == 200 and "queue_full" in r[2]]  # type: ignore
    assert not refused_inside_200, (f"{len(refused_inside_200)} of {BURST} requests got HTTP 200 and the "
                                    f"queue_full refusal inside the stream: {refused_inside_200[0]!r}")
    assert statuses == [200] + [429] * (BURST - 1), statuses
    for status, headers, text in results:  # type: ignore[misc]
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(text)["error"]["code"] == "queue_full"
        elif stream:
            assert text.rstrip().endswith("data: [DONE]")
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 4
    wait_drained(qhttp)
    counted = metric(qhttp, "kvarn_requests_rejected_total", {"status": "429"}) - rejected
    disconnected = metric(qhttp, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"}) - \
        disconnects
    assert (counted, disconnected) == (BURST - 1, 1), \
        (f"{BURST - 1} requests were refused with 429 and one client (the first's) left, but /metrics counted "
         f"{counted:g} in kvarn_requests_rejected_total and {disconnected:g} disconnects in kvarn_requests_total")


def test_requests_abandoned_while_waiting_leave_the_queue(queue_server: Server, qhttp: httpx.Client) -> None:
    """Behind a running request: a waiting streamed n=2 request whose client leaves, and a waiting
    non-streamed one whose client times out, both leave the queue (forks included); nothing is
    left once the running one is closed too."""
    wait_drained(qhttp)
    disconnects = metric(qhttp, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"})

    def wait_for(waiting: int) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while (health := qhttp.get("/health").json())["waiting"] != waiting:
            assert time.monotonic() < deadline, f"expected {waiting} waiting: {health}"
            time.sleep(0.02)
        return health

    with decoding_stream(queue_server):
        with httpx.Client(base_url=queue_server.base_url, timeout=120) as other:
            with other.stream("POST", CHAT, json=chat_body("hi", n=2, max_tokens=50, ignore_eos=True,
                                                           stream=True)) as waiting:
                assert waiting.status_code == 200
                lines = (line for line in waiting.iter_lines() if line.startswith("data: "))
                roles = [json.loads(next(lines)[len("data: "):]) for _ in range(2)]  # role chunks
                assert [c["choices"][0]["index"] for c in roles] == [0, 1]
                health = wait_for(1)
                assert health["running"] == 1
        wait_for(0)  # the n=2 request went away before it ever ran
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(queue_server.base_url + CHAT, json=chat_body("hi", max_tokens=50),
                       timeout=httpx.Timeout(30, read=1.0))
        health = wait_for(0)
        assert health["running"] == 1
    # the first stream closes here
    wait_drained(qhttp)
    assert metric(qhttp, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"}) == \
        disconnects + 3
    ok = post_json(qhttp, CHAT, chat_body("hi", n=2, max_tokens=4, ignore_eos=True))
    assert ok["usage"]["completion_tokens"] == 8
    wait_drained(qhttp)


# --- n > 1 (the default session server) ---

HI_RAW = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # a raw prompt whose greedy reply ends on EOS


def _sdk_chat(sdk: openai.OpenAI, content: str = PROMPT, **fields: Any) -> Any:
    return sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}], **fields)


def _sdk_completion(sdk: openai.OpenAI, prompt: str = RAW_PROMPT, **fields: Any) -> Any:
    return sdk.completions.create(model=MODEL_ID, prompt=prompt, **fields)


def _texts(kind: str, response: Any) -> list[str]:
    return [c.message.content if kind == "chat" else c.text for c in response.choices]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n3_choices_count_their_tokens(sdk: openai.OpenAI, kind: str) -> None:
    """n=3 sampled with logprobs: three choices indexed 0..2, each with exactly max_tokens tokens,
    usage summing them and counting the prompt once (as the n=1 request does)."""
    create = _sdk_chat if kind == "chat" else _sdk_completion
    lp = {"logprobs": True} if kind == "chat" else {"logprobs": 0}
    one = create(sdk, max_tokens=10, temperature=1.0, seed=11, extra_body={"ignore_eos": True}, **lp)
    three = create(sdk, n=3, max_tokens=10, temperature=1.0, seed=11, extra_body={"ignore_eos": True}, **lp)
    assert len(three.choices) == 3
    assert [c.index for c in three.choices] == [0, 1, 2]
    counts = []
    for choice, text in zip(three.choices, _texts(kind, three)):
        assert choice.finish_reason == "length"
        tokens = ([e.token for e in choice.logprobs.content] if kind == "chat" else choice.logprobs.tokens)
        assert "".join(tokens) == text
        counts.append(len(tokens))
    assert counts == [10, 10, 10]
    assert three.usage.completion_tokens == sum(counts)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + sum(counts)
    assert len(set(_texts(kind, three))) > 1, "three seeded choices came out identical"
    assert _texts(kind, three)[0] == _texts(kind, one)[0]  # choice 0 uses the request's own seed


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("natural", [False, True], ids=["length", "eos"])
def test_n3_greedy_choices_equal_the_n1_answer(sdk: openai.OpenAI, kind: str, natural: bool) -> None:
    """Greedy n=3: every choice is the n=1 answer, cut by max_tokens or ending on EOS (which
    each choice counts, as the n=1 request does)."""
    if kind == "chat":
        create = functools.partial(_sdk_chat, content="hi" if natural else PROMPT)
    else:
        create = functools.partial(_sdk_completion, prompt=HI_RAW if natural else RAW_PROMPT)
    fields: dict[str, Any] = {"max_tokens": 40, "temperature": 0}
    if not natural:
        fields.update(max_tokens=24, extra_body={"ignore_eos": True})
    one = create(sdk, **fields)
    three = create(sdk, n=3, **fields)
    assert one.choices[0].finish_reason == ("stop" if natural else "length")
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert _texts(kind, three) == _texts(kind, one) * 3
    assert [c.finish_reason for c in three.choices] == [one.choices[0].finish_reason] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_seeded_choice_i_uses_seed_plus_i(sdk: openai.OpenAI, kind: str) -> None:
    create = _sdk_chat if kind == "chat" else _sdk_completion
    seed = 4242
    common = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    two = create(sdk, n=2, seed=seed, **common)
    first = create(sdk, seed=seed, **common)
    second = create(sdk, seed=seed + 1, **common)
    assert _texts(kind, two) == [_texts(kind, first)[0], _texts(kind, second)[0]]
    assert _texts(kind, two)[0] != _texts(kind, two)[1]
    assert two.usage.completion_tokens == first.usage.completion_tokens + second.usage.completion_tokens == 32
    assert two.usage.prompt_tokens == first.usage.prompt_tokens


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streamed_n2_matches_non_streamed(http: httpx.Client, path: str) -> None:
    base = (chat_body(PROMPT, max_tokens=20, temperature=1.0, seed=99, n=2) if path == CHAT else
            {"model": MODEL_ID, "prompt": RAW_PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 99, "n": 2})
    whole = post_json(http, path, base)
    chunks = stream_json(http, path, {**base, "stream": True, "stream_options": {"include_usage": True}})
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all("usage" not in c for c in choice_chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all(len(c["choices"]) == 1 for c in choice_chunks)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in choice_chunks:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1]
    for index, choices in by_index.items():
        finishes = [c["finish_reason"] for c in choices]
        assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] is not None, finishes
        assert finishes[-1] == whole["choices"][index]["finish_reason"]
        if path == CHAT:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in c["delta"] for c in choices[1:])
            text = "".join(c["delta"].get("content", "") for c in choices)
            assert text == whole["choices"][index]["message"]["content"]
        else:
            assert "".join(c["text"] for c in choices) == whole["choices"][index]["text"]
    texts = [(c["message"]["content"] if path == CHAT else c["text"]) for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1] and texts[0] != texts[1]
    single = post_json(http, path, {**base, "n": 1})
    assert whole["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    second = post_json(http, path, {**base, "n": 1, "seed": 100})
    assert whole["usage"]["completion_tokens"] == \
        single["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]


def test_n3_reserves_n_sequences_and_an_abort_frees_every_choice(server: Server, http: httpx.Client,
                                                                 tokenizer: Tokenizer) -> None:
    """A running n=3 request reserves exactly three KVarN windows, its prompt's record blocks once
    (the choices share them) and each choice's records up to prompt + max_tokens; it holds no
    more KV than that, and closing its stream frees all three choices."""
    health = wait_drained(http)
    dtype = http.get("/v1/models").json()["data"][0]["compute_dtype"]
    prices = pricing(_DTYPE_BYTES[dtype])
    max_tokens = 300
    text = " ".join(f"{PROMPT} (question {i})" for i in range(30))  # a prompt of a few tiles
    prompt = chat_prompt_tokens(tokenizer, text)
    total, shared = prices.records(prompt + max_tokens), prices.records(prompt)
    expected = 3 * prices.window_bytes() + (total + 2 * (total - shared)) * prices.block_bytes()
    assert shared >= 2 and expected < prices.reservation(prompt, max_tokens, 3).kv  # < three whole sequences
    assert health["budget_bytes"] >= expected
    body = chat_body(text, n=3, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=5, stream=True)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            texts: dict[int, int] = {}
            lines = response.iter_lines()  # kept: a dropped line iterator would close the connection
            for line in lines:
                if not line.startswith("data: "):
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                if choice["delta"].get("content"):
                    texts[choice["index"]] = texts.get(choice["index"], 0) + 1
                    if len(texts) == 3 and min(texts.values()) >= 2:
                        break  # every choice is decoding
            during = http.get("/health").json()
    assert during["running"] == 3, during
    assert during["reserved_bytes"] == expected, (during, expected)
    assert 0 < during["kv_bytes"] <= during["reserved_bytes"], during
    wait_drained(http)
