"""Paged KVarN rows, the one KVarN storage (kvarn/paged.py, its decode step in
kvarn/decode_graph.py): a row holds exactly what its tokens determine (sink and tail rotated and
rounded to float16, each record the quantizer's bytes for its tile: ``tests/kvarn/row_contents.py``),
so byte-identical whatever the chunking and batching; one graph per layer for a whole decode
batch equal to each row alone and to a float64 reference; windows kept consecutive for a batch;
forks that allocate no record bytes; tail-only trims; snapshots that restore bit-exactly. The
pool and its allocator: tests/kvarn/test_pool.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow
from kvarn.paged import PagedBatch
from tests.kvarn.row_contents import paged_attention
from kvarn.pool import RECORD_FIELDS, KVarNPool
from kvarn.rows import RowStore
from tests.kvarn.row_contents import Fed, assert_row_holds, assert_same_bytes, reference_decode, row_contents
from tests.metal.cases import max_rel_error

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)
SCALE = D ** -0.5
# On the CPU: max |a - b| / max |b| of float32 decode attention vs float64 (measured 1.3e-6), and of
# the same attention by two float32 paths (batched vs alone, chunk vs decode). MLX's CUDA backend
# runs float32 matmuls as TF32 (a 10-bit mantissa): there two paths summing in other orders differ
# ~2.5e-4 (H100), so the bounds are TF32's.
ON_CPU = mx.default_device() == mx.cpu
DECODE_TOL = 1.5e-5 if ON_CPU else 2e-3
NOISE = 2e-5 if ON_CPU else 2e-3


def kv(rng: np.random.Generator, n: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    shape = (rows, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def one_row(layout: KVLayout = LAYOUT) -> PagedLayer:
    """Layer 0 of a row of a one-layer pool of its own."""
    return PagedRow(KVarNPool(layout, 1), [0]).layers[0]


CHUNKINGS = {"whole": (300,), "ones": (1,) * 300, "sevens": (7,) * 42 + (6,), "hundreds": (100,) * 3,
             "sink-then-rest": (64, 236), "ragged": (5, 59, 1, 200, 35), "mid-tile": (130, 170)}


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_a_row_holds_what_its_tokens_determine_however_the_prompt_is_chunked(chunks):
    """300 tokens in chunks of any sizes (one token at a time too: decode): after every chunk the
    row holds exactly its tokens' sink, tail and records (the quantizer's bytes for each tile), so
    byte-identical to the whole prompt's row, priced by ``layout.sequence_bytes``; every token's
    attention equals the whole prompt's at its position, and a lone decode token's equals the
    float64 reference over the row's contents."""
    rng = np.random.default_rng(1)
    k_all, v_all = kv(rng, 300)
    q_all = mx.array(rng.standard_normal((1, 4, 300, D)).astype(np.float32))
    whole = one_row()
    whole.update_and_fetch(k_all, v_all)
    want = np.array(paged_attention(q_all, whole, SCALE, "causal"))
    view = one_row()
    outs, start, worst = [], 0, 0.0
    for n in chunks:
        end = start + n
        view.update_and_fetch(k_all[:, :, start: end], v_all[:, :, start: end])
        q = q_all[:, :, start: end]
        outs.append(np.array(paged_attention(q, view, SCALE, "causal" if n > 1 else None)))
        if n == 1 and start > 0:
            worst = max(worst, max_rel_error(outs[-1], reference_decode(q, [view], SCALE)))
        if len(chunks) < 50 or end % 50 == 0:
            assert_row_holds(view, k_all[:, :, :end], v_all[:, :, :end])
        start = end
    assert worst < DECODE_TOL
    assert max_rel_error(np.concatenate(outs, axis=2), want) < NOISE
    assert view.num_tiles == 3
    assert_same_bytes(row_contents(view), row_contents(whole))


