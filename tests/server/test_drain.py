"""SIGTERM under load: in-flight requests finish, new ones get 503, /health says draining, exit 0.

Each test starts its own ``kvarn serve`` (the signal ends it). Streams run through the official
``openai`` SDK; the refusal is checked over plain HTTP for its status, header and error shape.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai

from tests.server.conftest import MODEL_ID, start_server


def _stream(base_url: str, max_tokens: int, started: threading.Event, out: list) -> None:
    sdk = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        stream = sdk.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Tell me a long story."}], temperature=0.7,
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
        finish, text = None, ""
        for chunk in stream:
            started.set()
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        out.append(("done", finish, text))
    except openai.APIError as exc:
        out.append(("error", type(exc).__name__, str(exc)))


def _load(base_url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list]:
    out: list = []
    threads = []
    for _ in range(n):
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(base_url, max_tokens, started, out))
        t.start()
        assert started.wait(60), "a stream did not start"
        threads.append(t)
    return threads, out


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(tmp_path):
    srv = start_server(tmp_path / "server.log", "--drain-timeout", "60")
    try:
        threads, out = _load(srv.base_url, 3, 96)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            refused = http.post("/v1/chat/completions", json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "server_draining" and error["type"] and "shutting down" in error["message"]
        for t in threads:
            t.join(120)
        assert [o[:2] for o in out] == [("done", "length")] * 3, out
        assert srv.proc.wait(60) == 0
        assert "drained: shutting down" in srv.log()
    finally:
        srv.stop()


def test_a_drain_timeout_ends_what_is_left_with_an_error_and_exits_0(tmp_path):
    srv = start_server(tmp_path / "server.log", "--drain-timeout", "1")
    try:
        threads, out = _load(srv.base_url, 2, 3000)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert len(out) == 2 and all(o[0] == "error" and "drain timeout" in o[2] for o in out), out
        assert srv.proc.wait(60) == 0
        assert "drain timeout: ending 2 requests" in srv.log()
    finally:
        srv.stop()
