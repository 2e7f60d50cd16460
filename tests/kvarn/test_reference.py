"""Self-checks of the NumPy reference (tests/kvarn/reference.py), mainly its section-4 attention,
which kvarn/attention.py will be compared against."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn import quantize as Q
from tests.kvarn import reference as R


def naive_attention(q, keys, values, scale, causal=False):
    """Plain float64 softmax attention, unrotated space. q [n_rep, L, D], keys/values [T, D]."""
    s = np.einsum("rld,td->rlt", q, keys) * scale
    if causal:
        seq_q, total = q.shape[1], keys.shape[0]
        mask = np.arange(total)[None, :] > (total - seq_q + np.arange(seq_q))[:, None]
        s = np.where(mask[None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ values


def sequence(rng, d, g, n_rec, n_tail, scale=1.0):
    t = g * (1 + n_rec) + n_tail
    k = rng.standard_normal((t, d)) * scale
    v = rng.standard_normal((t, d))
    k[:, : d // 8] *= 6.0  # a few outlier channels
    return k, v


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_exact_records_is_plain_attention(d, causal):
    """With unquantized records the rotations cancel: plain softmax attention."""
    rng = np.random.default_rng(d)
    g, n_rec, n_tail, n_rep, seq_q = 64, 3, 17, 4, (5 if causal else 1)
    k, v = sequence(rng, d, g, n_rec, n_tail)
    h = R.rotation_matrix(d)
    kr, vr = k @ h, v @ h
    recs = [(kr[g * (i + 1): g * (i + 2)], vr[g * (i + 1): g * (i + 2)]) for i in range(n_rec)]
    q = rng.standard_normal((n_rep, seq_q, d))
    scale = 1 / np.sqrt(d)
    out = R.reference_attention(q, kr[:g], vr[:g], recs, kr[g * (n_rec + 1):],
                                vr[g * (n_rec + 1):], scale, causal=causal)
    want = naive_attention(q, k, v, scale, causal=causal)
    assert out.shape == (n_rep, seq_q, d) and out.dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


def test_attention_empty_parts_and_gqa_rows_are_independent():
    rng = np.random.default_rng(0)
    d = 128
    k, v = sequence(rng, d, 64, 1, 0)
    kr, vr = R.rotate(k, np.float64), R.rotate(v, np.float64)
    q = rng.standard_normal((3, 2, d))
    full = R.reference_attention(q, None, None, [(kr, vr)], None, None, 0.1)
    for r in range(3):
        for i in range(2):
            one = R.reference_attention(q[r:r + 1, i:i + 1], kr[:10], vr[:10], [], kr[10:],
                                        vr[10:], 0.1)
            np.testing.assert_allclose(one[0, 0], full[r, i], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("d", [128, 256])
def test_attention_over_quantized_records_converges_with_bits(d):
    rng = np.random.default_rng(1)
    g, n_rec, n_tail = 128, 4, 30
    k, v = sequence(rng, d, g, n_rec, n_tail, scale=2.0)
    kr = R.rotate(k, np.float16)  # sink/tail are stored rotated fp16
    vr = R.rotate(v, np.float16)
    q = rng.standard_normal((2, 1, d)) * 2
    scale = 1 / np.sqrt(d)
    exact = naive_attention(q, kr.astype(np.float64) @ R.rotation_matrix(d),
                            vr.astype(np.float64) @ R.rotation_matrix(d), scale)
    errs = []
    for bits in (2, 4, 8):
        recs = [R.quantize_record(kr[g * (i + 1): g * (i + 2)], vr[g * (i + 1): g * (i + 2)],
                                  bits, bits) for i in range(n_rec)]
        assert len(recs[0].keys) == d // R.slice_width(d)
        out = R.reference_attention(q, kr[:g], vr[:g], recs, kr[g * (n_rec + 1):],
                                    vr[g * (n_rec + 1):], scale)
        errs.append(np.abs(out - exact).max() / np.abs(exact).max())
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.03, errs  # measured 0.010 (D=128), 0.015 (D=256)


def test_record_from_kvarn_tiles_matches_reference_record():
    """kvarn's stored tiles, read through record_from_tiles, give (nearly) the reference's
    attention: the same codes and fp16 scales up to rare float32 boundary cases."""
    rng = np.random.default_rng(2)
    d, g = 256, 64
    k, v = sequence(rng, d, g, 2, 5, scale=3.0)
    kr = np.array(Q.rotate(mx.array(k.astype(np.float32))))
    vr = np.array(Q.rotate(mx.array(v.astype(np.float32))))
    recs_mlx, recs_ref = [], []
    for i in range(2):
        kt = R.split_slices(kr[g * (i + 1): g * (i + 2)])  # [S, G, W]
        vt = R.split_slices(vr[g * (i + 1): g * (i + 2)])
        recs_mlx.append(R.record_from_tiles(Q.quantize_keys(mx.array(kt), 4, 8),
                                            Q.quantize_values(mx.array(vt), 2, 8), 4, 2))
        recs_ref.append(R.quantize_record(kr[g * (i + 1): g * (i + 2)],
                                          vr[g * (i + 1): g * (i + 2)], 4, 2))
        km, vm = recs_mlx[-1].dequantize(np.float32)
        np.testing.assert_allclose(
            km, R.join_slices(np.array(Q.dequantize_keys(Q.quantize_keys(mx.array(kt), 4, 8),
                                                         4))), rtol=1e-6, atol=1e-30)
        assert vm.shape == (g, d)
    q = rng.standard_normal((4, 1, d))
    args = (kr[:g].astype(np.float16), vr[:g].astype(np.float16))
    tail = (kr[3 * g:].astype(np.float16), vr[3 * g:].astype(np.float16))
    a = R.reference_attention(q, *args, recs_mlx, *tail, d ** -0.5)
    b = R.reference_attention(q, *args, recs_ref, *tail, d ** -0.5)
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())


def test_pack_unpack_roundtrip_all_widths():
    rng = np.random.default_rng(3)
    for bits in R.BITS:
        c = rng.integers(0, 1 << bits, (2, 3, 128)).astype(np.uint8)
        p = R.pack(c, bits)
        assert p.shape == (2, 3, 128 * bits // 32) and p.dtype == np.uint32
        np.testing.assert_array_equal(R.unpack(p, bits), c)
