"""/v1/models, /health and /metrics."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvarn.layout import KVLayout
from kvarn.pool import block_nbytes
from metal import KERNELS
from tests.server.conftest import CONTEXT_LENGTH, MODEL_ID, Server, chat_body, post_json, wait_idle

STAMP = re.compile(r"[0-9a-f]{16}")


def _check_kv_cache(kv: dict) -> None:
    assert isinstance(kv["scheme"], str) and kv["scheme"]
    for key in ("key_bits", "value_bits"):
        assert isinstance(kv[key], int) and not isinstance(kv[key], bool) and kv[key] > 0
    assert isinstance(kv["stamp"], str) and STAMP.fullmatch(kv["stamp"]), kv["stamp"]


def test_models(http: httpx.Client) -> None:
    response = http.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    model = body["data"][0]
    assert model["id"] == MODEL_ID
    assert model["object"] == "model"
    assert model["owned_by"] == "kvarn"
    assert isinstance(model["created"], int) and model["created"] > 1_600_000_000
    assert model["context_length"] == CONTEXT_LENGTH
    assert re.fullmatch(r"[0-9a-f]{16}", model["fingerprint"])
    _check_kv_cache(model["kv_cache"])
    assert http.get("/v1/models").json() == body  # stable


def test_models_sdk_strict(sdk: openai.OpenAI, http: httpx.Client) -> None:
    models = list(sdk.models.list())
    assert [m.id for m in models] == [MODEL_ID]
    assert models[0].object == "model" and models[0].owned_by == "kvarn"
    extra = models[0].model_extra or {}
    assert extra["kv_cache"] == http.get("/v1/models").json()["data"][0]["kv_cache"]


def test_health_reports_the_same_kv_cache(http: httpx.Client) -> None:
    wait_idle(http)
    health = http.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok"
    assert body["model"] == MODEL_ID
    assert body["kv_cache"] == http.get("/v1/models").json()["data"][0]["kv_cache"]
    _check_kv_cache(body["kv_cache"])
    assert body["running"] == 0 and body["waiting"] == 0 and body["kv_bytes"] == 0
    # the KVarN decode path, decided when the engine was made: on the CPU kvarn's C++ kernel where it
    # builds and passes its check here (the server's process decides as this one does)
    expected = body["attention"]
    if mx.default_device() == mx.cpu:
        expected = "cpu-native" if KERNELS.cpu() is not None else "reference"
    assert body["attention"] == expected == http.get("/v1/models").json()["data"][0]["attention"]
    assert body["attention"] in ("cuda-fused", "metal-fused", "cpu-native", "reference")


def test_response_fingerprint_is_the_kv_stamp(http: httpx.Client) -> None:
    stamp = http.get("/health").json()["kv_cache"]["stamp"]
    response = post_json(http, "/v1/chat/completions", chat_body("hi", max_tokens=2))
    assert response["system_fingerprint"] == f"kvarn-{stamp}"


def test_health_answered_503_while_loading(server: Server) -> None:
    if not server.loading_answers:
        pytest.skip("the model loaded before the first /health poll")
    for response in server.loading_answers:
        assert response.status_code == 503
        assert response.json() == {"status": "loading"}
        assert response.headers["retry-after"] == "1"


def _samples(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_count_a_request_exactly(http: httpx.Client) -> None:
    wait_idle(http)
    before = _samples(http)
    response = post_json(http, "/v1/chat/completions", chat_body("hi", max_tokens=7, ignore_eos=True))
    text = http.get("/metrics").text
    assert "kvarn_requests_total" in text
    after = _samples(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kvarn_requests_total", endpoint="chat", finish_reason="length") == 1
    assert delta("kvarn_prompt_tokens_total") == response["usage"]["prompt_tokens"]
    assert delta("kvarn_generation_tokens_total") == 7
    assert delta("kvarn_time_to_first_token_seconds_count") == 1
    assert delta("kvarn_request_latency_seconds_count") == 1
    assert delta("kvarn_prefill_chunks_total") == 1 and delta("kvarn_prefill_forwards_total") == 1  # one chunk
    assert after[("kvarn_num_requests_running", ())] == 0
    assert after[("kvarn_num_requests_waiting", ())] == 0
    assert after[("kvarn_kv_cache_bytes", ())] == 0

    completion = post_json(http, "/v1/completions", {"model": MODEL_ID, "prompt": "SELECT", "max_tokens": 2,
                                                     "temperature": 0, "ignore_eos": True, "stream": False})
    assert completion["usage"]["completion_tokens"] == 2
    later = _samples(http)
    key = ("kvarn_requests_total", (("endpoint", "completion"), ("finish_reason", "length")))
    assert later[key] - after.get(key, 0.0) == 1


def _idle_pool_bytes() -> int:
    """The bundled model's block pool with its pad ids alone (one record block, one window and
    one cached sink per layer): what it shrinks to once idle with nothing cached."""
    layers, heads, dim, tile = 8, 2, 128, 128
    compute = "float32" if mx.default_device() == mx.cpu else "bfloat16"  # the model's compute dtype
    layout = KVLayout.kvarn("k4v2", tile_size=tile).with_storage_dtype(compute)
    window = layout.sequence_bytes(1, dim, heads)  # one token: the row's sink and tail, K and V
    sink = 2 * heads * tile * dim * 2  # K and V, float16
    return layers * (block_nbytes(layout, heads, dim) + window + sink)


def _wait_for(http: httpx.Client, done, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = {name: value for (name, labels), value in _samples(http).items() if not labels}
        if done(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in {timeout} s: {samples}")
        time.sleep(0.05)


def test_metrics_report_kv_storage_and_mlx_memory_and_an_idle_server_gives_a_burst_back(http: httpx.Client) -> None:
    """``kvarn_kv_allocated_bytes`` (the pool's arrays) grows with a burst of rows and, after a
    prefix cache reset, comes back to the pool's pad ids once the engine is idle, with MLX's
    buffer cache empty; MLX's active and peak memory are reported."""
    floor = _idle_pool_bytes()
    post_json(http, "/v1/chat/completions", chat_body("hi", max_tokens=2))  # the pool's arrays exist from here
    wait_idle(http)
    assert http.post("/v1/cache/reset").status_code == 200
    idle = _wait_for(http, lambda s: s["kvarn_kv_allocated_bytes"] == floor, "the idle pool")
    assert idle["kvarn_mlx_cache_memory_bytes"] == 0
    assert idle["kvarn_mlx_peak_memory_bytes"] >= idle["kvarn_mlx_active_memory_bytes"] > floor

    def ask(i: int) -> None:
        post_json(http, "/v1/chat/completions", chat_body(f"How do I count lines? ({i})", n=2, max_tokens=64,
                                                          ignore_eos=True))

    busy = []  # samples taken while rows ran
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        while not all(f.done() for f in futures):
            samples = {name: value for (name, labels), value in _samples(http).items() if not labels}
            if samples["kvarn_kv_cache_bytes"] > 0:
                busy.append(samples)
            time.sleep(0.02)
        for future in futures:
            future.result()
    assert busy and max(s["kvarn_kv_allocated_bytes"] for s in busy) > floor
    assert all(s["kvarn_kv_allocated_bytes"] >= s["kvarn_kv_cache_bytes"] for s in busy)
    wait_idle(http)
    assert http.post("/v1/cache/reset").status_code == 200
    after = _wait_for(http, lambda s: s["kvarn_kv_allocated_bytes"] == floor, "the pool given back")
    assert after["kvarn_mlx_cache_memory_bytes"] == 0 and after["kvarn_kv_cache_bytes"] == 0
