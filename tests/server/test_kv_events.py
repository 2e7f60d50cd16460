"""KV events over real ZMQ from a real ``kvarn serve``, decoded as vLLM's subscriber example does.

One server publishes (memory cap for one prompt's two blocks, a disk tier of 3 MiB); a SUB socket
connected before any request sees every batch. Expected hashes are computed here from the
documented scheme (``apc/events.py``: 8 router blocks of 16 tokens per cached block of 128).
Also: vLLM's metric names, and a default server opens no ZMQ socket at all.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import pytest
import zmq

from apc.hashing import block_keys, root_key
from tests.server.conftest import MODEL_ID, client_of, free_port, metric, served, wait_idle

ROUTER_BLOCK = 16
PER_BLOCK = 128 // ROUTER_BLOCK


# Types as in vLLM's examples/online_serving/kv_events_subscriber.py (vllm.distributed.kv_events)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def sub_hashes(key: bytes) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(key + j.to_bytes(4, "little"), digest_size=8).digest(), "big") >> 1
            for j in range(PER_BLOCK)]


@pytest.fixture(scope="module")
def publishing(tmp_path_factory):
    pub, replay = free_port(), free_port()
    disk = tmp_path_factory.mktemp("kv-events-disk")
    with served(tmp_path_factory, "kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--kv-events-topic", "kvarn",
                "--apc-memory-bytes", "1.5MiB", "--apc-disk-dir", str(disk), "--apc-disk-bytes", "3MiB") as srv:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{pub}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kvarn")
        time.sleep(0.5)  # a PUB drops what it sends before the subscription reaches it
        with client_of(srv) as http:
            yield srv, http, sub, replay, ctx
        sub.close(0)
        ctx.term()


def receive(sub: zmq.Socket, quiet_s: float = 1.5) -> list[tuple[int, bytes, KVEventBatch]]:
    """Every message until none came for ``quiet_s`` seconds: (sequence, payload, batch)."""
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kvarn" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), payload, DECODER.decode(payload)))
    return out


def complete(http, prompt: list[int]) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    wait_idle(http)
    return response.json()


def events_of(received, kind: type, medium: str | None = None) -> list[Any]:
    return [e for _, _, batch in received for e in batch.events
            if isinstance(e, kind) and (medium is None or e.medium == medium)]


def test_store_evict_disk_and_reset_events(publishing):
    srv, http, sub, _, _ = publishing
    stamp = http.get("/v1/cache/stats").json()["stamp"]
    root = root_key(stamp, http.get("/v1/models").json()["data"][0]["fingerprint"])
    prompts = [list(range(base, base + 300)) for base in (100, 1100, 2100)]  # 2 reusable blocks each
    keys = [block_keys(p, 128, root, limit=2) for p in prompts]
    seen = []
    for prompt in prompts:
        complete(http, prompt)
        seen += receive(sub)
    assert [seq for seq, _, _ in seen] == list(range(len(seen)))  # numbered from 0, none missed
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, _, batch in seen)

    # memory tier: one event a prompt, both blocks as 16 router blocks, chained from the root
    stored = events_of(seen, BlockStored, "GPU")
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id) for e in stored] == [
        (sub_hashes(k[0].key) + sub_hashes(k[1].key), None, p[:256], ROUTER_BLOCK, None) for k, p in zip(keys, prompts)]
    # the cap holds one prompt's blocks: the next prompt evicts them
    removed = events_of(seen, BlockRemoved, "GPU")
    assert [sorted(e.block_hashes) for e in removed] == [
        sorted(sub_hashes(k[0].key) + sub_hashes(k[1].key)) for k in keys[:2]]

    # disk tier: one event a block written, the second chained to the first's last router block
    on_disk = events_of(seen, BlockStored, "DISK")
    assert sorted((e.block_hashes, e.parent_block_hash, e.token_ids) for e in on_disk) == sorted(
        (sub_hashes(k[i].key), sub_hashes(k[0].key)[-1] if i else None, p[i * 128:(i + 1) * 128])
        for k, p in zip(keys, prompts) for i in (0, 1))
    # 3 MiB holds two prompts' files (1 MiB sink + 0.2 MiB record each): the third removes the
    # oldest down to what fits it (its sink alone needs the first prompt's files and the second's sink)
    disk_removed = events_of(seen, BlockRemoved, "DISK")
    assert sorted(h for e in disk_removed for h in e.block_hashes) == sorted(
        sub_hashes(keys[0][0].key) + sub_hashes(keys[0][1].key) + sub_hashes(keys[1][0].key))

    assert http.post("/v1/cache/reset").status_code == 200
    cleared = receive(sub)
    assert [type(e) for _, _, batch in cleared for e in batch.events] == [AllBlocksCleared]
    assert cleared[0][0] == seen[-1][0] + 1


def test_replay_answers_from_a_sequence_number(publishing):
    srv, http, sub, replay, ctx = publishing
    complete(http, list(range(3100, 3400)))
    live = receive(sub)
    assert live
    dealer = ctx.socket(zmq.DEALER)  # as a router's replay client: [empty, start] out, [empty, seq, payload] back
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        start = max(live[0][0] - 2, 0)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answered = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            answered.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)
    assert [s for s, _ in answered] == list(range(start, live[-1][0] + 1))
    assert [p for s, p in answered if s >= live[0][0]] == [p for _, p, _ in live]


def test_vllm_metric_names_and_values(publishing):
    _, http, _, _, _ = publishing
    complete(http, list(range(40, 300)))  # a query of its own: the test may run first on its server
    wait_idle(http)
    stats = http.get("/v1/cache/stats").json()
    labels = {"model_name": MODEL_ID}
    assert metric(http, "vllm:prefix_cache_queries_total", labels) == stats["query_tokens"] > 0
    assert metric(http, "vllm:prefix_cache_hits_total", labels) == stats["hit_tokens"]
    assert metric(http, "vllm:num_requests_running", labels) == 0
    assert metric(http, "vllm:num_requests_waiting", labels) == 0
    health = http.get("/health").json()
    usage = health["reserved_bytes"] / health["budget_bytes"]
    assert metric(http, "vllm:kv_cache_usage_perc", labels) == usage
    assert metric(http, "vllm:gpu_cache_usage_perc", labels) == usage
    text = http.get("/metrics").text
    assert f'vllm:num_requests_running{{model_name="{MODEL_ID}"}}' in text


def test_nothing_is_published_when_off(server):
    """The session's default server: no ZMQ library is even loaded into it."""
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "libzmq" not in maps and "zmq" not in maps
