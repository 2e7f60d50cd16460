"""The pure-MLX twins of the decode kernels, with their signatures: what each kernel's self-check
and tests compare it with, and what runs where no kernel does. ``metal`` imports nothing of
``kvarn``, so the dequantization of ``kvarn.pool`` is restated here."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from metal.paged_plan import DecodePlan, RowLengths
from metal.records import RECORD_FIELDS


def hadamard(x: mx.array) -> mx.array:
    """x @ H along the last axis, block-diagonal over 128-channel slices (``kvarn.quantize.rotate``)."""
    D = x.shape[-1]
    if D <= 128:
        return mx.hadamard_transform(x)
    return mx.hadamard_transform(x.reshape(*x.shape[:-1], D // 128, 128)).reshape(x.shape)


def _dequantize(fields: dict[str, mx.array], G: int, key_bits: int, value_bits: int,
                dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Gathered record fields [B, nb, H, ...] -> rotated keys and values [B, H, nb*G, D]
    (``kvarn.pool.dequantize_blocks``)."""
    B, nb, H, S, W, _ = fields["k_codes"].shape
    k = mx.dequantize(fields["k_codes"], fields["k_alpha"][..., None].astype(dtype),
                      fields["k_beta"][..., None].astype(dtype), group_size=G, bits=key_bits)
    k = (k * fields["k_r"][..., None, :].astype(dtype)).transpose(0, 2, 1, 5, 3, 4).reshape(B, H, nb * G, S * W)
    v = mx.dequantize(fields["v_codes"], fields["v_alpha"].astype(dtype), fields["v_beta"].astype(dtype),
                      group_size=W, bits=value_bits)
    v = (v * fields["v_c"][:, :, :, None, :].astype(dtype)).transpose(0, 2, 1, 3, 4).reshape(B, H, nb * G, S * W)
    return k, v


def validity_mask(lengths: RowLengths, G: int, nb: int) -> mx.array:
    """Which keys each row attends [B, 2G + nb*G] (bool): its window's sink and tail tokens, then
    its first ``num_tiles`` of ``nb`` records."""
    i32 = mx.int32
    sl, tl, nt = (mx.array(x, dtype=i32)[:, None] for x in (lengths.sink_len, lengths.tail_len, lengths.num_tiles))
    w = mx.arange(2 * G, dtype=i32)[None]
    mask = (w < sl) | ((w >= G) & (w < G + tl))
    if nb:
        mask = mx.concatenate([mask, (mx.arange(nb * G, dtype=i32)[None] // G) < nt], axis=1)
    return mask


def reference_paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array,
                                     win_v: mx.array, table: mx.array | None, lengths: RowLengths, scale: float,
                                     key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                                     variant: object = None) -> mx.array:
    """The pure-MLX twin of ``metal.cuda.paged_decode.paged_decode_attention`` (``plan`` and
    ``variant`` are ignored): the windows and the gathered, dequantized records as one operand, one
    SDPA under the rows' validity mask, in float16 (float32 where the queries are float32), the
    gather+dequantize+SDPA path of ``kvarn.attention.decode_attention_over``."""
    G = win_k.shape[2] // 2
    dtype = mx.float32 if queries.dtype == mx.float32 else mx.float16
    slots = mx.array(lengths.slots, dtype=mx.int32)
    keys, vals = win_k[slots].astype(dtype), win_v[slots].astype(dtype)
    mask = validity_mask(lengths, G, 0 if table is None else table.shape[1])
    if table is not None:
        fields = {name: records[name][table] for name in RECORD_FIELDS}
        rec_k, rec_v = _dequantize(fields, G, key_bits, value_bits, dtype)
        keys, vals = mx.concatenate([keys, rec_k], axis=2), mx.concatenate([vals, rec_v], axis=2)
    q = hadamard(queries.astype(mx.float32)).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=mask[:, None, None, :])
    return hadamard(out.astype(mx.float32)).astype(queries.dtype)


def reference_ragged_decode_attention(*, queries: mx.array, keys: mx.array, values: mx.array, slots: Sequence[int],
                                      lengths: Sequence[int], scale: float, plan: object = None) -> mx.array:
    """The pure-MLX twin of ``metal.cuda.ragged_decode.ragged_decode_attention`` (``plan`` is
    ignored): the rows' slots gathered (tokens [0, max length)), one SDPA in float32 under the rows'
    validity mask [B, 1, 1, T], cast to the queries' dtype."""
    T = max(lengths)
    idx = mx.array(list(slots), dtype=mx.int32)
    k = mx.take(keys[:, :, :T], idx, axis=0).astype(mx.float32)
    v = mx.take(values[:, :, :T], idx, axis=0).astype(mx.float32)
    mask = mx.arange(T, dtype=mx.int32)[None] < mx.array(list(lengths), dtype=mx.int32)[:, None]
    out = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), k, v, scale=scale,
                                               mask=mask[:, None, None, :])
    return out.astype(queries.dtype)