def test_one_decode_graph_for_ragged_rows_equals_each_row_alone():
    """Rows of 5, 63, 130 and 300 tokens (one joins late, one leaves early; sinks fill and tiles
    commit at different steps) decode 150 steps as one batch: every step's attention equals the
    same row decoding alone (a pool of its own) and, every 10 steps, the float64 reference; the
    rows end holding exactly their tokens, byte-identical to the rows decoded alone."""
    rng = np.random.default_rng(3)
    starts = [5, 63, 130, 300]
    pool = KVarNPool(LAYOUT, num_layers=1)
    views = [PagedRow(pool, [0]).layers[0] for _ in starts]
    alone = [one_row() for _ in starts]
    fed = [Fed() for _ in starts]
    for n, view, solo, tokens in zip(starts, views, alone, fed):
        k, v = kv(rng, n)
        view.update_and_fetch(k, v)
        solo.update_and_fetch(k, v)
        tokens.add(k, v)
    live = [0, 1, 2]
    batch = PagedBatch([views[i] for i in live])
    worst, worst_ref = 0.0, 0.0
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
        out = np.array(paged_attention(q, batch, SCALE, None))
        if step % 10 == 0:
            worst_ref = max(worst_ref, max_rel_error(out, reference_decode(q, batch.rows, SCALE)))
        for b, i in enumerate(live):
            alone[i].update_and_fetch(k[b: b + 1], v[b: b + 1])
            fed[i].add(k[b: b + 1], v[b: b + 1])
            want = np.array(paged_attention(q[b: b + 1], alone[i], SCALE, None))
            worst = max(worst, float(np.abs(out[b: b + 1] - want).max()))
    assert worst < NOISE and worst_ref < DECODE_TOL, (worst, worst_ref)
    for view, solo, tokens in zip(views, alone, fed):
        assert view.num_tiles > 0
        assert_row_holds(view, *tokens.all())
        assert_same_bytes(row_contents(view), row_contents(solo))


def test_fork_allocates_no_record_bytes_and_diverges_without_touching_the_parent():
    rng = np.random.default_rng(4)
    pool = KVarNPool(LAYOUT, num_layers=2)
    parent = PagedRow(pool, [0, 1])
    k, v = kv(rng, 3 * G + 10)
    for l in (0, 1):
        parent.layers[l].update_and_fetch(k, v)
    held = pool.records.num_held
    child_cache = RowStore.fork([parent.layers[0], parent.layers[1]])
    child = child_cache[0].row
    assert child_cache[1].row is child and child is not parent
    assert pool.records.num_held == held and child.table == parent.table
    assert all(pool.records.refs[b] == 2 for b in parent.table)
    assert child.slot != parent.slot and pool.windows.num_held == 2
    fed = Fed()
    fed.add(k, v)
    for _ in range(2 * G):  # the child commits two records of its own
        k1, v1 = kv(rng, 1)
        for l in (0, 1):
            child_cache[l].update_and_fetch(k1, v1)
        fed.add(k1, v1)
    assert child_cache[0].num_tiles == parent.layers[0].num_tiles + 2 and pool.records.num_held == held + 2
    assert child.table[: len(parent.table)] == parent.table
    for l in (0, 1):
        assert_row_holds(parent.layers[l], k, v)
        assert_row_holds(child_cache[l], *fed.all())
    child.release()
    assert pool.records.num_held == held and all(pool.records.refs[b] == 1 for b in parent.table)
    parent.release()
    parent.release()  # idempotent
    assert pool.records.num_held == 0 and pool.windows.num_held == 0


def test_fork_of_a_short_row_fills_its_own_sink():
    rng = np.random.default_rng(5)
    pool = KVarNPool(LAYOUT, num_layers=1)
    parent = PagedRow(pool, [0])
    k, v = kv(rng, 10)
    parent.layers[0].update_and_fetch(k, v)
    child = parent.fork()
    assert child.slot != parent.slot
    fed = Fed()
    fed.add(k, v)
    for _ in range(G):
        k1, v1 = kv(rng, 1)
        child.layers[0].update_and_fetch(k1, v1)
        fed.add(k1, v1)
    assert_row_holds(parent.layers[0], k, v)
    assert child.layers[0].offset == 10 + G and child.layers[0].num_tiles == 0
    assert_row_holds(child.layers[0], *fed.all())


