"""kvarn/cpu_attention.py against float64 NumPy and MLX's own attention; decode attention's record
products over unpacked codes against the NumPy reference's dequantization and the other paths."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn import cpu_attention as CA
from kvarn import attention as PA
from kvarn.rows import make_dispatch
from kvarn.layout import KVLayout
from kvarn.pool import RECORD_FIELDS, LayerArrays, quantize_blocks
from tests.kvarn import reference as R


def test_softmax_weights_match_float64_exp():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-90, 0, 200_000), rng.uniform(-1, 1, 50_000), [0.0, -1e-30, -86.9]])
    x = x.astype(np.float32)[None]
    got = np.array(CA.softmax_weights(mx.array(x)), np.float64)
    want = np.exp((x - x.max()).astype(np.float64))  # the float32 difference, as MLX's softmax takes it
    normal = want > 1e-37  # float32's normal range
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 3e-7, rel.max()
    floor = np.exp(np.float64(CA.EXP_FLOOR)) * (1 + 3e-7)  # what anything below the floor weighs
    assert np.all(got[~normal] <= np.maximum(want[~normal] * (1 + 3e-7), floor))


def test_masked_keys_weigh_nothing():
    scores = mx.array([[0.0, -np.inf, 3.0, -np.inf, -1e30]], dtype=mx.float32)
    w = np.array(CA.softmax_weights(scores))
    np.testing.assert_allclose(w[0, [0, 2]], np.exp([-3.0, 0.0]), rtol=3e-7)
    assert np.all(w[0, [1, 3, 4]] < 2e-38) and np.all(np.isfinite(w))


def reference(q, k, v, scale, mask):
    """float64 attention with mlx-lm's GQA (query head i reads KV head i // (n_q / H))."""
    q, k, v, mask = (np.asarray(a, np.float64) for a in (q, k, v, mask))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * scale + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("n_q,H,L,T,D", [(4, 2, 37, 300, 128), (8, 8, 16, 16, 64), (2, 1, 129, 513, 256)])
def test_attention_matches_float64_and_mlx(n_q, H, L, T, D):
    rng = np.random.default_rng([n_q, H, L, T])
    q = rng.standard_normal((1, n_q, L, D)).astype(np.float32) * 2
    k = rng.standard_normal((1, H, T, D)).astype(np.float32)
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    seen = rng.random((L, T)) < 0.6
    seen[:, 0] = True  # every query sees a key
    mask = np.where(seen, 0.0, -np.inf).astype(np.float32)
    scale = D ** -0.5
    got = np.array(CA.attention(mx.array(q), mx.array(k), mx.array(v), scale, mx.array(mask)))
    want = reference(q, k, v, scale, mask)
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-6
    mlx = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=scale,
                                                         mask=mx.array(mask)))
    assert np.abs(got - mlx).max() / np.abs(want).max() < 2e-6


@pytest.mark.parametrize("form", ["bool per row", "bool per head", "additive per row", "causal", "none"])
@pytest.mark.parametrize("B,L,T", [(16, 1, 256), (1, 1, 3000), (2, 20, 64), (3, 17, 40)])
def test_attention_takes_every_mask_mlx_lm_passes_as_its_sdpa_does(form, B, L, T):
    """Decode rows (few query rows: scores as keys @ q^T) and prompt chunks, under each mask form
    mlx-lm and the slots hand to the seam: its values are MLX's SDPA's."""
    rng = np.random.default_rng([B, L, T])
    n_q, H, D = 4, 2, 128
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((B, n_q, L, D), (B, H, T, D), (B, H, T, D)))
    seen = rng.random((B, n_q if form == "bool per head" else 1, L, T)) < 0.7
    seen[..., 0] = True
    mask = {"bool per row": mx.array(seen), "bool per head": mx.array(seen), "causal": "causal", "none": None,
            "additive per row": mx.array(np.where(seen, 0.0, -np.inf).astype(np.float32))}[form]
    got = CA.attention(q, k, v, 0.09, CA.causal_mask(L, T) if form == "causal" else mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.09, mask=mask)
    assert mx.abs(got - want).max().item() < 2e-6 * mx.abs(want).max().item()


