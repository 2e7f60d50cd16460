"""kvarn/cpu_attention.py against float64 NumPy and MLX's own attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn import cpu_attention as CA


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


@pytest.mark.parametrize("start,L,window_start", [(0, 300, 64), (70, 200, 64), (192, 64, 128), (130, 1, 128),
                                                  (320, 77, 256)])
def test_window_attention_is_the_masked_attention_over_the_joined_keys(start, L, window_start):
    """The window taken tile by tile gives what one masked attention over [keys | window] gives."""
    from kvarn.chunk_attention import chunk_view_mask

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
