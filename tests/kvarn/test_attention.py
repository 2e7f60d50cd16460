"""KVarN attention over pool rows (kvarn/attention.py) against the
float64 NumPy reference (tests/kvarn/reference.py, docs/kvarn.md).

The records are read straight out of the pool (``KVarNPool.gather_records``) with an independent
reading of the block-major record layout (kvarn/pool.py's docstring) and decoded by the
reference, so these tests check the layout, the decode path that reads the pool's codes
(``mx.gather_qmm``, the CPU and Metal), the gather-and-dequantize decode path (one SDPA over the
dequantized records), a decode batch of ragged rows, and prompt chunks (the first one too).

Measured errors, relative to max|reference output| (float32 queries, random data with outlier
channels and per-token scales, over the whole grid: head_dim 64/128/256/512, GQA 1/2/4, G 64/128,
k4v2/k8v8/k3v3, 0/1/3 records, partial tails), with their bounds:
  * decode path (codes read in place) vs reference: 5.5e-6          -> DECODE_TOL 1.5e-5
  * dequantized decode path vs reference: 3.0e-6, vs the decode
    path: 6.2e-6 (float32 queries dequantize in float32; the bound
    is float16's, the dtype half-precision queries dequantize in)   -> DEQUANT_TOL 2e-2
  * continuation chunk (L > 1, each token with decode's view) vs
    reference: 7.6e-5; a first chunk: 4.5e-6                        -> CONTINUATION_TOL 4e-3
  * a chunk vs the same tokens decoded one by one, any chunking:
    1.3e-6                                                           -> DECODE_TOL
``-s`` prints the measured values (test_report_measured_tolerances).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from kvarn import attention as PA
from kvarn import quantize as Q
from kvarn.rows import make_dispatch
from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow
from kvarn.paged import PagedBatch
from tests.kvarn.row_contents import paged_attention
from kvarn.pool import KVarNPool
from tests.kvarn import reference as R

H = 2  # KV heads
DECODE_TOL = 1.5e-5
DEQUANT_TOL = 2e-2
CONTINUATION_TOL = 4e-3
# --------------------------------------------------------------------------------------------
# helpers: an independent reading of the record layout
# --------------------------------------------------------------------------------------------

def new_row(layout: KVLayout, pool: KVarNPool | None = None) -> PagedLayer:
    return PagedRow(pool or KVarNPool(layout, 1), [0]).layers[0]


def window(view: PagedLayer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sink_k, sink_v, tail_k, tail_v) [H, n, D] of a row: its window slot's valid tokens."""
    a, G = view.row.pool.layers[view.l], view.layout.tile_size
    k, v = np.array(a.win_k[view.row.slot]), np.array(a.win_v[view.row.slot])
    tail = slice(G, G + view.tail_len)
    return k[:, : view.sink_len], v[:, : view.sink_len], k[:, tail], v[:, tail]


