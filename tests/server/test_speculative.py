"""Speculative decoding over HTTP: ``kvarn serve --speculative ngram`` answers greedy requests
with the same text as a server without it (streamed and not), reports what is in force on
``/health`` and ``/v1/models`` with its acceptance, counts drafts in ``/metrics``, honours a
request's ``"speculative": false``, and refuses bad flags and fields clearly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, Server, chat_body, client_of, metric, post_json, served, stream_json, \
    wait_idle

REPEATING = "Repeat after me ten times: the quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "speculative", "--speculative", "ngram", "--num-speculative-tokens", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_http(spec_server: Server) -> Iterator[httpx.Client]:
    with client_of(spec_server) as client:
        yield client


def test_greedy_text_equals_the_server_without_speculation(spec_http, http):
    body = chat_body(REPEATING, max_tokens=96, ignore_eos=True)
    want = post_json(http, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    before = metric(spec_http, "kvarn_spec_decode_verifies_total")
    got = post_json(spec_http, "/v1/chat/completions", body)
    assert got["choices"][0]["message"]["content"] == want
    assert got["usage"]["completion_tokens"] == 96
    streamed = stream_json(spec_http, "/v1/chat/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == want
    wait_idle(spec_http)
    verifies = metric(spec_http, "kvarn_spec_decode_verifies_total")
    drafted = metric(spec_http, "kvarn_spec_decode_draft_tokens_total")
    accepted = metric(spec_http, "kvarn_spec_decode_accepted_tokens_total")
    assert verifies > before and 0 < accepted <= drafted
    health = spec_http.get("/health").json()["speculative"]
    assert health["method"] == "ngram" and health["num_speculative_tokens"] == 4
    assert (health["draft_tokens"], health["accepted_tokens"]) == (drafted, accepted)
    assert health["acceptance_rate"] == round(accepted / drafted, 4)
    card = spec_http.get("/v1/models").json()["data"][0]
    assert card["speculative"]["method"] == "ngram" and card["speculative"]["ngram_max"] == 4
    assert http.get("/v1/models").json()["data"][0]["speculative"] is None
    assert http.get("/health").json()["speculative"] is None


def test_a_request_opts_out(spec_http, http):
    body = chat_body(REPEATING, max_tokens=48, ignore_eos=True, speculative=False)
    wait_idle(spec_http)
    before = metric(spec_http, "kvarn_spec_decode_verifies_total")
    got = post_json(spec_http, "/v1/chat/completions", body)
    want = post_json(http, "/v1/chat/completions", {**body, "speculative": True})
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert metric(spec_http, "kvarn_spec_decode_verifies_total") == before


def test_a_bad_speculative_field_is_a_400(spec_http):
    response = spec_http.post("/v1/chat/completions", json=chat_body(speculative="yes"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "speculative"


@pytest.mark.parametrize("flags,message", [
    (("--num-speculative-tokens", "0"), "num_speculative_tokens"),
    (("--speculative-ngram-min", "5", "--speculative-ngram-max", "3"), "ngram_min <= ngram_max"),
])
def test_bad_flags_stop_the_server_before_it_loads(flags, message):
    result = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--speculative", "ngram", *flags],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode != 0 and message in result.stderr
