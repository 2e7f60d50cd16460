"""Attention over KVarN caches (docs/kvarn.md, "Attention") and the seam that routes
mlx-lm models to it.

Three paths, by what the cache holds:
- prompt chunks (the first one too): the records are dequantized once to float16 and joined with the
  sink and the chunk's float16 window for the fused SDPA, under a mask that gives each token
  the view decode would give it (``chunk_attention``; transient: one copy of the history);
- decode (L == 1): scores from ``quantized_matmul`` over the transposed key codes, per-tile value
  partials with channel factors, fp16 sink and tail, one softmax, inverse rotation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvarn.batch import BatchRows, batch_attention
from kvarn.cache import Chunk, KVarNKVCache
from kvarn.paged import PagedLayer
from kvarn.paged_batch import PagedBatch, paged_attention, reads_codes_directly
from kvarn.slot_attention import attends_per_row, fused_decode, fused_decode_attention, per_row_attention
from kvarn.slots import SlotBatch
from kvarn.step import StepContext, step_of
from kvarn.quantize import rotate
from kvarn.record import RecordArrays

SEAM_NAME = "scaled_dot_product_attention"
_SEAM_MARK = "__kvarn_seam__"


def dequantize_records(cache: KVarNKVCache, view: RecordArrays,
                       dtype: mx.Dtype = mx.float16) -> tuple[mx.array, mx.array]:
    """Rotated keys and values [B, H, T_q, D] of the committed records, in ``dtype`` (float16,
    or float32 where that is the compute dtype: MLX's CPU backend runs float32 ~3x faster)."""
    layout = cache.layout
    B, H, S, W, _ = view.k_codes.shape
    k = mx.dequantize(view.k_codes, view.k_alpha.astype(dtype), view.k_beta.astype(dtype),
                      group_size=layout.tile_size, bits=layout.key_bits)
    k = (k * view.k_r[..., None, :].astype(dtype)).transpose(0, 1, 4, 2, 3).reshape(B, H, -1, S * W)
    v = mx.dequantize(view.v_codes, view.v_alpha.astype(dtype), view.v_beta.astype(dtype), group_size=W,
                      bits=layout.value_bits)
    v = (v * view.v_c[..., None, :].astype(dtype)).reshape(B, H, -1, S * W)
    return k, v


def full_history(cache: KVarNKVCache, dtype: mx.Dtype = mx.float16) -> tuple[mx.array, mx.array]:
    """[sink | dequantized records | tail] as rotated keys and values in ``dtype``."""
    parts_k = [cache.sink_k[..., : cache.sink_len, :].astype(dtype)]
    parts_v = [cache.sink_v[..., : cache.sink_len, :].astype(dtype)]
    view = cache.records.view()
    if view is not None:
        k, v = dequantize_records(cache, view, dtype)
        parts_k.append(k)
        parts_v.append(v)
    parts_k.append(cache.tail_k[..., : cache.tail_len, :].astype(dtype))
    parts_v.append(cache.tail_v[..., : cache.tail_len, :].astype(dtype))
    return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)


def _record_scores(q: mx.array, view: RecordArrays, cache: KVarNKVCache) -> mx.array:
    """q [B,H,R,D] rotated and scaled -> scores [B,H,R,T_q] over the records."""
    B, H, S, W, _ = view.k_codes.shape
    R = q.shape[2]
    q_s = q.reshape(B, H, R, S, W).transpose(0, 1, 3, 2, 4)  # [B,H,S,R,W]
    raw = mx.quantized_matmul(q_s, view.k_codes, view.k_alpha.astype(q.dtype), view.k_beta.astype(q.dtype),
                              transpose=False, group_size=cache.layout.tile_size, bits=cache.layout.key_bits)
    return mx.sum(raw * view.k_r[..., None, :].astype(q.dtype), axis=2)


