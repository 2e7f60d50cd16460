"""A KVarN row in the block pool (kvarn/paged.py, kvarn/pool.py): chunking invariance, exact bytes,
records byte-identical whichever decode batch made them, snapshot round trips, trim. Every
comparison of row contents here is exact (bytes), never a tolerance."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow
from kvarn.paged import PagedBatch
from tests.kvarn.row_contents import paged_attention
from kvarn.pool import RECORD_FIELDS, KVarNPool, quantize_blocks_reference
from kvarn.quantize import rotate

H, D = 2, 128


def tokens(seed: int, n: int, b: int = 1, h: int = H, d: int = D) -> tuple[np.ndarray, np.ndarray]:
    """Raw (unrotated) keys and values [b, h, n, d] with outlier channels and token scales."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k[..., : d // 16] *= 8.0
    k *= np.exp(rng.normal(0, 0.5, (b, h, n, 1))).astype(np.float32)
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    return k, v


def new_row(layout: KVLayout, pool: KVarNPool | None = None) -> PagedLayer:
    """Layer 0 of a fresh row (of a one-layer pool of its own unless ``pool`` is given)."""
    return PagedRow(pool or KVarNPool(layout, 1), [0], layout.max_kv_size).layers[0]


def feed(view: PagedLayer, k: np.ndarray, v: np.ndarray, chunk: int | None = None,
         start: int = 0, stop: int | None = None) -> PagedLayer:
    """Feed tokens [start, stop) in chunks of ``chunk`` (None: all at once)."""
    stop = k.shape[2] if stop is None else stop
    step = (stop - start) if chunk is None else chunk
    for i in range(start, stop, max(step, 1)):
        j = min(i + step, stop)
        view.update_and_fetch(mx.array(k[:, :, i:j]), mx.array(v[:, :, i:j]))
    mx.eval(view.state)
    return view


def contents(view: PagedLayer) -> dict[str, np.ndarray | None]:
    """Everything a row holds that attention reads: its valid sink and tail (the window slot)
    and its committed records (block-major, in table order)."""
    row, pool = view.row, view.row.pool
    a, G = pool.layers[view.l], view.layout.tile_size
    out: dict[str, np.ndarray | None] = {}
    for name, buffer in (("k", a.win_k), ("v", a.win_v)):
        window = None if buffer is None else buffer[row.slot][None]
        out[f"sink_{name}"] = None if window is None else np.array(window[:, :, : view.sink_len])
        out[f"tail_{name}"] = None if window is None else np.array(window[:, :, G: G + view.tail_len])
    blocks = row.table[: view.num_tiles - row.first]
    fields = pool.gather_records(view.l, mx.array(blocks, dtype=mx.int32)) if blocks else None
    for name in RECORD_FIELDS:
        out[name] = None if fields is None else np.array(fields[name])
    return out


def assert_same_row(a: PagedLayer, b: PagedLayer) -> None:
    assert (a.offset, a.tail_len, a.sink_len, a.num_tiles) == (b.offset, b.tail_len, b.sink_len, b.num_tiles)
    assert a.layout == b.layout
    assert a.nbytes == b.nbytes
    ca, cb = contents(a), contents(b)
    for name in ca:
        if ca[name] is None or cb[name] is None:
            assert ca[name] is None and cb[name] is None, name
            continue
        assert ca[name].dtype == cb[name].dtype and ca[name].shape == cb[name].shape, name
        assert np.array_equal(ca[name], cb[name]), name


def assert_records_are_the_reference_quantizers(view: PagedLayer, k: np.ndarray, v: np.ndarray) -> None:
    """Each record holds the pure-MLX quantizer's bytes for its own tile of the rotated float16
    inputs (record r = tokens (r + 1) G .. (r + 2) G - 1)."""
    G, n = view.layout.tile_size, view.num_tiles
    if not n:
        assert contents(view)["k_codes"] is None
        return
    tiles = [rotate(mx.array(x[0, :, G: G + n * G])).astype(mx.float16) for x in (k, v)]  # [H, n*G, D]
    tiles = [t.reshape(t.shape[0], n, G, t.shape[-1]).transpose(1, 0, 2, 3) for t in tiles]  # [n, H, G, D]
    want = quantize_blocks_reference(*tiles, view.layout)
    got = contents(view)
    for name in RECORD_FIELDS:
        assert np.array(want[name]).tobytes() == got[name].tobytes(), name


