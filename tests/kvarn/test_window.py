"""Attention windows (``--max-kv-size``, kvarn/window.py, kvarn/rotating.py): which records a
windowed KVarN token attends, paged rows that drop whole blocks and hold flat bytes, prompt
chunks that see exactly what decode would, batches and forks of windowed rows, and the rotating
fp16 / affine windows against mlx-lm's own ``RotatingKVCache``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import RotatingKVCache

from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow
from kvarn.paged import PagedBatch
from tests.kvarn.row_contents import paged_attention
from kvarn.pool import RECORD_FIELDS, KVarNPool, dequantize_blocks
from kvarn.rotating import AffineRotatingKVCache, FP16RotatingKVCache, make_window_cache
from kvarn.window import committed_records, evicted_records
from tests.kvarn import reference as R

H, D, G = 2, 128, 64
SCALE = D ** -0.5
WINDOWS = [2 * G, 4 * G, 4 * G + 10, 5 * G - 1]


def layout(window: int | None) -> KVLayout:
    return KVLayout.kvarn("k4v2", tile_size=G).with_window(window)


def kv(rng: np.random.Generator, n: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    shape = (rows, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def queries(rng: np.random.Generator, n: int, rows: int = 1) -> mx.array:
    return mx.array(rng.standard_normal((rows, 2 * H, n, D)).astype(np.float32))


def span(num_tokens: int, window: int) -> int:
    """Tokens the newest of ``num_tokens`` attends: the sink, the kept records, the tail."""
    c = committed_records(num_tokens, G)
    tail = num_tokens - G - c * G if num_tokens > G else 0
    return min(num_tokens, G) + (c - evicted_records(num_tokens, window, G)) * G + tail


@pytest.mark.parametrize("window", WINDOWS)
def test_a_token_attends_at_most_the_window_and_evictions_never_come_back(window):
    previous = 0
    for n in range(1, 12 * G):
        e = evicted_records(n, window, G)
        assert e >= previous  # a record dropped for one token is never needed again
        previous = e
        assert span(n, window) <= window
        if n >= window:  # whole tiles only: the span stays within one tile of the window
            assert span(n, window) > window - G
        else:
            assert e == 0 and span(n, window) == n
    assert evicted_records(10**6, None, G) == 0


def test_layout_windows_are_validated_and_named():
    assert KVLayout.kvarn("k4v2").with_window(256).name == "kvarn-k4v2-g128-w256"
    assert KVLayout.fp16().with_window(8).name == "fp16-float16-w8"
    for bad in (255, 0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_kv_size"):
            KVLayout.kvarn("k4v2").with_window(bad)
    with pytest.raises(ValueError, match="max_kv_size"):
        KVLayout.affine(4).with_window(4)
    assert KVLayout.fp16().with_window(5).max_kv_size == 5
    plain = KVLayout.kvarn("k4v2")
    assert "max_kv_size" not in plain.describe("f")  # unwindowed verdicts and stamps are what they were
    stamps = {plain.stamp("f"), plain.with_window(512).stamp("f"), plain.with_window(1024).stamp("f")}
    assert len(stamps) == 3 and plain.with_window(512).describe("f")["max_kv_size"] == 512


def run_paged(window: int, chunks: list[int], K: mx.array, V: mx.array, Q: mx.array):
    """Feed a windowed paged row ``chunks``; returns every token's attention and the row, and
    checks after each write that the table holds what the newest token attends (nothing more
    once a chunk is done) and at most (N - G) // G blocks."""
    pool = KVarNPool(layout(window), num_layers=1)
    row = PagedRow(pool, [0], window)
    view, outs, p = row.layers[0], [], 0
    for c in chunks:
        view.update_and_fetch(K[:, :, p: p + c], V[:, :, p: p + c])
        out = paged_attention(Q[:, :, p: p + c], view, SCALE, "causal" if c > 1 else None)
        mx.eval(out)
        outs.append(out)
        p += c
        row.evict()  # the engine's RowStore.settle after a chunk (decode evicts at the next step)
        assert row.first == evicted_records(p + 1, window, G)
        assert len(row.table) == view.num_tiles - row.first <= (window - G) // G
        assert pool.records.num_held == len(row.table)
    return mx.concatenate(outs, axis=2), row


def records(view: PagedLayer, blocks: list[int]) -> dict[str, np.ndarray]:
    """The record fields of ``blocks`` of a view's layer (block-major, in that order)."""
    fields = view.row.pool.gather_records(view.l, mx.array(blocks, dtype=mx.int32))
    return {name: np.array(fields[name]) for name in RECORD_FIELDS}


