"""The KVarN block pool and its allocator (kvarn/allocator.py, kvarn/pool.py): the allocator's
state asserted exactly (counts, free and cached queues, hashes, eviction order, shrinking), the
pool's growth, shrinking and LRU eviction keeping every row's contents, record writes, and the
commit's quantizer (a batch of tiles byte-identical to each tile alone; the warmed templates)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn.allocator import BlockAllocator
from kvarn.layout import KVLayout
from kvarn.paged import PagedRow
from kvarn.pool import PAD, RECORD_FIELDS, KVarNPool, quantize_blocks, quantize_blocks_reference
from tests.kvarn.row_contents import Fed, assert_row_holds

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)


def kv(rng: np.random.Generator, n: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    shape = (rows, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


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
    fed = []
    for i, row in enumerate(rows):
        k, v = kv(rng, G * (3 + i) + 5)
        row.layers[0].update_and_fetch(k, v)
        fed.append((k, v))
    assert pool.records.capacity >= 1 + 2 + 3 + 4 and pool.windows.capacity >= 4
    assert pool.layers[0].records["k_codes"].shape[0] == pool.records.capacity
    for row, (k, v) in zip(rows, fed):
        assert_row_holds(row.layers[0], k, v)
    assert sorted(b for r in rows for b in r.table) == list(range(1, 10))


def test_pool_shrink_releases_the_arrays_past_the_last_id_in_use_and_keeps_the_rest():
    rng = np.random.default_rng(5)
    old_limit = mx.set_cache_limit(0)  # released buffers are freed, not kept: active memory is exact
    try:
        pool = KVarNPool(LAYOUT, num_layers=2)
        rows = [PagedRow(pool, [0, 1]) for _ in range(9)]
        fed = Fed()  # the first row's tokens
        for i, row in enumerate(rows):
            k, v = kv(rng, 3 * G + 7)
            for l in (0, 1):
                row.layers[l].update_and_fetch(k, v)
            if i == 0:
                fed.add(k, v)
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
            assert_row_holds(first.layers[l], *fed.all())
        shrunk = pool.records.capacity
        k, v = kv(rng, G)  # and goes on committing into the shrunk pool, which grows again
        for l in (0, 1):
            first.layers[l].update_and_fetch(k, v)
        fed.add(k, v)
        assert pool.records.capacity > shrunk
        for l in (0, 1):
            assert_row_holds(first.layers[l], *fed.all())
        first.release()
        pool.shrink()
        assert (pool.records.capacity, pool.windows.capacity, pool.sinks.capacity) == (1, 1, 1)
        window = 4 * H * G * D * pool.window_dtype.size  # the pad ids alone stay
        assert pool.nbytes() == 2 * (pool.block_bytes() // 2 + window + 2 * H * G * D * 2)
    finally:
        mx.set_cache_limit(old_limit)


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


def test_batched_commit_is_byte_identical_to_a_single_tile_commit():
    """Five tiles quantized in one call hold the same bytes as each tile quantized alone."""
    rng = np.random.default_rng(2)
    tiles_k = mx.array(rng.standard_normal((5, H, G, D)).astype(np.float16))
    tiles_v = mx.array(rng.standard_normal((5, H, G, D)).astype(np.float16))
    batched = quantize_blocks(tiles_k, tiles_v, LAYOUT)
    one = [quantize_blocks_reference(tiles_k[i: i + 1], tiles_v[i: i + 1], LAYOUT) for i in range(5)]
    for name in RECORD_FIELDS:
        want = mx.concatenate([r[name] for r in one])
        got = np.array(batched[name])
        assert got.shape[0] == 5 and got.dtype == np.array(want).dtype
        assert got.tobytes() == np.array(want).tobytes(), name


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