def test_trim_removes_only_tail_tokens_and_the_row_goes_on_as_if_never_fed_them():
    """Tokens in the sink or a committed record stay; trimmed tail tokens are gone: a row trimmed
    and fed new tokens holds what a row fed only the kept and new tokens holds."""
    rng = np.random.default_rng(11)
    short = one_row()
    short.update_and_fetch(*kv(rng, 40))
    assert short.trim(5) == 0 and short.offset == 40  # all in the sink
    view = one_row()
    k, v = kv(rng, 3 * G + 10)
    view.update_and_fetch(k, v)
    records = {n: x for n, x in row_contents(view).items() if n in RECORD_FIELDS}
    assert view.is_trimmable() and view.trim(15) == 10
    assert (view.offset, view.tail_len, view.num_tiles) == (3 * G, 0, 2)
    assert all(row_contents(view)[n].tobytes() == x.tobytes() for n, x in records.items())
    assert view.trim(1) == 0
    k2, v2 = kv(rng, G + 3)
    view.update_and_fetch(k2, v2)
    assert_row_holds(view, mx.concatenate([k[:, :, : 3 * G], k2], axis=2),
                     mx.concatenate([v[:, :, : 3 * G], v2], axis=2))


def test_a_snapshot_restores_a_row_bit_exactly_and_it_continues_identically():
    """A two-layer row mid-decode is snapshotted, its arrays copied out (as to disk) and restored
    into a fresh row of another pool: it holds the same bytes, and fed the same tokens (a record
    commits on the way) both attend identically and end byte-identical."""
    rng = np.random.default_rng(12)
    live = PagedRow(KVarNPool(LAYOUT, 2), [0, 1])
    k, v = kv(rng, 2 * G + 50)
    for l in (0, 1):
        live.layers[l].update_and_fetch(k, v)
    for _ in range(5):
        k1, v1 = kv(rng, 1)
        for l in (0, 1):
            live.layers[l].update_and_fetch(k1, v1)
    meta, arrays = live.snapshot()
    assert meta["records"] == 1 and meta["written"] == [0, 1]
    copied = [mx.array(np.array(a)) for a in arrays]
    fresh = PagedRow(KVarNPool(LAYOUT, 2), [0, 1])
    fresh.restore(meta, copied)
    for l in (0, 1):
        assert_same_bytes(row_contents(fresh.layers[l]), row_contents(live.layers[l]))
        assert fresh.layers[l].nbytes == live.layers[l].nbytes
    for _ in range(20):  # the tail fills at the 9th: a record commits in both
        k1, v1 = kv(rng, 1)
        q = mx.array(rng.standard_normal((1, 4, 1, D)).astype(np.float32))
        for l in (0, 1):
            outs = []
            for row in (live, fresh):
                row.layers[l].update_and_fetch(k1, v1)
                outs.append(np.array(paged_attention(q, row.layers[l], SCALE, None)))
            assert np.array_equal(*outs)
    for l in (0, 1):
        assert fresh.layers[l].num_tiles == 2
        assert_same_bytes(row_contents(fresh.layers[l]), row_contents(live.layers[l]))
    with pytest.raises(ValueError, match="fresh row"):
        fresh.restore(meta, copied)
    with pytest.raises(ValueError, match="missing arrays"):
        PagedRow(KVarNPool(LAYOUT, 2), [0, 1]).restore(meta, copied[:-1])
    with pytest.raises(ValueError, match="other layers"):
        PagedRow(KVarNPool(LAYOUT, 2), [0]).restore(meta, copied)


