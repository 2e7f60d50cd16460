"""Two replicas with one ``--apc-disk-dir``: a prefix one of them computed is a disk hit for the
other (``apc.disk_tier`` finds files another process wrote), through the official SDK."""

from __future__ import annotations

import time

import openai

from tests.server.conftest import MODEL_ID, client_of, served


def test_a_prefix_one_replica_computed_is_a_disk_hit_for_the_other(tmp_path_factory):
    disk = tmp_path_factory.mktemp("shared-disk")
    flags = ("--apc-disk-dir", str(disk))
    with served(tmp_path_factory, "replica-a", *flags) as a, served(tmp_path_factory, "replica-b", *flags) as b:
        prompt = list(range(500, 800))  # 300 tokens: two whole blocks of 128 may be reused
        sdk_a, sdk_b = (openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
                        for s in (a, b))
        first = sdk_a.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        with client_of(a) as http_a:  # A writes its blocks behind: wait until they are on disk
            deadline = time.monotonic() + 30
            while http_a.get("/v1/cache/stats").json()["disk"]["writes"] < 2:
                assert time.monotonic() < deadline, "replica A did not write its blocks"
                time.sleep(0.05)
        second = sdk_b.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens == 256
        assert second.choices[0].text == first.choices[0].text  # greedy: the restored prefix is exact
        with client_of(b) as http_b:
            stats = http_b.get("/v1/cache/stats").json()
        assert stats["disk_hit_tokens"] == 256 and stats["disk"]["writes"] == 0 and stats["disk"]["hits"] == 2
