"""The automatic prefix cache as the API shows it: ``usage.prompt_tokens_details.cached_tokens``,
``cache_salt``, ``/v1/cache/stats`` and ``/v1/cache/reset``, the Prometheus counters, ``--no-apc``,
the disk tier across a restart, and the ``--apc-*`` flags.

The HTTP tests run real ``kvarn serve`` subprocesses on the bundled model (tile 128, prefill chunk
512). Their long prompts are 513..640 tokens: a repeat may reuse (n - 1) // 128 = 4 whole blocks,
512 tokens, which is exactly the first prefill chunk of the cold run, so the warm run attends over
the same records the cold one made and its greedy text must be the same. Each test opens its
prompts with a tag of its own, so no two tests share a cached block.

A few tests run the app in-process on a stand-in engine client, to pin down what the server
itself does with the cache fields (what it hands to ``generate``, how it counts usage).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from engine import ApcConfig, EngineNotReady, FinishReason, ModelInfo, RequestOutput
from server.app import create_app
from server.cli import _apc_config, server_config, build_parser
from server.config import ServerConfig
from server.metrics import Metrics
from tests.server.conftest import API_KEY, MODEL_ID, Server, chatml, client_of, metric, post_json, served, \
    stream_json, wait_idle

BLOCK = 128  # the KVarN tile of the default layout: the prefix cache's block
CHUNK = 512  # kvarn serve's default --prefill-chunk-size
WARM = 512  # what a 513..640-token prompt reuses as whole blocks alone: (n - 1) // 128 of them (from disk
# after a restart, or where the memory cap leaves no room for its float16 tail)

_SENTENCES = (
    "The shell reads a line, splits it into words, expands variables and globs, and runs the first word as a "
    "command with the rest as its arguments.",
    "A pipe connects the standard output of one process to the standard input of the next, so small tools can "
    "be combined into larger ones.",
    "The ls command lists the entries of a directory; with -l it prints permissions, owners, sizes and times.",
    "Environment variables are inherited by child processes, which is why exporting PATH changes what every "
    "later command finds.",
    "A cron table schedules commands by minute, hour, day of month, month and day of week.",
    "The grep command prints the lines of its input that match a regular expression.",
    "Every file has an owner, a group and three sets of permission bits: read, write and execute.",
    "The find command walks a directory tree and tests each file against an expression.",
    "Standard error is a separate stream, so a program can report problems while its output goes to a file.",
    "A symbolic link is a small file that names another path; a hard link is another name for the same inode.",
    "The tar command packs many files into one archive and can compress it on the way.",
    "Signals interrupt a process: SIGTERM asks it to stop, SIGKILL stops it without asking.",
    "The ssh command opens an encrypted shell on another machine and can forward ports through it.",
    "Disk usage is reported by du for files and folders, and by df for whole file systems.",
    "A here document feeds several lines of text to a command's standard input.",
    "The sed command edits a stream of text with commands such as substitute, delete and print.",
)


# --- helpers ---

def long_text(tag: str, tokenizer: Tokenizer, tokens: int = 540) -> str:
    """About ``tokens`` tokens of prose opening with ``tag`` (tokens of the text alone)."""
    text, i = f"Notes {tag}.", 0
    while len(tokenizer.encode(text).ids) < tokens:
        text += " " + _SENTENCES[i % len(_SENTENCES)]
        i += 1
    return text


def cached_tokens(usage: dict[str, Any]) -> int:
    """``cached_tokens`` of a usage object, checking the whole object's shape on the way."""
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    details = usage["prompt_tokens_details"]
    assert set(details) == {"cached_tokens"}, details
    n = details["cached_tokens"]
    assert isinstance(n, int) and not isinstance(n, bool) and 0 <= n < usage["prompt_tokens"], usage
    return n


def warm_tokens(prompt_tokens: int) -> int:
    """What a repeat of a ``prompt_tokens`` prompt reuses from memory (KVarN, the default layout):
    its whole blocks and the float16 tail cached after them, all but its last token."""
    return prompt_tokens - 1


def body_of(kind: str, text: str | list[int], **fields: Any) -> tuple[str, dict[str, Any]]:
    base = {"model": MODEL_ID, "temperature": 0, "max_tokens": 8, **fields}
    if kind == "chat":
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**base, "prompt": text}