def reference_records(view: PagedLayer, h: int) -> list[R.RefRecord]:
    """The row's committed records for KV head ``h``, as reference records.

    Layout (kvarn/pool.py), block-major, one entry per block of the row's table:
    keys codes [n,H,S,W, G*bk/32], alpha/beta [n,H,S,W], r [n,H,S,G]; values codes
    [n,H,G, D*bv/32] (slice s = words s*W*bv/32 ..), alpha/beta [n,H,G,S], c [n,H,D].
    """
    blocks = view.row.table[: view.num_tiles - view.row.first]
    if not blocks:
        return []
    layout = view.layout
    g = layout.tile_size
    fields = view.row.pool.gather_records(view.l, mx.array(blocks, dtype=mx.int32))
    kc, ka, kb, kr, vc, va, vb, vcc = (np.array(fields[name]) for name in
                                       ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c"))
    s, w = kc.shape[2], kc.shape[3]
    assert kc.shape[4] == g * layout.key_bits // 32 and vc.shape[2:] == (g, s * w * layout.value_bits // 32)
    out = []
    for i in range(len(blocks)):
        keys = SimpleNamespace(codes=kc[i, h], alpha=ka[i, h], beta=kb[i, h], r=kr[i, h])
        values = SimpleNamespace(codes=vc[i, h].reshape(g, s, -1).transpose(1, 0, 2), alpha=va[i, h].T,
                                 beta=vb[i, h].T, c=vcc[i, h].reshape(s, w))
        out.append(R.record_from_tiles(keys, values, layout.key_bits, layout.value_bits))
    return out


def reference_output(views: list[PagedLayer], queries: mx.array, scale: float) -> np.ndarray:
    """Section 4 in float64 for every row (one view each) and KV head; queries [B, n_q, 1, D]
    (unrotated), each row's query seeing its whole row (decode)."""
    b_, n_q, seq_q, d = queries.shape
    n_rep = n_q // H
    q = np.array(queries.astype(mx.float32)).astype(np.float64)
    out = np.zeros((b_, n_q, seq_q, d))
    for b, view in enumerate(views):
        sink_k, sink_v, tail_k, tail_v = window(view)
        for h in range(H):
            rows = slice(h * n_rep, (h + 1) * n_rep)  # mlx-lm GQA: query head i reads KV head i // n_rep
            out[b, rows] = R.reference_attention(q[b, rows], sink_k[h], sink_v[h], reference_records(view, h),
                                                 tail_k[h], tail_v[h], scale)
    return out


def dequantized_path(queries: mx.array, cache: PagedLayer | PagedBatch, scale: float) -> mx.array:
    """The decode step's attention (after its write) through the path that gathers and
    dequantizes the records (one SDPA), forced where MLX would read the codes in place."""
    original = PA.reads_codes_directly
    try:
        PA.reads_codes_directly = lambda: False
        return paged_attention(queries, cache, scale, None)
    finally:
        PA.reads_codes_directly = original


def advance(view: PagedLayer, k: np.ndarray, v: np.ndarray, stop: int) -> None:
    """Tokens up to ``stop``: all but the last as one prompt chunk, the last alone (a decode
    token, or the prompt's first token)."""
    if stop - 1 > view.offset:
        view.update_and_fetch(mx.array(k[:, :, view.offset: stop - 1]), mx.array(v[:, :, view.offset: stop - 1]))
    view.update_and_fetch(mx.array(k[:, :, stop - 1: stop]), mx.array(v[:, :, stop - 1: stop]))


def make_kv(rng, n: int, d: int, b: int = 1) -> tuple[np.ndarray, np.ndarray]:
    k = rng.standard_normal((b, H, n, d)).astype(np.float32)
    k[..., : d // 8] *= 4.0  # outlier channels
    k *= np.exp(rng.normal(0, 0.4, (b, H, n, 1))).astype(np.float32)  # token magnitudes
    v = (rng.standard_normal((b, H, n, d)) * np.exp(rng.normal(0, 0.4, (b, H, n, 1)))).astype(np.float32)
    return k, v


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# --------------------------------------------------------------------------------------------
# the record layout, read independently
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,g,preset", [(64, 64, "k4v2"), (128, 128, "k3v3"), (256, 64, "k8v8"),
                                        (512, 128, "k4v2")])
