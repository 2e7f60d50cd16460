"""Masked attention on MLX's CPU backend with a vectorized exp.

On the CPU MLX's attention is unfused (scores, softmax, weighted sum) and its ``exp`` is a scalar
libm call an element (~12 ns on this project's CPU): the softmax of a prompt chunk's scores cost
four times both matrix products together (76 of 117 ms for 512 queries over 3,072 keys, 4 heads).
Here ``exp`` is evaluated as ``2**n * p(r)`` (Cody-Waite reduction, the degree-7 polynomial of
Cephes' ``expf``: 1.7e-7 relative error) in one compiled elementwise kernel, and the
normalization is applied to the output instead of to every weight:

    scores = q k^T * scale + mask          one product, one add
    w      = exp(scores - max)             one fused kernel (argument reduction, polynomial)
    out    = (w v) / sum(w)                one product, one sum, one divide over [L, D]

Masked keys (-inf) get weight 2**-126 * p: ~1e-38, nothing next to the row's maximum's 1.

A KVarN prompt chunk's float16 window is seen tile by tile (a token sees its own tile's tokens up
to itself), so ``window_attention`` takes it as G x G blocks beside the masked keys instead of as
L more masked columns: the two parts share one max and one normalization.

Where kvarn's CPU kernels run (``metal.cpu``: built at first use, checked by ``metal.KERNELS``) the
softmax's exp and row sums are theirs (``softmax_parts``: the same bits, one vectorized pass a row)
and KVarN's decode attention is their kernel, which reads the codes in place. Where they do not,
decode attention over KVarN records (``record_scores``, ``record_values``) multiplies by the
records' integer codes unpacked to float32 instead of through MLX's CPU ``quantized_matmul``,
which dequantizes every code once for every query row in a scalar loop (and again for the next
row). A code of b bits (b = 2, 4, 8) is one of the 8/b fields of a byte: one compiled elementwise
kernel a field, ``(byte >> b*j) & (2**b - 1)`` to float32, then an OpenBLAS product; the
records' affine factors go on the small side of each product instead of on the codes:

    keys   K[g, d] = (code[d, g] * alpha[d] + beta[d]) * r[g]
           q . K[g] = r[g] * ((q * alpha) @ code[:, g] + q . beta)         per block
    values V[g, d] = (code[g, d] * alpha[g] + beta[g]) * c[d]
           p @ V    = c * ((p * alpha) @ code + p . beta)                    per block, summed

A byte's fields hold consecutive tokens (keys) or channels (values), so the products of field j
are every (8/b)-th column of the result: they are interleaved back. The unpacked codes of a
layer are transient (never kept) and made ``CHUNK_CODES`` at a time: a step's float32 copy of
a layer's codes is bounded (unchunked, 64 rows of 2,000 tokens wrote 270 MiB a layer and took
2.9x as long as in chunks of 8 MiB).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from metal import KERNELS

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * LN2_HI is exact
EXP_FLOOR = -87.0  # exp of anything lower is below float32's normal range
ROUND = 12582912.0  # 1.5 * 2**23: x + ROUND - ROUND rounds a float32 |x| < 2**22 to an integer
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
UNPACKED_BITS = (2, 4, 8)  # widths whose codes never straddle a byte
CHUNK_CODES = 1 << 21  # codes unpacked per product (8 MiB of float32): 64 blocks of the bundled model


@mx.compile
def _exp_below(scores: mx.array, top: mx.array) -> mx.array:
    """exp(scores - top) for scores <= top, as one compiled elementwise kernel: x = n ln2 + r
    (r in [-ln2/2, ln2/2]), 2**n from the float32 bits of n + ROUND + 127 shifted into the
    exponent field (no integer conversion), exp(r) by Estrin's scheme (one kernel: split in two,
    reduction and polynomial, it took 1.23x as long)."""
    x = mx.maximum(scores - top, EXP_FLOOR)
    shifted = x * LOG2E + ROUND  # n + ROUND: n in its low mantissa bits
    n = shifted - ROUND
    r = (x - n * LN2_HI) - n * LN2_LO
    scale = ((shifted + 127.0).view(mx.uint32) << 23).view(mx.float32)  # 2**n
    r2 = r * r
    high = (POLY[0] * r + POLY[1]) * r2 + (POLY[2] * r + POLY[3])
    low = (POLY[4] * r + POLY[5]) * r2 + (r + 1.0)
    return (high * (r2 * r2) + low) * scale


def softmax_weights(scores: mx.array, top: mx.array | None = None) -> mx.array:
    """exp(scores - top) (float32; ``top`` by default the max along the last axis): softmax
    before its normalization."""
    return softmax_parts(scores, top)[0]


def softmax_parts(scores: mx.array, top: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(``softmax_weights``, their sums along the last axis, kept): the CPU kernel's one pass a
    row where it runs (``metal.cpu``: the same bits), else ``_exp_below`` and a sum."""
    kernels = KERNELS.cpu() if scores.dtype == mx.float32 else None
    if kernels is not None:
        return kernels.exp_rows(scores, top)[:2]
    weights = _exp_below(scores, mx.max(scores, axis=-1, keepdims=True) if top is None else top)
    return weights, mx.sum(weights, axis=-1, keepdims=True)


