"""The e2e stress runner against a real server subprocess (the bundled model), plus its pure parts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e import checks, stress
from e2e.report import markdown, percentile
from metal import KERNELS

API_KEY = "e2e-test-key"
ROOT = Path(__file__).resolve().parents[2]
# bad_input sends 35 malformed bodies, 3 wrong routes/methods, 3 bad API keys (the server has a key),
# then one normal request.
BAD_INPUT_REQUESTS = 35 + 3 + 3 + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--api-key", API_KEY,
                             "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, proc)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server at {base_url} was not healthy within {timeout}s")


def _requests_seen(base_url: str) -> float:
    """Finished requests plus admitted prompt tokens, from /metrics: moves with any load."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("kvarn_requests_total", "kvarn_prompt_tokens_total")))


def test_stress_run_passes_with_exact_counts(server: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = stress.main(["--base-url", server, "--api-key", API_KEY, "--scheme", "kvarn", "--key-bits", "4",
                        "--value-bits", "2", "--concurrency", "8",
                        "--requests", "12", "--max-tokens", "16", "--seed", "7", "--json", str(out)])
    report = json.loads(out.read_text())
    failures = [(s["name"], s["failures"], [c for c in s["checks"] if not c["ok"]]) for s in report["scenarios"]]
    assert code == 0, failures
    assert report["passed"] and report["exit_code"] == 0 and report["error"] is None
    assert (report["kv_cache"]["scheme"], report["kv_cache"]["key_bits"], report["kv_cache"]["value_bits"]) == ("kvarn", 4, 2)
    served = "cpu-native" if KERNELS.cpu() is not None else "reference"  # the server decides as this process does
    assert report["attention"] == served  # the served decode path: kvarn's C++ kernel on this CPU
    assert f"decode attention `{served}`" in markdown(report)
    counts = {s["name"]: (s["requests"], s["ok"], s["failed"], s["dropped"], s["aborted"])
              for s in report["scenarios"]}
    assert counts == {
        "burst": (8, 8, 0, 0, 0),
        "mixed": (12, 12, 0, 0, 2),  # two of every 12 mixed requests disconnect mid-stream on purpose
        "abort": (9, 9, 0, 0, 8),  # 8 aborted streams, then one normal request
        "bad_input": (BAD_INPUT_REQUESTS, BAD_INPUT_REQUESTS, 0, 0, 0),
        "determinism": (13, 13, 0, 0, 0),  # solo + 8 greedy copies + 4 seeded copies
        "prefix": (12, 12, 0, 0, 0),  # 3 conversations x 3 turns, 2 repeats, 1 salted repeat
    }
    for scenario in report["scenarios"]:
        assert scenario["passed"] and all(c["ok"] for c in scenario["checks"])
        assert scenario["output_tokens"] > 0 and scenario["latency_p50_s"] is not None


def test_layout_mismatch_exits_3_without_load(server: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = _requests_seen(server)
    out = tmp_path / "report.json"
    code = stress.main(["--base-url", server, "--api-key", API_KEY, "--scheme", "fp16", "--json", str(out)])
    assert code == 3
    report = json.loads(out.read_text())
    assert report["exit_code"] == 3 and report["scenarios"] == []
    assert "scheme 'kvarn', expected 'fp16'" in report["error"]
    assert "refusing to run" in capsys.readouterr().err
    assert _requests_seen(server) == before


def _args(scheme: str, bits: int | None = None, key: int | None = None, value: int | None = None) -> Namespace:
    return Namespace(scheme=scheme, bits=bits, key_bits=key, value_bits=value)


def test_layout_rules() -> None:
    fp32 = {"scheme": "fp16", "key_bits": 32, "value_bits": 32}
    assert stress.layout_mismatch(_args("fp16"), fp32) is None
    assert stress.layout_mismatch(_args("fp16"), {**fp32, "key_bits": 16, "value_bits": 16}) is None
    assert stress.layout_mismatch(_args("fp16", bits=32), fp32) is None
    assert "key_bits 32, expected 16" in stress.layout_mismatch(_args("fp16", bits=16), fp32)
    assert "value_bits 32, expected 8" in stress.layout_mismatch(_args("fp16", key=32, value=8), fp32)
    assert "expected 16 or 32" in stress.layout_mismatch(_args("fp16"), {**fp32, "key_bits": 8})
    assert "expected 'affine'" in stress.layout_mismatch(_args("affine"), fp32)
    assert stress.layout_mismatch(_args("kvarn"), {"scheme": "kvarn", "key_bits": 3, "value_bits": 2}) is None
    assert "no kv_cache" in stress.layout_mismatch(_args("fp16"), None)


def test_bits_flags_conflict() -> None:
    assert stress.main(["--scheme", "fp16", "--bits", "16", "--key-bits", "16"]) == 2


def test_response_checks() -> None:
    assert checks.usage({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, 4, "length") == []
    assert checks.usage({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, 4, "stop") == []
    assert checks.usage({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 6}, 4, "stop")
    assert checks.usage({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, 4, "length")
    assert checks.error_shape(400, {"error": {"message": "m", "type": "t", "param": None, "code": None}}) == []
    assert checks.error_shape(500, {"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert checks.error_shape(400, {"detail": "x"})
    reasons, text, finish, _ = checks.stream("completion", [
        {"id": "a", "object": "text_completion", "model": "m", "choices": [{"text": "hi", "finish_reason": None}]},
        {"id": "a", "object": "text_completion", "model": "m", "choices": [{"text": "", "finish_reason": "stop"}]},
    ], done=False, model="m", max_tokens=4, include_usage=False)
    assert reasons == ["stream ended without [DONE]"] and text == "hi" and finish == "stop"


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
