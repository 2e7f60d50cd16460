"""Fixtures of the HTTP integration suite: real ``kvarn serve`` subprocesses on the bundled model.

One server is shared by the whole session (``server``); a second one with ``--api-key`` starts
only when an auth test asks for it (``auth_server``). Both are reached over real HTTP, with
httpx and with the official ``openai`` SDK in strict response validation.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "engine" / "bundled" / "fixture-chat-29m-q8"
MODEL_ID = "fixture-chat-29m-q8"
CONTEXT_LENGTH = 4096
VOCAB_SIZE = 8192
API_KEY = "sk-kvarn-test-4f1c9a"
DEFAULT_SYSTEM = "You are a helpful assistant."
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """The child's environment: ours (already under OpenBLAS), minus any API key from outside."""
    env = dict(os.environ)
    env.pop("KVARN_API_KEY", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Server:
    """A running ``kvarn serve`` subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    loading_answers: list[httpx.Response] = field(default_factory=list)  # 503s seen while it loaded

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(log_path: Path, *extra: str) -> Server:
    """Start ``kvarn serve`` and wait until /health says 200 (another free port if ours was taken)."""
    for _ in range(3):
        server = _launch(log_path, *extra)
        if server is not None:
            return server
    raise RuntimeError(f"kvarn serve found no free port:\n{log_path.read_text(errors='replace')[-4000:]}")


def _launch(log_path: Path, *extra: str) -> Server | None:
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *extra],
                                cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(base_url=server.base_url, timeout=5) as client:
        while True:
            if proc.poll() is not None:
                if "address already in use" in server.log():
                    return None
                raise RuntimeError(f"kvarn serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                response = client.get("/health")
                if response.status_code == 200:
                    return server
                server.loading_answers.append(response)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"kvarn serve was not ready in {STARTUP_TIMEOUT_S} s:\n{server.log()[-4000:]}")
            time.sleep(0.1)


@contextmanager
def served(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Iterator[Server]:
    """A ``kvarn serve`` with ``flags`` for the length of a fixture (log in a temp folder ``name``)."""
    srv = start_server(tmp_path_factory.mktemp(name) / "server.log", *flags)
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def client_of(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "kvarn") as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tmp_path_factory, "kvarn-auth", "--api-key", API_KEY) as srv:
        yield srv


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    with client_of(server) as client:
        yield client


@pytest.fixture(scope="session")
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", _strict_response_validation=True,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The model's tokenizer through the ``tokenizers`` library, independent of the server's."""
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def chatml(messages: list[dict[str, str]]) -> str:
    """The bundled template's rendering, written out by hand (a default system turn when none)."""
    turns = messages if messages[0]["role"] == "system" else [{"role": "system", "content": DEFAULT_SYSTEM},
                                                              *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns) + "<|im_start|>assistant\n"


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, checking that nothing else is in it."""
    payloads = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payloads.append(line[len("data: "):])
    return payloads


def stream_json(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streamed request; return its chunks, checking the SSE framing and the final [DONE]."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def post_json(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_body(content: str = "How do I list files in Linux?", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 16, **fields}


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /health until nothing runs or waits; return that answer (fail after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        health = http.get("/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"the server was still busy after {timeout} s: {health}")
        time.sleep(0.05)


def metric(http: httpx.Client, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the server's /metrics (0 when it has none yet)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    return 0.0


class HealthPoller:
    """Polls /health in a thread while the block runs; keeps every answer (and any error)."""

    def __init__(self, base_url: str, interval: float = 0.01) -> None:
        self.samples: list[dict[str, Any]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._base_url, self._interval = base_url, interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self._base_url, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    self.samples.append(client.get("/health").json())
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(exc)
                time.sleep(self._interval)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def max(self, key: str) -> int:
        return max(s[key] for s in self.samples)
