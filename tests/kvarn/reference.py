"""Independent NumPy reference of KVarN (docs/kvarn.md: the quantizer and the attention).

Written from the design text, not from ``kvarn/quantize.py``; it imports no MLX, so the tests
that compare the two are a real cross-check.

Quantizer, all arithmetic in float32:
  * elementwise float32 ops (``/``, ``*``, ``-``, clip, round half to even) are IEEE and so
    agree bit-for-bit with any other float32 implementation;
  * the transcendental functions and the sample std are *correctly rounded* float32 values
    (computed in float64, then rounded once to float32). MLX's own float32 ``exp``/``var`` are a
    few ulps off those, which is the only legitimate source of disagreement; the tests account
    for it explicitly.

Attention is computed in float64 from the stored (fp16) parts.

Tile convention (one 128-channel slice, or the whole head when head_dim <= 128; W = its width):
  K tile: M = k_rot^T  (W x G)  rows = channels, columns = tokens  -> RTN per channel
          K_rot[g, d] = (q[d, g] * alpha[d] + beta[d]) * r[g]
  V tile: M = v_rot    (G x W)  rows = tokens, columns = channels  -> RTN per token
          V_rot[g, d] = (q[g, d] * alpha[g] + beta[g]) * c[d]
All quantizer functions are vectorized over leading axes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

F32 = np.float32
F16 = np.float16

SLICE = 128
STD_LO, STD_HI = F32(1e-3), F32(1e3)
LOG_LO, LOG_HI = F32(-0.3), F32(10.0)
IMB_FLOOR = F32(1e-8)
MIN_STEP = F32(1e-10)
BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_ITERS = 8


# --------------------------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------------------------

def sylvester(n: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix H_n (float64): H_1 = [1], H_2n = [[H, H], [H, -H]],
    scaled by 1/sqrt(n). Symmetric, orthogonal, H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, not {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def slice_width(head_dim: int) -> int:
    if head_dim in (64, 128):
        return head_dim
    if head_dim in (256, 512):
        return SLICE
    raise ValueError(f"unsupported head_dim {head_dim}")


def rotation_matrix(head_dim: int) -> np.ndarray:
    """The float64 rotation for a head: Sylvester H for head_dim <= 128, block-diagonal with one
    128x128 Sylvester block per slice for 256/512."""
    w = slice_width(head_dim)
    out = np.zeros((head_dim, head_dim))
    h = sylvester(w)
    for s in range(head_dim // w):
        out[s * w:(s + 1) * w, s * w:(s + 1) * w] = h
    return out


def rotate(x, dtype=F32) -> np.ndarray:
    """x @ H along the last axis, computed in float64 and rounded once to ``dtype``."""
    x = np.asarray(x, dtype=np.float64)
    return (x @ rotation_matrix(x.shape[-1])).astype(dtype)


def split_slices(x: np.ndarray) -> np.ndarray:
    """[..., G, D] -> [..., S, G, W]: the per-slice tiles of a head (S = 1 when D <= 128)."""
    d = x.shape[-1]
    w = slice_width(d)
    y = x.reshape(*x.shape[:-1], d // w, w)
    return np.moveaxis(y, -2, -3)


def join_slices(x: np.ndarray) -> np.ndarray:
    """Inverse of ``split_slices``: [..., S, G, W] -> [..., G, S*W]."""
    y = np.moveaxis(x, -3, -2)
    return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])


# --------------------------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------------------------

def _exp(x: np.ndarray) -> np.ndarray:
    return np.exp(np.asarray(x, np.float64)).astype(F32)


def _log(x: np.ndarray) -> np.ndarray:
    return np.log(np.asarray(x, np.float64)).astype(F32)


def sample_std(m: np.ndarray, axis: int) -> np.ndarray:
    """Sample std (ddof=1) of float32 data, correctly rounded to float32."""
    return np.std(np.asarray(m, np.float64), axis=axis, ddof=1).astype(F32)


def balance(m: np.ndarray, lr: np.ndarray, lc: np.ndarray) -> np.ndarray:
    """M / exp(lc)[None, :] / exp(lr)[:, None] (in this order, float32)."""
    return (m / _exp(lc)[..., None, :]) / _exp(lr)[..., :, None]


def imbalance(col_std: np.ndarray, row_std: np.ndarray) -> np.ndarray:
    """max/min of the column stds + max/min of the row stds (raw stds, min floored at 1e-8)."""
    col = col_std.max(axis=-1) / np.maximum(col_std.min(axis=-1), IMB_FLOOR)
    row = row_std.max(axis=-1) / np.maximum(row_std.min(axis=-1), IMB_FLOOR)
    return (col + row).astype(F32)


def _update(log_scale: np.ndarray, std: np.ndarray) -> np.ndarray:
    return np.clip(log_scale + _log(np.clip(std, STD_LO, STD_HI)), LOG_LO, LOG_HI).astype(F32)


@dataclass
class NormTrace:
    """Every iterate of the normalization (index 0 = the start, lr = lc = 0).

    lr [..., n+1, R], lc [..., n+1, C], imb [..., n+1], best [...] (index of the chosen iterate).
    """

    lr: np.ndarray
    lc: np.ndarray
    imb: np.ndarray
    best: np.ndarray

    def chosen(self, index=None) -> tuple[np.ndarray, np.ndarray]:
        """(lr, lc) of iterate ``index`` per tile (default: the best one)."""
        idx = self.best if index is None else np.broadcast_to(index, self.best.shape)
        lr = np.take_along_axis(self.lr, idx[..., None, None], axis=-2)[..., 0, :]
        lc = np.take_along_axis(self.lc, idx[..., None, None], axis=-2)[..., 0, :]
        return lr, lc


def normalize_trace(m, iters: int = DEFAULT_ITERS) -> NormTrace:
    """Two-axis log-domain normalization of m [..., R, C], recording every iterate."""
    m = np.asarray(m, F32)
    lr = np.zeros(m.shape[:-1], F32)
    lc = np.zeros(m.shape[:-2] + m.shape[-1:], F32)
    cur = m  # the current balanced matrix (M itself at the start)
    lrs, lcs = [lr], [lc]
    imbs = [imbalance(sample_std(cur, -2), sample_std(cur, -1))]
    for _ in range(iters):
        # column step on the current balanced matrix
        lc = _update(lc, sample_std(cur, -2))
        cur = balance(m, lr, lc)
        # row step on the matrix with the new column scales
        lr = _update(lr, sample_std(cur, -1))
        cur = balance(m, lr, lc)
        lrs.append(lr)
        lcs.append(lc)
        imbs.append(imbalance(sample_std(cur, -2), sample_std(cur, -1)))
    imb = np.stack(imbs, axis=-1)
    best = np.zeros(imb.shape[:-1], dtype=np.int64)
    best_val = imb[..., 0]
    for i in range(1, iters + 1):
        take = imb[..., i] <= best_val  # ties go to the later iterate
        best = np.where(take, i, best)
        best_val = np.where(take, imb[..., i], best_val)
    return NormTrace(np.stack(lrs, axis=-2), np.stack(lcs, axis=-2), imb, best)


def normalize(m, iters: int = DEFAULT_ITERS) -> tuple[np.ndarray, np.ndarray]:
    """(lr, lc) of the best iterate."""
    return normalize_trace(m, iters).chosen()


# --------------------------------------------------------------------------------------------
# Rounding, absorption
# --------------------------------------------------------------------------------------------

@dataclass
class Rounded:
    codes: np.ndarray  # [..., R, C] uint8
    step: np.ndarray  # [..., R] float32 (a)
    zero: np.ndarray  # [..., R] float32 (z = row min)
    pre: np.ndarray  # [..., R, C] float32, (x - z) / a before rounding


def round_rows(x, bits: int) -> Rounded:
    """Asymmetric min/max round-to-nearest (half to even) of every row of x."""
    if bits not in BITS:
        raise ValueError(f"unsupported bits {bits}")
    x = np.asarray(x, F32)
    top = F32((1 << bits) - 1)
    lo = x.min(axis=-1)
    hi = x.max(axis=-1)
    a = np.maximum((hi - lo) / top, MIN_STEP).astype(F32)
    pre = ((x - lo[..., None]) / a[..., None]).astype(F32)
    codes = np.clip(np.rint(pre), 0, top).astype(np.uint8)
    return Rounded(codes, a, lo, pre)


@dataclass
class RefKeyTile:
    codes: np.ndarray  # [..., W, G] uint8
    alpha: np.ndarray  # [..., W] float16
    beta: np.ndarray  # [..., W] float16
    r: np.ndarray  # [..., G] float16
    bits: int

    def dequantize(self, dtype=F32) -> np.ndarray:
        """Rotated keys [..., G, W]."""
        q = self.codes.astype(dtype)
        k = q * self.alpha[..., :, None].astype(dtype) + self.beta[..., :, None].astype(dtype)
        k = k * self.r[..., None, :].astype(dtype)
        return np.swapaxes(k, -1, -2)

    def packed(self) -> np.ndarray:
        return pack(self.codes, self.bits)


@dataclass
class RefValueTile:
    codes: np.ndarray  # [..., G, W] uint8
    alpha: np.ndarray  # [..., G] float16
    beta: np.ndarray  # [..., G] float16
    c: np.ndarray  # [..., W] float16
    bits: int

    def dequantize(self, dtype=F32) -> np.ndarray:
        """Rotated values [..., G, W]."""
        q = self.codes.astype(dtype)
        v = q * self.alpha[..., :, None].astype(dtype) + self.beta[..., :, None].astype(dtype)
        return v * self.c[..., None, :].astype(dtype)

    def packed(self) -> np.ndarray:
        return pack(self.codes, self.bits)


@dataclass
class QuantDetail:
    """Everything the quantizer computed, for diagnosis (float32 values before the fp16 cast)."""

    trace: NormTrace
    balanced: np.ndarray  # the balanced matrix that was rounded
    rounded: Rounded
    scale_row: np.ndarray  # exp(lr) of the chosen iterate
    scale_col: np.ndarray  # exp(lc)
    alpha32: np.ndarray
    beta32: np.ndarray


def _quantize_matrix(m: np.ndarray, bits: int, iters: int, index=None):
    trace = normalize_trace(m, iters)
    lr, lc = trace.chosen(index)
    balanced = balance(m, lr, lc)
    rounded = round_rows(balanced, bits)
    s_row, s_col = _exp(lr), _exp(lc)
    alpha32 = (s_row * rounded.step).astype(F32)
    beta32 = (s_row * rounded.zero).astype(F32)
    return QuantDetail(trace, balanced, rounded, s_row, s_col, alpha32, beta32)


def quantize_keys_detail(k_rot, bits: int, iters: int = DEFAULT_ITERS, index=None):
    """Quantize rotated key tiles [..., G, W]; ``index`` forces a normalization iterate."""
    m = np.swapaxes(np.asarray(k_rot, F32), -1, -2)
    d = _quantize_matrix(m, bits, iters, index)
    tile = RefKeyTile(d.rounded.codes, d.alpha32.astype(F16), d.beta32.astype(F16),
                      d.scale_col.astype(F16), bits)
    return tile, d


def quantize_values_detail(v_rot, bits: int, iters: int = DEFAULT_ITERS, index=None):
    """Quantize rotated value tiles [..., G, W]; ``index`` forces a normalization iterate."""
    m = np.asarray(v_rot, F32)
    d = _quantize_matrix(m, bits, iters, index)
    tile = RefValueTile(d.rounded.codes, d.alpha32.astype(F16), d.beta32.astype(F16),
                        d.scale_col.astype(F16), bits)
    return tile, d


def quantize_keys(k_rot, bits: int, iters: int = DEFAULT_ITERS) -> RefKeyTile:
    return quantize_keys_detail(k_rot, bits, iters)[0]


def quantize_values(v_rot, bits: int, iters: int = DEFAULT_ITERS) -> RefValueTile:
    return quantize_values_detail(v_rot, bits, iters)[0]


# --------------------------------------------------------------------------------------------
# Bit packing (MLX affine layout: little-endian bit stream of b-bit values in uint32 words)
# --------------------------------------------------------------------------------------------

def pack(codes, bits: int) -> np.ndarray:
    """[..., n] codes -> [..., n*bits/32] uint32. Bit j of code i is bit (i*bits + j) of the
    stream; stream bit k is bit k % 32 of word k // 32."""
    codes = np.asarray(codes)
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole words")
    if codes.size and int(codes.max()) >> bits:
        raise ValueError(f"code out of range for {bits} bits")
    c = codes.astype(np.uint32)
    stream = ((c[..., None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], n * bits)
    by = np.packbits(stream, axis=-1, bitorder="little")  # [..., n*bits/8]
    return np.ascontiguousarray(by).view("<u4").astype(np.uint32)


def unpack(words, bits: int, n: int | None = None) -> np.ndarray:
    """Inverse of ``pack``: [..., n*bits/32] uint32 -> [..., n] uint8."""
    words = np.ascontiguousarray(np.asarray(words, dtype=np.uint32)).astype("<u4")
    by = words.view(np.uint8)
    stream = np.unpackbits(by, axis=-1, bitorder="little")
    total = stream.shape[-1] // bits
    n = total if n is None else n
    stream = stream[..., :n * bits].reshape(*words.shape[:-1], n, bits).astype(np.uint32)
    return (stream << np.arange(bits, dtype=np.uint32)).sum(axis=-1).astype(np.uint8)


def key_tile_from_packed(codes, alpha, beta, r, bits: int) -> RefKeyTile:
    """A reference key tile from stored parts (packed uint32 codes [..., W, G*b/32])."""
    r = np.asarray(r, F16)
    return RefKeyTile(unpack(codes, bits, r.shape[-1]), np.asarray(alpha, F16),
                      np.asarray(beta, F16), r, bits)


def value_tile_from_packed(codes, alpha, beta, c, bits: int) -> RefValueTile:
    """A reference value tile from stored parts (packed uint32 codes [..., G, W*b/32])."""
    c = np.asarray(c, F16)
    return RefValueTile(unpack(codes, bits, c.shape[-1]), np.asarray(alpha, F16),
                        np.asarray(beta, F16), c, bits)


# --------------------------------------------------------------------------------------------
# Records and attention
# --------------------------------------------------------------------------------------------

@dataclass
class RefRecord:
    """One quantized tile of one KV head: a key tile and a value tile per 128-channel slice
    (a single slice when head_dim <= 128). Tiles here are unbatched ([W, G] / [G, W] codes)."""

    keys: list[RefKeyTile] = field(default_factory=list)
    values: list[RefValueTile] = field(default_factory=list)

    def dequantize(self, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
        """Rotated (K, V), each [G, D]."""
        k = np.concatenate([t.dequantize(dtype) for t in self.keys], axis=-1)
        v = np.concatenate([t.dequantize(dtype) for t in self.values], axis=-1)
        return k, v


def quantize_record(k_rot, v_rot, k_bits: int, v_bits: int,
                    iters: int = DEFAULT_ITERS) -> RefRecord:
    """Reference-quantize one tile [G, D] of rotated keys and values into a record."""
    ks = split_slices(np.asarray(k_rot, F32))
    vs = split_slices(np.asarray(v_rot, F32))
    return RefRecord([quantize_keys(k, k_bits, iters) for k in ks],
                     [quantize_values(v, v_bits, iters) for v in vs])


def record_from_tiles(keys, values, k_bits: int, v_bits: int) -> RefRecord:
    """A reference record from stored tiles of ONE token tile of one KV head.

    ``keys``/``values``: objects with ``codes, alpha, beta, r`` / ``codes, alpha, beta, c``
    attributes (e.g. kvarn's KeyTiles/ValueTiles; anything ``np.asarray`` reads), either for a
    single slice (codes [W, G*b/32] / [G, W*b/32]) or with a leading slice axis [S, ...]."""
    def parts(t, names):
        arrs = [np.asarray(getattr(t, n)) for n in names]
        if arrs[0].ndim == 2:
            arrs = [a[None] for a in arrs]
        return arrs

    kc, ka, kb, kr = parts(keys, ("codes", "alpha", "beta", "r"))
    vc, va, vb, vcs = parts(values, ("codes", "alpha", "beta", "c"))
    return RefRecord(
        [key_tile_from_packed(kc[s], ka[s], kb[s], kr[s], k_bits) for s in range(kc.shape[0])],
        [value_tile_from_packed(vc[s], va[s], vb[s], vcs[s], v_bits) for s in range(vc.shape[0])])


def _as2d(x, d: int) -> np.ndarray:
    if x is None:
        return np.zeros((0, d))
    return np.asarray(x, dtype=np.float64).reshape(-1, d)


def reference_attention(q, sink_k, sink_v, records, tail_k, tail_v, scale: float,
                        *, causal: bool = False) -> np.ndarray:
    """Attention of one sequence and one KV head group, in float64.

    q: [n_rep, L, D] queries (unrotated). sink_k/sink_v: [n_sink, D] rotated (fp16) or None.
    records: list of RefRecord (or of (K_rot, V_rot) [G, D] array pairs), in sequence order.
    tail_k/tail_v: [n_tail, D] rotated (fp16) or None. ``scale`` multiplies q.k (usually
    1/sqrt(D)). With ``causal`` the L queries are the last L positions of the sequence (query i
    sees keys up to T - L + i); otherwise every query sees every key (decode).
    Returns the output [n_rep, L, D], rotated back (unrotated space).
    """
    q = np.asarray(q, dtype=np.float64)
    n_rep, seq_q, d = q.shape
    h = rotation_matrix(d)
    q_rot = q @ h
    ks, vs = [_as2d(sink_k, d)], [_as2d(sink_v, d)]
    for rec in records:
        k, v = rec.dequantize(np.float64) if isinstance(rec, RefRecord) else rec
        ks.append(_as2d(k, d))
        vs.append(_as2d(v, d))
    ks.append(_as2d(tail_k, d))
    vs.append(_as2d(tail_v, d))
    keys, values = np.concatenate(ks), np.concatenate(vs)
    total = keys.shape[0]
    scores = np.einsum("rld,td->rlt", q_rot, keys) * float(scale)
    if causal:
        if seq_q > total:
            raise ValueError("more queries than keys")
        limit = total - seq_q + np.arange(seq_q)
        mask = np.arange(total)[None, :] > limit[:, None]
        scores = np.where(mask[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    o_rot = np.einsum("rlt,td->rld", p, values)
    return o_rot @ h