def masked_softmax_parts(scores: mx.array, mask: mx.array | None,
                         floor: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """(``softmax_parts`` of x = ``scores`` + the additive ``mask``, and the top they are taken
    under: x's row max, at least ``floor`` [..., 1] where given). A float32 [L, T] mask under
    scores [..., L, T] is added inside the CPU kernel's pass a row where it runs (MLX's add and
    max reduction each take a pass over the whole matrix, on one thread); the same bits either way."""
    kernels = KERNELS.cpu() if scores.dtype == mx.float32 else None
    if kernels is not None and (mask is None or (mask.ndim == 2 and mask.dtype == mx.float32
                                                 and mask.shape[1] == scores.shape[-1]
                                                 and scores.ndim >= 2 and scores.shape[-2] == mask.shape[0])):
        return kernels.exp_rows(scores, mask=mask, floor=floor)
    x = scores if mask is None else scores + mask
    top = mx.max(x, axis=-1, keepdims=True)
    if floor is not None:
        top = mx.maximum(top, floor)
    return (*softmax_parts(x, top), top)


FEW_QUERY_ROWS = 16  # up to this many query rows a KV head, scores are computed as keys @ q^T


def scores_product(q: mx.array, keys: mx.array) -> mx.array:
    """q [..., M, D] @ keys [..., T, D]^T. For a few query rows (decode: M = the query heads a KV
    head serves) as (keys @ q^T)^T: OpenBLAS then packs the few query rows instead of every key
    (one 3,072-token row's scores 0.30 ms against 0.45 ms, 16 rows of 256 0.78 against 0.97 ms)."""
    if q.shape[-2] <= FEW_QUERY_ROWS and mx.default_device() == mx.cpu:
        return mx.swapaxes(keys @ mx.swapaxes(q, -1, -2), -1, -2)
    return q @ mx.swapaxes(keys, -1, -2)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """softmax(queries keys^T * scale + mask) values for float32 queries [B, n_q, L, D] over keys
    and values [B, H, T, D] (query head i reads KV head i // (n_q / H), as mlx-lm's GQA) under
    ``mask``: additive or boolean (True: attended), [L, T] or [B, 1 | n_q, L, T], or None."""
    B, n_q, L, D = queries.shape
    H = keys.shape[1]
    R = n_q // H
    scores = scores_product((queries * scale).reshape(B, H, R * L, D), keys).reshape(B, H, R, L, -1)
    if mask is not None and (mask.ndim != 2 or mask.dtype == mx.bool_):
        if mask.ndim == 4:  # per row (and per query head): onto [B, H, R, L, T]
            mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(B, H, R, L, -1)
        scores, mask = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask, None
    weights, total, _ = masked_softmax_parts(scores, mask)  # an additive [L, T] mask: added in the pass
    out = weights.reshape(B, H, R * L, -1) @ values
    return (out.reshape(B, H, R, L, D) / total).reshape(B, n_q, L, D)


def causal_mask(L: int, T: int) -> mx.array:
    """Additive [L, T]: query i (position T - L + i) sees keys 0 .. T - L + i (mlx-lm's "causal")."""
    rows, cols = mx.arange(T - L, T)[:, None], mx.arange(T)[None]
    return mx.where(cols <= rows, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))


