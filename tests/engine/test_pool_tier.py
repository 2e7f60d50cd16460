"""engine/pool_tier.py: the KVarN block pool's hashed blocks as the prefix cache's memory tier.

A cached record is the row's own block (no copy), a hit pins blocks and an empty row adopts them
(no new record bytes), a block's disk payload is the single-stream cache's block format byte for
byte, and a block read from disk into a fresh pool rebuilds a row that continues identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from apc.disk_tier import Part
from apc.hashing import block_keys, root_key
from engine.pool_tier import PoolTier, SinkOf
from kvarn.cache import KVarNKVCache
from kvarn.layout import KVLayout
from kvarn.paged import PagedRow, as_record_arrays
from kvarn.pool import KVarNPool
from kvarn.record import RecordArrays

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)
LAYERS = 2


def kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    shape = (1, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def filled(pool: KVarNPool, tokens: int, seed: int = 0) -> tuple[PagedRow, list[KVarNKVCache]]:
    """A paged row and single-stream caches (one per layer) fed the same keys and values."""
    rng = np.random.default_rng(seed)
    row = PagedRow(pool, range(LAYERS))
    caches = [KVarNKVCache(LAYOUT) for _ in range(LAYERS)]
    for l in range(LAYERS):
        k, v = kv(rng, tokens)
        row.layers[l].update_and_fetch(k, v)
        caches[l].update_and_fetch(k, v)
    return row, caches


def same(x: mx.array, y: mx.array) -> bool:
    x, y = np.array(x), np.array(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def cache_row(tier: PoolTier, row: PagedRow, blocks: int, tokens: list[int]) -> list:
    chain = block_keys(tokens[: blocks * G], G, root_key("stamp", "model"))
    for i, key in enumerate(chain):
        assert tier.insert(key, chain[i - 1] if i else None, SinkOf(row) if i == 0 else row.table[i - 1])
    return chain


def test_caching_hashes_the_rows_own_blocks_and_copies_the_sink_once():
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    row, _ = filled(pool, 5 * G + 7)  # the sink, 4 records, a tail
    capacity, held = pool.records.capacity, pool.records.num_held
    chain = cache_row(tier, row, 5, list(range(1000)))
    assert pool.records.capacity == capacity and pool.records.num_held == held == 4  # nothing copied
    assert [pool.records.lookup(k.key) for k in chain[1:]] == row.table and len(tier) == 5
    # the row holds every record; the sink's copy is the cache's alone
    assert pool.sinks.num_cached == 1 and row.sink is not None and tier.nbytes == pool.sink_bytes()
    row.release()  # its records released last-first, then the sink touched: the chain's head is evicted last
    assert tier.nbytes == 4 * pool.block_bytes() + pool.sink_bytes()
    assert pool.sinks.oldest_cached()[0] > max(tick for tick in pool.records.cached.values())
    assert tier.lookup(chain) == [pool.sinks.lookup(chain[0].key)] + [pool.records.lookup(k.key) for k in chain[1:]]
    other = block_keys(list(range(64)) + [7] * 64, G, root_key("stamp", "model"))
    assert len(tier.lookup(other)) == 1  # diverges in block 1


def test_a_hit_is_adopted_without_new_record_bytes_and_continues_like_the_row_that_made_it():
    rng = np.random.default_rng(5)
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, caches = filled(pool, 4 * G)
    chain = cache_row(tier, source, 4, list(range(1000)))
    capacity, held = pool.records.capacity, pool.records.num_held
    hit = tier.pin(tier.lookup(chain))
    row = PagedRow(pool, range(LAYERS))
    tier.adopt(hit, row)
    assert row.table == source.table and pool.records.refs[row.table[0]] == 2
    assert row.sink == source.sink and pool.sinks.refs[row.sink[0]] == 0  # the sink was copied, its pin let go
    assert pool.records.capacity == capacity and pool.records.num_held == held  # shared, not copied
    with pytest.raises(ValueError):
        tier.adopt(hit, PagedRow(pool, range(LAYERS)))  # a hit is adopted once
    tier.unpin(hit)  # a no-op once adopted
    assert pool.records.refs[row.table[0]] == 2
    for l in range(LAYERS):
        view, cache = row.layers[l], caches[l]
        assert (view.offset, view.num_tiles, view.tail_len) == (4 * G, 3, 0) == (cache.offset, cache.records.num_tiles, 0)
        a = pool.layers[l]
        assert same(a.win_k[row.slot][None, :, :G], cache.sink_k) and same(a.win_v[row.slot][None, :, :G], cache.sink_v)
        k, v = kv(rng, 100)
        view.update_and_fetch(k, v)
        cache.update_and_fetch(k, v)
        assert view.num_tiles == cache.records.num_tiles == 4 and view.tail_len == cache.tail_len
    source.release()
    row.release()
    assert pool.records.num_held == pool.sinks.num_held == 0


def test_an_unpinned_hit_goes_back_to_the_cache():
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, _ = filled(pool, 3 * G)
    chain = cache_row(tier, source, 3, list(range(1000)))
    source.release()
    cached = tier.nbytes
    hit = tier.pin(tier.lookup(chain))
    assert tier.nbytes == cached - 2 * pool.block_bytes() - pool.sink_bytes()  # pinned: not evictable
    tier.unpin(hit)
    assert tier.nbytes == cached and pool.records.num_held == 0


def test_disk_payloads_are_the_single_stream_block_format_and_load_into_a_fresh_pool():
    rng = np.random.default_rng(9)
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, caches = filled(pool, 4 * G + 3)
    chain = cache_row(tier, source, 4, list(range(1000)))
    parts = [tier.parts(SinkOf(source))] + [tier.parts(b) for b in source.table[:3]]
    for i, block_parts in enumerate(parts):  # byte for byte what KVarNKVCache's blocks hold
        want = [a for cache in caches for a in cache.blocks(4)[i].arrays]
        assert [p.name.split(".")[0] for p in block_parts] == ["sink" if i == 0 else "record"] * len(want)
        for part, array in zip(block_parts, want, strict=True):
            host = np.ascontiguousarray(np.array(array))
            assert part.shape == host.shape and part.data == host.tobytes()
    fresh = KVarNPool(LAYOUT, LAYERS)  # a restart: a new pool, shapes learnt from the blocks
    loaded = PoolTier(fresh)
    assert loaded.load(chain[0], list(zip(chain[1:3], parts[1:3]))) == (0, None)  # its parent is not cached
    wrong = [Part(p.name, p.dtype, p.shape[::-1], p.data) for p in parts[2]]  # verified bytes, wrong shapes
    assert loaded.load(None, list(zip(chain[:4], [parts[0], parts[1], wrong, parts[3]]))) == (2, chain[2].key)
    assert fresh.sinks.oldest_cached()[0] > max(fresh.records.cached.values())  # the head is evicted last
    assert loaded.load(chain[1], list(zip(chain[2:4], parts[2:4]))) == (2, None)  # one copy, one scatter a field
    assert fresh.records.num_cached == 3 and fresh.sinks.num_cached == 1 and fresh.records.num_held == 0
    row = PagedRow(fresh, range(LAYERS))
    loaded.adopt(loaded.pin(loaded.lookup(chain)), row)
    for l in range(LAYERS):
        want = KVarNKVCache.from_blocks(LAYOUT, caches[l].blocks(4))
        k, v = kv(rng, 2 * G + 5)
        row.layers[l].update_and_fetch(k, v)
        want.update_and_fetch(k, v)
        view = row.layers[l]
        assert (view.offset, view.num_tiles, view.tail_len) == (want.offset, want.records.num_tiles, want.tail_len)
        assert view.num_tiles == 5
        got = as_record_arrays(fresh.gather_records(l, mx.array(row.table, dtype=mx.int32)))
        for name in RecordArrays.__dataclass_fields__:
            assert same(getattr(got, name), getattr(want.records.view(), name)), name
        a = fresh.layers[l]
        assert same(a.win_k[row.slot][None, :, :G], want.sink_k)
        assert same(a.win_v[row.slot][None, :, G: G + view.tail_len], want.tail_v[..., : want.tail_len, :])
    other = PoolTier(KVarNPool(LAYOUT, LAYERS))  # a record with a part the layout has no room for
    extra = list(parts[1]) + [Part("record.meta", "|u1", (2,), b"{}")]
    assert other.load(None, list(zip(chain[:3], [parts[0], extra, parts[2]]))) == (1, chain[1].key)


def test_the_budget_decides_whether_a_sink_is_copied():
    pool = KVarNPool(LAYOUT, LAYERS)
    room = [0]
    tier = PoolTier(pool, headroom=lambda: room[0])
    row, _ = filled(pool, 2 * G)
    chain = block_keys(list(range(2 * G)), G, root_key("stamp", "model"))
    assert not tier.insert(chain[0], None, SinkOf(row)) and pool.sinks.num_held == pool.sinks.num_cached == 0
    assert row.sink is None
    assert not tier.insert(chain[1], chain[0], row.table[0])  # its parent is not cached: unreachable
    room[0] = pool.sink_bytes()
    assert tier.insert(chain[0], None, SinkOf(row)) and tier.insert(chain[1], chain[0], row.table[0])
    assert tier.nbytes == pool.sink_bytes() and pool.held_bytes() == pool.window_bytes() + pool.block_bytes()