def lengths(g: int) -> list[int]:
    return [g - 1, g, g + 1, 2 * g - 1, 2 * g, 2 * g + 1, 5 * g + 3]


def expected_counts(n: int, g: int) -> tuple[int, int, int]:
    """(sink_len, num_tiles, tail_len) of a sequence of n tokens."""
    if n <= g:
        return n, 0, 0
    return g, (n - g) // g, (n - g) % g


def decode(view: PagedLayer, k: np.ndarray, v: np.ndarray, i: int, q: mx.array) -> np.ndarray:
    """Token ``i`` written as a lone decode token, then its attention for ``q``."""
    view.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
    return np.array(paged_attention(q, view, D ** -0.5, None))


# --------------------------------------------------------------------------------------------
# chunking invariance and bytes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", [64, 128])
def test_chunking_gives_byte_identical_records(g):
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(g, 5 * g + 3)
    for n in lengths(g):
        whole = feed(new_row(layout), k, v, None, stop=n)
        sink_len, num_tiles, tail_len = expected_counts(n, g)
        assert (whole.offset, whole.sink_len, whole.num_tiles, whole.tail_len) == (n, sink_len, num_tiles, tail_len)
        assert whole.size() == n and not whole.empty()
        assert len(whole.row.table) == num_tiles
        for chunk in (1, 7, 100, 300):
            assert_same_row(whole, feed(new_row(layout), k, v, chunk, stop=n))
        # nbytes is exactly what capacity pricing charges
        assert whole.nbytes == layout.sequence_bytes(n, D, H), n
        # the stored sink/tail are the rotated inputs rounded to fp16
        rot = np.array(mx.hadamard_transform(mx.array(k[:, :, :n])).astype(mx.float16))
        np.testing.assert_array_equal(contents(whole)["sink_k"], rot[:, :, :sink_len])
        np.testing.assert_array_equal(contents(whole)["tail_k"], rot[:, :, n - tail_len: n])
        assert_records_are_the_reference_quantizers(whole, k[:, :, :n], v[:, :, :n])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(chunks=st.lists(st.integers(1, 150), min_size=1, max_size=12), g=st.sampled_from([64, 128]),
       preset=st.sampled_from(["k4v2", "k3v3", "k8v8"]))
def test_random_chunkings_give_byte_identical_records(chunks, g, preset):
    layout = KVLayout.kvarn(preset, tile_size=g)
    n = sum(chunks)
    k, v = tokens(n, n, d=64)
    whole = feed(new_row(layout), k, v)
    pieces = new_row(layout)
    i = 0
    for c in chunks:
        pieces.update_and_fetch(mx.array(k[:, :, i:i + c]), mx.array(v[:, :, i:i + c]))
        i += c
    assert_same_row(whole, pieces)
    assert_records_are_the_reference_quantizers(pieces, k, v)
    assert pieces.nbytes == layout.sequence_bytes(n, 64, H)


