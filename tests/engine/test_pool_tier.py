"""apc/pool_tier.py: the KVarN block pool's hashed blocks as the prefix cache's memory tier.

A row's blocks: block 0 = its float16 sink, block i = record i - 1. A cached record is the row's
own block (no copy), a hit pins blocks and an empty row adopts them (no new record bytes); a
row rebuilt from its first n blocks is the original row at token n*G, byte for byte, and
continues identically; a block's disk payload is the single-tile format (per layer: the sink's
float16 keys and values, or a record's eight fields with a one-tile row's unit axes), and a block
read from disk into a fresh pool rebuilds a row that continues identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from apc.disk_tier import Part
from apc.hashing import block_keys, root_key
from apc.pool_tier import PoolTier, SinkOf
from kvarn.layout import KVLayout
from kvarn.paged import PagedRow
from kvarn.pool import RECORD_FIELDS, KVarNPool

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)
LAYERS = 2
Fed = list[tuple[mx.array, mx.array]]  # each layer's keys and values


def kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    shape = (1, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def filled(pool: KVarNPool, tokens: int, seed: int = 0) -> tuple[PagedRow, Fed]:
    """A row of ``pool`` fed ``tokens`` random keys and values in every layer (returned too)."""
    rng = np.random.default_rng(seed)
    row = PagedRow(pool, range(LAYERS))
    fed = []
    for l in range(LAYERS):
        k, v = kv(rng, tokens)
        row.layers[l].update_and_fetch(k, v)
        fed.append((k, v))
    return row, fed


def fed_alone(fed: Fed, tokens: int) -> PagedRow:
    """A row of a pool of its own fed the first ``tokens`` of ``fed`` (what a row holds at that token)."""
    row = PagedRow(KVarNPool(LAYOUT, LAYERS), range(LAYERS))
    for l, (k, v) in enumerate(fed):
        row.layers[l].update_and_fetch(k[:, :, :tokens], v[:, :, :tokens])
    return row


def extend(rows: list[PagedRow], rng: np.random.Generator, n: int) -> None:
    """The same ``n`` new tokens into every layer of each of ``rows``."""
    for l in range(LAYERS):
        k, v = kv(rng, n)
        for row in rows:
            row.layers[l].update_and_fetch(k, v)


def same(x: mx.array, y: mx.array) -> bool:
    x, y = np.array(x), np.array(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_same_row(a: PagedRow, b: PagedRow) -> None:
    """Every layer of ``a`` holds byte for byte what ``b``'s holds: counters, the window's valid
    sink and tail, the committed records."""
    for l in range(LAYERS):
        x, y = a.layers[l], b.layers[l]
        assert (x.offset, x.num_tiles, x.tail_len, x.nbytes) == (y.offset, y.num_tiles, y.tail_len, y.nbytes)
        wa, wb = a.pool.layers[l], b.pool.layers[l]
        for name in ("win_k", "win_v"):
            ra, rb = getattr(wa, name)[a.slot], getattr(wb, name)[b.slot]
            assert same(ra[:, : x.sink_len], rb[:, : y.sink_len]), name
            assert same(ra[:, G: G + x.tail_len], rb[:, G: G + y.tail_len]), name
        if not x.num_tiles:
            continue
        fa = a.pool.gather_records(l, mx.array(a.table[: x.num_tiles], dtype=mx.int32))
        fb = b.pool.gather_records(l, mx.array(b.table[: y.num_tiles], dtype=mx.int32))
        for name in RECORD_FIELDS:
            assert same(fa[name], fb[name]), name


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
    # the row holds every record; the sink's copy is the cache's alone, a float16 copy of the row's sink
    assert pool.sinks.num_cached == 1 and row.sink is not None and tier.nbytes == pool.sink_bytes()
    sink = row.sink[0]
    for a in pool.layers:
        assert a.sink_k.dtype == a.sink_v.dtype == mx.float16
        assert same(a.sink_k[sink], a.win_k[row.slot, :, :G].astype(mx.float16))
        assert same(a.sink_v[sink], a.win_v[row.slot, :, :G].astype(mx.float16))
    row.release()  # its records released last-first, then the sink touched: the chain's head is evicted last
    assert tier.nbytes == 4 * pool.block_bytes() + pool.sink_bytes()
    assert pool.sinks.oldest_cached()[0] > max(tick for tick in pool.records.cached.values())
    assert tier.lookup(chain) == [pool.sinks.lookup(chain[0].key)] + [pool.records.lookup(k.key) for k in chain[1:]]
    other = block_keys(list(range(64)) + [7] * 64, G, root_key("stamp", "model"))
    assert len(tier.lookup(other)) == 1  # diverges in block 1
    assert tier.lookup([]) == []


def test_a_hit_is_adopted_without_new_record_bytes_and_continues_like_the_row_that_made_it():
    rng = np.random.default_rng(5)
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, fed = filled(pool, 4 * G)
    chain = cache_row(tier, source, 4, list(range(1000)))
    capacity, held = pool.records.capacity, pool.records.num_held
    hit = tier.pin(tier.lookup(chain))
    with pytest.raises(ValueError):
        tier.adopt(hit, source)  # only an empty row adopts a hit
    row = PagedRow(pool, range(LAYERS))
    tier.adopt(hit, row)
    assert row.table == source.table and pool.records.refs[row.table[0]] == 2
    assert row.sink == source.sink and pool.sinks.refs[row.sink[0]] == 0  # the sink was copied, its pin let go
    assert pool.records.capacity == capacity and pool.records.num_held == held  # shared, not copied
    with pytest.raises(ValueError):
        tier.adopt(hit, PagedRow(pool, range(LAYERS)))  # a hit is adopted once
    tier.unpin(hit)  # a no-op once adopted
    assert pool.records.refs[row.table[0]] == 2
    for view in row.layers.values():
        assert (view.offset, view.num_tiles, view.tail_len, view.chunk) == (4 * G, 3, 0, None)
    assert_same_row(row, source)
    assert_same_row(row, fed_alone(fed, 4 * G))
    extend([row, source], rng, 100)  # both commit a record of their own into the shared pool
    assert [v.num_tiles for v in row.layers.values()] == [4] * LAYERS
    assert row.table[:3] == source.table[:3] and row.table[3] != source.table[3]
    assert_same_row(row, source)
    source.release()
    row.release()
    assert pool.records.num_held == pool.sinks.num_held == 0


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_a_row_rebuilt_from_its_first_blocks_is_the_row_at_that_token(count):
    """A hit of a chain's first ``count`` blocks rebuilds the row at token count*G byte for byte
    (the sink, ``count - 1`` records, an empty tail), and it continues identically across tile
    boundaries."""
    rng = np.random.default_rng(count)
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, fed = filled(pool, 5 * G + 7, seed=count)  # sink + 4 records + a 7-token tail: 5 whole blocks
    chain = cache_row(tier, source, 5, list(range(1000)))
    hits = tier.lookup(chain[:count])
    assert len(hits) == count
    row = PagedRow(pool, range(LAYERS))
    tier.adopt(tier.pin(hits), row)
    reference = fed_alone(fed, count * G)
    for view in row.layers.values():
        assert (view.offset, view.num_tiles, view.tail_len) == (count * G, count - 1, 0)
    assert_same_row(row, reference)
    extend([row, reference], rng, 2 * G + 5)
    assert [v.tail_len for v in row.layers.values()] == [5] * LAYERS
    assert_same_row(row, reference)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_row_restored_inside_its_first_chunk_continues_like_the_original(count):
    """Every chunk attends with decode's view, so a row restored from the blocks of its first
    chunk (sink and records) that takes the rest of that chunk holds byte for byte what the row
    that took the prompt at once holds: the same sink, records and tail."""
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    whole, fed = filled(pool, 4 * G + 20)
    chain = cache_row(tier, whole, count, list(range(1000)))
    row = PagedRow(pool, range(LAYERS))
    tier.adopt(tier.pin(tier.lookup(chain)), row)
    for l, (k, v) in enumerate(fed):
        view = row.layers[l]
        assert view.offset == count * G and view.chunk is None
        view.update_and_fetch(k[:, :, count * G:], v[:, :, count * G:])
        assert view.offset == whole.layers[l].offset and view.chunk.start == count * G
    assert_same_row(row, whole)


@pytest.mark.parametrize("tokens,most", [(0, 0), (G - 1, 0), (G, 1), (2 * G - 1, 1), (2 * G, 2)])
def test_a_row_offers_only_whole_blocks(tokens, most):
    """A row's whole blocks are its sink once it holds G tokens and its committed records; a
    record not yet committed has no block to offer."""
    pool = KVarNPool(LAYOUT, LAYERS)
    row = filled(pool, tokens)[0] if tokens else PagedRow(pool, range(LAYERS))
    records = max(most - 1, 0)
    assert all(view.num_tiles == records and (view.offset >= G) == (most > 0) for view in row.layers.values())
    assert [row.record_block(i) for i in range(records + 1)] == row.table + [None]
    assert len(row.table) == records == pool.records.num_held


def test_blocks_are_taken_and_loaded_in_order_only():
    """A row takes record blocks in order (never past a missing one); a block read from disk is
    cached only after its parent, block 0 only as a sink and later blocks only as records."""
    pool = KVarNPool(LAYOUT, LAYERS)
    row = PagedRow(pool, range(LAYERS))
    with pytest.raises(ValueError, match="before record 0"):
        row.blocks_for(1, 1)
    assert row.blocks_for(0, 2) == row.table and len(row.table) == 2
    source, _ = filled(pool, 3 * G)
    tier = PoolTier(pool)
    chain = cache_row(tier, source, 3, list(range(1000)))
    parts = [tier.parts(SinkOf(source))] + [tier.parts(b) for b in source.table]
    fresh = PoolTier(KVarNPool(LAYOUT, LAYERS))
    assert fresh.load(None, [(chain[0], parts[1])]) == (0, chain[0].key)  # a record as block 0
    assert fresh.load(chain[0], [(chain[1], parts[1])]) == (0, None)  # its parent is not cached
    assert fresh.load(None, [(chain[0], parts[0]), (chain[1], parts[0])]) == (1, chain[1].key)  # a sink as block 1
    assert fresh.load(chain[0], [(chain[1], parts[1]), (chain[2], parts[2])]) == (2, None)
    assert len(fresh) == 3


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


# the disk format of one block, per layer (H heads, D = S*W channels; here S = 1, W = D)
SINK_PARTS = [((1, H, G, D), "<f2")] * 2
RECORD_PARTS = [((1, H, 1, D, G * LAYOUT.key_bits // 32), "<u4"), ((1, H, 1, D, 1), "<f2"), ((1, H, 1, D, 1), "<f2"),
                ((1, H, 1, G), "<f2"), ((1, H, 1, G, D * LAYOUT.value_bits // 32), "<u4"), ((1, H, 1, G, 1), "<f2"),
                ((1, H, 1, G, 1), "<f2"), ((1, H, 1, D), "<f2")]


def test_disk_payloads_are_the_single_tile_format_and_load_into_a_fresh_pool():
    rng = np.random.default_rng(9)
    pool = KVarNPool(LAYOUT, LAYERS)
    tier = PoolTier(pool)
    source, fed = filled(pool, 4 * G + 3)
    chain = cache_row(tier, source, 4, list(range(1000)))
    parts = [tier.parts(SinkOf(source))] + [tier.parts(b) for b in source.table[:3]]
    for i, block_parts in enumerate(parts):  # the documented layout, holding the pool's bytes
        kind, layout = ("sink", SINK_PARTS) if i == 0 else ("record", RECORD_PARTS)
        assert [p.name.split(".")[0] for p in block_parts] == [kind] * len(layout) * LAYERS
        assert [(p.shape, p.dtype) for p in block_parts] == layout * LAYERS
        for l, a in enumerate(pool.layers):
            mine = block_parts[len(layout) * l: len(layout) * (l + 1)]
            if i == 0:
                want = [x[source.slot, :, :G].astype(mx.float16) for x in (a.win_k, a.win_v)]
            else:
                want = [a.records[name][source.table[i - 1]] for name in RECORD_FIELDS]
            for part, array in zip(mine, want, strict=True):
                assert part.data == np.ascontiguousarray(np.array(array)).tobytes()
    fresh = KVarNPool(LAYOUT, LAYERS)  # a restart: a new pool, shapes learnt from the blocks
    loaded = PoolTier(fresh)
    assert loaded.load(chain[0], list(zip(chain[1:3], parts[1:3]))) == (0, None)  # its parent is not cached
    wrong = [Part(p.name, p.dtype, p.shape[::-1], p.data) for p in parts[2]]  # verified bytes, wrong shapes
    assert loaded.load(None, list(zip(chain[:4], [parts[0], parts[1], wrong, parts[3]]))) == (2, chain[2].key)
    assert fresh.sinks.oldest_cached()[0] > max(fresh.records.cached.values())  # the head is evicted last
    assert loaded.load(chain[1], list(zip(chain[2:4], parts[2:4]))) == (2, None)  # one copy, one scatter a field
    assert fresh.records.num_cached == 3 and fresh.sinks.num_cached == 1 and fresh.records.num_held == 0
    assert fresh.shapes == [(H, D)] * LAYERS
    row = PagedRow(fresh, range(LAYERS))
    loaded.adopt(loaded.pin(loaded.lookup(chain)), row)
    want = fed_alone(fed, 4 * G)
    assert_same_row(row, want)
    extend([row, want], rng, 2 * G + 5)
    assert [view.num_tiles for view in row.layers.values()] == [5] * LAYERS
    assert_same_row(row, want)
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
