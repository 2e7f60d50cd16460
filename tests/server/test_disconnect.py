"""A client that goes away frees its request at once, streamed or not, and the server says nothing
alarming about it."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import Server, chat_body, metric, wait_idle

LONG = 3000  # tokens: over a minute of decoding on this CPU
FREED_WITHIN_S = 10.0


def _wait_running(http: httpx.Client, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while http.get("/health").json()["running"] != 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)


def test_streamed_disconnect_frees_the_request(http: httpx.Client, server: Server) -> None:
    wait_idle(http)
    disconnects = metric(http, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"})
    generated = metric(http, "kvarn_generation_tokens_total")
    body = chat_body("Tell me everything about Linux.", max_tokens=LONG, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection at once
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:  # the role chunk and two with text
                        break
            assert http.get("/health").json()["running"] == 1
    closed = time.monotonic()
    health = wait_idle(http, FREED_WITHIN_S)
    assert health["running"] == 0 and health["waiting"] == 0 and health["kv_bytes"] == 0
    assert time.monotonic() - closed < FREED_WITHIN_S
    assert metric(http, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"}) == \
        disconnects + 1
    assert generated + 2 <= metric(http, "kvarn_generation_tokens_total") < generated + LONG // 4


def test_non_streamed_client_timeout_frees_the_request(http: httpx.Client, server: Server) -> None:
    wait_idle(http)
    disconnects = metric(http, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"})
    errors: list[BaseException] = []

    def impatient() -> None:
        try:
            httpx.post(server.base_url + "/v1/chat/completions", timeout=httpx.Timeout(30, read=1.5),
                       json=chat_body("Tell me everything about Linux.", max_tokens=LONG, ignore_eos=True))
        except BaseException as exc:  # noqa: BLE001 - the timeout is what this test wants
            errors.append(exc)

    thread = threading.Thread(target=impatient)
    thread.start()
    _wait_running(http)
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], httpx.ReadTimeout), errors
    closed = time.monotonic()
    health = wait_idle(http, FREED_WITHIN_S)
    assert health["kv_bytes"] == 0
    assert time.monotonic() - closed < FREED_WITHIN_S
    assert metric(http, "kvarn_requests_total", {"endpoint": "chat", "finish_reason": "disconnect"}) == \
        disconnects + 1


def test_a_disconnect_leaves_no_traceback_and_the_server_serves_on(http: httpx.Client, server: Server) -> None:
    wait_idle(http)
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:][:3000]
    assert "Exception in ASGI application" not in log
    response = http.post("/v1/chat/completions", json=chat_body("hi", max_tokens=4, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
