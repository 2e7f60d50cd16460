"""Reasoning content over HTTP on a thinking variant of the bundled model (``tests/think_model.py``):
its template opens ``<think>`` in the generation prompt, so what it writes is reasoning until it
writes ``</think>``; ``--no-reasoning-content`` leaves all of it in ``content``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import client_of, post_json, served, stream_json
from tests.think_model import THINK_END_ID, make_think_model

MODEL = "fixture-think"
CLOSED = "I should list the files.</think>Use ls."
# the think-end token by id (llguidance takes an added token's text in a string literal as plain
# text and then refuses the token the tokenizer makes of it: a grammar dead end)
CLOSED_GRAMMAR = f'start: "I should list the files." <[{THINK_END_ID}]> "Use ls."\n'


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_think_model(tmp_path_factory.mktemp("think-model") / MODEL))


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory, think_dir: str) -> Iterator[httpx.Client]:
    with served(tmp_path_factory, "think", think_dir) as srv, client_of(srv) as client:
        yield client


@pytest.fixture(scope="module")
def think_off(tmp_path_factory: pytest.TempPathFactory, think_dir: str) -> Iterator[httpx.Client]:
    with served(tmp_path_factory, "think-off", think_dir, "--no-reasoning-content") as srv, client_of(srv) as client:
        yield client


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "How do I list files?"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, **fields}


def streamed(client: httpx.Client, **fields: Any) -> dict[str, str]:
    chunks = stream_json(client, "/v1/chat/completions", body(stream=True, **fields))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    return {key: "".join(d.get(key) or "" for d in deltas) for key in ("content", "reasoning_content")}


def test_an_open_think_block_is_reasoning(think: httpx.Client, think_off: httpx.Client) -> None:
    """Greedy tokens are the same on both servers; only where their text goes differs."""
    text = post_json(think_off, "/v1/chat/completions", body())["choices"][0]["message"]
    message = post_json(think, "/v1/chat/completions", body())["choices"][0]["message"]
    assert "reasoning_content" not in text and text["content"]
    assert (message["reasoning_content"], message["content"]) == (text["content"], "")
    assert streamed(think) == {"content": "", "reasoning_content": text["content"]}
    assert streamed(think_off) == {"content": text["content"], "reasoning_content": ""}


@pytest.mark.parametrize("stream", [False, True])
def test_the_end_of_thinking_starts_the_content(think: httpx.Client, think_off: httpx.Client, stream: bool) -> None:
    fields = {"guided_grammar": CLOSED_GRAMMAR, "ignore_eos": False, "max_tokens": 40}
    if stream:
        assert streamed(think, **fields) == {"content": "Use ls.", "reasoning_content": "I should list the files."}
        assert streamed(think_off, **fields) == {"content": CLOSED, "reasoning_content": ""}
        return
    message = post_json(think, "/v1/chat/completions", body(**fields))["choices"][0]
    assert message["finish_reason"] == "stop"
    assert (message["message"]["reasoning_content"], message["message"]["content"]) == (
        "I should list the files.", "Use ls.")
    off = post_json(think_off, "/v1/chat/completions", body(**fields))["choices"][0]["message"]
    assert (off["content"], "reasoning_content" in off) == (CLOSED, False)


def test_a_model_without_a_tool_format_refuses_tools(think: httpx.Client) -> None:
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
    response = think.post("/v1/chat/completions", json=body(tools=[tool]))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools" and response.json()["error"]["code"] == "unsupported_value"

