"""``kvarn serve --max-kv-size N`` over HTTP: /v1/models and /health report the window, a request
that a whole context could not fit is admitted at its window's price, and one that even its
window cannot fit is an OpenAI-shaped 400."""

import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_ID, start_server
from tests.server.test_admission import assert_openai_error

WINDOW = 256
# the bundled model on the CPU (float32 windows), 1,500 prompt tokens + 2,000 to generate: priced
# unwindowed 49.4 MB (a 3,500-token row, 9.9 MB, and one chunk's transient over its history);
# windowed at 256 tokens 14.2 MB for one choice (4.4 MB: the window and one record block, and the
# transient over at most the window and a chunk), 18.6 MB for two
BUDGET = 16 * 2**20


def test_a_windowed_server_reports_its_window_and_prices_rows_at_it(tmp_path: Path):
    srv = start_server(tmp_path / "server.log", "--max-kv-size", str(WINDOW), "--kv-budget-bytes", str(BUDGET))
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            kv = http.get("/v1/models").json()["data"][0]["kv_cache"]
            assert (kv["scheme"], kv["max_kv_size"], kv["budget_bytes"]) == ("kvarn", WINDOW, BUDGET)
            assert http.get("/health").json()["kv_cache"] == kv
            # 1,500 prompt tokens + 2,000 to generate: a whole context's price, well over the budget,
            # admitted at its window's; the prompt is attended window by window
            body = {"model": MODEL_ID, "prompt": list(range(20, 1520)), "max_tokens": 2000, "temperature": 0,
                    "ignore_eos": True, "stop": None, "n": 1}
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                events = 0
                for line in response.iter_lines():  # admitted and generating; then the client leaves
                    events += line.startswith("data: {")
                    if events == 40:
                        break
            assert events == 40
            refused = http.post("/v1/completions", json={**body, "n": 2})
            error = assert_openai_error(refused, 400, "kv_budget_exceeded", "invalid_request_error")
            assert f"{BUDGET:,}" in error["message"]
            for _ in range(100):  # the stream's disconnect cancels it at the next engine step
                health = http.get("/health").json()
                if health["running"] == 0:
                    break
                time.sleep(0.1)
            assert health["running"] == 0 and health["kv_bytes"] == 0
    finally:
        srv.stop()
