"""Attention over the paged KVarN rows (``kvarn.paged``), as pure functions of arrays: a decode
batch's where no fused kernel attends, and a prompt chunk's. The storages call them from their
``attend`` (the model reaches that through the seam, ``kvarn.rows``); ``kvarn.cpu_attention`` holds the
CPU's own products.

Decode attention of paged KVarN rows after their step's write
(``kvarn.decode_graph.PagedStepLayer``): every row of one layer over its window and its records.
Where ``metal.KERNELS`` has a fused kernel for this device and shape (CUDA, the CPU's kernels, or
Metal on an Apple GPU: it reads the pool in place) the step calls it. Here: from the codes of
the rows' gathered records where MLX reads quantized codes (the CPU without its kernels:
unpacked to float32 for OpenBLAS products, ``kvarn.cpu_attention``, for 2-, 4- and 8-bit codes;
Metal and other widths: ``mx.quantized_matmul``), else one SDPA over the records gathered and
dequantized (the reference path), under the step's per-row validity mask.

Attention of a KVarN prompt chunk (the first one too): each token sees what decode would show it.
A chunk's tokens attend the row's sink, the records committed before them (dequantized once
to the attention dtype) and their own tile in float16, under one additive mask per chunk
(``chunk_view_mask``, shared by every layer of the forward through its ``StepContext``), so a
row's cache and outputs do not depend on how its prompt was chunked (docs/kvarn.md, "Attention").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvarn import cpu_attention
from kvarn.pool import RECORD_FIELDS, dequantize_blocks
from kvarn.quantize import rotate, rotate_to
from kvarn.step_context import StepContext
from metal import KERNELS
from metal.selector import FUSED

# --- decode attention of paged KVarN rows where no fused kernel attends ---

def attention_dtype(queries: mx.array) -> mx.Dtype:
    """Float32 where that is the compute dtype, else float16 (the storage dtype: bfloat16 would
    round the float16 history again)."""
    return mx.float32 if queries.dtype == mx.float32 else mx.float16


@dataclass(frozen=True)
class Attended:
    """What a decode step's attention reads besides the pool's arrays: the batch's ``windows``
    (a ``(lo, hi)`` range read as a slice, or their ids), the first ``win_len`` tokens of each,
    the block ``table`` [B, nb] (None: no records yet) and the validity ``mask``
    [B, 1, 1, win_len + nb*G]."""

    windows: mx.array | tuple[int, int]
    win_len: int
    table: mx.array | None
    mask: mx.array


def decode_attention_over(queries: mx.array, a: Any, layout: Any, scale: float, *, windows: mx.array | tuple[int, int],
                          win_len: int, table: mx.array | None, mask: mx.array) -> mx.array:
    """Decode attention of every row of one layer over the arrays ``a`` (a ``LayerArrays``: the
    pool's, or a compiled step's values of them) without a fused kernel: straight from the
    codes where MLX reads them (``_quantized_matmul_attention``), else the records gathered and
    dequantized (``_dequantized_attention``). Every per-step value is an array or a shape, so a
    compiled step runs it as is (``kvarn.decode_graph``)."""
    index = Attended(windows, win_len, table, mask)
    if reads_codes_directly():
        return _quantized_matmul_attention(queries, a, index, layout, scale)
    return _dequantized_attention(queries, a, index, layout, scale)


def fused_attention() -> bool:
    """Whether decode attention runs a fused kernel on this device (``metal.KERNELS``' verdict):
    its launch is planned from host integers, so such a step is not planned as arrays."""
    return KERNELS.attention_path() in FUSED


def _dequantized_attention(queries: mx.array, a: Any, index: Any, layout: Any, scale: float) -> mx.array:
    """One SDPA over [window (sink, tail) | records gathered and dequantized], under the mask."""
    dtype = attention_dtype(queries)
    keys, vals = _windows(a, index)
    keys, vals = keys.astype(dtype), vals.astype(dtype)
    if index.table is not None:
        gathered = {name: a.records[name][index.table] for name in RECORD_FIELDS}
        rec_k, rec_v = dequantize_blocks(gathered, layout, dtype)
        keys, vals = mx.concatenate([keys, rec_k], axis=2), mx.concatenate([vals, rec_v], axis=2)
    q = rotate_to(queries, dtype)
    mask = index.mask
    if mask.shape[2] > 1:  # per query row of a KV head [B, 1, R, cols] (several positions a row) -> per head
        B, n_q = queries.shape[:2]
        H = keys.shape[1]
        mask = mx.broadcast_to(mask[:, :, :, None], (B, H, n_q // H, 1, mask.shape[-1])).reshape(B, n_q, 1, -1)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=mask)
    return rotate_to(out, queries.dtype)


def reads_codes_directly() -> bool:
    """Whether MLX here has ``quantized_matmul`` kernels for KVarN's transpose=False shapes (the CPU
    and Metal; MLX's CUDA backend has none for some of them, e.g. 2-bit values with few rows)."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def _windows(a: Any, index: Attended) -> tuple[mx.array, mx.array]:
    """The batch's windows, their first ``index.win_len`` tokens (a slice when consecutive)."""
    w, n = index.windows, index.win_len
    if isinstance(w, tuple):
        return a.win_k[w[0]: w[1], :, :n], a.win_v[w[0]: w[1], :, :n]
    return a.win_k[w][:, :, :n], a.win_v[w][:, :, :n]


def _quantized_matmul_attention(queries: mx.array, a: Any, index: Attended, layout: Any, scale: float) -> mx.array:
    """The reference path where MLX reads quantized codes (CPU, Metal): scores and values of the
    records straight from their codes, the windows by plain matmuls, one softmax under the step's
    validity mask, in float32; the factored form keeps the per-token factors (k_r, v_c) outside
    the products. On the CPU, for widths whose codes sit within a byte, the codes are unpacked
    to float32 for OpenBLAS products (``kvarn.cpu_attention.record_scores``: MLX's CPU
    ``quantized_matmul`` is a scalar loop: one layer 0.77-0.80x its time from one row of 3,000
    tokens to 64 of 2,000); elsewhere through ``mx.quantized_matmul``. The rows' blocks
    are gathered first (``_row_records``), so a step reads what its rows hold whatever the
    pool's size."""
    B, n_q, _, D = queries.shape
    H = a.win_k.shape[1]
    R, G, f32 = n_q // H, layout.tile_size, mx.float32
    native = _native(layout, a, D) if index.mask.shape[2] in (1, R) else None
    if native is not None:  # the CPU's kernel: codes read in place, one pass a row and KV head, the
        # queries rotated and scaled and the output rotated back inside (``rotate``'s bits)
        out = native.decode_attention(queries.astype(f32).reshape(B, H, R, D), a.records, a.win_k, a.win_v,
                                      _window_ids(index, B), index.table, index.mask.reshape(B, index.mask.shape[2], -1),
                                      win_len=index.win_len, key_bits=layout.key_bits, value_bits=layout.value_bits,
                                      scale=scale)
        return out.astype(queries.dtype).reshape(B, n_q, 1, D)
    q = rotate(queries.astype(f32)).reshape(B, H, R, D) * scale
    win_k, win_v = _windows(a, index)
    scores = [cpu_attention.scores_product(q, win_k.astype(f32))]
    table = index.table
    unpacked = _reads_unpacked(layout)
    if table is not None:
        rec = {name: x[table] for name, x in a.records.items()} if unpacked else _row_records(a.records, table)
        nb = table.shape[1]
        rec_scores = cpu_attention.record_scores(q, rec, layout.key_bits) if unpacked else _record_scores(q, rec, layout)
        scores.append(rec_scores.transpose(0, 2, 3, 1, 4).reshape(B, H, R, nb * G))
    s = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    p = _softmax(mx.where(index.mask, s, -mx.inf))
    n = index.win_len
    out = p[..., :n] @ win_v.astype(f32)
    if table is not None:
        p_rec = p[..., n:].reshape(B, H, R, nb, G).transpose(0, 3, 1, 2, 4)  # [B, nb, H, R, G]
        out = out + (cpu_attention.record_values(p_rec, rec, layout.value_bits) if unpacked
                     else _record_values(p_rec, rec, layout))
    return rotate(out).astype(queries.dtype).reshape(B, n_q, 1, D)


def _native(layout: Any, a: Any, head_dim: int) -> Any:
    """The CPU's decode kernel (``metal.cpu``) where it runs and takes this layout and these arrays
    (float32 or float16 windows, float16 factors), else None."""
    if mx.default_device() != mx.cpu or a.win_k.dtype not in (mx.float32, mx.float16) \
            or a.records["k_alpha"].dtype != mx.float16:
        return None
    kernels = KERNELS.cpu()
    if kernels is None or not kernels.is_supported(head_dim=head_dim, key_bits=layout.key_bits,
                                                   value_bits=layout.value_bits):
        return None
    return kernels


def _window_ids(index: Attended, B: int) -> mx.array:
    """The rows' window ids [B] int32 (a range where they are consecutive)."""
    w = index.windows
    return mx.arange(w[0], w[1], dtype=mx.int32) if isinstance(w, tuple) else w.astype(mx.int32).reshape(B)


def _reads_unpacked(layout: Any) -> bool:
    """Whether the records' products go through unpacked codes (``kvarn.cpu_attention``): on the
    CPU, where MLX's ``quantized_matmul`` is scalar, for widths whose codes sit within a byte."""
    return mx.default_device() == mx.cpu and cpu_attention.reads_unpacked(layout.key_bits, layout.value_bits)


def _softmax(scores: mx.array) -> mx.array:
    """Softmax along the last axis; on the CPU through ``kvarn.cpu_attention``'s vectorized exp
    (MLX's CPU ``exp`` is a scalar call an element: its softmax took a seventh of a layer's decode
    attention over one 3,000-token row, a fifth over 16 rows of 1,024)."""
    if mx.default_device() != mx.cpu:
        return mx.softmax(scores, axis=-1)
    weights, total = cpu_attention.softmax_parts(scores)
    return weights / total


def _row_records(records: dict[str, mx.array], table: mx.array) -> dict[str, mx.array]:
    """The record fields of the blocks ``table`` [B, nb], factors in float32 ([B, nb, ...]).
    Gathered, not indexed inside the products: ``mx.gather_qmm`` over the whole pool casts every
    block's float16 factors to float32 at each call (a step's cost then grows with the pool:
    8.0 vs 1.9 ms a layer for one 3,000-token row in a pool of 2,072 blocks on a CPU)."""
    return {name: x[table] if x.dtype == mx.uint32 else x[table].astype(mx.float32) for name, x in records.items()}


def _record_scores(q: mx.array, rec: dict[str, mx.array], layout: Any) -> mx.array:
    """Scores [B, nb, H, R, G] of queries ``q`` [B, H, R, D] (rotated, scaled) against each row's
    records: per 128-channel slice, q . (codes * alpha + beta) over the slice's channels, times
    the token factor k_r, summed over slices."""
    B, H, R, D = q.shape
    S, W = rec["k_codes"].shape[3:5]
    q_s = q.reshape(B, 1, H, R, S, W).transpose(0, 1, 2, 4, 3, 5)  # [B, 1, H, S, R, W]: one product a block
    raw = mx.quantized_matmul(q_s, rec["k_codes"], rec["k_alpha"][..., None], rec["k_beta"][..., None],
                              transpose=False, group_size=layout.tile_size, bits=layout.key_bits)  # [B,nb,H,S,R,G]
    return mx.sum(raw * rec["k_r"][:, :, :, :, None, :], axis=3)


def _record_values(p: mx.array, rec: dict[str, mx.array], layout: Any) -> mx.array:
    """sum over each row's records of p [B, nb, H, R, G] @ values: per block, p @ (codes * alpha +
    beta) over its tokens, times the channel factor v_c, summed over blocks -> [B, H, R, D]."""
    S = rec["v_alpha"].shape[-1]
    D = rec["v_c"].shape[-1]
    part = mx.quantized_matmul(p, rec["v_codes"], rec["v_alpha"], rec["v_beta"], transpose=False, group_size=D // S,
                               bits=layout.value_bits)  # [B, nb, H, R, D]
    return mx.sum(part * rec["v_c"][:, :, :, None, :], axis=1)


# --- a KVarN prompt chunk's attention ---

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
    q = rotate_to(queries, queries.dtype)
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
    # the CPU takes the window tile by tile beside the mask (``cpu_attention.window_attention``), except
    # before the prompt's first record (fewer than 2G tokens): then every token sees exactly the keys up
    # to its own, and one causal product over the sink and the window is the cheaper way
    by_tiles = on_cpu and (rec_k is not None or window is not None)
    if chunk.window_k is not None:
        window_start = chunk.window_start
        if not by_tiles:
            parts_k.append(chunk.window_k.astype(sink_k.dtype))
            parts_v.append(chunk.window_v.astype(sink_v.dtype))
    keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate(parts_k, axis=2)
    values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    mask_end = window_start if by_tiles else end
    shape = (start, end, sink_k.shape[2], num_records, window_start, G, q.dtype, rec_first, window, mask_end)
    mask = (step or StepContext()).get(("chunk_mask", *shape), lambda: chunk_view_mask(*shape[:-1], mask_end))
    if not on_cpu:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    elif by_tiles and window_start < end:
        out = cpu_attention.window_attention(q, keys, values, mask, chunk.window_k.astype(q.dtype),
                                             chunk.window_v.astype(q.dtype), start=start, window_start=window_start,
                                             G=G, scale=scale)
    else:
        out = cpu_attention.attention(q, keys, values, scale, mask)
    return rotate_to(out, queries.dtype)


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
