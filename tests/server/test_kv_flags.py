"""The KV layout flags reach the engine and /v1/models reports what is in force."""

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_ID, start_server


@pytest.mark.parametrize("flags,expected", [
    ([], {"scheme": "kvarn", "key_bits": 4, "value_bits": 2, "tile": 128}),
    (["--kv-scheme", "kvarn", "--kv-key-bits", "3", "--kv-value-bits", "3", "--kv-tile", "64"],
     {"scheme": "kvarn", "key_bits": 3, "value_bits": 3, "tile": 64}),
    (["--kv-scheme", "affine", "--kv-bits", "8", "--kv-group-size", "32"],
     {"scheme": "affine", "key_bits": 8, "value_bits": 8, "group_size": 32}),
    (["--kv-scheme", "fp16"], {"scheme": "fp16", "tile": None}),
])
def test_layout_in_force_is_reported_and_serves(flags, expected, tmp_path: Path, server):
    srv = server if not flags else start_server(tmp_path / "server.log", *flags)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            kv = http.get("/v1/models").json()["data"][0]["kv_cache"]
            assert {k: kv[k] for k in expected} == expected
            assert kv["layers"] == kv["layers_with_layout"] == 8 and len(kv["stamp"]) == 16
            assert http.get("/health").json()["kv_cache"] == kv
            # 300 prompt tokens: the sink fills and a record is committed during prefill
            body = {"model": MODEL_ID, "prompt": list(range(20, 320)), "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200
            assert response.json()["usage"] == {"prompt_tokens": 300, "completion_tokens": 4, "total_tokens": 304,
                                                "prompt_tokens_details": {"cached_tokens": 0}}
    finally:
        if srv is not server:
            srv.stop()


def test_stamps_differ_between_layouts(tmp_path: Path, server):
    other = start_server(tmp_path / "server.log", "--kv-scheme", "kvarn", "--kv-bits", "4")
    try:
        with httpx.Client(base_url=server.base_url) as a, httpx.Client(base_url=other.base_url) as b:
            stamp_a = a.get("/v1/models").json()["data"][0]["kv_cache"]["stamp"]
            stamp_b = b.get("/v1/models").json()["data"][0]["kv_cache"]["stamp"]
        assert stamp_a != stamp_b
    finally:
        other.stop()
