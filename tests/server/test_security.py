"""The API key on /v1/*, the loopback Host guard, and the refusal to listen openly without a key."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_ID, REPO_ROOT, Server, chat_body, free_port, server_env


def _assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code
    assert body["error"]["param"] is None
    assert body["error"]["message"]


# --- API key ---

@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": API_KEY},
    {"Authorization": "Bearer"},
], ids=["none", "wrong", "longer", "basic", "no-scheme", "empty"])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions"), ("GET", "/v1/nope")])
def test_v1_needs_the_key(auth_server: Server, headers: dict[str, str], method: str, path: str) -> None:
    response = httpx.request(method, auth_server.base_url + path, headers=headers,
                             json=chat_body("hi", max_tokens=2) if method == "POST" else None)
    _assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_works(auth_server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(auth_server.base_url + "/v1/models", headers=headers)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_ID
    lower = httpx.get(auth_server.base_url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    assert lower.status_code == 200
    response = httpx.post(auth_server.base_url + "/v1/chat/completions", headers=headers, timeout=60,
                          json=chat_body("hi", max_tokens=3, ignore_eos=True))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_sdk_with_and_without_the_key(auth_server: Server) -> None:
    good = openai.OpenAI(base_url=auth_server.base_url + "/v1", api_key=API_KEY, _strict_response_validation=True,
                         max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL_ID]
    r = good.completions.create(model=MODEL_ID, prompt="SELECT", max_tokens=3, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=auth_server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"


def test_health_and_metrics_stay_open(auth_server: Server) -> None:
    health = httpx.get(auth_server.base_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(auth_server.base_url + "/metrics").status_code == 200


def test_server_without_key_needs_none(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


# --- Host guard (DNS rebinding) on a loopback bind ---

@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost.evil.example",
                                  "127.0.0.1.nip.io:{port}", "10.0.0.1:{port}", ""])
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_foreign_host_header_is_refused(server: Server, host: str, path: str) -> None:
    response = httpx.get(server.base_url + path, headers={"Host": host.format(port=server.port)})
    _assert_openai_error(response, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "localhost", "127.0.0.1",
                                  "LOCALHOST:{port}", "[::1]:{port}"])
def test_loopback_host_headers_are_served(server: Server, host: str) -> None:
    headers = {"Host": host.format(port=server.port)}
    assert httpx.get(server.base_url + "/v1/models", headers=headers).json()["data"][0]["id"] == MODEL_ID
    assert httpx.get(server.base_url + "/health", headers=headers).status_code == 200


def test_host_guard_comes_before_auth(auth_server: Server) -> None:
    response = httpx.get(auth_server.base_url + "/v1/models",
                         headers={"Host": "evil.example", "Authorization": f"Bearer {API_KEY}"})
    _assert_openai_error(response, 403, "host_not_allowed")


# --- refusal to start ---

def test_refuses_a_non_loopback_bind_without_a_key() -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--host", "0.0.0.0", "--port",
                           str(free_port())], cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "refusing to listen on non-loopback host '0.0.0.0' without an API key" in output
    assert "--api-key" in output and "KVARN_API_KEY" in output
    assert "loaded" not in output and "Uvicorn running" not in output  # no model load, no bind
    assert took < 30, f"took {took:.1f} s"
