"""200 concurrent requests through the HTTP server: continuous batching changes nothing a client
can see.

Chat and completions, streamed and not, greedy and seeded, with aborts mid-stream and client
timeouts among them. Every answer that is not abandoned equals its solo answer (computed first,
one request at a time) token for token, with exact usage; the server really batched (many rows
running at once) and holds nothing afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_ID, HealthPoller, Server, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOTAL = 200
ABORTED = 40  # streamed, closed after a few chunks
TIMED_OUT = 5  # non-streamed, given up by the client's read timeout
MAX_TOKENS = 12
LONG_MAX_TOKENS = 200  # for the requests that are abandoned: still running when their client leaves
MIN_BATCH = 16  # /health must have shown at least this many rows running at once
PROMPTS = [
    "How do I list files in Linux?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does.",
    "Give me three tips for better sleep.",
]
SEEDS = [(0, 7), (1, 1234), (2, 99), (3, 2024)]  # (prompt index, seed) of the sampled requests


@dataclass(frozen=True)
class Spec:
    path: str
    stream: bool
    prompt: int
    seed: int | None  # None: greedy
    fate: str = "complete"  # "complete", "abort" (mid-stream) or "timeout" (non-streamed)

    @property
    def key(self) -> tuple[str, int, int | None]:
        return self.path, self.prompt, self.seed


def body(spec: Spec | tuple[str, int, int | None], **extra: Any) -> dict[str, Any]:
    path, prompt, seed = spec.key if isinstance(spec, Spec) else spec
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    if path == CHAT:
        return {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPTS[prompt]}],
                "max_tokens": MAX_TOKENS, "logprobs": True, **sampling, **extra}
    return {"model": MODEL_ID, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "logprobs": 0,
            **sampling, **extra}


@dataclass
class Answer:
    """What a client got: the text, the tokens (from logprobs), the finish reason and usage."""

    text: str
    tokens: list[str]
    finish: str
    usage: dict[str, int]
    chat: bool = True

    def check_usage(self) -> None:
        # every received token is counted, plus the EOS that ended a "stop": counted, not shown in
        # chat logprobs (OpenAI's); legacy completions show it with no text (vLLM's, what lm-eval reads)
        eos_hidden = self.chat and self.finish == "stop"
        assert self.usage["completion_tokens"] == len(self.tokens) + eos_hidden, self
        assert self.usage["total_tokens"] == self.usage["prompt_tokens"] + self.usage["completion_tokens"]
        assert "".join(self.tokens) == self.text


def parse_whole(path: str, response: httpx.Response) -> Answer:
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert data["object"] == ("chat.completion" if path == CHAT else "text_completion")
    assert data["model"] == MODEL_ID
    assert data["id"].startswith("chatcmpl-" if path == CHAT else "cmpl-")
    [choice] = data["choices"]
    assert choice["index"] == 0
    if path == CHAT:
        assert choice["message"]["role"] == "assistant"
        text, tokens = choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]
    else:
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
    return Answer(text, tokens, choice["finish_reason"], data["usage"], path == CHAT)


def parse_stream(path: str, payloads: list[str]) -> Answer:
    assert payloads and payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1], payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    *choice_chunks, last = chunks
    assert last["choices"] == [] and set(last["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                                            "prompt_tokens_details"}
    assert all("usage" not in c and len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in choice_chunks)
    choices = [c["choices"][0] for c in choice_chunks]
    finishes = [c["finish_reason"] for c in choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] is not None, finishes
    text, tokens = "", []
    for choice in choices:
        if path == CHAT:
            text += choice["delta"].get("content", "")
            tokens += [e["token"] for e in (choice["logprobs"] or {"content": []})["content"]]
        else:
            text += choice["text"]
            tokens += (choice["logprobs"] or {"tokens": []})["tokens"]
    if path == CHAT:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    return Answer(text, tokens, finishes[-1], last["usage"], path == CHAT)


def make_specs() -> list[Spec]:
    rng = random.Random(20240607)
    specs = []
    for i in range(TOTAL):
        path = CHAT if i % 2 == 0 else COMPLETIONS
        if i < ABORTED:
            prompt, seed = rng.choice([(p, None) for p in range(len(PROMPTS))] + SEEDS)
            specs.append(Spec(path, True, prompt, seed, "abort"))
        elif i < ABORTED + TIMED_OUT:
            specs.append(Spec(path, False, rng.randrange(len(PROMPTS)), None, "timeout"))
        else:
            prompt, seed = rng.choice([(p, None) for p in range(len(PROMPTS))] * 2 + SEEDS)  # 5 of 7 greedy
            specs.append(Spec(path, rng.random() < 0.5, prompt, seed))
    rng.shuffle(specs)
    return specs


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


async def run_one(client: httpx.AsyncClient, spec: Spec) -> Any:
    if spec.fate == "timeout":
        try:
            response = await client.post(spec.path, json=body(spec, max_tokens=LONG_MAX_TOKENS, ignore_eos=True),
                                         timeout=httpx.Timeout(60, read=1.0))
        except httpx.ReadTimeout as exc:
            return exc
        return response
    if spec.fate == "abort":
        seen: list[dict[str, Any]] = []
        async with client.stream("POST", spec.path, json=body(spec, max_tokens=LONG_MAX_TOKENS, ignore_eos=True,
                                                              stream=True)) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line and not line.startswith(":"):  # ":" lines are SSE comments (the server's pings)
                    assert line.startswith("data: ") and line != "data: [DONE]", line
                    seen.append(json.loads(line[len("data: "):]))
                    if len(seen) == 3:
                        break
        return seen
    if spec.stream:
        payloads = []
        async with client.stream("POST", spec.path, json=body(spec, stream=True,
                                                              stream_options={"include_usage": True})) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line and not line.startswith(":"):  # ":" lines are SSE comments (the server's pings)
                    assert line.startswith("data: "), line
                    payloads.append(line[len("data: "):])
        return parse_stream(spec.path, payloads)
    return parse_whole(spec.path, await client.post(spec.path, json=body(spec)))


async def test_200_concurrent_requests_match_their_solo_answers(server: Server, http: httpx.Client) -> None:
    wait_idle(http, 30)
    specs = make_specs()
    assert sum(s.fate == "abort" for s in specs) == ABORTED and sum(s.fate == "timeout" for s in specs) == TIMED_OUT

    # solo answers, one request at a time
    solo: dict[tuple[str, int, int | None], Answer] = {}
    for key in sorted({s.key for s in specs if s.fate == "complete"}, key=str):
        answer = parse_whole(key[0], http.post(key[0], json=body(key)))
        answer.check_usage()
        solo[key] = answer
    assert len({k for k in solo if k[2] is None}) == 2 * len(PROMPTS)  # every greedy prompt, both endpoints

    before = http.get("/metrics").text
    limits = httpx.Limits(max_connections=TOTAL + 10, max_keepalive_connections=TOTAL + 10)
    started = time.monotonic()
    with HealthPoller(server.base_url, interval=0.02) as poller:
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as client:
            results = await asyncio.gather(*(run_one(client, s) for s in specs), return_exceptions=True)
    elapsed = time.monotonic() - started

    failures = [(s, r) for s, r in zip(specs, results) if isinstance(r, BaseException)
                and not (s.fate == "timeout" and isinstance(r, httpx.ReadTimeout))]
    assert not failures, f"{len(failures)} requests failed, e.g. {failures[:3]}"
    mismatches = []
    for spec, result in zip(specs, results):
        if spec.fate == "timeout":
            assert isinstance(result, httpx.ReadTimeout), (spec, result)
        elif spec.fate == "abort":
            assert len(result) == 3, (spec, result)
            assert all(c["choices"][0]["finish_reason"] is None for c in result), (spec, result)
        else:
            result.check_usage()
            expected = solo[spec.key]
            if (result.text, result.tokens, result.finish, result.usage) != \
                    (expected.text, expected.tokens, expected.finish, expected.usage):
                mismatches.append((spec, result, expected))
    assert not mismatches, (f"{len(mismatches)} of {TOTAL - ABORTED - TIMED_OUT} batched answers differ from "
                            f"their solo answers, e.g.:\n" + "\n".join(map(repr, mismatches[:3])))

    # the server really batched, and gives everything back once the clients are gone
    assert not poller.errors, poller.errors[:3]
    peak = max(s["running"] for s in poller.samples)
    assert peak >= MIN_BATCH, f"at most {peak} requests ran at once"
    deadline = time.monotonic() + 10
    while True:
        health = http.get("/health").json()
        if (health["running"], health["waiting"], health["kv_bytes"], health["reserved_bytes"]) == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, f"the server still holds requests after the run: {health}"
        time.sleep(0.05)
    after = http.get("/metrics").text
    completed = TOTAL - ABORTED - TIMED_OUT
    assert sample(after, "kvarn_requests_total", {"finish_reason": "disconnect"}) - \
        sample(before, "kvarn_requests_total", {"finish_reason": "disconnect"}) == ABORTED + TIMED_OUT
    assert sample(after, "kvarn_requests_total") - sample(before, "kvarn_requests_total") == TOTAL
    assert sample(after, "kvarn_requests_rejected_total") == sample(before, "kvarn_requests_rejected_total")
    assert completed > 0 and elapsed < 120, elapsed
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:][:3000]
