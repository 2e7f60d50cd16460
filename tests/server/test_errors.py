"""Every bad request gets the right status in OpenAI's error shape, never a traceback, and the
server serves normally afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import CONTEXT_LENGTH, MODEL_ID, VOCAB_SIZE, Server, chat_body, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
JSON_HEADERS = {"content-type": "application/json"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": MSGS, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": "hi", **fields}


@dataclass
class Bad:
    id: str
    path: str
    status: int
    param: str | None
    code: str | None
    message: str = ""  # a substring of the message
    body: Any = None  # sent as JSON
    raw: bytes | None = None  # sent as is, with content-type application/json
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


CASES = [
    # the body itself
    Bad("invalid-json", CHAT, 400, None, "invalid_request", "could not be parsed as JSON", raw=b'{"model": '),
    Bad("invalid-json-completions", COMPLETIONS, 400, None, "invalid_request", "could not be parsed", raw=b"{x}"),
    Bad("empty-body", CHAT, 400, None, "invalid_request", "must be a JSON object", raw=b""),
    Bad("null-body", CHAT, 400, None, "invalid_request", "must be a JSON object", raw=b"null"),
    Bad("array-body", CHAT, 400, None, "invalid_request", "must be a JSON object", body=[chat()]),
    Bad("string-body", COMPLETIONS, 400, None, "invalid_request", "must be a JSON object", body="hi"),
    Bad("number-body", CHAT, 400, None, "invalid_request", "must be a JSON object", body=42),
    Bad("json-as-text-plain", CHAT, 415, None, "unsupported_media_type", "Content-Type 'text/plain'",
        raw=json.dumps({"model": MODEL_ID, "messages": MSGS}).encode(), headers={"content-type": "text/plain"}),
    Bad("form-body", COMPLETIONS, 415, None, "unsupported_media_type", "send it with 'Content-Type: application/json'",
        raw=b"model=x&prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"}),
    # missing fields
    Bad("missing-model", CHAT, 400, "model", "invalid_value", "Missing required parameter: 'model'",
        body={"messages": MSGS}),
    Bad("missing-messages", CHAT, 400, "messages", "invalid_value", "Missing required parameter: 'messages'",
        body={"model": MODEL_ID}),
    Bad("missing-prompt", COMPLETIONS, 400, "prompt", "invalid_value", "Missing required parameter: 'prompt'",
        body={"model": MODEL_ID}),
    Bad("missing-role", CHAT, 400, "messages.0.role", "invalid_value", "Missing required parameter",
        body=chat(messages=[{"content": "hi"}])),
    # wrong types: refused, never coerced
    Bad("temperature-string", CHAT, 400, "temperature", "invalid_value", "valid number", body=chat(temperature="hot")),
    Bad("temperature-numeric-string", CHAT, 400, "temperature", "invalid_value", "valid number",
        body=chat(temperature="0.5")),
    Bad("max-tokens-string", CHAT, 400, "max_tokens", "invalid_value", "valid integer", body=chat(max_tokens="10")),
    Bad("max-tokens-bool", CHAT, 400, "max_tokens", "invalid_value", "valid integer", body=chat(max_tokens=True)),
    Bad("max-tokens-fraction", COMPLETIONS, 400, "max_tokens", "invalid_value", "integer",
        body=completion(max_tokens=1.5)),
    Bad("stream-string", CHAT, 400, "stream", "invalid_value", "valid boolean", body=chat(stream="yes")),
    Bad("messages-string", CHAT, 400, "messages", "invalid_value", "", body=chat(messages="hi")),
    Bad("message-string", CHAT, 400, "messages.0", "invalid_value", "", body=chat(messages=["hi"])),
    Bad("content-number", CHAT, 400, "messages.0.content", "invalid_value", "",
        body=chat(messages=[{"role": "user", "content": 5}])),
    Bad("prompt-number", COMPLETIONS, 400, "prompt", "invalid_value", "", body=completion(prompt=5)),
    Bad("prompt-floats", COMPLETIONS, 400, "prompt", "invalid_value", "", body=completion(prompt=[1.5])),
    Bad("content-part-type", CHAT, 400, "messages.0.content", "invalid_value", "",
        body=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    Bad("seed-string", CHAT, 400, "seed", "invalid_value", "valid integer", body=chat(seed="1")),
    # out of range
    Bad("temperature-high-streamed", CHAT, 400, "temperature", "invalid_value", "", body=chat(temperature=5,
                                                                                             stream=True)),
    Bad("temperature-high", CHAT, 400, "temperature", "invalid_value", "less than or equal to 2",
        body=chat(temperature=2.5)),
    Bad("temperature-negative", COMPLETIONS, 400, "temperature", "invalid_value", "greater than or equal to 0",
        body=completion(temperature=-0.1)),
    Bad("temperature-nan", CHAT, 400, "temperature", "invalid_value", "",
        raw=json.dumps(chat(temperature=float("nan"))).encode()),
    Bad("top-p-zero", CHAT, 400, "top_p", "invalid_value", "greater than 0", body=chat(top_p=0)),
    Bad("top-p-high", COMPLETIONS, 400, "top_p", "invalid_value", "less than or equal to 1",
        body=completion(top_p=1.5)),
    Bad("max-tokens-zero", CHAT, 400, "max_tokens", "invalid_value", "greater than or equal to 1",
        body=chat(max_tokens=0)),
    Bad("max-tokens-zero-completions", COMPLETIONS, 400, "max_tokens", "invalid_value", "greater than or equal to 1",
        body=completion(max_tokens=0)),
    Bad("max-completion-tokens-negative", CHAT, 400, "max_completion_tokens", "invalid_value", "",
        body=chat(max_completion_tokens=-1)),
    Bad("top-logprobs-21", CHAT, 400, "top_logprobs", "invalid_value", "less than or equal to 20",
        body=chat(logprobs=True, top_logprobs=21)),
    Bad("top-logprobs-without-logprobs", CHAT, 400, None, "invalid_request", "top_logprobs requires logprobs",
        body=chat(top_logprobs=2)),
    Bad("completions-logprobs-21", COMPLETIONS, 400, "logprobs", "invalid_value", "less than or equal to 20",
        body=completion(logprobs=21)),
    Bad("presence-penalty-high", CHAT, 400, "presence_penalty", "invalid_value", "", body=chat(presence_penalty=2.5)),
    Bad("frequency-penalty-low", COMPLETIONS, 400, "frequency_penalty", "invalid_value", "",
        body=completion(frequency_penalty=-2.5)),
    Bad("logit-bias-value", CHAT, 400, "logit_bias.5", "invalid_value", "less than or equal to 100",
        body=chat(logit_bias={"5": 101})),
    Bad("logit-bias-key", CHAT, 400, "logit_bias", "invalid_value", "must be token ids",
        body=chat(logit_bias={"hello": 1})),
    Bad("logit-bias-key-superscript", CHAT, 400, "logit_bias", "invalid_value", "must be token ids",
        body=chat(logit_bias={"\u00b2": 1})),  # "²": str.isdigit() says yes, int() refuses it
    Bad("logit-bias-key-double-minus", CHAT, 400, "logit_bias", "invalid_value", "must be token ids",
        body=chat(logit_bias={"--1": 1})),
    Bad("logit-bias-outside-vocab", CHAT, 400, "logit_bias", "invalid_value", "outside the vocabulary",
        body=chat(logit_bias={str(VOCAB_SIZE): 1})),
    Bad("empty-messages", CHAT, 400, "messages", "invalid_value", "at least 1", body=chat(messages=[])),
    Bad("unknown-role", CHAT, 400, "messages.0.role", "invalid_value", "",
        body=chat(messages=[{"role": "bot", "content": "x"}])),
    Bad("empty-stop", CHAT, 400, "stop", "invalid_value", "must not be empty", body=chat(stop="")),
    Bad("too-many-stops", CHAT, 400, "stop", "invalid_value", "at most 16",
        body=chat(stop=[str(i) for i in range(17)])),
    Bad("stream-options-without-stream", CHAT, 400, None, "invalid_request", "stream_options is only allowed",
        body=chat(stream_options={"include_usage": True})),
    # unknown fields
    Bad("unknown-field", CHAT, 400, "foo", "invalid_value", "Unrecognized request argument supplied: foo",
        body=chat(foo=1)),
    Bad("unknown-field-dashed", CHAT, 400, "foo-bar", "invalid_value",
        "Unrecognized request argument supplied: foo-bar", body=chat(**{"foo-bar": 1})),
    Bad("unknown-field-completions", COMPLETIONS, 400, "functions", "invalid_value",
        "Unrecognized request argument supplied: functions", body=completion(functions=[])),
    Bad("unknown-message-field", CHAT, 400, "messages.0.mood", "invalid_value",
        "Unrecognized request argument supplied: messages.0.mood",
        body=chat(messages=[{"role": "user", "content": "hi", "mood": "sunny"}])),
    # the model
    Bad("unknown-model", CHAT, 404, "model", "model_not_found", "The model 'gpt-4o' does not exist",
        body=chat(model="gpt-4o")),
    Bad("unknown-model-streamed", CHAT, 404, "model", "model_not_found", "does not exist",
        body=chat(model="gpt-4o", stream=True)),
    Bad("unknown-model-completions", COMPLETIONS, 404, "model", "model_not_found", "does not exist",
        body=completion(model="davinci-002")),
    # the context
    Bad("prompt-5000-ids", COMPLETIONS, 400, "prompt", "context_length_exceeded",
        f"maximum context length is {CONTEXT_LENGTH} tokens", body=completion(prompt=[100] * 5000, max_tokens=1)),
    Bad("prompt-fills-context", COMPLETIONS, 400, "prompt", "context_length_exceeded", "",
        body=completion(prompt=[100] * CONTEXT_LENGTH)),
    Bad("prompt-plus-max-tokens", COMPLETIONS, 400, "prompt", "context_length_exceeded", "(4000 in the prompt, 97 in",
        body=completion(prompt=[100] * 4000, max_tokens=97)),
    Bad("chat-max-tokens-past-context", CHAT, 400, "messages", "context_length_exceeded", "",
        body=chat(max_tokens=CONTEXT_LENGTH)),
    Bad("streamed-past-context", COMPLETIONS, 400, "prompt", "context_length_exceeded", "",
        body=completion(prompt=[100] * 5000, stream=True)),
    Bad("chat-long-message", CHAT, 400, "messages", "context_length_exceeded", "",
        body=chat(messages=[{"role": "user", "content": "ls -la " * 2500}])),
    # unsupported
    Bad("n-17", CHAT, 400, "n", "invalid_value", "at most 16", body=chat(n=17)),
    Bad("n-17-completions", COMPLETIONS, 400, "n", "invalid_value", "at most 16", body=completion(n=17)),
    Bad("n-0", CHAT, 400, "n", "invalid_value", "", body=chat(n=0)),
    Bad("best-of-2", COMPLETIONS, 400, "best_of", "unsupported_value", "", body=completion(best_of=2)),
    Bad("suffix", COMPLETIONS, 400, "suffix", "unsupported_value", "", body=completion(suffix="x")),
    # echo with logprobs and lists of prompts are served (tests/server/test_prompt_logprobs.py)
    Bad("max-tokens-0-without-echo", COMPLETIONS, 400, "max_tokens", "invalid_value", "0 only with echo",
        body=completion(max_tokens=0)),
    Bad("prompts-257", COMPLETIONS, 400, "prompt", "invalid_value", "At most 256 prompts",
        body=completion(prompt=["a"] * 257)),
    # prompts
    Bad("token-id-vocab-size", COMPLETIONS, 400, "prompt", "invalid_value", f"Token id {VOCAB_SIZE} is outside",
        body=completion(prompt=[1, VOCAB_SIZE])),
    Bad("token-id-negative", COMPLETIONS, 400, "prompt", "invalid_value", "Token id -1 is outside",
        body=completion(prompt=[-1])),
    Bad("token-id-nested", COMPLETIONS, 400, "prompt", "invalid_value", "outside the vocabulary",
        body=completion(prompt=[[10 ** 9]])),
    Bad("empty-prompt", COMPLETIONS, 400, "prompt", "invalid_value", "The prompt is empty", body=completion(prompt="")),
    Bad("empty-id-prompt", COMPLETIONS, 400, "prompt", "invalid_value", "The prompt is empty",
        body=completion(prompt=[])),
    # routes and methods
    Bad("unknown-route", "/v1/nope", 404, None, None, "no such route", method="GET"),
    Bad("unknown-route-post", "/v1/embeddings", 404, None, None, "no such route", body={"model": MODEL_ID}),
    Bad("unknown-root-route", "/index.html", 404, None, None, "no such route", method="GET"),
    Bad("get-chat", CHAT, 405, None, None, "Method Not Allowed", method="GET"),
    Bad("put-completions", COMPLETIONS, 405, None, None, "Method Not Allowed", method="PUT", body=completion()),
    Bad("post-models", "/v1/models", 405, None, None, "Method Not Allowed", body={}),
    Bad("delete-health", "/health", 405, None, None, "Method Not Allowed", method="DELETE"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(http: httpx.Client, case: Bad) -> None:
    if case.raw is not None:
        response = http.request(case.method, case.path, content=case.raw, headers={**JSON_HEADERS, **case.headers})
    elif case.body is not None:
        response = http.request(case.method, case.path, json=case.body, headers=case.headers)
    else:
        response = http.request(case.method, case.path, headers=case.headers)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"] == "application/json"
    assert "Traceback" not in response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.param
    assert error["code"] == case.code
    assert isinstance(error["message"], str) and error["message"]
    assert case.message in error["message"]
    if case.status == 405:
        assert response.headers["allow"]


def test_validation_messages_do_not_leak_internals(http: httpx.Client) -> None:
    """Validation messages name the parameter, not the server's pydantic classes or files."""
    for body in (chat(messages=["hi"]), chat(foo=1), [1]):
        message = http.post(CHAT, json=body).json()["error"]["message"]
        assert "server/" not in message and ".py" not in message and "pydantic" not in message


def test_sdk_maps_errors(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="gpt-4o", messages=MSGS)
    assert not_found.value.status_code == 404
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model=MODEL_ID, prompt=[100] * 5000, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.chat.completions.create(model=MODEL_ID, messages=MSGS, extra_body={"bogus": 1})
    assert unknown.value.code == "invalid_value" and unknown.value.param == "bogus"
    assert "Unrecognized request argument supplied: bogus" in unknown.value.message


def test_still_serves_after_bad_requests(http: httpx.Client, server: Server) -> None:
    health = wait_idle(http, 5)
    assert health["status"] == "ok"
    response = http.post(CHAT, json=chat_body("hi", max_tokens=5, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
