"""KV events made with the prefix cache: a ``PrefixCache`` built with ``events`` publishes its
exact tier's changes from its first insert (memory and disk tiers, evictions, a reset), the
checkpoint tier takes none, ``PrefixReuse.close`` closes the publisher only after the disk
tier's writes (and their events) have landed, and bad settings are refused before any socket
stays open."""

from __future__ import annotations

import hashlib
import socket
import time

import mlx.core as mx
import numpy as np
import pytest
import zmq

from apc.blocks import Payload
from apc.disk_tier import DiskTier
from apc.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvents, KVEventsConfig
from apc.prefix_cache import PrefixCache
from apc.publisher import open_cache_events
from apc.reuse import PrefixReuse
from engine.kv_config import ApcConfig
from kvarn.layout import KVLayout

G, B = 4, 2  # the cache's block size, the routers'


def payload(i: int) -> Payload:
    return Payload("record", (mx.full((2, 3), i, mx.float16), mx.arange(5, dtype=mx.uint32) + i))


def sub_hashes(key: bytes) -> list[int]:
    """The documented scheme (``apc/events.py``), computed here on its own."""
    return [int.from_bytes(hashlib.blake2b(key + j.to_bytes(4, "little"), digest_size=8).digest(), "big") >> 1
            for j in range(G // B)]


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def can_bind(endpoint: str) -> bool:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        sock.bind(endpoint)
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)
        ctx.term()


class Recorder:
    """A publisher stand-in: what was emitted, and what had been emitted when it was closed."""

    def __init__(self) -> None:
        self.emitted: list = []
        self.at_close: list | None = None

    def emit(self, event) -> None:
        self.emitted.append(event)

    def close(self) -> None:
        self.at_close = list(self.emitted)


def test_a_cache_made_with_events_publishes_from_its_first_insert(tmp_path):
    sent = Recorder()
    cache = PrefixCache("stamp", "model", G, 10**6, tmp_path, 10**6, events=CacheEvents(sent.emit, B, G))
    tokens = list(np.random.default_rng(0).integers(0, 50_000, 3 * G))
    chain = cache.chain(tokens, None)
    assert cache.insert(chain, 0, [payload(i) for i in range(3)]) == 3
    cache.flush()  # the disk tier's writes land: one DISK event a block
    stored = [e for e in sent.emitted if isinstance(e, BlockStored)]
    memory = [e for e in stored if e.medium == "GPU"]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) for e in memory] == [
        ([h for k in chain for h in sub_hashes(k.key)], None, [int(t) for t in tokens], B)]
    disk = sorted((e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored if e.medium == "DISK")
    assert disk == sorted((sub_hashes(k.key), sub_hashes(chain[i - 1].key)[-1] if i else None,
                           [int(t) for t in tokens[i * G:(i + 1) * G]]) for i, k in enumerate(chain))

    cache.evict_to(0)
    cache.sync_events()  # memory evictions are found once a step
    removed = [e for e in sent.emitted if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert [sorted(e.block_hashes) for e in removed] == [sorted(h for k in chain for h in sub_hashes(k.key))]
    before = len(sent.emitted)
    cache.reset()
    assert [type(e) for e in sent.emitted[before:]] == [AllBlocksCleared]
    cache.close()


def test_a_cache_made_without_events_publishes_nothing(tmp_path):
    cache = PrefixCache("stamp", "model", G, 10**6, tmp_path, 10**6)
    assert cache.events is None and cache.disk.on_written is None and cache.disk.on_removed is None
    cache.close()


def test_the_checkpoint_tier_takes_no_events():
    with pytest.raises(ValueError, match="only the exact tier"):
        PrefixCache("stamp", "model", G, 10**6, tier="checkpoint", events=CacheEvents(Recorder().emit, B, G))


def test_closing_the_reuse_lands_the_disk_writes_before_the_publisher_closes(tmp_path, monkeypatch):
    write = DiskTier._write

    def slow_write(self, *args):  # writes still queued when close is called
        time.sleep(0.05)
        write(self, *args)

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    sent = Recorder()
    cache = PrefixCache("stamp", "model", G, 10**6, tmp_path, 10**6, events=CacheEvents(sent.emit, B, G))
    reuse = PrefixReuse(cache, KVLayout.fp16(), publisher=sent)
    chain = cache.chain(list(range(100, 100 + 5 * G)), None)
    cache.insert(chain, 0, [payload(i) for i in range(5)])  # written behind, on the disk tier's thread
    reuse.close()
    assert sent.at_close is not None
    on_disk = [e for e in sent.at_close if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert sorted(h for e in on_disk for h in e.block_hashes) == sorted(h for k in chain for h in sub_hashes(k.key))


def test_open_cache_events_feeds_its_publisher_and_frees_the_endpoint_on_close():
    endpoint = free_endpoint()
    events, publisher = open_cache_events(KVEventsConfig(endpoint, block_size=B), G)
    try:
        assert events.emit == publisher.emit and events.per_block == G // B
        assert not can_bind(endpoint)  # bound at once
    finally:
        publisher.close()
    assert can_bind(endpoint)


def test_a_router_block_size_that_does_not_divide_the_cache_s_opens_no_socket():
    endpoint = free_endpoint()
    with pytest.raises(ValueError, match="must divide the prefix cache's block size 4"):
        open_cache_events(KVEventsConfig(endpoint, block_size=3), G)
    assert can_bind(endpoint)


@pytest.mark.parametrize("fields,message", [
    (dict(endpoint=""), "must name a ZMQ endpoint"),
    (dict(endpoint="tcp://127.0.0.1:5557", block_size=0), "block size must be >= 1"),
    (dict(endpoint="tcp://127.0.0.1:5557", layout="json"), "layout must be one of array, map"),
])
def test_bad_events_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig(**fields)


def test_events_with_the_prefix_cache_off_are_refused():
    events = KVEventsConfig("tcp://127.0.0.1:5557")
    assert ApcConfig(kv_events=events).kv_events is events
    with pytest.raises(ValueError, match="KV events report the prefix cache's contents: they need the prefix cache on"):
        ApcConfig(enabled=False, kv_events=events)