def test_records_hold_each_tile_quantized_on_its_own(d, g, preset):
    """Every record of every row equals the quantizer's output for its own tile (byte-identical),
    read through the documented layout; and decodes (reference) close to the stored rotated
    inputs. Two rows of one pool, each with its own tokens."""
    layout = KVLayout.kvarn(preset, tile_size=g)
    rng = np.random.default_rng(d + g)
    k, v = make_kv(rng, 3 * g + 11, d, b=2)
    pool = KVarNPool(layout, 1)
    views = [new_row(layout, pool) for _ in range(2)]
    for b, view in enumerate(views):
        view.update_and_fetch(mx.array(k[b: b + 1]), mx.array(v[b: b + 1]))
    k_rot = np.array(Q.rotate(mx.array(k)).astype(mx.float16))
    v_rot = np.array(Q.rotate(mx.array(v)).astype(mx.float16))
    w = Q.slice_width(d)
    for b, h in itertools.product(range(2), range(H)):
        recs = reference_records(views[b], h)
        assert len(recs) == 2
        for i, rec in enumerate(recs):
            tok = slice(g * (i + 1), g * (i + 2))
            kt = R.split_slices(k_rot[b, h, tok].astype(np.float32))  # [S, G, W]
            vt = R.split_slices(v_rot[b, h, tok].astype(np.float32))
            want_k = Q.quantize_keys(mx.array(kt), layout.key_bits, layout.iters)
            want_v = Q.quantize_values(mx.array(vt), layout.value_bits, layout.iters)
            for s in range(d // w):
                np.testing.assert_array_equal(rec.keys[s].packed(), np.array(want_k.codes[s]))
                np.testing.assert_array_equal(rec.keys[s].alpha, np.array(want_k.alpha[s]))
                np.testing.assert_array_equal(rec.keys[s].beta, np.array(want_k.beta[s]))
                np.testing.assert_array_equal(rec.keys[s].r, np.array(want_k.r[s]))
                np.testing.assert_array_equal(rec.values[s].packed(), np.array(want_v.codes[s]))
                np.testing.assert_array_equal(rec.values[s].alpha, np.array(want_v.alpha[s]))
                np.testing.assert_array_equal(rec.values[s].beta, np.array(want_v.beta[s]))
                np.testing.assert_array_equal(rec.values[s].c, np.array(want_v.c[s]))
            kd, vd = rec.dequantize()
            bound = {"k8v8": 0.01, "k4v2": 0.6, "k3v3": 0.3}[preset]
            for got, ref in ((kd, k_rot[b, h, tok]), (vd, v_rot[b, h, tok])):
                ref = ref.astype(np.float64)
                assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < bound
        # the history a chunk attends is [sink | dequantized records] in fp16, in sequence order,
        # and the window's tail holds the rest
        hk, hv, rk, rv = (np.array(x).astype(np.float64) for x in views[b].history(mx.float16))
        assert hk.shape[2] == g and rk.shape[2] == 2 * g
        sink_k, sink_v, tail_k, tail_v = window(views[b])
        np.testing.assert_array_equal(hk[0, h], k_rot[b, h, :g].astype(np.float64))
        np.testing.assert_array_equal(hv[0, h], v_rot[b, h, :g].astype(np.float64))
        np.testing.assert_array_equal(tail_k[h], k_rot[b, h, 3 * g:])
        np.testing.assert_array_equal(tail_v[h], v_rot[b, h, 3 * g:])
        want = np.concatenate([r.dequantize()[0] for r in recs])
        np.testing.assert_allclose(rk[0, h], want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
        want_v = np.concatenate([r.dequantize()[1] for r in recs])
        np.testing.assert_allclose(rv[0, h], want_v, rtol=1e-3, atol=1e-3 * np.abs(want_v).max())


# --------------------------------------------------------------------------------------------
# decode paths vs the reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["k4v2", "k8v8", "k3v3"])
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("n_rep", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_decode_matches_reference(d, n_rep, g, preset):
    rng = np.random.default_rng([d, n_rep, g, ord(preset[1]), ord(preset[3])])
    layout = KVLayout.kvarn(preset, tile_size=g)
    total = 4 * g + 5
    k, v = make_kv(rng, total, d)
    view = new_row(layout)
    scale = d ** -0.5
    seam = make_dispatch(lambda *a, **kw: pytest.fail("the original SDPA must not be called"))
    # 1 token; a partial sink; sink only; sink + tail; one record, empty tail (committed by the
    # decode token); three records + tail
    for stop, tiles in ((1, 0), (g - 1, 0), (g, 0), (g + 7, 0), (2 * g, 1), (total, 3)):
        advance(view, k, v, stop)
        assert view.num_tiles == tiles and view.offset == stop
        q = mx.array((rng.standard_normal((1, H * n_rep, 1, d)) * 1.5).astype(np.float32))
        want = reference_output([view], q, scale)
        if stop == 1:  # the prompt's first token attends as a chunk (there is no decode step yet)
            got = paged_attention(q, view, scale, None)
            err = rel_err(np.array(got), want)
            assert got.shape == q.shape and got.dtype == mx.float32 and err < DECODE_TOL, err
            continue
        got = paged_attention(q, view, scale, None)
        assert got.shape == q.shape and got.dtype == mx.float32
        deq = dequantized_path(q, view, scale)
        # where MLX lacks quantized_matmul kernels for these shapes (CUDA) decode runs the
        # dequantized path: check that one against the reference there
        if not PA.reads_codes_directly():
            assert np.array_equal(np.array(got), np.array(deq))
        err = rel_err(np.array(got), want)
        assert err < (DECODE_TOL if PA.reads_codes_directly() else DEQUANT_TOL), (stop, err)
        # the seam sends a lone decode token to the decode path
        routed = seam(q, view, view, cache=view, scale=scale, mask=None)
        assert np.array_equal(np.array(routed), np.array(got))
        err_deq = rel_err(np.array(deq), want)
        assert err_deq < DEQUANT_TOL, (stop, err_deq)
        assert rel_err(np.array(got), np.array(deq).astype(np.float64)) < DEQUANT_TOL


@pytest.mark.parametrize("d,n_rep,g", [(128, 4, 128), (256, 2, 64), (64, 1, 64)])
def test_decode_batch_rows_attend_their_own_records(d, n_rep, g):
    """Ragged rows of one pool in one decode batch (one of them committing a tile in the step):
    each row attends to its own sink, records and tail."""
    rng = np.random.default_rng(5)
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    pool = KVarNPool(layout, 1)
    lengths = [2 * g + 30, g + 5, 3 * g]
    k, v = make_kv(rng, max(lengths), d, b=3)
    views = [new_row(layout, pool) for _ in lengths]
    for b, (view, n) in enumerate(zip(views, lengths)):
        view.update_and_fetch(mx.array(k[b: b + 1, :, : n - 1]), mx.array(v[b: b + 1, :, : n - 1]))
    batch = PagedBatch(views)
    batch.update_and_fetch(mx.array(np.concatenate([k[b: b + 1, :, n - 1: n] for b, n in enumerate(lengths)])),
                           mx.array(np.concatenate([v[b: b + 1, :, n - 1: n] for b, n in enumerate(lengths)])))
    assert [view.offset for view in views] == lengths and [view.num_tiles for view in views] == [1, 0, 2]
    q = mx.array(rng.standard_normal((3, H * n_rep, 1, d)).astype(np.float32))
    want = reference_output(views, q, d ** -0.5)
    got = np.array(paged_attention(q, batch, d ** -0.5, None))
    tol = DECODE_TOL if PA.reads_codes_directly() else DEQUANT_TOL
    assert rel_err(got, want) < tol
    rows = [rel_err(got[b], want[b]) for b in range(3)]
    assert max(rows) < tol
    deq = np.array(dequantized_path(q, batch, d ** -0.5))
    assert rel_err(deq, want) < DEQUANT_TOL


def reference_chunk_output(view: PagedLayer, queries: mx.array, scale: float, k_raw: np.ndarray,
                           v_raw: np.ndarray, start: int) -> np.ndarray:
    """Section 4 in float64 for a chunk whose queries sit at ``start`` .. ``start + L - 1``: each
    query attends as decode at its position would (the reference's decode view): the sink up to
    itself, the records of the tiles committed once it is in (those ending at or before p + 1),
    and its own tile's tokens up to itself in float16 (rotated raw keys/values)."""
    _, n_q, seq_q, d = queries.shape
    n_rep, g = n_q // H, view.layout.tile_size
    q = np.array(queries.astype(mx.float32)).astype(np.float64)
    sink_k, sink_v, _, _ = window(view)
    k_rot = R.rotate(k_raw).astype(np.float16)
    v_rot = R.rotate(v_raw).astype(np.float16)
    out = np.zeros((1, n_q, seq_q, d))
    for h in range(H):
        records = reference_records(view, h)
        rows = slice(h * n_rep, (h + 1) * n_rep)
        for i in range(seq_q):
            p = start + i
            committed = ((p + 1) // g) * g
            n_records = max(committed // g - 1, 0)
            tail = slice(max(committed, g), p + 1)
            out[0, rows, i] = R.reference_attention(
                q[0, rows, i:i + 1], sink_k[h, : min(p + 1, g)], sink_v[h, : min(p + 1, g)],
                records[:n_records], k_rot[0, h, tail], v_rot[0, h, tail], scale)[:, 0]
    return out


@pytest.mark.parametrize("d,n_rep,g,preset", [(128, 2, 128, "k4v2"), (256, 4, 64, "k8v8"), (64, 1, 64, "k3v3"),
                                              (512, 2, 128, "k4v2")])
def test_continuation_chunk_matches_reference(d, n_rep, g, preset):
    """A later prefill chunk (L > 1) gives each token decode's view: sink, the records committed
    before its tile ends, its own tile in float16."""
    rng = np.random.default_rng(d * n_rep)
    view = new_row(KVLayout.kvarn(preset, tile_size=g))
    k, v = make_kv(rng, 3 * g + 20, d)
    scale = d ** -0.5
    start = 2 * g + 3
    view.update_and_fetch(mx.array(k[:, :, :start]), mx.array(v[:, :, :start]))
    seq_q = g + 17  # this chunk completes a tile (committed as a record) and leaves a tail
    mask = view.make_mask(seq_q)
    assert mask == "causal"
    view.update_and_fetch(mx.array(k[:, :, start:]), mx.array(v[:, :, start:]))
    assert view.chunk.start == start and view.num_tiles == 2
    q = mx.array(rng.standard_normal((1, H * n_rep, seq_q, d)).astype(np.float32))
    got = np.array(paged_attention(q, view, scale, mask))
    want = reference_chunk_output(view, q, scale, k, v, start)
    err = rel_err(got, want)
    assert err < CONTINUATION_TOL
    # the model's mask (a boolean array instead of "causal") does not change the view
    arr = paged_attention(q, view, scale, create_causal_mask(seq_q, view.offset - seq_q))
    assert np.array_equal(np.array(arr), got)


@pytest.mark.parametrize("preset,g", [("k4v2", 64), ("k3v3", 128)])
def test_chunk_attention_is_decode_and_chunking_invariant(preset, g):
    """Each token of a later chunk attends exactly as decode does at its position, whatever the
    chunking (this is what makes a prefix-cache restore continue like the row that made it)."""
    rng = np.random.default_rng(g)
    d, n_rep, n, first = 128, 2, 4 * g + 9, g + 5
    k, v = (mx.array(a) for a in make_kv(rng, n, d))
    q = mx.array(rng.standard_normal((1, H * n_rep, n, d)).astype(np.float32))
    scale = d ** -0.5
    layout = KVLayout.kvarn(preset, tile_size=g)

    def run(cuts):
        view = new_row(layout)
        view.update_and_fetch(k[:, :, :first], v[:, :, :first])
        outs = []
        for a, b in zip([first, *cuts], [*cuts, n]):
            view.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
            outs.append(paged_attention(q[:, :, a:b], view, scale, "causal" if b - a > 1 else None))
        return np.array(mx.concatenate(outs, axis=2))

    decode = run(list(range(first + 1, n)))
    for cuts in ([], [2 * g], [2 * g - 1, 2 * g, 3 * g + 1]):
        err = rel_err(run(cuts), decode)
        assert err < DECODE_TOL


# --------------------------------------------------------------------------------------------
# a prompt's first chunk: decode's view too (no full-precision chunk)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,n_rep,g,n", [(128, 2, 128, 300), (64, 4, 64, 64), (256, 1, 64, 33), (512, 2, 128, 1)])
def test_first_chunk_gets_decodes_view(d, n_rep, g, n):
    """A prompt's first chunk gives each token what decode would show it (the sink up to itself,
    the records committed once it is in, its own tile in float16), like any later chunk."""
    rng = np.random.default_rng(n)
    k, v = make_kv(rng, n, d)
    q = mx.array(rng.standard_normal((1, H * n_rep, n, d)).astype(np.float32))
    view = new_row(KVLayout.kvarn("k4v2", tile_size=g))
    mask = view.make_mask(n)
    cached_k, cached_v = view.update_and_fetch(mx.array(k), mx.array(v))
    assert cached_k is None and cached_v is None and view.chunk.start == 0  # it attends itself (``attend``)
    assert view.num_tiles == max(n // g - 1, 0)
    scale = d ** -0.5
    got = paged_attention(q, view, scale, mask)
    err = rel_err(np.array(got), reference_chunk_output(view, q, scale, k, v, 0))
    assert err < CONTINUATION_TOL, err
    # through the seam, as an mlx-lm model calls it
    dispatch = make_dispatch(lambda *a, **kw: pytest.fail("the original SDPA must not be called"))
    seam = dispatch(q, cached_k, cached_v, cache=view, scale=scale, mask=mask)
    assert np.array_equal(np.array(seam), np.array(got))
    with pytest.raises(ValueError, match="sinks"):
        dispatch(q, cached_k, cached_v, cache=view, scale=scale, mask=mask, sinks=mx.zeros((H * n_rep,)))
    # half-precision queries keep their dtype
    half = paged_attention(q.astype(mx.float16), view, scale, mask)
    assert half.dtype == mx.float16
    assert rel_err(np.array(half.astype(mx.float32)), np.array(got)) < 1e-2


def test_attention_before_a_write_is_refused():
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    k, v = make_kv(np.random.default_rng(0), 70, 128)
    view = new_row(layout)
    view.update_and_fetch(mx.array(k), mx.array(v))
    view.chunk = None  # as after a decode step dropped the prompt's last chunk
    q = mx.zeros((1, H, 1, 128))
    with pytest.raises(RuntimeError, match="before update_and_fetch"):
        paged_attention(q, view, 1.0, None)
    with pytest.raises(RuntimeError, match="before update_and_fetch"):
        paged_attention(q, PagedBatch([view]), 1.0, None)


# --------------------------------------------------------------------------------------------
# reduced-precision queries
# --------------------------------------------------------------------------------------------

SEEDS = range(5)


def reduced_precision_errors(dtype, seed: int) -> tuple[float, float, float]:
    """(decode path, dequantized path, decode path computed in float32 then cast) errors vs the
    reference, for queries in ``dtype`` over plain Gaussian keys and values."""
    d, g = 128, 128
    rng = np.random.default_rng(seed)
    view = new_row(KVLayout.kvarn("k4v2", tile_size=g))
    k = rng.standard_normal((1, H, 3 * g + 5, d)).astype(np.float32)
    v = rng.standard_normal((1, H, 3 * g + 5, d)).astype(np.float32)
    advance(view, k, v, 3 * g + 5)
    q = mx.array(rng.standard_normal((1, 2 * H, 1, d)).astype(np.float32)).astype(dtype)
    scale = d ** -0.5
    want = reference_output([view], q, scale)
    decode = rel_err(np.array(paged_attention(q, view, scale, None).astype(mx.float32)), want)
    deq = rel_err(np.array(dequantized_path(q, view, scale).astype(mx.float32)), want)
    f32 = rel_err(np.array(paged_attention(q.astype(mx.float32), view, scale, None).astype(dtype)
                           .astype(mx.float32)), want)
    return decode, deq, f32


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_reduced_precision_decode_bound(dtype):
    """Half-precision queries keep their dtype; fp16 queries within 2e-2 of the reference, bf16
    within 2e-1."""
    for seed in SEEDS:
        decode, deq, _ = reduced_precision_errors(dtype, seed)
        assert decode < (2e-2 if dtype == mx.float16 else 2e-1), (seed, decode, deq)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_reduced_precision_decode_is_as_accurate_as_the_dequantized_path(dtype):
    errs = np.array([reduced_precision_errors(dtype, seed) for seed in SEEDS])
    decode, deq, _ = errs.mean(axis=0)
    assert decode <= 1.5 * deq, errs