def _record_values(p: mx.array, view: RecordArrays, cache: KVarNKVCache) -> mx.array:
    """p [B,H,R,T_q] -> weighted values [B,H,R,D] over the records."""
    B, H, n, G, _ = view.v_codes.shape
    S = view.v_alpha.shape[-1]
    D = view.v_c.shape[-1]
    R = p.shape[2]
    p_tiles = p.reshape(B, H, R, n, G).transpose(0, 1, 3, 2, 4)  # [B,H,n,R,G]
    partial = mx.quantized_matmul(p_tiles, view.v_codes, view.v_alpha.astype(p.dtype),
                                  view.v_beta.astype(p.dtype), transpose=False, group_size=D // S,
                                  bits=cache.layout.value_bits)  # [B,H,n,R,D]
    return mx.sum(partial * view.v_c[..., None, :].astype(p.dtype), axis=2)


def decode_attention(queries: mx.array, cache: KVarNKVCache, scale: float) -> mx.array:
    """The exact MLX-native decode path; queries [B, n_q, L, D] (L small), GQA folded into rows."""
    B, n_q, L, D = queries.shape
    H = cache.sink_k.shape[1]
    R = (n_q // H) * L
    dtype = mx.float32  # as the fused SDPA accumulates: fp16/bf16 scores cost ~10x the error
    q = rotate(queries.astype(mx.float32)).reshape(B, H, R, D) * scale
    sink_k, sink_v = cache.sink_k[..., : cache.sink_len, :], cache.sink_v[..., : cache.sink_len, :]
    tail_k, tail_v = cache.tail_k[..., : cache.tail_len, :], cache.tail_v[..., : cache.tail_len, :]
    view = cache.records.view()
    scores = [q @ mx.swapaxes(sink_k, -1, -2).astype(dtype)]
    if view is not None:
        scores.append(_record_scores(q, view, cache))
    scores.append(q @ mx.swapaxes(tail_k, -1, -2).astype(dtype))
    probs = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1).astype(dtype)
    n_sink, n_rec = cache.sink_len, 0 if view is None else view.k_r.shape[-1]
    out = probs[..., :n_sink] @ sink_v.astype(dtype)
    if view is not None:
        out = out + _record_values(probs[..., n_sink: n_sink + n_rec], view, cache)
    out = out + probs[..., n_sink + n_rec:] @ tail_v.astype(dtype)
    return rotate(out).astype(queries.dtype).reshape(B, n_q, L, D)


def decode_uses_quantized_matmul() -> bool:
    """MLX's CUDA backend has no ``quantized_matmul`` kernel for some transpose=False shapes the
    value path needs (2-bit, few rows): there, a single-stream cache's decode uses the dequantized
    path (same values to float16 noise); paged rows run the fused kernels of ``metal/``."""
    return reads_codes_directly()


def chunk_attention(queries: mx.array, cache: KVarNKVCache, scale: float) -> mx.array:
    """A prompt chunk of a single-stream cache: ``chunk_attention_over`` its history."""
    dtype = mx.float32 if queries.dtype == mx.float32 else mx.float16
    sink_k = cache.sink_k[..., : cache.sink_len, :].astype(dtype)
    sink_v = cache.sink_v[..., : cache.sink_len, :].astype(dtype)
    view = cache.records.view()
    rec_k, rec_v = dequantize_records(cache, view, dtype) if view is not None else (None, None)
    return chunk_attention_over(queries, sink_k, sink_v, rec_k, rec_v, cache.chunk, cache.layout.tile_size, scale,
                                step=step_of(cache))


