"""Paged KVarN rows (kvarn/allocator.py, kvarn/pool.py, kvarn/paged.py): the allocator's state asserted exactly, rows in
the pool byte-identical to the single-stream ``KVarNKVCache`` whatever the chunking and batching,
one graph per layer for a whole decode batch equal to each row alone, forks that allocate no
record bytes, and prefix-cache blocks that round-trip."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn.attention import kvarn_attention
from kvarn.cache import KVarNKVCache
from kvarn.layout import KVLayout
from kvarn.paged import PagedRow, as_record_arrays, fork_rows
from kvarn.paged_batch import PagedBatch, paged_attention
from kvarn.allocator import BlockAllocator
from kvarn.pool import PAD, KVarNPool, quantize_blocks
from kvarn.record import RecordArrays, quantize_tiles

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)
SCALE = D ** -0.5


def kv(rng: np.random.Generator, n: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    shape = (rows, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def pool_records(view) -> RecordArrays | None:
    if not view.num_tiles:
        return None
    table = mx.array(view.row.table[: view.num_tiles], dtype=mx.int32)
    return as_record_arrays(view.row.pool.gather_records(view.l, table))


def assert_same_row(view, cache: KVarNKVCache) -> None:
    """A paged layer holds byte for byte what the single-stream cache holds."""
    assert (view.offset, view.tail_len, view.num_tiles) == (cache.offset, cache.tail_len, cache.records.num_tiles)
    a = view.row.pool.layers[view.l]
    row = view.row
    pairs = [(a.win_k[row.slot][None, :, : view.sink_len], cache.sink_k[..., : cache.sink_len, :]),
             (a.win_v[row.slot][None, :, : view.sink_len], cache.sink_v[..., : cache.sink_len, :]),
             (a.win_k[row.slot][None, :, G: G + view.tail_len], cache.tail_k[..., : cache.tail_len, :]),
             (a.win_v[row.slot][None, :, G: G + view.tail_len], cache.tail_v[..., : cache.tail_len, :])]
    mine, theirs = pool_records(view), cache.records.view()
    if theirs is not None:
        pairs += [(getattr(mine, f), getattr(theirs, f)) for f in RecordArrays.__dataclass_fields__]
    for x, y in pairs:
        x, y = np.array(x), np.array(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    assert view.nbytes == cache.nbytes


# --- the allocator ---

def test_allocator_counts_free_and_cached_queues_hash_reuse_and_eviction_order():
    a = BlockAllocator(capacity=5)  # ids 1..4 (0 is the pad)
    assert list(a.free) == [1, 2, 3, 4] and a.num_held == 0
    x = a.allocate(3)
    assert x == [1, 2, 3] and a.refs[1:4] == [1, 1, 1] and list(a.free) == [4]
    for block, key in zip(x, "abc"):
        assert a.set_hash(block, key, meta=(block,))
    assert not a.set_hash(1, "z") and a.lookup("z") is None  # it has its hash already
    a.incref([1])  # a second row shares block 1
    a.decref(x)  # the first row ends: released last-first, block 1 is still held
    assert a.refs[1:4] == [1, 0, 0] and list(a.cached) == [3, 2] and list(a.free) == [4]
    assert (a.num_held, a.num_cached) == (1, 2)
    assert a.lookup("b") == 2 and a.lookup("c") == 3 and a.meta_of[2] == (2,)  # cached, still findable
    a.incref([2])  # a prefix hit takes a cached block back
    assert a.refs[2] == 1 and list(a.cached) == [3]
    with pytest.raises(MemoryError):
        a.allocate(2)  # one plain id left: cached blocks are never handed out by allocate
    assert a.allocate(1) == [4] and a.lookup("c") == 3
    assert not a.set_hash(4, "b") and 4 not in a.hash_of  # the same content twice: it stays plain
    assert a.evict() == 3 and a.lookup("c") is None and list(a.free) == [3] and a.evicted == 1
    a.grow(7)  # new ids after the plain free ones
    assert list(a.free) == [3, 5, 6]
    a.decref([2])
    a.decref([1])
    assert list(a.cached) == [2, 1] and a.oldest_cached()[1] == 2
    with pytest.raises(ValueError):
        a.decref([2])
    with pytest.raises(ValueError):
        a.incref([3])  # a plain free block cannot be taken by reference
    with pytest.raises(ValueError):
        a.set_hash(3, "d")  # only a held block gets a hash
    assert a.drop_hashes() == 2 and a.lookup("a") is None and list(a.free) == [3, 5, 6, 2, 1]
    assert a.num_cached == 0 and a.hash_of == {} and a.meta_of == {}


def test_pool_evicts_cached_records_and_sinks_in_one_lru_order_and_caps_its_growth():
    rng = np.random.default_rng(3)
    pool = KVarNPool(LAYOUT, num_layers=1)
    row = PagedRow(pool, [0])
    k, v = kv(rng, 4 * G)
    row.layers[0].update_and_fetch(k, v)  # the sink and 3 records
    b = row.table
    for i, block in enumerate(b):
        pool.records.set_hash(block, f"r{i}")
    sink = pool.save_sink(row.slot)
    pool.sinks.set_hash(sink, "s")
    pool.sinks.decref([sink])  # cached first: the oldest
    row.release()  # its records cached last-first: r2, r1, r0
    bb, sb = pool.block_bytes(), pool.sink_bytes()
    assert pool.cached_bytes() == 3 * bb + sb and pool.held_bytes() == 0
    assert pool.evict_to(3 * bb) == 1 and pool.sinks.lookup("s") is None  # the sink went first
    assert pool.evict_to(bb + 1) == 2 and pool.records.lookup("r0") == b[0]  # then r2, r1
    # at its cap the pool evicts a cached block of the kind it needs instead of growing
    pool.max_blocks["records"] = pool.records.capacity - 1
    free = len(pool.records.free)
    got = pool.allocate("records", free + 1)
    assert b[0] in got and pool.records.lookup("r0") is None
    with pytest.raises(MemoryError):
        pool.allocate("records", 1)


def test_pool_grows_by_doubling_and_keeps_contents():
    rng = np.random.default_rng(0)
    pool = KVarNPool(LAYOUT, num_layers=1)
    rows = [PagedRow(pool, [0]) for _ in range(3)]
    caches = [KVarNKVCache(LAYOUT) for _ in rows]
    for i, (row, cache) in enumerate(zip(rows, caches)):
        k, v = kv(rng, G * (3 + i) + 5)
        row.layers[0].update_and_fetch(k, v)
        cache.update_and_fetch(k, v)
    assert pool.records.capacity >= 1 + 2 + 3 + 4 and pool.windows.capacity >= 4
    assert pool.layers[0].records["k_codes"].shape[0] == pool.records.capacity
    for row, cache in zip(rows, caches):
        assert_same_row(row.layers[0], cache)
    assert sorted(b for r in rows for b in r.table) == list(range(1, 10))


def test_allocator_shrink_drops_only_the_trailing_free_ids():
    a = BlockAllocator(capacity=9)  # ids 1..8
    x = a.allocate(6)
    assert a.set_hash(4, "h")
    a.decref([x[1], x[3], x[4], x[5]])  # 2, 5, 6 plain free; 4 cached
    assert a.shrink() == 5 and a.capacity == 5 and len(a.refs) == 5  # 5..8 were free; 4 is cached
    assert list(a.free) == [2] and list(a.cached) == [4] and a.refs[1:] == [1, 0, 1, 0]
    assert a.allocate(1) == [2] and a.shrink() == 5  # nothing free at the end: unchanged
    a.drop_hashes()
    a.decref([1, 2, 3])
    assert a.shrink() == 1 and a.capacity == 1 and not a.free and a.num_held == 0  # the pad alone
    a.grow(3)
    assert a.allocate(2) == [1, 2]


def test_pool_shrink_releases_the_arrays_past_the_last_id_in_use_and_keeps_the_rest():
    rng = np.random.default_rng(5)
    old_limit = mx.set_cache_limit(0)  # released buffers are freed, not kept: active memory is exact
    try:
        pool = KVarNPool(LAYOUT, num_layers=2)
        rows = [PagedRow(pool, [0, 1]) for _ in range(9)]
        caches = [KVarNKVCache(LAYOUT) for _ in rows]
        for row, cache in zip(rows, caches):
            k, v = kv(rng, 3 * G + 7)
            for l in (0, 1):
                row.layers[l].update_and_fetch(k, v)
            cache.update_and_fetch(k, v)
        mx.eval([x for layer in pool.layers for x in layer.arrays()])
        first = rows[0]
        for row in rows[1:]:
            row.release()
        grown, before = pool.nbytes(), mx.get_active_memory()
        released = pool.shrink()
        mx.synchronize()  # on CUDA a buffer is freed when the work that used it has finished
        assert released > 0 and released == grown - pool.nbytes()
        # MLX's allocator counts a few bytes per buffer beyond nbytes: the old buffers are freed
        assert before - mx.get_active_memory() >= 0.95 * released, (before - mx.get_active_memory(), released)
        assert pool.records.capacity == 1 + max(first.table) and pool.windows.capacity == first.slot + 1
        for l in (0, 1):  # every array at its kind's capacity; the kept row reads what it wrote
            a = pool.layers[l]
            assert a.records["v_c"].shape[0] == pool.records.capacity and a.win_k.shape[0] == pool.windows.capacity
            assert_same_row(first.layers[l], caches[0])
        k, v = kv(rng, G)  # and goes on committing into the shrunk pool, which grows again
        for l in (0, 1):
            first.layers[l].update_and_fetch(k, v)
        caches[0].update_and_fetch(k, v)
        for l in (0, 1):
            assert_same_row(first.layers[l], caches[0])
        first.release()
        pool.shrink()
        assert (pool.records.capacity, pool.windows.capacity, pool.sinks.capacity) == (1, 1, 1)
        window = 4 * H * G * D * pool.window_dtype.size  # the pad ids alone stay
        assert pool.nbytes() == 2 * (pool.block_bytes() // 2 + window + 2 * H * G * D * 2)
    finally:
        mx.set_cache_limit(old_limit)


# --- rows ---

@pytest.mark.parametrize("chunks", [(300,), (64, 236), (5, 59, 1, 200, 35), (130, 170)])
def test_paged_row_is_byte_identical_to_the_single_stream_cache(chunks):
    rng = np.random.default_rng(1)
    pool = KVarNPool(LAYOUT, num_layers=1)
    view = PagedRow(pool, [0]).layers[0]
    cache = KVarNKVCache(LAYOUT)
    for n in chunks:
        k, v = kv(rng, n)
        view.update_and_fetch(k, v)
        cache.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((1, 4, n, D)).astype(np.float32))
        mask = "causal" if n > 1 else None
        got = paged_attention(q, view, SCALE, mask)
        want = kvarn_attention(q, cache, SCALE, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)
        assert_same_row(view, cache)


def test_batched_commit_is_byte_identical_to_a_single_row_commit():
    rng = np.random.default_rng(2)
    tiles_k = mx.array(rng.standard_normal((5, H, G, D)).astype(np.float16))
    tiles_v = mx.array(rng.standard_normal((5, H, G, D)).astype(np.float16))
    batched = as_record_arrays(quantize_blocks(tiles_k, tiles_v, LAYOUT))
    one = [quantize_tiles(tiles_k[i][None, :, None], tiles_v[i][None, :, None], LAYOUT) for i in range(5)]
    for name in RecordArrays.__dataclass_fields__:
        from kvarn.record import TILE_AXIS

        want = mx.concatenate([getattr(r, name) for r in one], axis=TILE_AXIS[name])
        assert np.array(getattr(batched, name)).tobytes() == np.array(want).tobytes()


def test_one_decode_graph_for_ragged_rows_equals_each_row_alone():
    """Rows of 5, 63, 130 and 300 tokens (one joins late, one leaves early; sinks fill and tiles
    commit at different steps) decode 150 steps as one batch: every step's attention equals the
    same row alone in a single-stream cache, and the rows end byte-identical to it."""
    rng = np.random.default_rng(3)
    starts = [5, 63, 130, 300]
    pool = KVarNPool(LAYOUT, num_layers=1)
    views = [PagedRow(pool, [0]).layers[0] for _ in starts]
    alone = [KVarNKVCache(LAYOUT) for _ in starts]
    for n, view, cache in zip(starts, views, alone):
        k, v = kv(rng, n)
        view.update_and_fetch(k, v)
        cache.update_and_fetch(k, v)
    live = [0, 1, 2]
    batch = PagedBatch([views[i] for i in live])
    worst = 0.0
    for step in range(150):
        if step == 30:
            batch.extend([views[3]])
            live.append(3)
        if step == 100:
            batch.filter([0, 2, 3])
            live = [0, 2, 3]
        k, v = kv(rng, 1, rows=len(live))
        q = mx.array(rng.standard_normal((len(live), 4, 1, D)).astype(np.float32))
        assert np.array(batch.offset).tolist() == [views[i].offset for i in live]
        batch.update_and_fetch(k, v)
        out = paged_attention(q, batch, SCALE, None)
        for b, i in enumerate(live):
            alone[i].update_and_fetch(k[b: b + 1], v[b: b + 1])
            want = kvarn_attention(q[b: b + 1], alone[i], SCALE, None)
            worst = max(worst, float(mx.max(mx.abs(out[b: b + 1] - want))))
    assert worst < 2e-5
    for view, cache in zip(views, alone):
        assert view.num_tiles > 0
        assert_same_row(view, cache)


def test_fork_allocates_no_record_bytes_and_diverges_without_touching_the_parent():
    rng = np.random.default_rng(4)
    pool = KVarNPool(LAYOUT, num_layers=2)
    parent = PagedRow(pool, [0, 1])
    solo = [KVarNKVCache(LAYOUT) for _ in range(2)]
    k, v = kv(rng, 3 * G + 10)
    for l in (0, 1):
        parent.layers[l].update_and_fetch(k, v)
        solo[l].update_and_fetch(k, v)
    held = pool.records.num_held
    child_cache = fork_rows([parent.layers[0], parent.layers[1]])
    child = child_cache[0].row
    assert pool.records.num_held == held and child.table == parent.table
    assert all(pool.records.refs[b] == 2 for b in parent.table)
    assert child.slot != parent.slot and pool.windows.num_held == 2
    for _ in range(2 * G):  # the child commits two records of its own
        k1, v1 = kv(rng, 1)
        for l in (0, 1):
            child_cache[l].update_and_fetch(k1, v1)
    assert child_cache[0].num_tiles == parent.layers[0].num_tiles + 2 and pool.records.num_held == held + 2
    for l in (0, 1):
        assert_same_row(parent.layers[l], solo[l])
    child.release()
    assert pool.records.num_held == held and all(pool.records.refs[b] == 1 for b in parent.table)
    parent.release()
    parent.release()  # idempotent
    assert pool.records.num_held == 0 and pool.windows.num_held == 0


def test_fork_of_a_short_row_fills_its_own_sink():
    rng = np.random.default_rng(5)
    pool = KVarNPool(LAYOUT, num_layers=1)
    parent = PagedRow(pool, [0])
    solo = KVarNKVCache(LAYOUT)
    k, v = kv(rng, 10)
    parent.layers[0].update_and_fetch(k, v)
    solo.update_and_fetch(k, v)
    child = parent.fork()
    assert child.slot != parent.slot
    for _ in range(G):
        k1, v1 = kv(rng, 1)
        child.layers[0].update_and_fetch(k1, v1)
    assert_same_row(parent.layers[0], solo)
    assert child.layers[0].offset == 10 + G and child.layers[0].num_tiles == 0


def test_record_writes_by_slice_and_by_scatter_leave_the_same_pool():
    """Consecutive ids are written with one slice update a field on the CPU, others (and id
    arrays, and every write on a GPU) with a scatter: the pools' bytes are the same either way,
    and only the given blocks change."""
    rng = np.random.default_rng(9)
    k, v = kv(rng, 3 * G)
    tiles = quantize_blocks(*(x.reshape(H, 3, G, D).transpose(1, 0, 2, 3).astype(mx.float16) for x in (k, v)), LAYOUT)
    pools = []
    for ids in ([2, 3, 4], mx.array([2, 3, 4], dtype=mx.int32), [4, 2, 6]):
        pool = KVarNPool(LAYOUT, num_layers=1)
        pool.ensure_layer(0, H, D)
        pool.allocate("records", 7)
        before = {n: np.array(a) for n, a in pool.layers[0].records.items()}
        pool.write_records(0, ids, tiles)
        got = {n: np.array(a) for n, a in pool.layers[0].records.items()}
        rows = [int(i) for i in (ids.tolist() if isinstance(ids, mx.array) else ids)]
        for n in got:
            untouched = [i for i in range(got[n].shape[0]) if i not in rows]
            assert np.array_equal(got[n][untouched], before[n][untouched]), n
            assert np.array_equal(got[n][rows], np.array(tiles[n]).astype(got[n].dtype)), n
        pools.append(got)
    assert all(np.array_equal(pools[0][n], pools[1][n]) for n in pools[0])


def test_pad_ids_are_never_handed_out():
    pool = KVarNPool(LAYOUT, num_layers=1)
    rows = [PagedRow(pool, [0]) for _ in range(9)]
    assert PAD not in [r.slot for r in rows]
    rows[0].table += pool.allocate("records", 5)
    assert PAD not in rows[0].table


@pytest.mark.parametrize("bits", [(4, 2), (3, 3), (8, 4)])
def test_stacked_key_value_quantizer_is_byte_identical_to_separate_calls(bits):
    """With G == W (tile 128, 128-channel slices) K and V go through one stacked pass."""
    from kvarn.quantize import quantize_keys, quantize_keys_values, quantize_values

    rng = np.random.default_rng(7)
    k = mx.array((rng.standard_normal((3, 2, 128, 128)) * rng.uniform(0.1, 5, (3, 2, 1, 128))).astype(np.float16))
    v = mx.array(rng.standard_normal((3, 2, 128, 128)).astype(np.float16))
    kt, vt = quantize_keys_values(k, v, bits[0], bits[1], 8)
    want_k, want_v = quantize_keys(k, bits[0], 8), quantize_values(v, bits[1], 8)
    for got, want in ((kt, want_k), (vt, want_v)):
        for name in got.__dataclass_fields__:
            x, y = np.array(getattr(got, name)), np.array(getattr(want, name))
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), name


def test_float32_windows_hold_the_same_float16_values_and_price_exactly():
    """Where the compute dtype is float32 (the CPU), sink and tail are held as float32: the same
    float16-rounded values (so the same attention and records), priced by the layout."""
    rng = np.random.default_rng(8)
    layout32 = LAYOUT.with_storage_dtype("float32")
    pool = KVarNPool(layout32, num_layers=1)
    view = PagedRow(pool, [0]).layers[0]
    cache = KVarNKVCache(LAYOUT)
    for n in (100, 90, 1, 1, 70):
        k, v = kv(rng, n)
        view.update_and_fetch(k, v)
        cache.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((1, 4, n, D)).astype(np.float32))
        got = paged_attention(q, view, SCALE, "causal" if n > 1 else None)
        want = kvarn_attention(q, cache, SCALE, "causal" if n > 1 else None)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)
    a = pool.layers[0]
    assert a.win_k.dtype == mx.float32
    sink = np.array(a.win_k[view.row.slot][None, :, :G])
    assert np.array_equal(sink, np.array(cache.sink_k).astype(np.float32))
    for x, y in zip(as_record_arrays(pool.gather_records(0, mx.array(view.row.table, dtype=mx.int32))).__dict__.values(),
                    cache.records.view().__dict__.values()):
        assert np.array(x).tobytes() == np.array(y).tobytes()
    assert view.nbytes == layout32.sequence_bytes(view.offset, D, H) == cache.nbytes + 4 * G * H * D * 2


def test_a_decode_batch_gets_consecutive_windows_in_batch_order_and_keeps_its_tokens():
    """Rows whose windows are scattered (others ended, a row still prefilling sits in the way)
    are moved so the batch's windows are one range in batch order; every row keeps its tokens
    (attention equals the single-stream caches) and the allocator's counts follow the moves."""
    rng = np.random.default_rng(9)
    pool = KVarNPool(LAYOUT, num_layers=1)
    rows = [PagedRow(pool, [0]) for _ in range(6)]  # windows 1..6
    alone = {}
    for i in (0, 2, 3, 5):
        k, v = kv(rng, 40 + 30 * i)
        rows[i].layers[0].update_and_fetch(k, v)
        alone[i] = KVarNKVCache(LAYOUT)
        alone[i].update_and_fetch(k, v)
    rows[1].release()  # window 2 free; rows[4] (window 5) is "still prefilling"
    order = [5, 0, 3, 2]
    batch = PagedBatch([rows[i].layers[0] for i in order])
    k, v = kv(rng, 1, rows=4)
    q = mx.array(rng.standard_normal((4, 4, 1, D)).astype(np.float32))
    batch.update_and_fetch(k, v)
    out = paged_attention(q, batch, SCALE, None)
    lo = min(rows[i].slot for i in order)
    assert [rows[i].slot for i in order] == [lo, lo + 1, lo + 2, lo + 3] and batch.index.windows == (lo, lo + 4)
    assert len({r.slot for r in rows if not r.released}) == 5 and pool.windows.num_held == 5
    assert all(pool.window_rows[r.slot] is r for r in rows if not r.released)
    for b, i in enumerate(order):
        alone[i].update_and_fetch(k[b: b + 1], v[b: b + 1])
        want = kvarn_attention(q[b: b + 1], alone[i], SCALE, None)
        np.testing.assert_allclose(np.array(out[b: b + 1]), np.array(want), atol=2e-5)
        assert_same_row(rows[i].layers[0], alone[i])


