"""Decode attention of paged KVarN rows (``kvarn.paged``) after their step's write
(``kvarn.decode_graph.PagedStepLayer``): every row of one layer over its window and its records.

Where ``metal.KERNELS`` has a fused kernel for this device and shape (CUDA, or Metal on an Apple
GPU: it reads the pool in place) the step calls it itself (``PagedStepLayer``). Here: from the
codes of the rows' gathered records where MLX reads quantized codes (the CPU: unpacked to float32
for OpenBLAS products, ``kvarn.cpu_attention``, for 2-, 4- and 8-bit codes; Metal and other
widths: ``mx.quantized_matmul``), else one SDPA over the records gathered and dequantized (the
reference path), under the step's per-row validity mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvarn import cpu_attention
from kvarn.pool import RECORD_FIELDS, dequantize_blocks
from kvarn.quantize import rotate
from metal import KERNELS
from metal.selector import FUSED


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
    q = rotate(queries.astype(mx.float32)).astype(dtype)
    mask = index.mask
    if mask.shape[2] > 1:  # per query row of a KV head [B, 1, R, cols] (several positions a row) -> per head
        B, n_q = queries.shape[:2]
        H = keys.shape[1]
        mask = mx.broadcast_to(mask[:, :, :, None], (B, H, n_q // H, 1, mask.shape[-1])).reshape(B, n_q, 1, -1)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


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
    win_k, win_v = _windows(a, index)
    q = rotate(queries.astype(f32)).reshape(B, H, R, D) * scale
    scores = [q @ mx.swapaxes(win_k, -1, -2).astype(f32)]
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
    weights = cpu_attention.softmax_weights(scores)
    return weights / mx.sum(weights, axis=-1, keepdims=True)


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
