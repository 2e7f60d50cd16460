"""Attention of a KVarN prompt chunk (the first one too): each token sees what decode would show it.

A chunk's tokens attend the row's sink, the records committed before them (dequantized once
to the attention dtype) and their own tile in float16, under one additive mask per chunk
(``chunk_view_mask``, shared by every layer of the forward through its ``StepContext``), so a
row's cache and outputs do not depend on how its prompt was chunked (docs/kvarn.md, "Attention").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvarn import cpu_attention
from kvarn.quantize import rotate
from kvarn.step import StepContext


@dataclass(frozen=True)
class Chunk:
    """Where the latest update of several tokens (a prompt chunk) sits, for its attention.

    ``window_k``/``window_v`` hold the rotated float16 keys and values of tokens
    ``[window_start, offset)``: the tail as it was before the chunk, then the chunk's own tokens
    past the sink (None if the chunk fits in the sink). Every token gets the view decode gives
    it (``chunk_attention_over``): the sink, the records of the tiles committed
    before it, and its own tile in float16 from this window, the first chunk of a prompt as
    much as any later one (so no chunk keeps raw keys, and a prompt's cache does not depend on
    how it was chunked)."""

    start: int = 0
    window_start: int = 0
    window_k: mx.array | None = None
    window_v: mx.array | None = None



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
    quadratic in the prompt's length). On the CPU MLX's attention is unfused whatever the mask, and
    float32 chunks attend through ``kvarn.cpu_attention`` (a vectorized exp).
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
    on_cpu = q.dtype == mx.float32 and mx.default_device() == mx.cpu  # MLX's CPU softmax: a scalar exp an element
    if chunk.window_k is not None:
        window_start = chunk.window_start
        if not on_cpu:
            parts_k.append(chunk.window_k.astype(sink_k.dtype))
            parts_v.append(chunk.window_v.astype(sink_v.dtype))
    keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate(parts_k, axis=2)
    values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    mask_end = window_start if on_cpu else end  # the CPU takes the window tile by tile, beside the mask
    shape = (start, end, sink_k.shape[2], num_records, window_start, G, q.dtype, rec_first, window, mask_end)
    mask = (step or StepContext()).get(("chunk_mask", *shape), lambda: chunk_view_mask(*shape[:-1], mask_end))
    if not on_cpu:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    elif window_start < end:
        out = cpu_attention.window_attention(q, keys, values, mask, chunk.window_k.astype(q.dtype),
                                             chunk.window_v.astype(q.dtype), start=start, window_start=window_start,
                                             G=G, scale=scale)
    else:
        out = cpu_attention.attention(q, keys, values, scale, mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


def chunk_view_mask(start: int, end: int, sink_len: int, num_records: int, window_start: int, G: int,
                    dtype: mx.Dtype, rec_first: int = 0, window: int | None = None,
                    window_end: int | None = None) -> mx.array:
    """The additive mask [L, sink_len + num_records * G + (window_end - window_start)] of
    ``chunk_attention_over`` for queries at positions ``start .. end - 1`` (0 where a key is seen,
    -inf where not) over records ``rec_first .. rec_first + num_records - 1`` and window tokens
    ``window_start .. window_end - 1`` (``window_end`` by default ``end``: all of them)."""
    window_end = end if window_end is None else window_end
    i32 = mx.int32
    p = mx.arange(start, end, dtype=i32)[:, None]
    seen = [mx.arange(sink_len, dtype=i32)[None] <= p]
    if num_records:
        r = mx.arange(rec_first * G, (rec_first + num_records) * G, dtype=i32)[None] // G
        rec_ok = p >= (r + 2) * G - 1
        if window is not None:
            rec_ok = rec_ok & (r >= evicted_records_at(p + 1, window, G))
        seen.append(rec_ok)
    if window_start < window_end:
        w = mx.arange(window_start, window_end, dtype=i32)[None]
        seen.append((w // G == p // G) & (w <= p) & (p % G != G - 1))
    ok = seen[0] if len(seen) == 1 else mx.concatenate(seen, axis=1)
    return mx.where(ok, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def evicted_records_at(n: mx.array, window: int, G: int) -> mx.array:
    """``kvarn.window.evicted_records`` for an array of token counts ``n`` (int32)."""
    committed = mx.maximum(n - G, 0) // G
    tail = mx.where(n > G, (n - G) % G, 0)
    keep = mx.maximum((window - G - tail) // G, 0)
    return mx.maximum(committed - keep, 0)