def test_decode_drops_the_rows_last_prompt_chunk():
    """A row's last prompt chunk (its float16 window, kept for the chunk's attention) is let go
    once the row decodes."""
    rng = np.random.default_rng(10)
    pool = KVarNPool(LAYOUT, num_layers=1)
    view = PagedRow(pool, [0]).layers[0]
    view.update_and_fetch(*kv(rng, 200))
    assert view.chunk is not None and view.chunk.window_k.shape[2] == 200 - LAYOUT.tile_size
    PagedBatch([view]).update_and_fetch(*kv(rng, 1))
    assert view.chunk is None


def test_warming_builds_the_decode_commit_for_the_models_heads_once(monkeypatch):
    """Where the fused commit runs, start-up also evaluates the decode commit (its own kernel
    template, by the model's heads) once a process; on the reference path it does not."""
    import kvarn.pool as pool_mod
    from metal.selector import Backend, CommitKernel, Kernels

    layout = KVLayout.kvarn("k4v2", tile_size=64)
    calls = []

    def kernel(*, win_k, win_v, slots, key_bits, value_bits, iters):
        calls.append((win_k.shape, slots.shape, key_bits, value_bits))
        G = win_k.shape[2] // 2
        return pool_mod.quantize_blocks_reference(win_k[slots][:, :, G:], win_v[slots][:, :, G:], layout)

    def tiles(*, keys, values, key_bits, value_bits, iters):
        return pool_mod.quantize_blocks_reference(keys, values, layout)

    monkeypatch.setattr(pool_mod, "_WARMED", set())
    monkeypatch.setattr(pool_mod, "KERNELS", Kernels(backend=None))  # as on a CPU, whatever runs the test
    pool_mod.warm_quantizer(layout, 3, 128, 2)
    assert not calls  # the reference path: nothing but the quantizer buckets
    fused = Backend("CUDA", "cuda-fused", commit=CommitKernel(tiles, kernel), commit_supported=lambda **kw: True)
    monkeypatch.setattr(pool_mod, "KERNELS", Kernels(fused))
    for _ in range(2):
        pool_mod.warm_quantizer(layout, 3, 128, 2)
    # the self-check's window commit (2 heads), then the model's heads' template, once
    assert calls == [((3, 2, 128, 128), (2,), 4, 2), ((1, 3, 128, 128), (1,), 4, 2)]