@pytest.mark.parametrize("window", [2 * G, 4 * G + 10])
def test_prompt_chunks_see_what_decode_sees_and_the_window_rule_holds(window):
    """A prompt well past the window, whole, in ragged chunks or token by token: the same
    attention for every token (the same records and float16 window; chunks attend window by
    window); the records kept are the unwindowed row's, byte for byte, and every token attends
    exactly the sink, records ``[evicted_records, committed)`` and its tail (float64 reference)."""
    rng = np.random.default_rng(11)
    T = 9 * G + 7
    K, V = kv(rng, T)
    Q = queries(rng, T)
    decoded, row = run_paged(window, [1] * T, K, V, Q)
    assert row.first > 0 and row.layers[0].offset == T
    for chunks in ([T], [100, 300, T - 400], [3 * G, 5, 1, 1, T - 3 * G - 7]):
        chunked, _ = run_paged(window, chunks, K, V, Q)
        np.testing.assert_allclose(np.array(chunked), np.array(decoded), atol=5e-5, rtol=1e-5)
    plain = PagedRow(KVarNPool(layout(None), num_layers=1), [0]).layers[0]
    plain.update_and_fetch(K, V)
    c = committed_records(T, G)
    assert plain.num_tiles == c and row.first + len(row.table) == c
    kept, same = records(row.layers[0], row.table), records(plain, plain.row.table[row.first:])
    assert all(kept[name].tobytes() == same[name].tobytes() for name in RECORD_FIELDS)
    fields = plain.row.pool.gather_records(0, mx.array([plain.row.table], dtype=mx.int32))
    rec_k, rec_v = (np.array(x)[0] for x in dequantize_blocks(fields, plain.layout, mx.float32))  # [H, c*G, D]
    k_rot, v_rot = (R.rotate(np.array(x)[0]).astype(np.float16) for x in (K, V))  # [H, T, D]
    q = np.array(Q)[0].astype(np.float64)
    want = np.zeros(q.shape)
    for p in range(T):
        n = p + 1
        done, gone = committed_records(n, G), evicted_records(n, window, G)
        tail = slice(G + done * G, n) if n > G else slice(0, 0)
        for h in range(H):
            heads = slice(2 * h, 2 * h + 2)
            recs = [(rec_k[h, r * G: (r + 1) * G], rec_v[h, r * G: (r + 1) * G]) for r in range(gone, done)]
            want[heads, p] = R.reference_attention(q[heads, p: p + 1], k_rot[h, : min(n, G)], v_rot[h, : min(n, G)],
                                                   recs, k_rot[h, tail], v_rot[h, tail], SCALE)[:, 0]
    np.testing.assert_allclose(np.array(decoded)[0], want, atol=5e-5, rtol=1e-5)


def test_a_window_not_yet_reached_is_the_unwindowed_row():
    rng = np.random.default_rng(12)
    T = 6 * G + 3
    K, V = kv(rng, T)
    Q = queries(rng, T)
    windowed, row = run_paged(8 * G, [200, T - 200], K, V, Q)
    pool = KVarNPool(layout(None), num_layers=1)
    plain = PagedRow(pool, [0]).layers[0]
    plain.update_and_fetch(K, V)
    want = paged_attention(Q, plain, SCALE, "causal")
    np.testing.assert_allclose(np.array(windowed), np.array(want), atol=5e-5, rtol=1e-5)
    assert row.first == 0 and row.table == plain.row.table[: len(row.table)]


def test_a_windowed_row_decoding_far_past_its_window_holds_flat_bytes():
    """Decode 8x the window: the pool's held blocks and the row's nbytes never exceed the
    window's (sink + (N - G) // G records + tail), the pool's arrays stop growing once the
    window is full, and every evicted block went back to the free queue."""
    rng = np.random.default_rng(13)
    window = 4 * G
    pool = KVarNPool(layout(window), num_layers=1)
    row = PagedRow(pool, [0], window)
    view = row.layers[0]
    k, v = kv(rng, 100)
    view.update_and_fetch(k, v)
    held, arrays = [], []
    for _ in range(8 * window):
        k, v = kv(rng, 1)
        view.update_and_fetch(k, v)
        mx.eval(paged_attention(queries(rng, 1), view, SCALE, None))
        held.append(pool.records.num_held)
        arrays.append(pool.nbytes())
    most = (window - G) // G
    assert max(held) == most and min(held[3 * window:]) == most - 1  # whole tiles: N - G < span <= N
    assert len(set(arrays[window:])) == 1  # the pool stopped growing
    assert view.nbytes == 4 * G * H * D * pool.window_dtype.size + len(row.table) * pool.block_bytes()
    assert row.first == view.num_tiles - len(row.table) > 20
    row.release()
    assert pool.records.num_held == 0 and len(pool.records.free) == pool.records.capacity - 1