@pytest.mark.parametrize("g", [64, 128])
def test_a_record_is_byte_identical_whichever_batch_produced_it_and_bytes_scale_with_rows(g):
    """Rows of one pool at different lengths decode as one batch (each row's tiles fill and commit
    at its own step, several in one quantizer call): every row then holds byte for byte what a
    row fed its tokens alone holds, and the pool holds exactly the rows' sequence bytes."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    b, n = 3, 3 * g + 17
    k, v = tokens(7, 5 * g + 3, b=b)
    for m in lengths(g):
        pool = KVarNPool(layout, 1)
        views = [feed(new_row(layout, pool), k[r:r + 1], v[r:r + 1], None, stop=m) for r in range(b)]
        assert sum(view.nbytes for view in views) == b * layout.sequence_bytes(m, D, H) == pool.held_bytes(), m
    pool = KVarNPool(layout, 1)
    starts = [1, g + 5, 2 * g - 1]  # a one-token sink, a short tail, a tail one token short of a tile
    views = [feed(new_row(layout, pool), k[r:r + 1], v[r:r + 1], 50, stop=s) for r, s in enumerate(starts)]
    live = list(range(b))
    batch = PagedBatch([views[r] for r in live])
    q = mx.array(np.random.default_rng(0).standard_normal((b, 2 * H, 1, D)).astype(np.float32))
    while live:
        at = [views[r].offset for r in live]
        batch.update_and_fetch(mx.array(np.concatenate([k[r:r + 1, :, i:i + 1] for r, i in zip(live, at)])),
                               mx.array(np.concatenate([v[r:r + 1, :, i:i + 1] for r, i in zip(live, at)])))
        mx.eval(paged_attention(q[: len(live)], batch, D ** -0.5, None))
        keep = [i for i, r in enumerate(live) if views[r].offset < n]
        if len(keep) < len(live):
            batch.filter(keep)
            live = [live[i] for i in keep]
    assert pool.held_bytes() == b * layout.sequence_bytes(n, D, H)
    for r, view in enumerate(views):
        one = feed(new_row(layout), k[r:r + 1], v[r:r + 1], None, stop=n)
        assert one.nbytes == view.nbytes == layout.sequence_bytes(n, D, H)
        assert_same_row(view, one)


@pytest.mark.parametrize("d", [64, 256, 512])
def test_nbytes_equals_sequence_bytes_for_every_head_dim(d):
    layout = KVLayout.kvarn("k3v3", tile_size=64)
    k, v = tokens(d, 3 * 64 + 5, d=d)
    view = new_row(layout)
    assert view.nbytes == 0 == layout.sequence_bytes(0, d, H)
    for stop in (1, 64, 128, 3 * 64 + 5):
        feed(view, k, v, None, start=view.offset, stop=stop)
        assert view.nbytes == layout.sequence_bytes(stop, d, H), stop


def test_rejects_non_kvarn_layouts():
    with pytest.raises(ValueError, match="kvarn layout"):
        KVarNPool(KVLayout.fp16(), 1)
    with pytest.raises(ValueError, match="kvarn layout"):
        KVarNPool(KVLayout.affine(4), 1)


# --------------------------------------------------------------------------------------------
# snapshot round trips
# --------------------------------------------------------------------------------------------

def copied(snapshot: tuple[dict, list[mx.array]]) -> tuple[dict, list[mx.array]]:
    """A snapshot as it comes back from memory or disk: its meta through JSON, fresh arrays with
    the same bytes."""
    meta, arrays = snapshot
    return json.loads(json.dumps(meta)), [mx.array(np.array(a)) for a in arrays]


def restored(snapshot: tuple[dict, list[mx.array]], layout: KVLayout, pool: KVarNPool | None = None) -> PagedLayer:
    view = new_row(layout, pool)
    view.row.restore(*copied(snapshot))
    return view


@pytest.mark.parametrize("n", [0, 37, 64, 100, 128, 129, 5 * 64 + 3])
def test_snapshot_round_trip_is_bit_exact(n):
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    k, v = tokens(n, max(n, 1))
    view = feed(new_row(layout), k, v, 33, stop=n) if n else new_row(layout)
    meta, arrays = view.row.snapshot()
    assert meta == {"first": 0, "records": view.num_tiles, "written": [0] if n else [],
                    "views": {"0": [n, view.tail_len, view.num_tiles]}}
    assert len(arrays) == (0 if n == 0 else 2 if n < 128 else 2 + len(RECORD_FIELDS))
    back = restored((meta, arrays), layout)
    assert back.chunk is None
    again = back.row.snapshot()
    assert again[0] == meta and len(again[1]) == len(arrays)
    for a, b in zip(arrays, again[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.array(a), np.array(b))
    assert back.nbytes == view.nbytes == layout.sequence_bytes(n, D, H)
    if n:
        assert_same_row(view, back)
    else:
        assert back.offset == 0 and back.empty() and back.row.table == [] and back.row.pool.shapes == [None]


def test_a_snapshot_is_restored_only_into_a_fresh_row_of_the_same_layers():
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    k, v = tokens(5, 200)
    view = feed(new_row(layout), k, v)
    meta, arrays = view.row.snapshot()
    with pytest.raises(ValueError, match="fresh row"):
        feed(new_row(layout), k, v, stop=3).row.restore(meta, arrays)
    with pytest.raises(ValueError, match="other layers"):
        PagedRow(KVarNPool(layout, 2), [0, 1]).restore(meta, arrays)
    with pytest.raises(ValueError, match="missing arrays"):
        new_row(layout).row.restore(meta, arrays[:-1])


@pytest.mark.parametrize("g", [64, 128])
def test_restored_row_continues_identically(g):
    """Round trip mid-tail, then keep writing across tile boundaries, in chunks and as decode
    tokens: records, sink, tail and attention outputs equal the uninterrupted row's, bit for bit."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    total = 4 * g + 9
    k, v = tokens(g + 1, total)
    rng = np.random.default_rng(0)
    for cut in (g // 2, g + 5, 2 * g):
        live = feed(new_row(layout), k, v, None, stop=cut)
        back = restored(live.row.snapshot(), layout)
        for start in range(cut, total, 23):
            stop = min(start + 23, total)
            if stop - 1 > start:  # a chunk, then one decode token
                q = mx.array(rng.standard_normal((1, 2 * H, stop - 1 - start, D)).astype(np.float32))
                outs = []
                for view in (live, back):
                    feed(view, k, v, None, start=start, stop=stop - 1)
                    outs.append(np.array(paged_attention(q, view, D ** -0.5, "causal")))
                assert np.array_equal(*outs)
            q = mx.array(rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32))
            assert np.array_equal(decode(live, k, v, stop - 1, q), decode(back, k, v, stop - 1, q))
            assert_same_row(live, back)