def test_float32_windows_hold_the_same_float16_values_and_price_exactly():
    """Where the compute dtype is float32 (the CPU), sink and tail are held as float32: the same
    float16-rounded values (so the same attention and records as float16 windows), priced by the
    layout."""
    rng = np.random.default_rng(8)
    layout32 = LAYOUT.with_storage_dtype("float32")
    view = one_row(layout32)
    view16 = one_row()
    fed = Fed()
    for n in (100, 90, 1, 1, 70):
        k, v = kv(rng, n)
        view.update_and_fetch(k, v)
        view16.update_and_fetch(k, v)
        fed.add(k, v)
        q = mx.array(rng.standard_normal((1, 4, n, D)).astype(np.float32))
        got = paged_attention(q, view, SCALE, "causal" if n > 1 else None)
        want = paged_attention(q, view16, SCALE, "causal" if n > 1 else None)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=NOISE, rtol=1e-5)
    a = view.row.pool.layers[0]
    assert a.win_k.dtype == mx.float32 and view16.row.pool.layers[0].win_k.dtype == mx.float16
    assert_row_holds(view, *fed.all())  # float16 values in the float32 window (row_contents checks)
    assert_same_bytes(row_contents(view), row_contents(view16))
    assert view.nbytes == layout32.sequence_bytes(view.offset, D, H) == view16.nbytes + 4 * G * H * D * 2


def test_a_decode_batch_gets_consecutive_windows_in_batch_order_and_keeps_its_tokens():
    """Rows whose windows are scattered (others ended, a row still prefilling sits in the way)
    are moved so the batch's windows are one range in batch order; every row keeps its tokens
    (each holds exactly what it was fed; attention equals the same rows alone and the float64
    reference) and the allocator's counts follow the moves."""
    rng = np.random.default_rng(9)
    pool = KVarNPool(LAYOUT, num_layers=1)
    rows = [PagedRow(pool, [0]) for _ in range(6)]  # windows 1..6
    alone, fed = {}, {}
    for i in (0, 2, 3, 4, 5):
        k, v = kv(rng, 40 + 30 * i)
        rows[i].layers[0].update_and_fetch(k, v)
        alone[i] = one_row()
        alone[i].update_and_fetch(k, v)
        fed[i] = Fed()
        fed[i].add(k, v)
    rows[1].release()  # window 2 free; rows[4] (window 5) is "still prefilling"
    order = [5, 0, 3, 2]
    batch = PagedBatch([rows[i].layers[0] for i in order])
    k, v = kv(rng, 1, rows=4)
    q = mx.array(rng.standard_normal((4, 4, 1, D)).astype(np.float32))
    batch.update_and_fetch(k, v)
    out = np.array(paged_attention(q, batch, SCALE, None))
    lo = min(rows[i].slot for i in order)
    assert [rows[i].slot for i in order] == [lo, lo + 1, lo + 2, lo + 3] and batch.decoding.windows == (lo, lo + 4)
    assert len({r.slot for r in rows if not r.released}) == 5 and pool.windows.num_held == 5
    assert all(pool.window_rows[r.slot] is r for r in rows if not r.released)
    assert max_rel_error(out, reference_decode(q, batch.rows, SCALE)) < DECODE_TOL
    for b, i in enumerate(order):
        alone[i].update_and_fetch(k[b: b + 1], v[b: b + 1])
        fed[i].add(k[b: b + 1], v[b: b + 1])
        want = np.array(paged_attention(q[b: b + 1], alone[i], SCALE, None))
        np.testing.assert_allclose(out[b: b + 1], want, atol=NOISE)
        assert_row_holds(rows[i].layers[0], *fed[i].all())
        assert_same_bytes(row_contents(rows[i].layers[0]), row_contents(alone[i]))
    assert_row_holds(rows[4].layers[0], *fed[4].all())  # the prefilling row's window moved with it


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


