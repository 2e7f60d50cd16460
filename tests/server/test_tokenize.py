"""vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, the render routes) and ``no_stop_trim``.

The ids these routes report must be the ids the chat and completions routes run: each case is
checked against the ``usage.prompt_tokens`` of the real request (through the official SDK), the
render routes against ``/tokenize``, and both against the model's tokenizer read independently.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.server.conftest import API_KEY, CONTEXT_LENGTH, MODEL_ID, VOCAB_SIZE, Server, chatml, client_of, \
    post_json, stream_json

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}
CHATS: dict[str, dict[str, Any]] = {
    "user only": {"messages": [{"role": "user", "content": "How do I list files?"}]},
    "system and turns": {"messages": [{"role": "system", "content": "You answer in one line."},
                                      {"role": "user", "content": "Name a colour."},
                                      {"role": "assistant", "content": "Blue."},
                                      {"role": "user", "content": "Another, ünïcödé 日本?"}]},
    "tools": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER_TOOL]},
    "template kwargs": {"messages": [{"role": "user", "content": "Think first."}],
                        "chat_template_kwargs": {"enable_thinking": True}},
}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_tokenize_chat_is_what_chat_completions_runs(case: str, http: httpx.Client, sdk: openai.OpenAI) -> None:
    body = CHATS[case]
    tokenized = post_json(http, "/tokenize", {"model": MODEL_ID, **body})
    extra = {k: v for k, v in body.items() if k not in ("messages", "tools")}  # vLLM's fields
    reply = sdk.chat.completions.create(model=MODEL_ID, max_tokens=1, temperature=0, messages=body["messages"],
                                        tools=body.get("tools", openai.NOT_GIVEN), extra_body=extra)
    assert tokenized["count"] == len(tokenized["tokens"]) == reply.usage.prompt_tokens
    assert tokenized["max_model_len"] == CONTEXT_LENGTH
    assert tokenized["token_strs"] is None
    rendered = post_json(http, "/v1/chat/completions/render", {"model": MODEL_ID, "max_tokens": 1, **body})
    assert rendered["token_ids"] == tokenized["tokens"]


def test_tokenize_chat_without_generation_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    full = post_json(http, "/tokenize", {"messages": messages})["tokens"]
    open_ended = post_json(http, "/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
    assert full == tokenizer.encode(chatml(messages), add_special_tokens=False).ids
    opening = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert open_ended + opening == full


@pytest.mark.parametrize("prompt", ["The ls command", " leading space and ünïcödé 日本語", "<|im_start|>user"])
def test_tokenize_prompt_is_what_completions_runs(prompt: str, http: httpx.Client, sdk: openai.OpenAI,
                                                  tokenizer: Tokenizer) -> None:
    tokenized = post_json(http, "/tokenize", {"model": MODEL_ID, "prompt": prompt, "return_token_strs": True})
    reply = sdk.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0)
    assert tokenized["count"] == reply.usage.prompt_tokens
    encoding = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenized["tokens"] == encoding.ids
    assert tokenized["token_strs"] == encoding.tokens
    rendered = post_json(http, "/v1/completions/render", {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1})
    assert [r["token_ids"] for r in rendered] == [tokenized["tokens"]]


def test_render_completions_has_one_entry_per_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    prompts = ["first prompt", "second, longer prompt", "third"]
    rendered = post_json(http, "/v1/completions/render", {"model": MODEL_ID, "prompt": prompts, "max_tokens": 3,
                                                          "stop": ["\n"], "temperature": 0, "n": 2})
    assert [r["token_ids"] for r in rendered] == [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    ids = post_json(http, "/v1/completions/render", {"model": MODEL_ID, "prompt": [[5, 6, 7], [8, 9]]})
    assert [r["token_ids"] for r in ids] == [[5, 6, 7], [8, 9]]
    assert all(r["request_id"].startswith("cmpl-") and r["model"] == MODEL_ID for r in rendered)
    assert len({r["request_id"] for r in rendered}) == 3
    params = rendered[0]["sampling_params"]
    assert (params["n"], params["max_tokens"], params["stop"], params["temperature"]) == (2, 3, ["\n"], 0.0)


def test_render_chat_reads_past_router_fields(http: httpx.Client) -> None:
    """vllm-router posts its whole request, SGLang's output switches included, to the render route."""
    body = {"model": MODEL_ID, "messages": CHATS["system and turns"]["messages"], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 5, "logprobs": False, "no_stop_trim": False,
            "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            "include_reasoning": True, "cache_salt": "tenant-a"}
    rendered = post_json(http, "/v1/chat/completions/render", body)
    tokens = post_json(http, "/tokenize", {"messages": body["messages"]})["tokens"]
    assert rendered["token_ids"] == tokens
    assert rendered["request_id"].startswith("chatcmpl-")
    assert (rendered["stream"], rendered["stream_options"], rendered["cache_salt"]) == (
        True, {"include_usage": True, "include_obfuscation": None}, "tenant-a")
    assert rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["features"] is None and rendered["priority"] == 0


@pytest.mark.parametrize("text", ["hello world", " Ünïcödé — 日本語 🙂", "<|im_end|>\n<|im_start|>user"])
def test_detokenize_round_trip(text: str, http: httpx.Client) -> None:
    tokens = post_json(http, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert post_json(http, "/detokenize", {"model": MODEL_ID, "tokens": tokens}) == {"prompt": text}


def test_detokenize_of_nothing_is_empty(http: httpx.Client) -> None:
    assert post_json(http, "/detokenize", {"tokens": []}) == {"prompt": ""}


BAD = [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
    ("/tokenize", {"model": MODEL_ID}, 400, "prompt"),
    ("/tokenize", {"model": "other-model", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"model": "other-model", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": "hello"}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 1}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": []}, 400, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tools": 1}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, VOCAB_SIZE]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"model": "other-model", "tokens": [1]}, 404, "model"),
    ("/v1/chat/completions/render", {"model": MODEL_ID, "messages": []}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}],
                                     "max_tokens": CONTEXT_LENGTH}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": "other-model", "messages": [{"role": "user", "content": "a"}]},
     404, "model"),
    ("/v1/completions/render", {"model": MODEL_ID, "prompt": [VOCAB_SIZE]}, 400, "prompt"),
    ("/v1/completions/render", {"model": MODEL_ID, "prompt": "a", "frobnicate": True}, 400, "frobnicate"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{p}-{s}-{q}" for p, _, s, q in BAD])
def test_bad_requests_are_4xx_in_openai_shape(path: str, body: dict[str, Any], status: int, param: str,
                                              http: httpx.Client) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/chat/completions/render"])
@pytest.mark.parametrize("raw", [b"[1, 2]", b"{not json", b""])
def test_bodies_that_are_no_json_object(path: str, raw: bytes, http: httpx.Client) -> None:
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_lone_surrogates_are_refused(http: httpx.Client) -> None:
    for path, raw in (("/tokenize", b'{"prompt": "a\\ud800"}'), ("/tokenize", b'{"messages": [{"role": "user", '
                      b'"content": "a\\ud800"}]}'), ("/v1/completions/render", b'{"model": "x", "prompt": "\\ud800"}')):
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("prompt", "messages.0.content")


def test_tokenize_needs_the_api_key(auth_server: Server) -> None:
    with client_of(auth_server) as client:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert client.post(path, json=body).status_code == 401
            keyed = client.post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            assert keyed.status_code == 200, keyed.text


def _stop_inside(text: str) -> str:
    """A stop string taken from the middle of a greedy output (a word-ish piece of 2-3 chars)."""
    middle = text[len(text) // 3:]
    piece = next((middle[i:i + 3] for i in range(len(middle) - 2) if middle[i:i + 3].strip()), None)
    assert piece, f"no stop string to take from {text!r}"
    return piece


PROMPT = "The ls command lists the files of a directory. To see hidden files"


def test_no_stop_trim_keeps_the_stop_string_in_completions(sdk: openai.OpenAI) -> None:
    free = sdk.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = _stop_inside(free)
    cut = free[:free.index(stop)]
    trimmed = sdk.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    kept = sdk.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"no_stop_trim": True})
    assert trimmed.choices[0].text == cut and trimmed.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"


def test_no_stop_trim_keeps_the_stop_string_in_chat_streams(sdk: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "How do I list files in Linux?"}]
    free = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0)
    text = free.choices[0].message.content
    stop = _stop_inside(text)
    cut = text[:text.index(stop)]
    kept = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0, stop=stop,
                                       extra_body={"no_stop_trim": True})
    assert kept.choices[0].message.content == cut + stop and kept.choices[0].finish_reason == "stop"
    chunks = stream_json(http, "/v1/chat/completions", {"model": MODEL_ID, "messages": messages, "max_tokens": 24,
                                                         "temperature": 0, "stop": [stop], "no_stop_trim": True,
                                                         "stream": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == cut + stop
    default = sdk.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0, stop=stop,
                                          extra_body={"no_stop_trim": False})
    assert default.choices[0].message.content == cut


def test_no_stop_trim_must_be_a_boolean(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "a", "no_stop_trim": "yes"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "no_stop_trim"


def test_the_routes_are_in_the_openapi_document(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for path, model in (("/tokenize", "Tokenized"), ("/detokenize", "Detokenized"),
                        ("/v1/chat/completions/render", "RenderedRequest"),
                        ("/v1/completions/render", "RenderedRequests")):
        responses = paths[path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "401", "404", "503"} <= set(responses) and "422" not in responses