def test_the_seam_runs_cpu_attention_for_float32_keys_and_mlx_lm_s_own_otherwise(monkeypatch):
    """On the CPU the seam's default takes float32 calls without sinks (no MLX CPU SDPA); codes,
    other dtypes and sinks go to mlx-lm's function."""
    calls = []
    monkeypatch.setattr(CA, "attention", lambda *a: calls.append("cpu") or a[0])
    seam = make_dispatch(lambda q, k, v, **kw: calls.append("mlx-lm") or q)
    q, k = mx.zeros((1, 4, 1, 128)), mx.zeros((1, 2, 8, 128))
    for mask in (None, "causal", mx.ones((1, 1, 1, 8), dtype=mx.bool_)):
        seam(q, k, k, cache=None, scale=1.0, mask=mask)
    seam(q, k, k, cache=None, scale=1.0, mask=None, sinks=mx.zeros((4,)))
    seam(q.astype(mx.float16), k.astype(mx.float16), k.astype(mx.float16), cache=None, scale=1.0, mask=None)
    plain = "cpu" if mx.default_device() == mx.cpu else "mlx-lm"  # a GPU keeps MLX's fused SDPA
    assert calls == [plain, plain, plain, "mlx-lm", "mlx-lm"]


@pytest.mark.parametrize("start,L,window_start", [(0, 300, 64), (70, 200, 64), (192, 64, 128), (130, 1, 128),
                                                  (320, 77, 256)])
def test_window_attention_is_the_masked_attention_over_the_joined_keys(start, L, window_start):
    """The window taken tile by tile gives what one masked attention over [keys | window] gives."""
    from kvarn.attention import chunk_view_mask

    G, H, n_q, D = 64, 2, 4, 128
    end = start + L
    num_records = max(window_start // G - 1, 0)  # the sink is full: records follow it up to the window
    rng = np.random.default_rng([start, L, window_start])
    q = mx.array(rng.standard_normal((1, n_q, L, D)).astype(np.float32))
    keys, values = (mx.array(rng.standard_normal((1, H, G + num_records * G, D)).astype(np.float32)) for _ in "kv")
    win_k, win_v = (mx.array(rng.standard_normal((1, H, end - window_start, D)).astype(np.float32)) for _ in "kv")
    args = (start, end, G, num_records, window_start, G, mx.float32)
    joined = CA.attention(q, mx.concatenate([keys, win_k], axis=2), mx.concatenate([values, win_v], axis=2), 0.1,
                          chunk_view_mask(*args))
    got = CA.window_attention(q, keys, values, chunk_view_mask(*args, window_end=window_start), win_k, win_v,
                              start=start, window_start=window_start, G=G, scale=0.1)
    assert np.abs(np.array(got) - np.array(joined)).max() / np.abs(np.array(joined)).max() < 2e-6


# --------------------------------------------------------------------------------------------
# decode attention's record products over unpacked codes
# --------------------------------------------------------------------------------------------

def quantized_blocks(rng, n, H, D, G, key_bits, value_bits):
    """``n`` pool blocks quantized from random rotated tiles with outlier channels, per-token
    scales and a channel offset (what makes the factored form's two terms cancel)."""
    layout = KVLayout.kvarn((key_bits, value_bits), tile_size=G)
    chan = np.where(rng.random(D) < 0.05, 8.0, 1.0) + 3.0 * rng.random(D)
    tok = np.exp(rng.standard_normal((n, 1, G, 1)) * 0.5)
    keys = (rng.standard_normal((n, H, G, D)) * chan * tok + rng.standard_normal(D) * 2).astype(np.float16)
    values = (rng.standard_normal((n, H, G, D)) * tok + 0.5).astype(np.float16)
    return quantize_blocks(mx.array(keys), mx.array(values), layout)


def dequantized_blocks(rec, key_bits, value_bits):
    """Rotated keys and values [n, H, G, D] (float64) from the pool's record fields, read with
    the NumPy reference's unpacking (docs/kvarn.md, section 3)."""
    f = {k: np.asarray(v.astype(mx.float32) if v.dtype != mx.uint32 else v).astype(np.float64 if v.dtype != mx.uint32
                                                                                    else np.uint32)
         for k, v in rec.items()}
    n, H, S, W, _ = f["k_codes"].shape
    G = f["k_r"].shape[-1]
    codes = R.unpack(f["k_codes"], key_bits, G).astype(np.float64)  # [n, H, S, W, G]
    k = (codes * f["k_alpha"][..., None] + f["k_beta"][..., None]) * f["k_r"][:, :, :, None, :]
    keys = np.swapaxes(k, -1, -2).transpose(0, 1, 3, 2, 4).reshape(n, H, G, S * W)
    vcodes = R.unpack(f["v_codes"], value_bits, S * W).astype(np.float64).reshape(n, H, G, S, W)
    v = vcodes * f["v_alpha"][..., None] + f["v_beta"][..., None]
    values = v.reshape(n, H, G, S * W) * f["v_c"][:, :, None, :]
    return keys, values


@pytest.mark.parametrize("chunk_blocks", [None, 4])
@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (8, 8), (2, 4)])
@pytest.mark.parametrize("d,g,n_rep", [(128, 128, 2), (64, 64, 1), (256, 64, 4)])
def test_record_products_match_float64(d, g, n_rep, key_bits, value_bits, chunk_blocks, monkeypatch):
    """record_scores / record_values over a block table (repeated and pad ids among them) equal
    float64 products with the dequantized records; ``chunk_blocks`` unpacks 4 of the 15 blocks
    at a time (the last chunk 3)."""
    H, B, nb = 2, 3, 5
    if chunk_blocks is not None:
        monkeypatch.setattr(CA, "CHUNK_CODES", chunk_blocks * H * d * g)
    rng = np.random.default_rng([d, g, n_rep, key_bits, value_bits])
    rec = quantized_blocks(rng, 9, H, d, g, key_bits, value_bits)
    table = mx.array(rng.integers(0, 9, (B, nb)), dtype=mx.int32)
    gathered = {name: x[table] for name, x in rec.items()}
    q = rng.standard_normal((B, H, n_rep, d)).astype(np.float32)
    p = rng.random((B, nb, H, n_rep, g)).astype(np.float32)
    keys, values = dequantized_blocks(rec, key_bits, value_bits)
    t = np.array(table)
    want_s = np.einsum("bhrd,bnhgd->bnhrg", q.astype(np.float64), keys[t])
    want_o = np.einsum("bnhrg,bnhgd->bhrd", p.astype(np.float64), values[t])
    got_s = np.array(CA.record_scores(mx.array(q), gathered, key_bits))
    got_o = np.array(CA.record_values(mx.array(p), gathered, value_bits))
    assert got_s.shape == want_s.shape and got_o.shape == want_o.shape
    assert np.abs(got_s - want_s).max() < 2e-6 * np.abs(want_s).max()
    assert np.abs(got_o - want_o).max() < 2e-6 * np.abs(want_o).max()