def chunk_attention_over(queries: mx.array, sink_k: mx.array, sink_v: mx.array, rec_k: mx.array | None,
                         rec_v: mx.array | None, chunk: Chunk, G: int, scale: float, *, rec_first: int = 0,
                         window: int | None = None, step: StepContext | None = None) -> mx.array:
    """A prompt chunk (the first one too), each token seeing what decode would have shown it.

    Decode at position p attends to the sink, the records of every tile committed once p is in
    (tiles ending at or before p + 1) and, in float16, the tail: its own tile's tokens up to p.
    So a token's attention does not depend on how the prompt was chunked, nor on whether it came
    in a chunk or in decode; a prefix restored from the prefix cache (records made by any of them)
    continues exactly as the row that made it would have. ``sink_*`` and ``rec_*`` [1, H, n, D]
    are the row's history in the attention dtype (``rec_*`` None: no records yet; they include the
    tiles this chunk committed); ``chunk.window_*`` the tail before the chunk and the chunk's own
    tokens in float16. A windowed row (``--max-kv-size``: ``window`` tokens, ``kvarn.window``)
    passes the records from ``rec_first`` on (its table: what the chunk's first token still
    attends), and each token's records are cut to its own window.

    One fused SDPA for the whole chunk, over every key any of its tokens may see, under an additive
    mask (``chunk_view_mask``, built once per chunk and shared by all layers through the forward's
    ``step``):

        keys   [ sink (s) | record 0 .. record n-1 (n*G, dequantized) | window (float16) ]
        query p, tile t = p // G, sees
          sink key j        j <= p
          record r          p >= (r + 2) * G - 1     (record r is tile r + 1; committed once its
                                                      last token is in), and, in a window,
                            r >= evicted_records(p + 1, window, G)
          window key at w   w // G == t, w <= p, and p is not its tile's last token
                            (the last one sees its tile as a record instead)

    MLX's GPU backends run this masked attention fused (CUDA: cuDNN with the mask as a bias; Metal:
    the full-attention kernel), so a chunk costs one attention call a layer however many tiles it
    spans, and the history is joined once (cutting the chunk at tiles instead joins it once a tile:
    quadratic in the prompt's length). On the CPU MLX's attention is unfused whatever the mask.
    """
    start, end = chunk.start, chunk.start + queries.shape[2]
    q = rotate(queries.astype(mx.float32)).astype(queries.dtype)
    parts_k, parts_v = [sink_k], [sink_v]
    num_records = 0
    if rec_k is not None:
        parts_k.append(rec_k)
        parts_v.append(rec_v)
        num_records = rec_k.shape[2] // G
    if rec_first and window is None:
        raise ValueError("records start past record 0 only in a windowed row")
    window_start = end
    if chunk.window_k is not None:
        parts_k.append(chunk.window_k.astype(sink_k.dtype))
        parts_v.append(chunk.window_v.astype(sink_v.dtype))
        window_start = chunk.window_start
    keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate(parts_k, axis=2)
    values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
    shape = (start, end, sink_k.shape[2], num_records, window_start, G, q.dtype, rec_first, window)
    mask = (step or StepContext()).get(("chunk_mask", *shape), lambda: chunk_view_mask(*shape))
    out = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale,
                                               mask=mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