def ask(http: httpx.Client, kind: str, text: str | list[int], stream: bool = False,
        **fields: Any) -> tuple[str, dict[str, Any]]:
    """One greedy request; its text and its usage (from the usage chunk when streamed)."""
    path, body = body_of(kind, text, **fields)
    if not stream:
        answer = post_json(http, path, body)
        choice = answer["choices"][0]
        return (choice["message"]["content"] if kind == "chat" else choice["text"]), answer["usage"]
    chunks = stream_json(http, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    *choice_chunks, last = chunks
    assert last["choices"] == [] and all("usage" not in c for c in choice_chunks)
    key = "delta" if kind == "chat" else None
    text_out = "".join((c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"]
                       for c in choice_chunks)
    return text_out, last["usage"]


def cache_stats(http: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = http.get("/v1/cache/stats", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def reset(http: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = http.post("/v1/cache/reset", headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "cache.reset"
    return body


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["param"] == param and body["error"]["message"]
    assert body["error"]["type"] == {401: "invalid_request_error", 400: "invalid_request_error",
                                     503: "server_error"}[status]


@pytest.fixture(scope="module")
def apc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of this module's own, so its cache counters see only these tests."""
    with served(tmp_path_factory, "kvarn-apc") as srv:
        yield srv


@pytest.fixture(scope="module")
def apc(apc_server: Server) -> Iterator[httpx.Client]:
    with client_of(apc_server) as client:
        yield client


# --- (a) a repeated prompt is served from the cache, with the same answer ---

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_repeated_prompt_is_served_from_the_cache(apc: httpx.Client, tokenizer: Tokenizer, kind: str,
                                                  stream: bool) -> None:
    text = long_text(f"repeat-{kind}-{stream}", tokenizer)
    cold_text, cold = ask(apc, kind, text, stream)
    n = cold["prompt_tokens"]
    assert CHUNK < n <= CHUNK + BLOCK, f"the prompt must be 513..640 tokens (see the module doc), not {n}"
    if kind == "chat":
        assert n == len(tokenizer.encode(chatml([{"role": "user", "content": text}])).ids)
    assert cached_tokens(cold) == 0
    warm_text, warm = ask(apc, kind, text, stream)
    assert cached_tokens(warm) == warm_tokens(n)
    assert warm["prompt_tokens"] == n and warm["completion_tokens"] == cold["completion_tokens"]
    assert warm_text == cold_text and warm_text


def test_plain_and_streamed_requests_share_the_cache(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    text = long_text("plain-then-stream", tokenizer)
    plain_text, plain = ask(apc, "chat", text, stream=False)
    assert cached_tokens(plain) == 0
    streamed_text, streamed = ask(apc, "chat", text, stream=True)
    assert cached_tokens(streamed) == warm_tokens(plain["prompt_tokens"]) and streamed_text == plain_text


def test_chat_and_completions_share_blocks_of_the_same_tokens(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    """The cache is keyed by token ids, not by endpoint: a completion whose prompt is the chat's
    rendered prompt (as token ids) reuses the chat's blocks."""
    text = long_text("chat-then-ids", tokenizer)
    _, chat = ask(apc, "chat", text)
    assert cached_tokens(chat) == 0
    ids = tokenizer.encode(chatml([{"role": "user", "content": text}])).ids
    assert len(ids) == chat["prompt_tokens"]
    _, completion = ask(apc, "completion", ids)
    assert cached_tokens(completion) == warm_tokens(len(ids))


@pytest.mark.parametrize("length,reused", [(128, 0), (129, 128), (256, 128), (257, 256)])
def test_the_last_prompt_token_is_never_cached(apc: httpx.Client, length: int, reused: int) -> None:
    """Only whole blocks before the prompt's last token are reused (its logits must be computed)."""
    ids = [1000 + length] + list(range(2000, 2000 + length - 1))  # its own first token: its own chain
    _, first = ask(apc, "completion", ids, max_tokens=2)
    assert first["prompt_tokens"] == length and cached_tokens(first) == 0
    _, again = ask(apc, "completion", ids, max_tokens=2)
    assert cached_tokens(again) == reused


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_n_choices_count_cached_tokens_once(apc: httpx.Client, tokenizer: Tokenizer, stream: bool) -> None:
    text = long_text(f"n-choices-{stream}", tokenizer)
    _, cold = ask(apc, "completion", text, stream, n=2)
    assert cached_tokens(cold) == 0
    _, warm = ask(apc, "completion", text, stream, n=2)
    assert cached_tokens(warm) == warm_tokens(cold["prompt_tokens"])
    assert warm["prompt_tokens"] == cold["prompt_tokens"]


# --- (b) cache_salt ---

@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_cache_salt_keeps_blocks_apart(apc: httpx.Client, tokenizer: Tokenizer, kind: str) -> None:
    text = long_text(f"salt-{kind}", tokenizer)
    _, a = ask(apc, kind, text, cache_salt="tenant-a")
    assert cached_tokens(a) == 0
    _, b = ask(apc, kind, text, cache_salt="tenant-b")
    assert cached_tokens(b) == 0  # another salt: nothing of tenant-a's
    _, unsalted = ask(apc, kind, text)
    assert cached_tokens(unsalted) == 0  # no salt is a salt of its own
    _, a_again = ask(apc, kind, text, cache_salt="tenant-a")
    assert cached_tokens(a_again) == warm_tokens(a["prompt_tokens"])
    _, b_again = ask(apc, kind, text, cache_salt="tenant-b")
    assert cached_tokens(b_again) == warm_tokens(b["prompt_tokens"])
    _, empty = ask(apc, kind, text, cache_salt="")
    assert cached_tokens(empty) == warm_tokens(unsalted["prompt_tokens"])  # "" is no salt: the unsalted request's


def test_cache_salt_of_the_longest_length_is_accepted(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    text = long_text("salt-256", tokenizer)
    salt = "s" * 255 + "é"  # 256 characters (257 bytes in UTF-8: the limit is on characters)
    _, first = ask(apc, "completion", text, cache_salt=salt)
    _, second = ask(apc, "completion", text, cache_salt=salt)
    assert (cached_tokens(first), cached_tokens(second)) == (0, warm_tokens(first["prompt_tokens"]))
    _, other = ask(apc, "completion", text, cache_salt="s" * 256)
    assert cached_tokens(other) == 0


# --- (h) cache_salt validation ---

@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("salt", ["x" * 257, "é" * 300, 123, ["a"], True])
def test_bad_cache_salt_is_a_400(apc: httpx.Client, kind: str, salt: Any) -> None:
    path, body = body_of(kind, "hello", cache_salt=salt)
    assert_openai_error(apc.post(path, json=body), 400, "invalid_value", "cache_salt")
    assert_openai_error(apc.post(path, json={**body, "stream": True}), 400, "invalid_value", "cache_salt")


def test_too_long_cache_salt_says_why(apc: httpx.Client) -> None:
    path, body = body_of("chat", "hello", cache_salt="x" * 257)
    message = apc.post(path, json=body).json()["error"]["message"]
    assert "cache_salt" in message and "256" in message


def test_null_cache_salt_is_no_salt(apc: httpx.Client) -> None:
    path, body = body_of("completion", "hello", cache_salt=None, max_tokens=2)
    assert apc.post(path, json=body).status_code == 200


# --- (c) the official SDK sees cached_tokens ---

def test_sdk_reads_cached_tokens(apc_server: Server, tokenizer: Tokenizer) -> None:
    sdk = openai.OpenAI(base_url=apc_server.base_url + "/v1", api_key="x", _strict_response_validation=True,
                        max_retries=0, timeout=120)
    messages = [{"role": "user", "content": long_text("sdk-chat", tokenizer)}]
    cold = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0)
    warm = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0)
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.prompt_tokens_details is not None and warm.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == warm_tokens(warm.usage.prompt_tokens)
    assert warm.choices[0].message.content == cold.choices[0].message.content

    stream = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == warm_tokens(last.usage.prompt_tokens)

    salted = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"cache_salt": "sdk-tenant"})
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0

    prompt = long_text("sdk-completion", tokenizer)
    first = sdk.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0)
    second = sdk.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) \
        == (0, warm_tokens(second.usage.prompt_tokens))
    assert second.choices[0].text == first.choices[0].text


# --- (d) /v1/cache/stats and /v1/cache/reset ---

STATS_KEYS = {"enabled", "tier", "block_size", "lookups", "query_tokens", "hit_tokens", "hit_rate", "memory",
              "disk", "checkpoints"}


def test_cache_stats_count_lookups_and_hits(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    wait_idle(apc)
    before = cache_stats(apc)
    assert STATS_KEYS <= set(before), before
    assert before["enabled"] is True and before["block_size"] == BLOCK
    assert before["disk"] is None  # no --apc-disk-dir
    assert isinstance(before["memory"], dict) and isinstance(before["checkpoints"], dict)
    text = long_text("stats", tokenizer)
    _, cold = ask(apc, "completion", text)
    _, warm = ask(apc, "completion", text)
    n = cold["prompt_tokens"]
    after = cache_stats(apc)
    assert after["lookups"] - before["lookups"] == 2
    assert after["hit_tokens"] - before["hit_tokens"] == cached_tokens(warm) == warm_tokens(n)
    queried = after["query_tokens"] - before["query_tokens"]
    assert 2 * (n - 1) <= queried <= 2 * n  # each lookup asks about its prompt (the last token at most)
    assert after["hit_rate"] == pytest.approx(after["hit_tokens"] / after["query_tokens"], abs=1e-3)
    assert json.loads(json.dumps(after)) == after  # plain JSON


def test_cache_reset_empties_the_cache(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    text = long_text("reset", tokenizer)
    _, cold = ask(apc, "chat", text)
    _, warm = ask(apc, "chat", text)
    assert (cached_tokens(cold), cached_tokens(warm)) == (0, warm_tokens(cold["prompt_tokens"]))
    released = reset(apc)
    json.dumps(released)
    _, after_reset = ask(apc, "chat", text)
    assert cached_tokens(after_reset) == 0  # nothing left to reuse
    _, again = ask(apc, "chat", text)
    assert cached_tokens(again) == warm_tokens(cold["prompt_tokens"])  # and the cache works on


def test_cache_routes_need_the_api_key(auth_server: Server) -> None:
    with client_of(auth_server) as http:
        for method, path in (("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset")):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = http.request(method, path, headers=headers)
                assert_openai_error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert cache_stats(http, good)["enabled"] is True
        reset(http, good)


def test_cache_routes_take_only_their_methods(apc: httpx.Client) -> None:
    assert apc.post("/v1/cache/stats").status_code == 405
    assert apc.get("/v1/cache/reset").status_code == 405


# --- (e) Prometheus ---

COUNTERS = ("lookups", "query_tokens", "hit_tokens", "inserted_blocks", "evicted_blocks", "disk_errors")
GAUGES = ("memory_bytes", "memory_budget_bytes", "disk_bytes")


def _families(http: httpx.Client) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def test_metrics_expose_the_prefix_cache(apc: httpx.Client, tokenizer: Tokenizer) -> None:
    families = _families(apc)
    for name in COUNTERS:
        assert families[f"kvarn_prefix_cache_{name}"].type == "counter", name
    for name in GAUGES:
        assert families[f"kvarn_prefix_cache_{name}"].type == "gauge", name

    wait_idle(apc)
    before = {name: metric(apc, f"kvarn_prefix_cache_{name}_total") for name in COUNTERS}
    served_before = metric(apc, "kvarn_prompt_cached_tokens_total")
    text = long_text("metrics", tokenizer)
    _, cold = ask(apc, "completion", text)
    _, warm = ask(apc, "completion", text)
    wait_idle(apc)
    after = {name: metric(apc, f"kvarn_prefix_cache_{name}_total") for name in COUNTERS}
    delta = {name: after[name] - before[name] for name in COUNTERS}
    n = cold["prompt_tokens"]
    assert delta["lookups"] == 2
    assert delta["hit_tokens"] == cached_tokens(warm) == warm_tokens(n)
    assert 2 * (n - 1) <= delta["query_tokens"] <= 2 * n
    assert delta["inserted_blocks"] >= n // BLOCK  # the cold prompt's whole blocks
    assert delta["evicted_blocks"] == 0 and delta["disk_errors"] == 0
    assert metric(apc, "kvarn_prompt_cached_tokens_total") - served_before == warm_tokens(n)

    stats = cache_stats(apc)
    assert after["lookups"] == stats["lookups"] and after["hit_tokens"] == stats["hit_tokens"]
    assert after["query_tokens"] == stats["query_tokens"]
    memory = metric(apc, "kvarn_prefix_cache_memory_bytes")
    budget = metric(apc, "kvarn_prefix_cache_memory_budget_bytes")
    assert 0 < memory <= budget
    assert metric(apc, "kvarn_prefix_cache_disk_bytes") == 0  # no disk tier


def test_small_memory_cap_evicts_within_it(tmp_path_factory: pytest.TempPathFactory,
                                                    tokenizer: Tokenizer) -> None:
    # room for one 4-block prompt of this model (a 1 MiB float16 sink + 3 k4v2 records of 216 KiB:
    # 1.63 MiB), not for two
    budget = 2 * 2**20
    with served(tmp_path_factory, "kvarn-apc-small", "--apc-memory-bytes", "2MiB") as srv, client_of(srv) as http:
        at_start = metric(http, "kvarn_prefix_cache_memory_budget_bytes")  # checked last
        first = long_text("evict-0", tokenizer)
        ask(http, "completion", first)
        _, again = ask(http, "completion", first)
        assert cached_tokens(again) == WARM  # one prompt fits
        for i in (1, 2, 3):
            ask(http, "completion", long_text(f"evict-{i}", tokenizer))
        wait_idle(http)
        assert metric(http, "kvarn_prefix_cache_evicted_blocks_total") > 0
        assert 0 < metric(http, "kvarn_prefix_cache_memory_bytes") <= budget
        _, last = ask(http, "completion", long_text("evict-3", tokenizer))
        assert cached_tokens(last) == WARM  # the most recent prompt survived
        assert metric(http, "kvarn_prefix_cache_memory_budget_bytes") == budget
        assert at_start == budget  # a scrape before the first request already shows the budget


# --- (f) --no-apc ---

def test_no_apc_never_caches(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> None:
    with served(tmp_path_factory, "kvarn-no-apc", "--no-apc") as srv, client_of(srv) as http:
        stats = cache_stats(http)
        assert stats["enabled"] is False
        for kind in ("chat", "completion"):
            for stream in (False, True):
                text = long_text(f"off-{kind}", tokenizer)
                answers = [ask(http, kind, text, stream) for _ in range(2)]
                assert [cached_tokens(usage) for _, usage in answers] == [0, 0]
                assert answers[0][0] == answers[1][0]
        _, salted = ask(http, "completion", long_text("off-completion", tokenizer), cache_salt="t")
        assert cached_tokens(salted) == 0
        after = cache_stats(http)
        assert after["enabled"] is False and after.get("hit_tokens", 0) == 0
        assert metric(http, "kvarn_prefix_cache_hit_tokens_total") == 0
        assert metric(http, "kvarn_prefix_cache_memory_bytes") == 0
        assert metric(http, "kvarn_prompt_cached_tokens_total") == 0
        reset(http)


# --- (g) the disk tier survives a restart ---

def test_disk_tier_serves_after_a_restart(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> None:
    disk = tmp_path_factory.mktemp("apc-disk")
    flags = ("--apc-disk-dir", str(disk))
    text = long_text("disk", tokenizer)
    with served(tmp_path_factory, "kvarn-apc-disk-1", *flags) as srv, client_of(srv) as http:
        stats = cache_stats(http)
        assert isinstance(stats["disk"], dict)
        cold_text, cold = ask(http, "chat", text)
        assert cached_tokens(cold) == 0
    assert any(p.is_file() for p in disk.rglob("*")), "the stopped server left no block files"
    with served(tmp_path_factory, "kvarn-apc-disk-2", *flags) as srv, client_of(srv) as http:
        warm_text, warm = ask(http, "chat", text)  # its first request: the memory tier is empty
        assert cached_tokens(warm) == WARM
        assert warm_text == cold_text
        assert metric(http, "kvarn_prefix_cache_disk_bytes") > 0
        assert metric(http, "kvarn_prefix_cache_disk_errors_total") == 0


def test_disk_tier_is_not_shared_across_salts_after_a_restart(tmp_path_factory: pytest.TempPathFactory,
                                                              tokenizer: Tokenizer) -> None:
    disk = tmp_path_factory.mktemp("apc-disk-salt")
    flags = ("--apc-disk-dir", str(disk))
    text = long_text("disk-salt", tokenizer)
    with served(tmp_path_factory, "kvarn-apc-disk-salt-1", *flags) as srv, client_of(srv) as http:
        _, cold = ask(http, "completion", text, cache_salt="tenant-a")
        assert cached_tokens(cold) == 0
    with served(tmp_path_factory, "kvarn-apc-disk-salt-2", *flags) as srv, client_of(srv) as http:
        _, other = ask(http, "completion", text, cache_salt="tenant-b")
        assert cached_tokens(other) == 0
        _, same = ask(http, "completion", text, cache_salt="tenant-a")
        assert cached_tokens(same) == WARM


# --- (i) the --apc-* flags ---

def _serve_args(*flags: str) -> Any:
    return build_parser().parse_args(["serve", *flags])


def test_apc_defaults() -> None:
    assert _apc_config(_serve_args()) == ApcConfig()
    assert ApcConfig() == ApcConfig(enabled=True, memory_bytes=None, disk_dir=None, disk_bytes=4 * 2**30)
    assert server_config(_serve_args()).engine.apc == ApcConfig()


@pytest.mark.parametrize("flags,expected", [
    (["--no-apc"], ApcConfig(enabled=False)),
    (["--apc-memory-bytes", "512MiB"], ApcConfig(memory_bytes=512 * 2**20)),
    (["--apc-memory-bytes", "0"], ApcConfig(memory_bytes=0)),
    (["--apc-disk-dir", "/var/cache/kvarn"], ApcConfig(disk_dir="/var/cache/kvarn")),
    (["--apc-disk-dir", "/d", "--apc-disk-bytes", "10G"], ApcConfig(disk_dir="/d", disk_bytes=10 * 10**9)),
    (["--apc-memory-bytes", "1.5GiB", "--apc-disk-dir", "/d", "--apc-disk-bytes", "64MiB"],
     ApcConfig(memory_bytes=int(1.5 * 2**30), disk_dir="/d", disk_bytes=64 * 2**20)),
])
def test_apc_flags(flags: list[str], expected: ApcConfig) -> None:
    assert _apc_config(_serve_args(*flags)) == expected
    config = server_config(_serve_args(*flags))
    assert config.engine.apc == expected
    assert config.engine.kv == server_config(_serve_args()).engine.kv  # nothing else moves


def test_apc_disk_dir_expands_the_home_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _apc_config(_serve_args("--apc-disk-dir", "~/kvarn-cache")).disk_dir == str(tmp_path / "kvarn-cache")


@pytest.mark.parametrize("flags,message", [
    (["--no-apc", "--apc-memory-bytes", "1G"], "--no-apc turns the prefix cache off; drop --apc-memory-bytes"),
    (["--no-apc", "--apc-disk-dir", "/d"], "drop --apc-disk-dir"),
    (["--apc-disk-bytes", "1G"], "--apc-disk-bytes caps the disk tier, which needs --apc-disk-dir"),
    (["--apc-disk-dir", "/d", "--apc-disk-bytes", "0"], "--apc-disk-bytes must be > 0"),
    (["--apc-disk-dir", " "], "--apc-disk-dir must name a folder"),
])
def test_contradictory_apc_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        server_config(_serve_args(*flags))
    assert message in str(exit_info.value.code)


@pytest.mark.parametrize("flag", ["--apc-memory-bytes", "--apc-disk-bytes"])
def test_bad_apc_sizes_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _serve_args(flag, "lots")
    assert exit_info.value.code == 2 and "not a size in bytes" in capsys.readouterr().err


def test_help_explains_the_apc_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--help")
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--no-apc", "--apc-memory-bytes", "--apc-disk-dir", "--apc-disk-bytes"):
        assert flag in text
    assert "it lives in the KV budget, never added to it" in text and "gives it back" in text
    assert "survives restarts" in text
    assert "default: 4GiB" in text and "cache_salt" in text


# --- the server's own part, on a stand-in engine client ---

class _FakeClient:
    """Just enough of ``EngineClient`` for the routes: a character "tokenizer" over a ChatML
    rendering, and a ``generate`` that records its arguments and answers ``cached`` tokens."""

    def __init__(self, cached: int = 0, ready: bool = True, system_alone: str | None = None,
                 system_fails: bool = False) -> None:
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.load_error = None
        self.info = ModelInfo(MODEL_ID, 4096, "0" * 16, "float32", {"stamp": "0123456789abcdef"}, 256)
        self.cached = cached
        self.system_alone = system_alone  # a rendering of the system turn alone that is no prefix
        self.system_fails = system_fails
        self.calls: list[dict[str, Any]] = []
        self.cache_calls: list[str] = []
        self.not_ready = False

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0, "apc_lookups": 5, "apc_hit_tokens": 640, "apc_memory_bytes": 1024}

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if not add_generation_prompt and len(messages) == 1:
            if self.system_fails:
                raise ValueError("this template cannot render a lone system turn")
            if self.system_alone is not None:
                return self.encode(self.system_alone)
        text = "".join(f"<|{m['role']}|>{m['content']}|" for m in messages)
        return self.encode(text + ("<|assistant|>" if add_generation_prompt else ""))

    def decode_token(self, token_id: int) -> str:
        return chr(token_id)

    def check_admission(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        return None

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str | None = None, n: int = 1,
                       admission: Any = None, cache_salt: str | None = None,
                       snapshot_at: tuple[int, ...] = ()) -> AsyncIterator[RequestOutput]:
        self.calls.append({"prompt_ids": prompt_ids, "cache_salt": cache_salt, "snapshot_at": snapshot_at, "n": n})
        for index in range(n):
            for k, finish in ((1, None), (2, FinishReason.LENGTH)):
                yield RequestOutput(request_id or "r", "ab"[k - 1], (97 + k,), (), len(prompt_ids), k, finish,
                                    index=index, num_cached_tokens=self.cached)
                await asyncio.sleep(0)

    async def cache_stats(self) -> dict[str, Any]:
        self.cache_calls.append("stats")
        if self.not_ready:
            raise EngineNotReady("the model is still loading")
        return {"enabled": True, "block_size": 128, "lookups": 5, "hit_tokens": 640, "disk": None}

    async def reset_cache(self) -> dict[str, Any]:
        self.cache_calls.append("reset")
        if self.not_ready:
            raise EngineNotReady("the model is still loading")
        return {"blocks": 7, "bytes": 4096}


@pytest.fixture
def fake() -> _FakeClient:
    return _FakeClient(cached=384)


def _app_client(fake: _FakeClient, api_key: str | None = None) -> TestClient:
    app = create_app(ServerConfig(api_key=api_key), client=fake)
    return TestClient(app, base_url="http://127.0.0.1")


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line and not line.startswith(":")]  # ":": SSE pings
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_generate_gets_the_salt_and_the_system_prompt_end(fake: _FakeClient) -> None:
    with _app_client(fake) as http:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": messages, "cache_salt": "t1"})
        assert r.status_code == 200, r.text
        system_ids = fake.apply_chat_template(messages[:1], add_generation_prompt=False)
        call = fake.calls[-1]
        assert call["cache_salt"] == "t1"
        assert call["snapshot_at"] == (len(system_ids),) and call["prompt_ids"][:len(system_ids)] == system_ids

        developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        assert http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": developer}).status_code == 200
        assert fake.calls[-1]["snapshot_at"] == (len(system_ids),) and fake.calls[-1]["cache_salt"] is None

        user_only = [{"role": "user", "content": "hi"}]
        r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": user_only, "cache_salt": ""})
        assert r.status_code == 200
        assert fake.calls[-1]["snapshot_at"] == () and fake.calls[-1]["cache_salt"] is None  # "" is no salt

        r = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "SELECT", "cache_salt": "t2",
                                               "stream": True})
        assert r.status_code == 200
        assert fake.calls[-1]["cache_salt"] == "t2" and fake.calls[-1]["snapshot_at"] == ()


def test_system_prompt_alone_that_is_no_prefix_gives_no_snapshot() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for fake in (_FakeClient(system_alone="<|system|>Be brief.</s>"), _FakeClient(system_fails=True),
                 _FakeClient(system_alone="")):
        with _app_client(fake) as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": messages})
            assert r.status_code == 200, r.text
            assert fake.calls[-1]["snapshot_at"] == ()
    only_system = _FakeClient()
    with _app_client(only_system) as http:  # the prompt still goes on past the system turn
        r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": messages[:1]})
        assert r.status_code == 200
        n = len(only_system.apply_chat_template(messages[:1], add_generation_prompt=False))
        assert only_system.calls[-1]["snapshot_at"] == (n,) and len(only_system.calls[-1]["prompt_ids"]) > n


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_usage_reports_cached_tokens_once(fake: _FakeClient, kind: str) -> None:
    with _app_client(fake) as http:
        path, body = body_of(kind, "hello there " * 80, n=3)
        usage = http.post(path, json=body).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 384}
        assert usage["completion_tokens"] == 6 and cached_tokens(usage) == 384
        r = http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = _sse(r)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
        assert all("usage" not in c for c in chunks[:-1])
        assert metric(http, "kvarn_prompt_cached_tokens_total") == 2 * 384


def test_usage_reports_zero_cached_tokens() -> None:
    with _app_client(_FakeClient(cached=0)) as http:
        path, body = body_of("chat", "hello")
        assert http.post(path, json=body).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cache_routes_pass_the_engine_answers_through(fake: _FakeClient) -> None:
    with _app_client(fake) as http:
        r = http.get("/v1/cache/stats")
        assert r.status_code == 200 and r.json() == {"enabled": True, "block_size": 128, "lookups": 5,
                                                     "hit_tokens": 640, "disk": None}
        r = http.post("/v1/cache/reset")
        assert r.status_code == 200 and r.json() == {"object": "cache.reset", "blocks": 7, "bytes": 4096}
        assert fake.cache_calls == ["stats", "reset"]


def test_cache_routes_answer_503_while_loading() -> None:
    loading = _FakeClient(ready=False)
    with _app_client(loading) as http:
        for method, path in (("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset")):
            response = http.request(method, path)
            assert_openai_error(response, 503, "model_loading")
            assert response.headers["retry-after"] == "1"
        assert loading.cache_calls == []
    racing = _FakeClient()  # ready as the route checks, EngineNotReady from the engine call
    racing.not_ready = True
    with _app_client(racing) as http:
        for method, path in (("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset")):
            assert_openai_error(http.request(method, path), 503, "model_loading")


def test_cache_routes_need_the_key_in_process(fake: _FakeClient) -> None:
    with _app_client(fake, api_key=API_KEY) as http:
        assert_openai_error(http.get("/v1/cache/stats"), 401, "invalid_api_key")
        assert_openai_error(http.post("/v1/cache/reset"), 401, "invalid_api_key")
        assert fake.cache_calls == []
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/v1/cache/stats", headers=good).status_code == 200
        assert http.post("/v1/cache/reset", headers=good).status_code == 200


def test_prefix_cache_collector_reads_stats_at_each_scrape() -> None:
    stats: dict[str, int] = {"apc_lookups": 3, "apc_hit_tokens": 256, "apc_memory_bytes": 4096,
                             "apc_memory_budget_bytes": 8192}
    text = generate_latest(Metrics(lambda: stats).registry).decode()
    samples = {s.name: (s.value, f.type) for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["kvarn_prefix_cache_lookups_total"] == (3, "counter")
    assert samples["kvarn_prefix_cache_hit_tokens_total"] == (256, "counter")
    for name in ("query_tokens", "inserted_blocks", "evicted_blocks", "disk_errors"):  # missing keys read 0
        assert samples[f"kvarn_prefix_cache_{name}_total"] == (0, "counter")
    assert samples["kvarn_prefix_cache_memory_bytes"] == (4096, "gauge")
    assert samples["kvarn_prefix_cache_memory_budget_bytes"] == (8192, "gauge")
    assert samples["kvarn_prefix_cache_disk_bytes"] == (0, "gauge")
    stats.update(apc_lookups=10, apc_disk_bytes=5, apc_disk_errors=1)
    metrics = Metrics(lambda: stats)
    again = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
             for s in f.samples}
    assert again["kvarn_prefix_cache_lookups_total"] == 10
    assert again["kvarn_prefix_cache_disk_bytes"] == 5 and again["kvarn_prefix_cache_disk_errors_total"] == 1