def test_snapshot_is_not_changed_by_the_live_row():
    """A snapshot left unevaluated while its row goes on (the tail rewritten, a record committed
    in place into the pool's arrays) still holds the row as it was."""
    g = 64
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(1, 4 * g)
    for cut in (g + 30, 2 * g + 30):  # 30 tokens in the tail: no record yet, one record
        live = feed(new_row(layout), k, v, None, stop=cut)
        snapshot = live.row.snapshot()
        # more tokens: a record committed, the tail rewritten from its first position
        feed(live, k, v, None, start=cut, stop=cut + g + 20)
        assert live.num_tiles == (cut - g) // g + 1 and live.tail_len == 50
        back = new_row(layout)
        back.row.restore(*snapshot)
        assert_same_row(back, feed(new_row(layout), k, v, None, stop=cut))


@pytest.mark.parametrize("cut", [40, 64 + 30])  # a partial sink, a partial tail
def test_rows_restored_or_forked_from_one_row_are_independent(cut):
    """Rows of one pool restored from one snapshot, and forks of one row, continue differently
    without touching each other or the row they came from."""
    g = 64
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(1, 3 * g)
    k2, v2 = tokens(2, 3 * g)
    pool = KVarNPool(layout, 1)
    live = feed(new_row(layout, pool), k, v, None, stop=cut)
    snapshot = live.row.snapshot()
    pairs = [(restored(snapshot, layout, pool), restored(snapshot, layout, pool)),
             (live.row.fork().layers[0], live.row.fork().layers[0])]
    for a, b in pairs:
        feed(a, k, v, None, start=cut, stop=cut + 40)  # crosses a tile boundary from the partial tail
        feed(b, k2, v2, None, start=cut, stop=cut + 40)  # a different continuation
        assert_same_row(a, feed(new_row(layout), k, v, None, stop=cut + 40))
    assert_same_row(live, feed(new_row(layout), k, v, None, stop=cut))


def test_restore_keeps_the_layout_and_head_dim():
    layout = KVLayout.kvarn("k3v3", tile_size=128)
    k, v = tokens(3, 300, d=256)
    view = feed(new_row(layout), k, v)
    back = restored(view.row.snapshot(), layout)
    assert back.layout == layout
    assert (back.layout.key_bits, back.layout.value_bits, back.layout.tile_size) == (3, 3, 128)
    assert back.row.pool.shapes == [(H, 256)]
    assert_same_row(view, back)