def runs(queries: mx.array, keys: Any, mask: Any, sinks: Any) -> bool:
    """Whether ``attention`` takes this call of mlx-lm's attention on the CPU: float32 queries
    and plain float32 keys (not a quantized cache's codes), no attention sinks, a mask it reads."""
    return (mx.default_device() == mx.cpu and sinks is None and isinstance(keys, mx.array)
            and queries.dtype == mx.float32 and keys.dtype == mx.float32
            and (mask is None or isinstance(mask, mx.array) or mask == "causal"))


def window_attention(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, window_k: mx.array,
                     window_v: mx.array, *, start: int, window_start: int, G: int, scale: float) -> mx.array:
    """``attention`` over [keys (under ``mask``) | window] for queries at positions ``start ..``,
    where query p sees window token w (positions ``window_start ..``, a multiple of G) iff
    w // G == p // G, w <= p and p is not its tile's last token. The window part is computed per
    tile, queries and window laid out on the window's tiles:

        tile rows   [ window_start .. lo | lo .. end | pad ]   lo = max(start, window_start)
        chunk rows             [ start .. lo | lo .. end ]     (rows before lo see no window)
    """
    B, n_q, L, D = queries.shape
    H = keys.shape[1]
    R, end = n_q // H, start + L
    lo = max(start, window_start)
    num_tiles = -(-(end - window_start) // G)
    front, back, skip = lo - window_start, num_tiles * G - (end - window_start), lo - start
    q = (queries * scale).reshape(B, H, R, L, D)
    main = (q.reshape(B, H, R * L, D) @ mx.swapaxes(keys, -1, -2)).reshape(B, H, R, L, -1)  # ``mask`` not yet added
    tiles_q = _pad_rows(q[:, :, :, skip:], front, back, 0.0).reshape(B, H, R, num_tiles, G, D)
    tiles_k, tiles_v = (_pad_rows(x, 0, back, 0.0).reshape(B, H, 1, num_tiles, G, D) for x in (window_k, window_v))
    local = tiles_q @ mx.swapaxes(tiles_k, -1, -2) + _tile_mask(G)  # [B, H, R, tiles, G, G]

    def to_chunk(x: mx.array, fill: float) -> mx.array:  # tile rows [.., tiles, G, k] -> chunk rows [.., L, k]
        x = x.reshape(B, H, R, num_tiles * G, -1)[:, :, :, front: num_tiles * G - back]
        return _pad_rows(x, skip, 0, fill)

    # one top a row over both parts: the masked main part's max, raised to the window part's
    w_main, sum_main, top = masked_softmax_parts(main, mask, to_chunk(mx.max(local, axis=-1, keepdims=True), -mx.inf))
    w_local, sum_local = softmax_parts(local, _pad_rows(top[:, :, :, skip:], front, back, 0.0).reshape(
        B, H, R, num_tiles, G, 1))
    out = (w_main.reshape(B, H, R * L, -1) @ values).reshape(B, H, R, L, D) + to_chunk(w_local @ tiles_v, 0.0)
    total = sum_main + to_chunk(sum_local, 0.0)
    return (out / total).reshape(B, n_q, L, D)


def _pad_rows(x: mx.array, before: int, after: int, fill: float) -> mx.array:
    """``x`` [..., rows, k] with ``before`` and ``after`` rows of ``fill`` added."""
    if not before and not after:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 2) + [(before, after), (0, 0)], constant_values=fill)


def _tile_mask(G: int) -> mx.array:
    """Additive [G, G]: a tile's query a sees its tile's token b iff b <= a and a is not the tile's
    last token (that one sees its tile as a record)."""
    a, b = mx.arange(G)[:, None], mx.arange(G)[None]
    return mx.where((b <= a) & (a < G - 1), mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))


def reads_unpacked(key_bits: int, value_bits: int) -> bool:
    """Whether ``record_scores`` / ``record_values`` take these widths (codes within a byte)."""
    return key_bits in UNPACKED_BITS and value_bits in UNPACKED_BITS