def test_windowed_rows_decode_as_one_batch_as_each_alone_and_forks_share_their_blocks():
    """Rows of different lengths and windows' phases in one decode graph equal each alone (a
    windowed row in a pool of its own), through evictions, a fork that shares its parent's
    blocks and drops them on its own, and rows joining and leaving."""
    rng = np.random.default_rng(14)
    window = 4 * G + 10
    pool = KVarNPool(layout(window), num_layers=1)
    starts = [5, 200, 4 * G, 7 * G + 3]
    rows = [PagedRow(pool, [0], window) for _ in starts]
    alone = [PagedRow(KVarNPool(layout(window), num_layers=1), [0], window) for _ in starts]
    for n, row, single in zip(starts, rows, alone):
        k, v = kv(rng, n)
        for r in (row, single):
            r.layers[0].update_and_fetch(k, v)
            r.evict()
    child = rows[3].fork()
    assert child.table == rows[3].table and child.first == rows[3].first
    assert all(pool.records.refs[b] == 2 for b in child.table)
    rows.append(child)
    alone.append(alone[3].fork())
    views = [r.layers[0] for r in rows]
    live = [0, 1, 2, 3, 4]
    batch = PagedBatch([views[i] for i in live])
    worst = 0.0
    for step in range(3 * G):
        if step == 100:
            batch.filter([0, 2, 3, 4])
            live = [0, 2, 3, 4]
        k, v = kv(rng, 1, rows=len(live))
        q = queries(rng, 1, rows=len(live))
        batch.update_and_fetch(k, v)
        out = paged_attention(q, batch, SCALE, None)
        for b, i in enumerate(live):
            single = alone[i].layers[0]
            single.update_and_fetch(k[b: b + 1], v[b: b + 1])
            want = paged_attention(q[b: b + 1], single, SCALE, None)
            worst = max(worst, float(mx.max(mx.abs(out[b: b + 1] - want))))
    assert worst < 5e-5
    assert not set(child.table) & set(rows[3].table)  # both replaced the shared blocks with their own
    for r, single in zip(rows, alone):
        assert len(r.table) <= (window - G) // G
        assert (r.first, len(r.table), r.layers[0].offset) == (single.first, len(single.table), single.layers[0].offset)
        mine, theirs = records(r.layers[0], r.table), records(single.layers[0], single.table)
        assert all(mine[name].tobytes() == theirs[name].tobytes() for name in RECORD_FIELDS)
    assert pool.records.num_held == len({b for r in rows for b in r.table})


# --- fp16 / affine: rotating windows ---

def test_the_fp16_window_is_mlx_lms_rotating_cache_allocated_once():
    rng = np.random.default_rng(15)
    window, capacity = 200, 500
    mine, theirs = FP16RotatingKVCache(window, capacity=capacity), RotatingKVCache(max_size=window, keep=4)
    sizes = []
    for n in [37] + [1] * 300 + [60, 1, 1]:
        k, v = kv(rng, n)
        q = queries(rng, n)
        outs = []
        for cache in (mine, theirs):
            keys, values = cache.update_and_fetch(k, v)
            mask = cache.make_mask(n)
            outs.append(scaled_dot_product_attention(q, keys, values, cache=cache, scale=SCALE, mask=mask))
        assert np.array(outs[0]).tobytes() == np.array(outs[1]).tobytes()
        sizes.append(mine.keys.shape[2])
    assert sizes[1] == window and max(sizes[:301]) == window  # one allocation up to the window, not 256-steps
    assert mine.offset == theirs.offset == 37 + 300 + 62
    assert FP16RotatingKVCache(window, capacity=50).update_and_fetch(*kv(rng, 1))[0].shape[2] == 1
    small = FP16RotatingKVCache(window, capacity=50)
    small.update_and_fetch(*kv(rng, 10))
    small.update_and_fetch(*kv(rng, 1))
    assert small.keys.shape[2] == 50  # a reservation under the window allocates the reservation


def test_the_affine_window_attends_the_fp16_windows_tokens_quantized():
    rng = np.random.default_rng(16)
    window = 150
    fp16, affine = FP16RotatingKVCache(window), make_window_cache(KVLayout.affine(8).with_window(window), 400)
    assert isinstance(affine, AffineRotatingKVCache) and affine.bits == 8
    worst = 0.0
    for n in [40] + [1] * 200 + [30, 1]:
        k, v = kv(rng, n)
        q = queries(rng, n)
        kf, vf = fp16.update_and_fetch(k, v)
        ka, va = affine.update_and_fetch(k, v)
        mask = fp16.make_mask(n)
        want = scaled_dot_product_attention(q, kf, vf, cache=fp16, scale=SCALE, mask=mask)
        got = scaled_dot_product_attention(q, ka, va, cache=affine, scale=SCALE, mask=affine.make_mask(n))
        assert ka[0].shape[2] == kf.shape[2] and affine.offset == fp16.offset
        worst = max(worst, float(mx.max(mx.abs(got - want))))
    assert worst < 0.05  # 8-bit codes of the same tokens (no window, no rotation, would be the same bound)
    child = affine.fork()
    child.update_and_fetch(*kv(rng, 1))
    assert child.offset == affine.offset + 1 and affine.nbytes == child.nbytes
    legs, arrays = affine.snapshot()
    restored = make_window_cache(KVLayout.affine(8).with_window(window), 400)
    restored.restore(legs, arrays)
    assert restored.offset == affine.offset and restored.nbytes == affine.nbytes
