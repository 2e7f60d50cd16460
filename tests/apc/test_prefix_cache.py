"""apc.prefix_cache.PrefixCache: the facade over keys, memory, disk and checkpoint tiers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from apc.blocks import Payload, payload_from_parts, payload_to_parts
from apc.prefix_cache import PENDING, PrefixCache

G = 4


def payload(i: int, dtype=mx.float16) -> Payload:
    return Payload("record", (mx.full((2, 3), i, dtype), mx.arange(5, dtype=mx.uint32) + i))


def tokens(n: int, seed: int = 0) -> list[int]:
    return list(np.random.default_rng(seed).integers(0, 50_000, n))


def cache(tmp_path=None, memory: int = 10**6, disk: int = 10**6, tier: str = "exact") -> PrefixCache:
    return PrefixCache("stamp", "model", G, memory, tmp_path, disk, tier=tier)


def test_lookup_finds_whole_blocks_and_never_the_last_token():
    c = cache()
    t = tokens(4 * G)
    chain = c.chain(t, None)
    assert len(chain) == 4
    c.insert(chain, 0, [payload(i) for i in range(4)])
    keys, hits = c.lookup(t, None)  # 16 tokens: the block holding the last token is never served
    assert len(hits) == 3 and keys == chain[:3]
    assert [int(h.arrays[0][0, 0]) for h in hits] == [0, 1, 2]
    assert len(c.lookup(t + [1], None)[1]) == 4
    assert c.lookup(t, "salt")[1] == []
    assert c.stats.lookups == 0  # a lookup counts nothing: the engine records the hit it takes
    c.record(16, keys)
    c.record(17, chain)
    c.record(16, [])
    assert (c.stats.lookups, c.stats.query_tokens, c.stats.hit_tokens) == (3, 16 + 17 + 16, 3 * G + 4 * G)


def test_chain_extends_known_keys():
    c = cache()
    t = tokens(5 * G + 2)
    assert c.chain(t, "s", c.chain(t[: 2 * G + 1], "s")) == c.chain(t, "s")
    assert c.chain(t[:G], "s", c.chain(t, "s")) == c.chain(t, "s")[:1]


def test_disk_continues_the_chain_after_memory_and_promotes(tmp_path):
    c = cache(tmp_path, memory=10**6)
    t = tokens(6 * G)
    chain = c.chain(t, None)
    c.insert(chain, 0, [payload(i) for i in range(6)])
    c.flush()
    fresh = cache(tmp_path)  # a restart: memory empty, disk indexed
    assert fresh.lookup(t, None) is PENDING and fresh.reading  # read on the disk tier's own thread
    assert fresh.lookup(t, None) is PENDING  # the same read, still in flight (or not yet polled)
    while fresh.reading:
        fresh.wait(5.0)
    assert len(fresh.memory) == 5  # the read blocks joined the memory tier
    keys, hits = fresh.lookup(t, None, disk=False)
    assert len(hits) == 5 and [int(h.arrays[1][0]) for h in hits] == [0, 1, 2, 3, 4]
    fresh.record(len(t), keys)
    assert fresh.stats.disk_hit_tokens == 5 * G and fresh.stats.memory_hit_tokens == 0
    keys, again = fresh.lookup_now(t, None)
    assert len(again) == 5 and fresh.stats.memory_hit_tokens == 5 * G
    fresh.close()
    c.close()


def test_reset_drops_memory_and_disk(tmp_path):
    c = cache(tmp_path)
    t = tokens(3 * G)
    c.insert(c.chain(t, None), 0, [payload(i) for i in range(3)])
    c.flush()
    assert c.memory_bytes > 0 and c.disk.stats.bytes > 0
    released = c.reset()
    assert released["memory_bytes"] > 0 and released["disk_bytes"] > 0
    assert c.lookup_now(t + [0], None)[1] == [] and len(c.disk) == 0 and not list(c.disk.folder.glob("*.blk"))
    c.close()


def test_snapshots_longest_proper_prefix_from_memory_then_disk(tmp_path):
    c = cache(tmp_path, tier="checkpoint")
    t = tokens(50)
    c.put_snapshot(t[:10], None, Payload("snapshot", (mx.ones((3,)),), meta='{"n": 10}'))
    c.put_snapshot(t[:30], None, Payload("snapshot", (mx.ones((4,)),), meta='{"n": 30}'))
    length, got = c.longest_snapshot(t, None)
    assert length == 30 and got.meta == '{"n": 30}'
    assert c.longest_snapshot(t[:30], None)[0] == 10  # proper prefixes only
    c.flush()  # both on disk too: another salt's prompt still finds nothing and reads nothing
    assert c.longest_snapshot(t, "other") is None and not c._reading
    fresh = cache(tmp_path, tier="checkpoint")
    assert fresh.longest_snapshot(t, None) is PENDING  # read on the disk tier's own thread
    length, got = fresh.longest_snapshot_now(t, None)
    assert length == 30 and got.meta == '{"n": 30}' and got.arrays[0].shape == (4,)
    assert fresh.stats.disk_hit_tokens == 30
    fresh.close()
    c.close()


def test_payload_parts_round_trip_every_dtype():
    p = Payload("fresh", (mx.array([1.5, -2.0], mx.bfloat16), mx.array([[1, 2]], mx.uint32),
                          mx.array([0.25], mx.float32), mx.array([3.0], mx.float16)), meta="{}")
    back = payload_from_parts(payload_to_parts(p))
    assert back.kind == "fresh" and back.meta == "{}"
    for a, b in zip(p.arrays, back.arrays):
        assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