@pytest.mark.parametrize("preset", ["k4v2", "k8v8", "k3v3"])
def test_compiled_decode_over_unpacked_codes_matches_quantized_matmul_and_dequantized(preset, monkeypatch):
    """decode_attention_over as the compiled step runs it (padded table, validity mask, windows
    as a slice) through the unpacked codes where the widths allow it (k4v2, k8v8), through
    mx.quantized_matmul otherwise (k3v3): the same output as the quantized_matmul path and the
    dequantized reference, to float32 noise."""
    rng = np.random.default_rng(7)
    layout = KVLayout.kvarn(preset)
    H, D, G, B, n_q = 2, 128, 128, 3, 4
    rec = quantized_blocks(rng, 8, H, D, G, layout.key_bits, layout.value_bits)
    lengths = [5, 2, 0]  # records a row holds; the table is padded to 8 with the pad block (0)
    table = mx.array([[1 + (b + i) % 7 for i in range(n)] + [0] * (8 - n) for b, n in enumerate(lengths)], mx.int32)
    tails = [40, 127, 3]
    cols = np.arange(2 * G + 8 * G)
    mask = np.stack([(cols < G + t) | ((cols >= 2 * G) & (cols < 2 * G + n * G)) for n, t in zip(lengths, tails)])
    win = [mx.array(rng.standard_normal((B + 1, H, 2 * G, D)).astype(np.float16).astype(np.float32)) for _ in range(2)]
    queries = mx.array(rng.standard_normal((B, n_q, 1, D)).astype(np.float32))
    fields = [rec[name] for name in RECORD_FIELDS]

    def attend(q, win_k, win_v, table, mask, *fields):
        a = LayerArrays(records=dict(zip(RECORD_FIELDS, fields)), win_k=win_k, win_v=win_v)
        return PA.decode_attention_over(q, a, layout, D ** -0.5, windows=(1, B + 1), win_len=2 * G, table=table,
                                        mask=mask)

    args = (queries, *win, table, mx.array(mask.reshape(B, 1, 1, -1)), *fields)
    assert PA._reads_unpacked(layout) == (preset != "k3v3")
    got = np.array(mx.compile(attend)(*args))
    monkeypatch.setattr(PA, "_reads_unpacked", lambda layout: False)
    qmm = np.array(mx.compile(attend)(*args))
    a = LayerArrays(records=dict(zip(RECORD_FIELDS, fields)), win_k=win[0], win_v=win[1])
    index = PA.Attended((1, B + 1), 2 * G, table, args[4])
    deq = np.array(PA._dequantized_attention(queries, a, index, layout, D ** -0.5))
    scale = np.abs(deq).max()
    assert np.abs(got - qmm).max() < 1e-5 * scale
    assert np.abs(got - deq).max() < 1e-5 * scale