def test_float32_windows_keep_their_dtype_and_stamp_through_a_snapshot():
    layout = KVLayout.kvarn("k4v2").with_storage_dtype("float32")
    k, v = tokens(200, 200)
    view = feed(new_row(layout), k, v, 50, stop=200)
    meta, arrays = view.row.snapshot()
    assert arrays[0].dtype == mx.float32 and view.row.pool.window_dtype == mx.float32
    back = restored((meta, arrays), layout)
    assert back.layout == layout and back.row.pool.layers[0].win_k.dtype == mx.float32
    assert back.layout.stamp("0123456789abcdef") == layout.stamp("0123456789abcdef")
    assert back.nbytes == layout.sequence_bytes(200, D, H)
    assert_same_row(view, back)


# --------------------------------------------------------------------------------------------
# trim
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", [64, 128])
def test_trim_removes_only_tail_tokens(g):
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(g + 2, 3 * g)
    assert new_row(layout).is_trimmable()
    # inside the sink: nothing is removable
    for n in (1, g // 2, g):
        view = feed(new_row(layout), k, v, stop=n)
        assert view.trim(1) == 0 and view.trim(5) == 0
        assert (view.offset, view.sink_len, view.tail_len) == (n, n, 0)
    # within the tail
    view = feed(new_row(layout), k, v, stop=g + 20)
    assert view.trim(5) == 5
    assert (view.offset, view.tail_len, view.num_tiles) == (g + 15, 15, 0)
    # past the sink boundary: only the tail goes
    assert view.trim(100) == 15
    assert (view.offset, view.tail_len, view.sink_len) == (g, 0, g)
    assert view.trim(1) == 0
    # past a committed record boundary: only what is in the tail
    view = feed(new_row(layout), k, v, stop=2 * g + 7)
    before = contents(view)
    assert view.num_tiles == 1 and view.tail_len == 7
    assert view.trim(g) == 7
    assert (view.offset, view.tail_len, view.num_tiles) == (2 * g, 0, 1)
    assert view.trim(3) == 0 and view.offset == 2 * g
    after = contents(view)
    for name in ("sink_k", "sink_v", *RECORD_FIELDS):
        assert np.array_equal(before[name], after[name]), name
    assert len(view.row.table) == 1 and view.row.pool.records.num_held == 1
    assert view.nbytes == layout.sequence_bytes(2 * g, D, H)


@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("kept,extra", [(20, 9), (5, 0), (0, 30)])
def test_decoding_after_trim_equals_never_seeing_the_tokens(g, kept, extra):
    """Tokens written then trimmed leave no trace: the row equals one that never saw them, and
    stays equal (records byte-identical, attention bit for bit) as decoding continues across
    tile boundaries."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    base = g + kept  # tokens kept
    k, v = tokens(kept + extra, base + 2 * g + 5)
    junk_k, junk_v = tokens(999, extra + 1)
    trimmed = feed(new_row(layout), k, v, None, stop=base)
    if extra:
        trimmed.update_and_fetch(mx.array(junk_k[:, :, :extra]), mx.array(junk_v[:, :, :extra]))
    assert trimmed.trim(extra) == extra
    clean = feed(new_row(layout), k, v, None, stop=base)
    assert_same_row(trimmed, clean)
    q = mx.array(np.random.default_rng(1).standard_normal((1, H, 1, D)).astype(np.float32))
    for i in range(base, base + 2 * g + 5):  # one token at a time, as decoding
        outs = [decode(view, k, v, i, q) for view in (trimmed, clean)]
        assert np.array_equal(*outs), i
        if i % 17 == 0 or i == base + 2 * g + 4:
            assert_same_row(trimmed, clean)
    assert trimmed.num_tiles == (base + 2 * g + 5 - g) // g


def test_mask_protocol():
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    view = new_row(layout)
    assert view.make_mask(5) == "causal" and view.make_mask(1) is None
    k, v = tokens(0, 70)
    feed(view, k, v)
    m = np.array(view.make_mask(3, return_array=True))
    assert m.shape == (3, 73)
    np.testing.assert_array_equal(m, np.arange(73)[None, :] <= (70 + np.arange(3))[:, None])
    w = np.array(view.make_mask(3, window_size=8))
    np.testing.assert_array_equal(w.sum(-1), [8, 8, 8])