def chunk_view_mask(start: int, end: int, sink_len: int, num_records: int, window_start: int, G: int,
                    dtype: mx.Dtype, rec_first: int = 0, window: int | None = None) -> mx.array:
    """The additive mask [L, sink_len + num_records * G + (end - window_start)] of
    ``chunk_attention_over`` for queries at positions ``start .. end - 1`` (0 where a key is seen,
    -inf where not) over records ``rec_first .. rec_first + num_records - 1``."""
    i32 = mx.int32
    p = mx.arange(start, end, dtype=i32)[:, None]
    seen = [mx.arange(sink_len, dtype=i32)[None] <= p]
    if num_records:
        r = mx.arange(rec_first * G, (rec_first + num_records) * G, dtype=i32)[None] // G
        rec_ok = p >= (r + 2) * G - 1
        if window is not None:
            rec_ok = rec_ok & (r >= evicted_records_at(p + 1, window, G))
        seen.append(rec_ok)
    if window_start < end:
        w = mx.arange(window_start, end, dtype=i32)[None]
        seen.append((w // G == p // G) & (w <= p) & (p % G != G - 1))
    ok = seen[0] if len(seen) == 1 else mx.concatenate(seen, axis=1)
    return mx.where(ok, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def evicted_records_at(n: mx.array, window: int, G: int) -> mx.array:
    """``kvarn.window.evicted_records`` for an array of token counts ``n`` (int32)."""
    committed = mx.maximum(n - G, 0) // G
    tail = mx.where(n > G, (n - G) % G, 0)
    keep = mx.maximum((window - G - tail) // G, 0)
    return mx.maximum(committed - keep, 0)


def kvarn_attention(queries: mx.array, cache: KVarNKVCache, scale: float, mask: Any) -> mx.array:
    chunk = cache.chunk
    L = queries.shape[2]
    if chunk is not None and (queries.shape[2] > 1 or chunk.start == 0):  # a prompt chunk (the first too)
        return chunk_attention(queries, cache, scale)
    if L == 1 and decode_uses_quantized_matmul():
        return decode_attention(queries, cache, scale)
    keys, values = full_history(cache, mx.float32 if queries.dtype == mx.float32 else mx.float16)
    q = rotate(queries.astype(mx.float32)).astype(queries.dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale,
                                               mask=mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


def affine_dequantized_attention(queries: mx.array, keys: tuple, values: tuple, cache: QuantizedKVCache,
                                 scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
    """mlx-lm's affine cache through dequantization: where MLX CUDA has no ``quantized_matmul``
    kernel for a sequence length (any odd one), this gives the same values to float noise."""
    k = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def make_dispatch(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        if isinstance(cache, (PagedLayer, PagedBatch)):
            if sinks is not None:
                raise ValueError("KVarN attention does not support attention sinks")
            return paged_attention(queries, cache, scale, mask)
        if isinstance(cache, SlotBatch) and fused_decode(cache, queries, sinks):
            return fused_decode_attention(queries, cache, scale)
        if isinstance(cache, SlotBatch) and attends_per_row(cache):
            return per_row_attention(queries, keys, values, cache, scale, sinks)
        if isinstance(cache, BatchRows):
            return batch_attention(scaled_dot_product_attention, queries, cache, scale, mask, sinks)
        if isinstance(cache, KVarNKVCache):
            if sinks is not None:
                raise ValueError("KVarN attention does not support attention sinks")
            return kvarn_attention(queries, cache, scale, mask)
        if isinstance(keys, tuple) and getattr(cache, "bits", None) is not None and not decode_uses_quantized_matmul():
            return affine_dequantized_attention(queries, keys, values, cache, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _SEAM_MARK, True)
    return scaled_dot_product_attention


def install_attention_seam(model: Any) -> list[str]:
    """Route every mlx-lm model module's ``scaled_dot_product_attention`` through KVarN.

    mlx-lm model modules bind the function at import time, so each loaded ``mlx_lm.models.*``
    module that holds it is patched. Fails loudly if the model's own module does not hold it
    (a new mlx-lm that moved the seam must not silently run fp16). Returns the patched modules.
    """
    own = sys.modules[type(model).__module__]
    if not callable(getattr(own, SEAM_NAME, None)):
        raise RuntimeError(f"{own.__name__} has no '{SEAM_NAME}': cannot route attention to KVarN "
                           "(mlx-lm's attention seam moved; refusing to run without it)")
    patched = []
    for name, module in list(sys.modules.items()):
        current = getattr(module, SEAM_NAME, None) if name.startswith("mlx_lm.models.") else None
        if current is None:
            continue
        if not getattr(current, _SEAM_MARK, False):  # installed once per module, never wrapped twice
            setattr(module, SEAM_NAME, make_dispatch(current))
        patched.append(name)
    if own.__name__ not in patched:
        raise RuntimeError(f"failed to install the KVarN attention seam in {own.__name__}")
    return patched