def record_scores(q: mx.array, rec: dict[str, mx.array], bits: int) -> mx.array:
    """Scores [B, nb, H, R, G] of queries ``q`` [B, H, R, D] (rotated, scaled, float32) against
    the records ``rec`` (fields as the pool stores them, gathered: [B, nb, ...]) of ``bits``-bit
    keys: per 128-channel slice r * ((q * alpha) @ codes + q . beta), summed over slices."""
    B, H, R, D = q.shape
    nb, S, W = rec["k_codes"].shape[1], rec["k_codes"].shape[3], rec["k_codes"].shape[4]
    G = rec["k_r"].shape[-1]
    q_s = q.reshape(B, 1, H, R, S, W).transpose(0, 1, 2, 4, 3, 5)  # [B, 1, H, S, R, W]
    qa = (q_s * rec["k_alpha"][:, :, :, :, None]).reshape(B * nb, H, S, R, W)
    qb = mx.sum(q_s * rec["k_beta"][:, :, :, :, None], axis=-1, keepdims=True)  # [B, nb, H, S, R, 1]
    codes = rec["k_codes"].reshape(B * nb, H, S, W, -1).view(mx.uint8)  # a byte: 8/bits tokens
    raw = _interleave(_code_products(qa, codes, bits)).reshape(B, nb, H, S, R, G) + qb
    return mx.sum(raw * rec["k_r"][:, :, :, :, None], axis=3)


def record_values(p: mx.array, rec: dict[str, mx.array], bits: int) -> mx.array:
    """sum over each row's records of p [B, nb, H, R, G] @ values (``bits``-bit codes, fields
    as gathered from the pool) -> [B, H, R, D]: per block and slice c * ((p * alpha) @ codes +
    p . beta)."""
    B, nb, H, R, G = p.shape
    S, D = rec["v_alpha"].shape[-1], rec["v_c"].shape[-1]
    p_s = p[:, :, :, None]  # [B, nb, H, 1, R, G]
    pa = (p_s * mx.swapaxes(rec["v_alpha"], -1, -2)[:, :, :, :, None]).reshape(B * nb, H, S, R, G)
    pb = mx.sum(p_s * mx.swapaxes(rec["v_beta"], -1, -2)[:, :, :, :, None], axis=-1, keepdims=True)
    codes = rec["v_codes"].view(mx.uint8).reshape(B * nb, H, G, S, -1)  # a byte: 8/bits channels
    codes = mx.contiguous(mx.swapaxes(codes, 2, 3)) if S > 1 else codes.reshape(B * nb, H, 1, G, -1)
    out = _interleave(_code_products(pa, codes, bits)).reshape(B, nb, H, S, R, D // S) + pb
    out = mx.swapaxes(out, 3, 4).reshape(B, nb, H, R, D)
    return mx.sum(out * rec["v_c"][:, :, :, None], axis=1)


def _code_products(left: mx.array, codes: mx.array, bits: int) -> list[mx.array]:
    """``left`` [n, ..., M, K] @ field j of the bytes ``codes`` [n, ..., K, N] as float32, for
    each field j (low bits first) -> [n, ..., M, N] each; ``CHUNK_CODES`` codes at a time along
    the leading (block) axis."""
    n = codes.shape[0]
    step = max(1, CHUNK_CODES * bits // 8 // (codes.size // n))
    fields = 8 // bits
    parts: list[list[mx.array]] = [[] for _ in range(fields)]
    for lo in range(0, n, step):
        chunk, a = codes[lo: lo + step], left[lo: lo + step]
        for j in range(fields):
            parts[j].append(a @ _unpack(chunk, bits, j))
    return [mx.concatenate(p) if len(p) > 1 else p[0] for p in parts]


def _unpack(codes: mx.array, bits: int, field: int) -> mx.array:
    """Field ``field`` (bits [b*field, b*(field + 1)) of every byte) of uint8 ``codes`` as float32."""
    if bits == 8:
        return codes.astype(mx.float32)
    shifted = codes >> (bits * field) if field else codes
    return (shifted & ((1 << bits) - 1)).astype(mx.float32)


def _interleave(parts: list[mx.array]) -> mx.array:
    """[..., m] x k -> [..., m * k] with parts[j][..., i] at position i * k + j."""
    if len(parts) == 1:
        return parts[0]
    x = mx.stack(parts, axis=-1)
    return x.reshape(*x.shape[:-2], -1)
