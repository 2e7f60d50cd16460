"""Speculative decoding over HTTP: ``kvarn serve --speculative ngram`` and ``--speculative draft``
(a copy of the bundled model keeping 2 of its layers as the draft) answer greedy requests with the
same text as a server without it (streamed and not), report what is in force on ``/health`` and
``/v1/models`` with its acceptance, count drafts in ``/metrics``, honour a request's
``"speculative": false``, and refuse bad flags, a draft model with another vocabulary and bad
fields clearly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_DIR, REPO_ROOT, Server, chat_body, client_of, metric, post_json, served, \
    stream_json, wait_idle

REPEATING = "Repeat after me ten times: the quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "speculative", "--speculative", "ngram", "--num-speculative-tokens", "4",
                "--speculative-ngram-max", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_http(spec_server: Server) -> Iterator[httpx.Client]:
    with client_of(spec_server) as client:
        yield client


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.draft_model import write_layer_subset

    return write_layer_subset(MODEL_DIR, tmp_path_factory.mktemp("draft") / "draft-2l", (0, 6))


@pytest.fixture(scope="module")
def draft_http(tmp_path_factory: pytest.TempPathFactory, draft_dir: Path) -> Iterator[httpx.Client]:
    with served(tmp_path_factory, "speculative-draft", "--speculative", "draft", "--draft-model", str(draft_dir),
                "--num-speculative-tokens", "3") as srv, client_of(srv) as client:
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


def test_a_draft_model_server_answers_as_the_server_without_speculation(draft_http, http):
    body = chat_body("Write a story about a cat who sleeps all day.", max_tokens=40, ignore_eos=True)
    want = post_json(http, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert post_json(draft_http, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == want
    streamed = stream_json(draft_http, "/v1/chat/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == want
    wait_idle(draft_http)
    drafted = metric(draft_http, "kvarn_spec_decode_draft_tokens_total")
    accepted = metric(draft_http, "kvarn_spec_decode_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted  # this 2-layer draft rarely agrees; rows then pause
    health = draft_http.get("/health").json()["speculative"]
    assert health["method"] == "draft" and health["draft_model"] == "draft-2l"
    assert health["num_speculative_tokens"] == 3 and "ngram_max" not in health
    assert (health["draft_tokens"], health["accepted_tokens"]) == (drafted, accepted)
    card = draft_http.get("/v1/models").json()["data"][0]["speculative"]
    assert card == {"method": "draft", "num_speculative_tokens": 3, "max_batch": 8, "draft_model": "draft-2l"}


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


def test_draft_flags_and_a_draft_with_another_vocabulary_stop_the_server_before_it_loads(draft_dir, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    for flags, message in [
        (("--speculative", "draft"), "the draft method needs a draft model (--draft-model PATH)"),
        (("--draft-model", str(draft_dir)), "--draft-model needs --speculative draft"),
        (("--speculative", "draft", "--draft-model", str(tmp_path / "none")), "is not a model folder"),
        (("--speculative", "draft", "--draft-model", str(other)), "the draft model's tokenizer differs"),
    ]:
        result = subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags], capture_output=True,
                                text=True, timeout=60, cwd=REPO_ROOT)
        assert result.returncode != 0 and message in result.stderr, (flags, result.stderr[-500:])


def test_draft_length_defaults_by_method():
    """Without --num-speculative-tokens, prompt lookup may draft up to 8 tokens and match suffixes
    of up to 8 (its adaptive length pays there); a draft model up to 4 (each draft costs a forward)."""
    from server.cli import build_parser
    from server.cli_args import spec_config

    def config(*flags):
        return spec_config(build_parser().parse_args(["serve", *flags]))

    ngram = config("--speculative", "ngram")
    assert (ngram.num_tokens, ngram.ngram_max) == (8, 8)
    assert config("--speculative", "ngram", "--num-speculative-tokens", "3").num_tokens == 3
    assert config() is None
